"""Extend (prefill / chunked prefill) attention through FlashInfer 0.6.15 over the head-group pool.

The same result as ``tangram_sgl.kernels.extend.extend_attention``, in two FlashInfer passes per layer merged
by log-sum-exp (``merge_state``), the way SGLang's FlashInfer backend splits a chunked prefill:

- the new tokens over themselves: a ragged causal prefill of the step's staging K/V (all heads; planned once
  per step, the same for every layer);
- the new tokens over their compressed prefix: a paged prefill in which each (request, kv head) is a
  pseudo-request of its G_q query heads (pseudo order: request, kv head, token) over a *page-size-1 view* of
  the pool: slot ``s`` of column ``c`` is pseudo-page ``(s // page_size * H_p + c) * page_size + s % page_size``
  of ``buffer.view(-1, 1, 1, D)``, so slot lists made of several segments' partial pages are valid. A layer's
  kv heads map to other groups than the next layer's, so the lengths differ per layer and this pass is
  planned per layer (extend steps are not graph-captured; plan() takes host index pointers).

plan() writes its schedule into a page-locked host buffer and copies it to the GPU asynchronously, so a
wrapper is not re-planned before the GPU has consumed its previous copy: each wrapper records an event after
plan() and waits for it before the next one (``_Planned``), and layers alternate between two prefix
wrappers so the host can plan one layer ahead. ``pseudo_token_indices`` (torch, device-side, CPU-testable)
builds the prefix pass's pseudo-page indices. flashinfer is imported lazily (GPU machines only).
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

    Row ``r*Hkv + h`` lists the slots of (request r, group ``head_group[h]``) as pseudo-pages of column
    ``head_column[h]`` of a page-size-1 view of the pool (see the module docstring). ``kv_indptr``: the step's
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
    """A FlashInfer wrapper and, on CUDA, the event after its last plan() (re-planned only once the GPU
    passed it)."""

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
    """FlashInfer wrappers of the two extend passes (one shared float workspace; see the module docstring)."""

    def __init__(self, device: torch.device | str, workspace_bytes: int = 256 << 20) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError("--tangram-extend-kernel flashinfer needs the flashinfer package (flashinfer-python "
                               "0.6.15, installed with sglang's GPU stack)") from e

        cuda = torch.device(device).type == "cuda"
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.chunk = _Planned(flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD"), cuda)
        self.prefix = [_Planned(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD"), cuda)
                       for _ in range(2)]

    def step(self, offsets: Sequence[int], kv_indptr: np.ndarray, kv_indices: torch.Tensor, *, num_kv_heads: int,
             page_size: int, heads_per_group: int) -> FlashInferExtendStep:
        """Plans of one step whose rows have new tokens ``[offsets[r], offsets[r+1])`` over the committed
        slot lists ``(kv_indptr`` on the host, ``kv_indices`` on the device) of ``TangramKVManager.slot_lists``."""
        return FlashInferExtendStep(self, offsets, kv_indptr, kv_indices, num_kv_heads, page_size, heads_per_group)


class FlashInferExtendStep:
    """One extend step's FlashInfer plans: the chunk pass planned here, the prefix pass per layer."""

    def __init__(self, fi: FlashInferExtend, offsets: Sequence[int], kv_indptr: np.ndarray, kv_indices: torch.Tensor,
                 num_kv_heads: int, page_size: int, heads_per_group: int) -> None:
        self.fi, self.kv_indptr, self.kv_indices = fi, np.asarray(kv_indptr, dtype=np.int64), kv_indices
        self.batch, self.hkv = len(offsets) - 1, num_kv_heads
        self.page_size, self.heads_per_group = page_size, heads_per_group
        self.qo_indptr = torch.tensor(list(offsets), dtype=torch.int32)
        # the paged plan() would find it with Python's max() over a tensor, element by element: ~4 ms per layer
        # at 1024 pseudo-requests on the H200's host (bench_step_host --cprofile); given, plan() skips that
        self.max_new = int(np.diff(np.asarray(offsets)).max()) if len(offsets) > 1 else 0
        dev = kv_indices.device
        fwd, inv, pseudo_qo = pseudo_request_order(offsets, num_kv_heads)
        self.pseudo_qo = torch.from_numpy(pseudo_qo)
        self.fwd, self.inv = (torch.from_numpy(x).to(dev, non_blocking=True) for x in (fwd, inv))
        self.has_prefix = bool(self.kv_indptr[-1] > 0)
        self._scale: float | None = None
        self._layers = 0

    def attend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buffer: torch.Tensor,
               v_buffer: torch.Tensor, head_group: Sequence[int], head_column: Sequence[int],
               sm_scale: float) -> torch.Tensor:
        """One layer: q ``[T, Hq, D]``, k_new/v_new ``[T, Hkv, D]`` (staging), the pool's buffers, the layer's
        head -> (group, column) maps on the host. Returns ``[T, Hq, D]``."""
        import flashinfer

        t, hq, d = q.shape
        gq = hq // self.hkv
        if sm_scale != self._scale:  # the same for every layer of a model: planned once per step
            self.fi.chunk.plan(self.qo_indptr, self.qo_indptr, hq, self.hkv, d, causal=True,
                               sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=k_new.dtype)
            self._scale = sm_scale
        chunk = self.fi.chunk.wrapper
        if not self.has_prefix:  # every row starts at position 0: the chunk pass is the whole extend
            return chunk.run(q, k_new, v_new)
        o1, s1 = chunk.run(q, k_new, v_new, return_lse=True)
        indptr, pages = pseudo_token_indices(self.kv_indptr, self.kv_indices, head_group, head_column,
                                             batch=self.batch, page_size=self.page_size,
                                             heads_per_group=self.heads_per_group)
        prefix = self.fi.prefix[self._layers % 2]
        self._layers += 1
        last = torch.from_numpy((np.diff(indptr) > 0).astype(np.int32))  # page size 1: an empty row has 0
        prefix.plan(self.pseudo_qo, torch.from_numpy(indptr), pages, last,
                    gq, 1, d, 1, causal=False, sm_scale=sm_scale, q_data_type=q.dtype,
                    kv_data_type=k_buffer.dtype, max_token_per_sequence=self.max_new)
        q_rows = q.reshape(t * self.hkv, gq, d)[self.fwd]
        view = (k_buffer.view(-1, 1, 1, d), v_buffer.view(-1, 1, 1, d))
        o2, s2 = prefix.wrapper.run(q_rows, view, return_lse=True)
        o2 = o2[self.inv].reshape(t, hq, d)
        s2 = s2[self.inv].reshape(t, hq)
        return flashinfer.merge_state(o1, s1, o2, s2)[0]
