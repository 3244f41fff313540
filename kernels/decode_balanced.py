"""Token-balanced split-KV paged decode (stream-K): every program attends to the same number of kept tokens.

The same pool contract and result as :func:`tangram_sgl.kernels.decode.paged_decode`, with a different split
rule. The (request, kv head) sequences of the batch, in order j = r * Hkv + h with n_j the length of request r's
list in group ``head_group[h]``, are laid end to end: T = sum n_j tokens. A launch of P programs gives program p
the token range ``[p * c, min((p + 1) * c, T))`` with ``c = ceil(T / P)``, whatever the sequences' lengths, so a
non-uniform cache (one head at budget 1.0, seven at 0.14) leaves no program waiting on a longer split and no
second, mostly idle wave. Each program derives its range on the GPU from the lengths (a prefix sum over the
batch's B * Hkv lengths), walks the sequences its range crosses, writes a sequence that lies wholly inside it
straight to the output and the at most two it shares with neighbours as partials (slot 0: the one holding the
range's first token, slot 1: the one holding its last). A merge program per sequence combines the partials of
the programs it crosses (log-sum-exp) and writes zeros for an empty one. Launch shapes depend only on
(B, Hq, Hkv, D, P): CUDA-graph capturable, no host planning, no device-to-host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tangram_sgl.kernels.decode import DECODE_CONFIG, H200_SMS, _attend_range, _block_h, _decode_shapes


@triton.jit
def _sequence_lengths(KvLens, HeadGroup, num_seq, num_groups, num_kv_heads, BLOCK_SEQ: tl.constexpr):
    """(index, length) of every sequence j = r * Hkv + h of the batch, 0 past the last."""
    offs = tl.arange(0, BLOCK_SEQ)
    mask = offs < num_seq
    g = tl.load(HeadGroup + offs % num_kv_heads, mask=mask, other=0)
    return offs, tl.load(KvLens + (offs // num_kv_heads) * num_groups + g, mask=mask, other=0)


@triton.jit
def _balanced_split_kernel(
    Q, K, V, O, MidO, MidLse,
    KvStarts, KvLens, KvIndices, HeadGroup, HeadColumn,
    sm_scale, num_seq, num_groups, num_kv_heads,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
    PAGE: tl.constexpr, GQ: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SEQ: tl.constexpr,
):
    p = tl.program_id(0)
    offs, n_all = _sequence_lengths(KvLens, HeadGroup, num_seq, num_groups, num_kv_heads, BLOCK_SEQ)
    mask = offs < num_seq
    ends = tl.cumsum(n_all, 0)
    total = tl.sum(n_all, 0)
    per = tl.cdiv(total, tl.num_programs(0))
    lo = p * per
    hi = tl.minimum(lo + per, total)
    # the sequence holding token lo: the first whose end is past it (empty sequences end where they start)
    before = mask & (ends <= lo)
    j = tl.sum(before.to(tl.int32), 0)
    seq_start = tl.max(tl.where(before, ends, 0), 0)
    pos = lo
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    offs_d = tl.arange(0, D)
    while pos < hi:
        r = j // num_kv_heads
        h = j % num_kv_heads
        g = tl.load(HeadGroup + h)
        n = tl.load(KvLens + r * num_groups + g)
        a = pos - seq_start
        b = tl.minimum(hi, seq_start + n) - seq_start
        if b > a:  # empty sequences met after the first piece have nothing to read (the merge zeroes them)
            c = tl.load(HeadColumn + h).to(tl.int64)
            kv_start = tl.load(KvStarts + r * num_groups + g).to(tl.int64)
            q = tl.load(Q + r * stride_qb + (h * GQ + offs_h)[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_h[:, None], other=0.0)
            acc, m_i, l_i = _attend_range(q, K, V, KvIndices, kv_start, c, a, b, sm_scale,
                                          stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                                          PAGE, BLOCK_H, D, BLOCK_N)
            out = acc / l_i[:, None]
            if (a == 0) & (b == n):  # the whole sequence is this program's: no merge
                tl.store(O + r * stride_ob + (h * GQ + offs_h)[:, None] * stride_oh + offs_d[None, :],
                         out.to(O.dtype.element_ty), mask=mask_h[:, None])
            else:
                part = (p * 2 + (pos != lo).to(tl.int32)) * GQ
                tl.store(MidO + (part + offs_h)[:, None] * D + offs_d[None, :], out, mask=mask_h[:, None])
                tl.store(MidLse + part + offs_h, m_i + tl.log(l_i), mask=mask_h)
        pos = seq_start + b
        seq_start += n
        j += 1


@triton.jit
def _balanced_merge_kernel(
    O, MidO, MidLse, KvLens, HeadGroup,
    num_seq, num_groups, num_programs, stride_ob, stride_oh,
    GQ: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_SEQ: tl.constexpr,
):
    """Program (r, h): sequence j = r * Hkv + h, its G_q query heads together."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    j = r * num_kv_heads + h
    g = tl.load(HeadGroup + h)
    n = tl.load(KvLens + r * num_groups + g)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    offs_d = tl.arange(0, D)
    o_ptr = O + r * stride_ob + (h * GQ + offs_h)[:, None] * stride_oh + offs_d[None, :]
    if n == 0:  # attends to nothing: zeros, as FlashInfer gives
        tl.store(o_ptr, tl.zeros([BLOCK_H, D], tl.float32).to(O.dtype.element_ty), mask=mask_h[:, None])
    else:
        offs, n_all = _sequence_lengths(KvLens, HeadGroup, num_seq, num_groups, num_kv_heads, BLOCK_SEQ)
        seq_start = tl.sum(tl.where(offs < j, n_all, 0), 0)
        total = tl.sum(n_all, 0)
        per = tl.cdiv(total, num_programs)
        p_first = seq_start // per
        p_last = (seq_start + n - 1) // per
        if p_last > p_first:  # shared by several programs (otherwise written whole by its one program)
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            w_sum = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, D], tl.float32)
            for pp in range(p_first, p_last + 1):
                slot = ((pp == p_first) & (seq_start != p_first * per)).to(tl.int32)
                part = (pp * 2 + slot) * GQ
                lse = tl.load(MidLse + part + offs_h, mask=mask_h, other=0.0)
                o = tl.load(MidO + (part + offs_h)[:, None] * D + offs_d[None, :], mask=mask_h[:, None], other=0.0)
                m_new = tl.maximum(m, lse)
                scale = tl.exp(m - m_new)
                w = tl.exp(lse - m_new)
                acc = acc * scale[:, None] + o * w[:, None]
                w_sum = w_sum * scale + w
                m = m_new
            tl.store(o_ptr, (acc / w_sum[:, None]).to(O.dtype.element_ty), mask=mask_h[:, None])


# one wave of this kernel's programs as the GPU's Triton 3.6 compiles it: 2 a SM (eval/results/kernel_resources.json)
BALANCED_PROGRAMS = 2 * H200_SMS
# register cap (Triton's ``maxnreg``) at which an SM holds 3 programs of 4 warps, as it holds the AOT-split kernel's
# (65536 registers, allocated 8 a thread at a time). Uncapped, the GPU's Triton 3.6 gives this kernel 201 registers
# (its piece loop costs ~40 over one piece), 2 programs a SM; capped, 7 values of the piece loop spill, stored and
# loaded once a piece outside the token loop (SASS read in session 28). Triton 3.8 needs 162 uncapped and spills
# inside the token loop capped. Not applied by default: the GPU study (stage probe) weighs it against
# 2 a SM x 132 programs.
THREE_PER_SM_MAXNREG = 168


def balanced_paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    *,
    sm_scale: float,
    num_programs: int = BALANCED_PROGRAMS,
    block_n: int = DECODE_CONFIG[0],
    num_warps: int = DECODE_CONFIG[1],
    num_stages: int = DECODE_CONFIG[2],
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Decode attention of one layer over the head-group page pool, ``num_programs`` programs each reading an
    equal share of the batch's kept tokens; returns ``[B, Hq, D]`` like ``q``. Arguments as
    :func:`tangram_sgl.kernels.decode.paged_decode` (no split table: the split follows the lengths); ``maxnreg``:
    the split kernel's register cap, if any (``THREE_PER_SM_MAXNREG``)."""
    if num_programs < 1:
        raise ValueError("num_programs must be >= 1")
    B, D, hkv, gq, num_groups = _decode_shapes(q, k_buffer, v_buffer, kv_starts, kv_lens, head_group)
    bh = _block_h(gq)
    block_seq = triton.next_power_of_2(B * hkv)
    out = torch.empty_like(q)
    mid_o = torch.empty((num_programs, 2, gq, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_programs, 2, gq), dtype=torch.float32, device=q.device)
    _balanced_split_kernel[(num_programs,)](
        q, k_buffer, v_buffer, out, mid_o, mid_lse,
        kv_starts, kv_lens, kv_indices, head_group, head_column,
        sm_scale, B * hkv, num_groups, hkv,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=k_buffer.shape[2], GQ=gq, BLOCK_H=bh, D=D, BLOCK_N=block_n, BLOCK_SEQ=block_seq,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    _balanced_merge_kernel[(B, hkv)](
        out, mid_o, mid_lse, kv_lens, head_group,
        B * hkv, num_groups, num_programs, out.stride(0), out.stride(1),
        GQ=gq, BLOCK_H=bh, D=D, BLOCK_SEQ=block_seq, num_warps=4,
    )
    return out
