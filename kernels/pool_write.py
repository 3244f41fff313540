"""Writes of K/V into the head-group page pool (a slot is page ``slot // page_size``, row ``slot % page_size``).

* :func:`scatter_kv`: entry i copies ``k_src[token[i], head[i]]`` (and the same of V) to slot ``slot[i]``, column
  ``column[i]``. One launch per layer for a step's whole-segment and compressed-segment writes, in place of
  gathering the source rows, converting the indices and an indexed assignment per buffer.
* :func:`write_token_kv`: one token per row that every group keeps (a decode step): kv head h of row r goes to
  slot ``slots[r, head_group[h]]``, column ``head_column[h]``. One launch per layer in place of the five
  index / convert / assign kernels of an indexed write (~14 us a layer at 8 rows on the H200, session 16's trace).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows(KSrc, VSrc, K, V, src_k, src_v, slot, col, mask,
               stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
               PAGE: tl.constexpr, D: tl.constexpr):
    """Rows ``KSrc + src_k[i]`` / ``VSrc + src_v[i]`` (D contiguous values) to (slot[i], column col[i]) of the pool,
    cast to its dtype, where ``mask``."""
    page, row = slot // PAGE, slot % PAGE
    d = tl.arange(0, D)
    k = tl.load(KSrc + src_k[:, None] + d[None, :], mask=mask[:, None])
    tl.store(K + (page * stride_kp + col * stride_kc + row * stride_kt)[:, None] + d[None, :],
             k.to(K.dtype.element_ty), mask=mask[:, None])
    v = tl.load(VSrc + src_v[:, None] + d[None, :], mask=mask[:, None])
    tl.store(V + (page * stride_vp + col * stride_vc + row * stride_vt)[:, None] + d[None, :],
             v.to(V.dtype.element_ty), mask=mask[:, None])


@triton.jit(do_not_specialize=["m"])  # the copy count: not a compile per value
def _scatter_kv_kernel(Slot, Column, Token, Head, KSrc, VSrc, K, V, m,
                       stride_st, stride_sh, stride_vst, stride_vsh,
                       stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                       PAGE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    slot = tl.load(Slot + offs, mask=mask, other=0).to(tl.int64)
    col = tl.load(Column + offs, mask=mask, other=0).to(tl.int64)
    tok = tl.load(Token + offs, mask=mask, other=0).to(tl.int64)
    head = tl.load(Head + offs, mask=mask, other=0).to(tl.int64)
    _copy_rows(KSrc, VSrc, K, V, tok * stride_st + head * stride_sh, tok * stride_vst + head * stride_vsh, slot, col,
               mask, stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt, PAGE, D)


def _check(k_src: torch.Tensor, v_src: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in (k_src, v_src, k_buffer, v_buffer)):
        raise ValueError("staging and pool tensors must be contiguous along head_dim")


def scatter_kv(slot: torch.Tensor, column: torch.Tensor, token: torch.Tensor, head: torch.Tensor,
               k_src: torch.Tensor, v_src: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, *,
               block: int = 32) -> None:
    """Copy ``k_src[token[i], head[i]]`` / ``v_src[...]`` (``[T, H, D]``) to ``(slot[i], column[i])`` of the pool
    buffers ``[pages, H_p, page_size, D]``, in place; the four index tensors: one entry per copy, on the pool's
    device."""
    _check(k_src, v_src, k_buffer, v_buffer)
    m = slot.numel()
    if m == 0:
        return
    _scatter_kv_kernel[(triton.cdiv(m, block),)](
        slot, column, token, head, k_src, v_src, k_buffer, v_buffer, m,
        k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=k_buffer.shape[2], D=k_buffer.shape[-1], BLOCK=block)


def scatter_kv_torch(slot: torch.Tensor, column: torch.Tensor, token: torch.Tensor, head: torch.Tensor,
                     k_src: torch.Tensor, v_src: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """Reference of :func:`scatter_kv`."""
    _check(k_src, v_src, k_buffer, v_buffer)
    slot, column, token, head = (x.long() for x in (slot, column, token, head))
    page, row = slot // k_buffer.shape[2], slot % k_buffer.shape[2]
    k_buffer[page, column, row] = k_src[token, head].to(k_buffer.dtype)
    v_buffer[page, column, row] = v_src[token, head].to(v_buffer.dtype)


@triton.jit
def _write_token_kv_kernel(Slots, HeadGroup, HeadColumn, KSrc, VSrc, K, V, num_heads,
                           stride_sr, stride_kr, stride_kh, stride_vr, stride_vh,
                           stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                           PAGE: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < num_heads
    g = tl.load(HeadGroup + h, mask=mask, other=0).to(tl.int64)
    col = tl.load(HeadColumn + h, mask=mask, other=0).to(tl.int64)
    slot = tl.load(Slots + r * stride_sr + g, mask=mask, other=0).to(tl.int64)
    _copy_rows(KSrc, VSrc, K, V, r * stride_kr + h * stride_kh, r * stride_vr + h * stride_vh, slot, col, mask,
               stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt, PAGE, D)


def write_token_kv(slots: torch.Tensor, head_group: torch.Tensor, head_column: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """Write ``k[r, h]`` / ``v[r, h]`` (``[R, H, D]``) at slot ``slots[r, head_group[h]]`` (``slots``: ``[R, G]``,
    contiguous rows), column ``head_column[h]`` of the pool buffers, in place; one program per row, fixed
    shapes (CUDA-graph capturable)."""
    _check(k, v, k_buffer, v_buffer)
    if slots.stride(1) != 1:
        raise ValueError("slots must be contiguous along the groups")
    rows, heads = k.shape[0], k.shape[1]
    if rows == 0:
        return
    _write_token_kv_kernel[(rows,)](
        slots, head_group, head_column, k, v, k_buffer, v_buffer, heads,
        slots.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=k_buffer.shape[2], D=k_buffer.shape[-1], BLOCK_H=triton.next_power_of_2(heads))


def write_token_kv_torch(slots: torch.Tensor, head_group: torch.Tensor, head_column: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """Reference of :func:`write_token_kv`."""
    _check(k, v, k_buffer, v_buffer)
    rows = slots.long()[:, head_group.long()]  # [R, H]: each head's slot is its group's slot
    column = head_column.long().expand_as(rows)
    page, row = rows // k_buffer.shape[2], rows % k_buffer.shape[2]
    k_buffer[page, column, row] = k.to(k_buffer.dtype)
    v_buffer[page, column, row] = v.to(v_buffer.dtype)
