"""Pseudo-page ids of the FlashInfer extend prefix pass (``kernels/flashinfer_extend.py``): pieces of the step's
slot lists rewritten as page ids of a page-size-1 view of the pool.

Piece ``p`` takes ``count[p]`` consecutive slots ``kv_indices[src[p]:]`` and writes ``out[dst[p]:]``: slot ``s``
of column ``col[p]`` is pseudo-page ``(s // page_size * H_p + col) * page_size + s % page_size``. The pieces'
destinations are consecutive (``dst`` is the exclusive prefix sum of ``count``). One launch writes a layer's
pieces; every size and offset was computed on the host beforehand, so nothing synchronises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tangram_sgl.kernels.pieces import piece_positions


@triton.jit
def _pseudo_pages_kernel(KvIndices, Src, Dst, Count, Col, Out, PAGE: tl.constexpr, HP: tl.constexpr,
                         BLOCK: tl.constexpr):
    p = tl.program_id(0)
    src = tl.load(Src + p).to(tl.int64)
    dst = tl.load(Dst + p).to(tl.int64)
    n = tl.load(Count + p).to(tl.int64)
    col = tl.load(Col + p).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slot = tl.load(KvIndices + src + offs, mask=mask, other=0).to(tl.int64)
        tl.store(Out + dst + offs, ((slot // PAGE * HP + col) * PAGE + slot % PAGE).to(tl.int32), mask=mask)


def write_pseudo_pages(kv_indices: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                       col: torch.Tensor, out: torch.Tensor, *, page_size: int, heads_per_group: int,
                       block: int = 1024) -> None:
    """Write every piece's pseudo-pages into ``out`` (int32, device); ``src``/``dst``/``count``/``col``: one
    entry per piece (integer tensors on ``out``'s device)."""
    if len(count):
        _pseudo_pages_kernel[(len(count),)](kv_indices, src, dst, count, col, out, PAGE=page_size,
                                            HP=heads_per_group, BLOCK=block)


def write_pseudo_pages_torch(kv_indices: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, count: torch.Tensor,
                             col: torch.Tensor, out: torch.Tensor, *, page_size: int, heads_per_group: int,
                             total: int) -> None:
    """Reference of :func:`write_pseudo_pages`; ``total``: the pieces' summed count (a host int)."""
    if total == 0:
        return
    count = count.long()
    slot = kv_indices.long()[piece_positions(src.long() - dst.long(), count, total)]
    column = torch.repeat_interleave(col.long(), count, output_size=total)
    out[:total] = (((slot // page_size) * heads_per_group + column) * page_size + slot % page_size).to(torch.int32)
