"""Extend (prefill / chunked prefill) attention through FlashInfer 0.6.15 over the head-group pool.

The same result as ``tangram_sgl.kernels.extend.extend_attention``, in two FlashInfer passes per layer merged
by log-sum-exp (``merge_state``), the way SGLang's FlashInfer backend splits a chunked prefill:

- the new tokens over themselves: a ragged causal prefill of the step's staging K/V (all heads; planned once
  per step, the same for every layer);
- the new tokens over their compressed prefix: a paged prefill in which each (request, kv head) is a
  pseudo-request of its G_q query heads over a *page-size-1 view* of the pool: slot ``s`` of column ``c`` is
  pseudo-page ``(s // page_size * H_p + c) * page_size + s % page_size`` of ``buffer.view(-1, 1, 1, D)``, so
  slot lists made of several segments' partial pages are valid. Pseudo order is (request, rank, token), where
  rank k is the layer's k-th kv head by descending group budget (``head_order``).

The prefix pass is **planned once per step** (plan() is mostly host time: ~10 ms per layer at 1024
pseudo-requests on the H200's host, ``bench_step_host --cprofile``). A layer maps its kv heads to other groups
than the next layer, so lengths differ per layer: the plan is made for each pseudo-request's largest length
over all layers, and each layer writes its own index pointers, last-page lengths and pseudo-page ids into the
buffers run() reads before it runs. That is valid on FlashInfer's fa2 prefill kernel, which reads the lengths
from those buffers at run time and clamps a kv chunk that starts past them (the plan stays correct while every
run-time length is at most the planned one); the wrapper is built with ``backend="fa2"``. It is not in
CUDA-graph mode (whose public caller-owned buffers would fit): there plan() sizes its split-KV scratch for the
padded worst case, 0.5 GB at 128 question rows. Outside it, run() reads the device tensors plan() made from its
arguments (``_paged_kv_*_buf``, FlashInfer 0.6.15's names, checked after every plan(): a FlashInfer that
changes them fails loudly rather than reading stale indices).

plan() writes its schedule into a page-locked host buffer and copies it to the GPU asynchronously, so a
wrapper is not re-planned before the GPU has consumed that copy: an event is recorded after each plan() and
waited for before the next (``_Planned``). ``pseudo_token_indices`` (torch, device-side,
CPU-testable) builds the prefix pass's pseudo-page indices. flashinfer is imported lazily (GPU machines only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tangram_sgl.kernels.pieces import piece_positions


def pseudo_token_indices(kv_indptr: np.ndarray, kv_indices: torch.Tensor, head_group: Sequence[int],
                         head_column: Sequence[int], *, batch: int, page_size: int,
                         heads_per_group: int) -> tuple[np.ndarray, torch.Tensor]:
    """(host int32 indptr ``[B*Hkv+1]``, device int32 pseudo-page ids) of the prefix pass for one layer.

    Row ``r*Hkv + k`` lists the slots of (request r, group ``head_group[k]``) as pseudo-pages of column
    ``head_column[k]`` of a page-size-1 view of the pool (see the module docstring). ``kv_indptr``: the step's
    host CSR ``[B*G+1]`` over ``kv_indices`` (device). Output sizes come from the host: no device->host sync.
    """
    num_groups = (len(kv_indptr) - 1) // batch
    seg = (np.arange(batch)[:, None] * num_groups + np.asarray(head_group)[None, :]).reshape(-1)  # [B*Hkv]
    src = kv_indptr[seg].astype(np.int64)
    lens = kv_indptr[seg + 1].astype(np.int64) - src
    indptr = np.zeros(len(seg) + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    total = int(indptr[-1])
    dev = kv_indices.device
    if total == 0:
        return indptr.astype(np.int32), torch.empty(0, dtype=torch.int32, device=dev)
    cols = np.tile(np.asarray(head_column, dtype=np.int64), batch)
    shift, count, col = torch.from_numpy(np.stack([src - indptr[:-1], lens, cols])).to(dev, non_blocking=True)
    slot = kv_indices.long()[piece_positions(shift, count, total)]  # shift: source - destination
    column = torch.repeat_interleave(col, count, output_size=total)
    pseudo = ((slot // page_size) * heads_per_group + column) * page_size + slot % page_size
    return indptr.astype(np.int32), pseudo.to(torch.int32)


def pseudo_request_order(offsets: Sequence[int], num_kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows with new tokens ``[offsets[r], offsets[r+1])``: (gather ``[T*Hkv]`` taking the query-head
    blocks of ``q.view(T*Hkv, G_q, D)`` into pseudo order (request, kv head, token), its inverse, the pseudo
    requests' qo indptr ``[B*Hkv+1]``)."""
    off = np.asarray(offsets, dtype=np.int64)
    rows = np.repeat(np.diff(off), num_kv_heads)  # tokens of each pseudo-request (r, h)
    qo = np.concatenate([[0], np.cumsum(rows)])
    pid = np.repeat(np.arange(len(rows)), rows)  # pseudo-request of each entry
    r, h = pid // num_kv_heads, pid % num_kv_heads
    fwd = (off[r] + np.arange(len(pid)) - qo[pid]) * num_kv_heads + h
    inv = np.empty_like(fwd)
    inv[fwd] = np.arange(len(fwd))
    return fwd, inv, qo.astype(np.int32)


class _Planned:
    """A FlashInfer wrapper and, on CUDA, the event after its last plan() (the GPU's copy of the schedule)."""

    def __init__(self, wrapper, cuda: bool) -> None:
        self.wrapper, self.cuda = wrapper, cuda
        self.event: torch.cuda.Event | None = None

    def plan(self, *args, **kwargs) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.wrapper.plan(*args, **kwargs)
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()


class FlashInferExtend:
    """FlashInfer wrappers of the two extend passes for one model's head maps (one shared float workspace;
    see the module docstring). ``head_group`` / ``head_column`` / ``head_order``: int ``[L, Hkv]``, each
    layer's kv head -> group, -> column, and its kv heads by descending group budget."""

    def __init__(self, device: torch.device | str, head_group: np.ndarray, head_column: np.ndarray,
                 head_order: np.ndarray, *, page_size: int, heads_per_group: int,
                 workspace_bytes: int = 256 << 20) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("--tangram-extend-kernel flashinfer needs the flashinfer package (flashinfer-python "
                               "0.6.15, installed with sglang's GPU stack)") from e

        order = np.asarray(head_order, dtype=np.int64)
        if not (np.asarray(head_group).shape == np.asarray(head_column).shape == order.shape and order.ndim == 2):
            raise ValueError("head_group, head_column and head_order must all be [layers, kv heads]")
        self.device, self.cuda = torch.device(device), torch.device(device).type == "cuda"
        # the maps in rank order: rank k of layer l is kv head order[l, k]
        self.rank_group = np.take_along_axis(np.asarray(head_group, dtype=np.int64), order, 1)
        self.rank_column = np.take_along_axis(np.asarray(head_column, dtype=np.int64), order, 1)
        self.head_order = torch.from_numpy(order).to(self.device)
        self.head_rank = torch.from_numpy(np.argsort(order, axis=1)).to(self.device)
        self.page_size, self.heads_per_group = page_size, heads_per_group
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.chunk = _Planned(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD"), self.cuda)
        self.prefix = _Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2"),
                               self.cuda)

    @property
    def num_kv_heads(self) -> int:
        return self.rank_group.shape[1]

    def step(self, offsets: Sequence[int], kv_indptr: np.ndarray, kv_indices: torch.Tensor) -> FlashInferExtendStep:
        """Plans of one step whose rows have new tokens ``[offsets[r], offsets[r+1])`` over the committed
        slot lists ``(kv_indptr`` on the host, ``kv_indices`` on the device) of ``TangramKVManager.slot_lists``."""
        return FlashInferExtendStep(self, offsets, kv_indptr, kv_indices)


def run_buffers(wrapper, indices: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """The device index pointers, last-page lengths and indices a planned paged wrapper's run() reads: the
    first two made by plan() from its host arguments, the last ``indices`` itself (a device tensor plan() keeps).
    Raises if this FlashInfer keeps them elsewhere (the per-layer writes would not reach run())."""
    bufs = {"indptr": getattr(wrapper, "_paged_kv_indptr_buf", None),
            "last": getattr(wrapper, "_paged_kv_last_page_len_buf", None),
            "indices": getattr(wrapper, "_paged_kv_indices_buf", None)}
    ok = (all(isinstance(b, torch.Tensor) and b.device == indices.device for b in bufs.values())
          and bufs["indices"].data_ptr() == indices.data_ptr() and bufs["indptr"].numel() == batch + 1
          and bufs["last"].numel() == batch)
    if not ok:
        raise RuntimeError("this FlashInfer's paged prefill wrapper does not keep plan()'s index buffers as "
                           "_paged_kv_{indptr,last_page_len,indices}_buf (FlashInfer 0.6.15 does): the extend "
                           "prefix pass cannot reuse one plan across layers with it")
    return bufs


class FlashInferExtendStep:
    """One extend step's FlashInfer plans (the chunk pass and the prefix pass, each planned once) and its
    per-layer prefix indices."""

    def __init__(self, fi: FlashInferExtend, offsets: Sequence[int], kv_indptr: np.ndarray,
                 kv_indices: torch.Tensor) -> None:
        self.fi, self.kv_indptr, self.kv_indices = fi, np.asarray(kv_indptr, dtype=np.int64), kv_indices
        self.batch, self.hkv = len(offsets) - 1, fi.num_kv_heads
        self.qo_indptr = torch.tensor(list(offsets), dtype=torch.int32)
        # the paged plan() would find it with Python's max() over a tensor, element by element: given, it skips that
        self.max_new = int(np.diff(np.asarray(offsets)).max()) if len(offsets) > 1 else 0
        dev = kv_indices.device
        fwd, inv, pseudo_qo = pseudo_request_order(offsets, self.hkv)
        self.pseudo_qo = torch.from_numpy(pseudo_qo)
        fwd, self.inv = (torch.from_numpy(x).to(dev, non_blocking=True) for x in (fwd, inv))
        self.fwd_rank = fwd % self.hkv  # the rank each pseudo row is taken from (identity order)
        self.fwd_base = fwd - self.fwd_rank
        lens = np.diff(self.kv_indptr).reshape(self.batch, -1)  # [B, G]
        # each pseudo-request (r, k)'s largest prefix length over the layers: what the one plan covers
        self.planned_lens = lens[:, fi.rank_group].max(axis=1).reshape(-1)  # [B*Hkv]
        self.has_prefix = bool(self.planned_lens.any())
        self._scale: float | None = None
        self._prefix_bufs: dict[str, torch.Tensor] | None = None  # what the prefix run() reads, once planned

    def _plan_prefix(self, gq: int, d: int, sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        indptr = np.zeros(len(self.planned_lens) + 1, dtype=np.int64)
        np.cumsum(self.planned_lens, out=indptr[1:])
        planned = self.fi.prefix
        last = torch.from_numpy((self.planned_lens > 0).astype(np.int32))  # page size 1: an empty row has 0
        # each layer writes its pseudo-pages here (attend); plan() reads only the lengths (indptr, last)
        indices = torch.empty(int(indptr[-1]), dtype=torch.int32, device=self.kv_indices.device)
        planned.plan(self.pseudo_qo, torch.from_numpy(indptr.astype(np.int32)), indices, last, gq, 1, d, 1,
                     causal=False, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
                     max_token_per_sequence=self.max_new)
        self._prefix_bufs = run_buffers(planned.wrapper, indices, len(self.planned_lens))

    def _write_prefix_indices(self, layer: int) -> None:
        """This layer's lengths and pseudo-pages into the buffers run() reads (all at most the planned lengths)."""
        fi, bufs = self.fi, self._prefix_bufs
        indptr, pages = pseudo_token_indices(self.kv_indptr, self.kv_indices, fi.rank_group[layer],
                                             fi.rank_column[layer], batch=self.batch, page_size=fi.page_size,
                                             heads_per_group=fi.heads_per_group)
        host = torch.from_numpy(np.concatenate([indptr, (np.diff(indptr) > 0).astype(np.int32)]))
        ptr_last = host.to(self.kv_indices.device, non_blocking=True)
        bufs["indptr"].copy_(ptr_last[:len(indptr)])
        bufs["last"].copy_(ptr_last[len(indptr):])
        bufs["indices"][:pages.numel()].copy_(pages)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buffer: torch.Tensor,
               v_buffer: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """Layer ``layer``: q ``[T, Hq, D]``, k_new/v_new ``[T, Hkv, D]`` (staging), the pool's buffers.
        Returns ``[T, Hq, D]``."""
        import flashinfer

        t, hq, d = q.shape
        gq = hq // self.hkv
        if sm_scale != self._scale:  # the same for every layer of a model: planned once per step
            self.fi.chunk.plan(self.qo_indptr, self.qo_indptr, hq, self.hkv, d, causal=True,
                               sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=k_new.dtype)
            if self.has_prefix:
                self._plan_prefix(gq, d, sm_scale, q.dtype, k_buffer.dtype)
            self._scale = sm_scale
        chunk = self.fi.chunk.wrapper
        if not self.has_prefix:  # every row starts at position 0: the chunk pass is the whole extend
            return chunk.run(q, k_new, v_new)
        o1, s1 = chunk.run(q, k_new, v_new, return_lse=True)
        self._write_prefix_indices(layer)
        fwd = self.fwd_base + self.fi.head_order[layer][self.fwd_rank]  # pseudo row (r, k, t) <- kv head order[k]
        inv = self.inv.view(t, self.hkv)[:, self.fi.head_rank[layer]].reshape(-1)
        view = (k_buffer.view(-1, 1, 1, d), v_buffer.view(-1, 1, 1, d))
        o2, s2 = self.fi.prefix.wrapper.run(q.reshape(t * self.hkv, gq, d)[fwd], view, return_lse=True)
        o2 = o2[inv].reshape(t, hq, d)
        s2 = s2[inv].reshape(t, hq)
        return flashinfer.merge_state(o1, s1, o2, s2)[0]
