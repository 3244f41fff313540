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
buffers run() reads before it runs. That needs a plan whose work does not depend on the kv lengths: FlashInfer's
own split-KV does (the fa2 kernel lays out a request's partial outputs by the chunk count of its *run-time*
length while the merge follows the planned one, so a shorter layer scrambles them; seen on the H200), so the
plan disables it (``disable_split_kv``) and the fa2 kernel reads each length at run time. The split is ours
instead, planned once per step: each pseudo-request's prefix is cut into ``chunks`` pieces of ``chunk`` slots
(``prefix_chunking``: chunks enough to fill the GPU's CTA slots when a few long prefixes would otherwise each
be streamed by one CTA), each piece a pseudo-request of its own (a piece past a layer's length is empty), merged
by log-sum-exp with the chunk pass. The wrapper is built with ``backend="fa2"`` and is not in CUDA-graph mode
(whose plan() sizes split-KV scratch for the padded worst case, 0.5 GB at 128 question rows); run() reads the
device tensors plan() made from its arguments (``_paged_kv_*_buf``, FlashInfer 0.6.15's names, checked after
every plan(): a FlashInfer that changes them fails loudly rather than reading stale indices).

plan() writes its schedule into a page-locked host buffer and copies it to the GPU asynchronously, so a
wrapper is not re-planned before the GPU has consumed that copy: an event is recorded after each plan() and
waited for before the next (``_Planned``). The prefix pass's per-layer lists are laid out for all layers at
plan time (``pseudo_lists``, host) and uploaded once; a layer then copies its index pointers and last-page
lengths and writes its pseudo-page ids in one launch (``kernels/pseudo_pages.py``; its torch reference off
CUDA). flashinfer is imported lazily (GPU machines only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tangram_sgl.kernels.pseudo_pages import write_pseudo_pages, write_pseudo_pages_torch


def piece_lengths(lens: np.ndarray, chunk: int, chunks: int) -> np.ndarray:
    """``[..., chunks]``: the lengths of pieces ``[j*chunk, (j+1)*chunk)`` of lists of ``lens`` slots (the whole
    list when ``chunks`` is 1)."""
    if chunks == 1:
        return lens[..., None]
    return np.clip(lens[..., None] - np.arange(chunks, dtype=np.int64) * chunk, 0, chunk)


def pseudo_lists(kv_indptr: np.ndarray, rank_group: np.ndarray, rank_column: np.ndarray, *, batch: int,
                 chunk: int = 0, chunks: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every layer's prefix-pass pseudo-requests, on the host: (``src [L, P]`` each one's first entry in the
    step's slot lists, ``indptr [L, P+1]`` its pseudo-pages' place, ``col [L, P]`` its column), P = B*Hkv*chunks.

    Pseudo-request ``(r*Hkv + k)*chunks + j`` of layer l holds slots ``[j*chunk, (j+1)*chunk)`` (all of them
    when ``chunks`` is 1) of (request r, group ``rank_group[l, k]``), column ``rank_column[l, k]``.
    ``kv_indptr``: the step's CSR ``[B*G+1]`` over its slot lists. ``kernels/pseudo_pages.py`` writes the ids.
    """
    num_groups = (len(kv_indptr) - 1) // batch
    layers = rank_group.shape[0]
    seg = (np.arange(batch)[None, :, None] * num_groups + rank_group[:, None, :]).reshape(layers, -1)  # [L, B*Hkv]
    src = kv_indptr[seg].astype(np.int64)
    lens = piece_lengths(kv_indptr[seg + 1].astype(np.int64) - src, chunk, chunks)
    src = (src[..., None] + np.arange(chunks, dtype=np.int64) * chunk).reshape(layers, -1)
    indptr = np.zeros((layers, src.shape[1] + 1), dtype=np.int64)
    np.cumsum(lens.reshape(layers, -1), axis=1, out=indptr[:, 1:])
    col = np.repeat(np.tile(np.asarray(rank_column, dtype=np.int64), (1, batch)), chunks, axis=1)
    return src, indptr, col


def pseudo_request_order(offsets: Sequence[int], num_kv_heads: int,
                         chunks: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows with new tokens ``[offsets[r], offsets[r+1])``: (gather ``[T*Hkv*chunks]`` taking the
    query-head blocks of ``q.view(T*Hkv, G_q, D)`` into pseudo order (request, kv head, chunk, token), its
    inverse ``[T*Hkv, chunks]`` (block ``t*Hkv + h``'s pseudo row in each chunk), the pseudo-requests' qo
    indptr ``[B*Hkv*chunks+1]``)."""
    off = np.asarray(offsets, dtype=np.int64)
    per = num_kv_heads * chunks
    rows = np.repeat(np.diff(off), per)  # tokens of each pseudo-request (r, h, j)
    qo = np.concatenate([[0], np.cumsum(rows)])
    pid = np.repeat(np.arange(len(rows)), rows)  # pseudo-request of each entry
    r, h, j = pid // per, pid // chunks % num_kv_heads, pid % chunks
    fwd = (off[r] + np.arange(len(pid)) - qo[pid]) * num_kv_heads + h
    inv = np.empty((len(fwd) // chunks, chunks), dtype=np.int64)
    inv[fwd, j] = np.arange(len(fwd))
    return fwd, inv, qo.astype(np.int32)


def prefix_chunking(planned_lens: np.ndarray, new_tokens: np.ndarray, gq: int, *, cta_slots: int,
                    min_chunk: int) -> tuple[int, int]:
    """(chunk, chunks): how the prefix pass cuts every pseudo-request's slot list (``chunks`` pieces of at most
    ``chunk`` slots). ``planned_lens``/``new_tokens``: each pseudo-request's planned prefix length and query
    rows. The whole step's work (FlashInfer fa2's 128 packed query rows per CTA, times prefix slots) spread
    over ``cta_slots`` CTAs gives the chunk, at least ``min_chunk``: one piece per list unless a few long
    prefixes would leave most of the GPU idle while single CTAs stream them."""
    longest = int(planned_lens.max(initial=0))
    tiles = -(-np.asarray(new_tokens, dtype=np.int64) * gq // 128)
    per_cta = -(-int((tiles * planned_lens).sum()) // max(1, cta_slots))
    chunks = max(1, -(-longest // max(min_chunk, per_cta)))
    return -(-longest // chunks), chunks


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
    layer's kv head -> group, -> column, and its kv heads by descending group budget. ``cta_slots`` (default:
    two per SM of a CUDA device, FlashInfer's own count) and ``min_chunk`` drive ``prefix_chunking``."""

    def __init__(self, device: torch.device | str, head_group: np.ndarray, head_column: np.ndarray,
                 head_order: np.ndarray, *, page_size: int, heads_per_group: int,
                 workspace_bytes: int = 256 << 20, cta_slots: int | None = None, min_chunk: int = 512) -> None:
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
        if cta_slots is None:
            cta_slots = 2 * torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 1
        self.cta_slots, self.min_chunk = cta_slots, min_chunk
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.chunk = _Planned(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD"), self.cuda)
        self.prefix = _Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2"),
                               self.cuda)

    @property
    def num_kv_heads(self) -> int:
        return self.rank_group.shape[1]

    def warm_up(self, num_q_heads: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        """Run every FlashInfer kernel a step can use once, on a tiny step, so that FlashInfer's JIT compiles them
        now rather than inside the first long prompt's forward (minutes on a fresh machine, the scheduler stuck
        meanwhile; SGLang's own warm-up sends a prompt short enough for the Triton kernel under ``mixed``)."""
        import flashinfer

        dev, groups, hkv = self.device, int(self.rank_group.max()) + 1, self.num_kv_heads
        rows = 2 * self.heads_per_group * self.page_size  # above every pseudo-page id of slots 0 and 1
        k_buf, v_buf = (torch.zeros(rows, head_dim, dtype=kv_dtype, device=dev) for _ in range(2))
        indptr = np.arange(groups + 1, dtype=np.int64) * 2  # one row, two prefix slots in every group
        indices = torch.tensor([0, 1] * groups, dtype=torch.int32, device=dev)
        q = torch.zeros(2, num_q_heads, head_dim, dtype=q_dtype, device=dev)
        kv_new = torch.zeros(2, hkv, head_dim, dtype=q_dtype, device=dev)
        self.step([0, 2], indptr, indices).attend(0, q, kv_new, kv_new, k_buf, v_buf, head_dim ** -0.5)
        # the merge of several prefix pieces (a step's pieces come only with long prefixes)
        states = torch.zeros(2, 2, num_q_heads, head_dim, dtype=q_dtype, device=dev)
        flashinfer.merge_states(states, torch.zeros(2, 2, num_q_heads, dtype=torch.float32, device=dev))
        if self.cuda:
            torch.cuda.synchronize(dev)

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
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.batch, self.hkv = len(offsets) - 1, fi.num_kv_heads
        self.qo_indptr = torch.tensor(list(offsets), dtype=torch.int32)
        # the paged plan() would find it with Python's max() over a tensor, element by element: given, it skips that
        self.max_new = int(np.diff(self.offsets).max()) if len(offsets) > 1 else 0
        lens = np.diff(self.kv_indptr).reshape(self.batch, -1)  # [B, G]
        # each pseudo-request (r, k)'s largest prefix length over the layers: what the one plan covers
        self.planned_lens = lens[:, fi.rank_group].max(axis=1).reshape(-1)  # [B*Hkv]
        self.has_prefix = bool(self.planned_lens.any())
        self.chunk, self.chunks = 0, 1  # the prefix pass's pieces per list (prefix_chunking), once planned
        self._scale: float | None = None
        self._prefix_bufs: dict[str, torch.Tensor] | None = None  # what the prefix run() reads, once planned

    def _plan_prefix(self, gq: int, d: int, sm_scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        fi, dev = self.fi, self.kv_indices.device
        new_tokens = np.repeat(np.diff(self.offsets), self.hkv)
        self.chunk, self.chunks = prefix_chunking(self.planned_lens, new_tokens, gq, cta_slots=fi.cta_slots,
                                                  min_chunk=fi.min_chunk)
        fwd, inv, pseudo_qo = pseudo_request_order(self.offsets, self.hkv, self.chunks)
        fwd, inv = (torch.from_numpy(x).to(dev, non_blocking=True) for x in (fwd, inv))
        rank = fwd % self.hkv  # the rank each pseudo row is taken from (identity order)
        # every layer's gathers: pseudo row (r, k, j, t) <- q block of kv head order[l, k]; back by the head's rank
        self._fwd = (fwd - rank)[None, :] + fi.head_order[:, rank]  # [L, T*Hkv*chunks]
        t = len(inv) // self.hkv
        self._inv = inv.view(t, self.hkv, self.chunks)[:, fi.head_rank].transpose(0, 1).reshape(
            len(fi.head_rank), t * self.hkv, self.chunks)  # [L, T*Hkv, chunks]
        lens = piece_lengths(self.planned_lens, self.chunk, self.chunks).reshape(-1)  # [B*Hkv*chunks]
        indptr = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=indptr[1:])
        last = torch.from_numpy((lens > 0).astype(np.int32))  # page size 1: an empty row has 0
        # each layer writes its pseudo-pages here (attend); plan() reads only the lengths (indptr, last)
        indices = torch.empty(int(indptr[-1]), dtype=torch.int32, device=dev)
        fi.prefix.plan(torch.from_numpy(pseudo_qo), torch.from_numpy(indptr.astype(np.int32)), indices, last, gq, 1,
                       d, 1, causal=False, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
                       max_token_per_sequence=self.max_new, disable_split_kv=True)
        self._prefix_bufs = run_buffers(fi.prefix.wrapper, indices, len(lens))
        # every layer's lists, uploaded once: [L, 3, P] (first slot, count, column), [L, 2P+1] (pointers, last)
        src, self.layer_indptr, col = pseudo_lists(self.kv_indptr, fi.rank_group, fi.rank_column, batch=self.batch,
                                                   chunk=self.chunk, chunks=self.chunks)
        count = np.diff(self.layer_indptr, axis=1)
        self._lists = torch.from_numpy(np.stack([src, count, col], axis=1)).to(dev, non_blocking=True)
        self._ptr_last = torch.from_numpy(np.concatenate([self.layer_indptr, count > 0], axis=1).astype(np.int32)
                                          ).to(dev, non_blocking=True)

    def _write_prefix_indices(self, layer: int) -> None:
        """This layer's lengths and pseudo-pages into the buffers run() reads (all at most the planned lengths)."""
        fi, bufs = self.fi, self._prefix_bufs
        n = self._lists.shape[2]
        bufs["indptr"].copy_(self._ptr_last[layer, :n + 1])
        bufs["last"].copy_(self._ptr_last[layer, n + 1:])
        src, count, col = self._lists[layer]
        if fi.cuda:
            write_pseudo_pages(self.kv_indices, src, self._ptr_last[layer, :n], count, col, bufs["indices"],
                               page_size=fi.page_size, heads_per_group=fi.heads_per_group)
        else:
            write_pseudo_pages_torch(self.kv_indices, src, self._ptr_last[layer, :n], count, col, bufs["indices"],
                                     page_size=fi.page_size, heads_per_group=fi.heads_per_group,
                                     total=int(self.layer_indptr[layer, -1]))

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
        fwd, inv = self._fwd[layer], self._inv[layer]
        view = (k_buffer.view(-1, 1, 1, d), v_buffer.view(-1, 1, 1, d))
        o2, s2 = self.fi.prefix.wrapper.run(q.reshape(t * self.hkv, gq, d)[fwd], view, return_lse=True)
        if self.chunks == 1:
            return flashinfer.merge_state(o1, s1, o2[inv[:, 0]].reshape(t, hq, d), s2[inv[:, 0]].reshape(t, hq))[0]
        # states per (token, kv head): the chunk pass first (never empty, so no merge starts from -inf), then
        # each piece of the prefix (a piece past this layer's length is empty: lse -inf, weight 0)
        v = torch.cat([o1.view(t * self.hkv, 1, gq, d), o2[inv]], dim=1)
        s = torch.cat([s1.view(t * self.hkv, 1, gq), s2[inv]], dim=1)
        return flashinfer.merge_states(v, s)[0].view(t, hq, d)
