"""Split-KV paged decode over head-group pages, split by the AOT table (no host planning).

Layout (the pool contract): ``k_buffer``/``v_buffer`` are ``[num_pages, H_p, page_size, D]``; a slot is
``page * page_size + offset``; for request r and group g the kept tokens are the slots
``kv_indices[kv_starts[r*G + g] : kv_starts[r*G + g] + kv_lens[r*G + g]]`` and kv head h of the layer reads
column ``head_column[h]`` of group ``head_group[h]``. (start, length) ranges rather than a CSR indptr let the
lists live in an arena with room to grow in place (``tangram_sgl.pool.device_slot_lists``); a CSR list is
the special case ``csr_ranges(kv_indptr)``.

Launch: grid ``(max_splits, B, Hkv)``; program (s, r, i) serves kv head ``h = head_order[i]``. Blocks are
issued x-fastest, so with ``head_order`` listing the layer's kv heads by descending group budget
(``launch_order``) the long (request, head) chunks are issued first: a longest-first schedule at no
cost. Program (r, h, s) derives its kv range on the GPU: with n the
(r, g) length and S_g = ``splits[g]`` (the AOT table row of the batch bucket),
``chunk = max(min_split_tokens, ceil(n / S_g))`` and it covers ``[s*chunk, min((s+1)*chunk, n))``;
programs past the last chunk exit at once. The G_q query heads of kv head h are processed together
(rows of one ``tl.dot``). A (r, h) with a single chunk writes the output directly (an empty one writes
zeros); otherwise each chunk writes a partial (acc, lse) and a log-sum-exp merge kernel combines them
(not launched when the bucket's max_splits is 1; one program per (request, query head) loads all its
partials in one round). Shapes depend only on
(B, Hq, Hkv, D, max_splits), so a batch bucket has one fixed launch: CUDA-graph capturable, no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_range(q, K, V, KvIndices, kv_start, c, lo, hi, sm_scale,
                  stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                  PAGE: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of ``q`` ([BLOCK_H, D], query rows of one kv head: decode's heads, extend's (token, head)
    pairs) over tokens [lo, hi) of the slot list at ``KvIndices + kv_start``, column ``c`` of the pages:
    (unnormalised acc, running max, running sum)."""
    q = q.to(K.dtype.element_ty)  # unscaled: the scale multiplies the fp32 dot product, as SGLang's kernels
    offs_d = tl.arange(0, D)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slot = tl.load(KvIndices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        page = slot // PAGE
        tok = slot % PAGE
        k_row = page * stride_kp + c * stride_kc + tok * stride_kt
        v_row = page * stride_vp + c * stride_vc + tok * stride_vt
        k = tl.load(K + k_row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(V + v_row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    Q, K, V, O, MidO, MidLse,
    KvStarts, KvLens, KvIndices, HeadGroup, HeadColumn, HeadOrder, Splits,
    sm_scale, num_groups, min_split,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
    PAGE: tl.constexpr, GQ: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_S: tl.constexpr,
):
    s = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.load(HeadOrder + tl.program_id(2))
    num_kv_heads = tl.num_programs(2)
    g = tl.load(HeadGroup + h)
    c = tl.load(HeadColumn + h).to(tl.int64)
    kv_start = tl.load(KvStarts + r * num_groups + g).to(tl.int64)
    n = tl.load(KvLens + r * num_groups + g)
    n_split = tl.minimum(tl.load(Splits + g), MAX_S)
    chunk = tl.maximum(min_split, tl.cdiv(n, n_split))
    lo = s * chunk
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    offs_d = tl.arange(0, D)
    o_ptr = O + r * stride_ob + (h * GQ + offs_h)[:, None] * stride_oh + offs_d[None, :]
    if n == 0:
        if s == 0:  # an empty (request, group) attends to nothing: zeros, as FlashInfer gives
            tl.store(o_ptr, tl.zeros([BLOCK_H, D], tl.float32).to(O.dtype.element_ty), mask=mask_h[:, None])
    elif lo < n:
        hi = tl.minimum(lo + chunk, n)
        num_chunks = tl.cdiv(n, chunk)
        q = tl.load(
            Q + r * stride_qb + (h * GQ + offs_h)[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None], other=0.0,
        )
        acc, m_i, l_i = _attend_range(q, K, V, KvIndices, kv_start, c, lo, hi, sm_scale,
                                      stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                                      PAGE, BLOCK_H, D, BLOCK_N)
        out = acc / l_i[:, None]
        if num_chunks == 1:
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=mask_h[:, None])
        else:
            part = ((r * num_kv_heads + h) * MAX_S + s) * GQ  # only the G_q real rows: padding is never read
            tl.store(MidO + (part + offs_h)[:, None] * D + offs_d[None, :], out, mask=mask_h[:, None])
            tl.store(MidLse + part + offs_h, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    O, MidO, MidLse, KvLens, HeadGroup, Splits,
    num_groups, min_split, stride_ob, stride_oh,
    GQ: tl.constexpr, D: tl.constexpr, MAX_S: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (r, q): query head q of request r; all its partials are loaded at once (one round of loads)."""
    r = tl.program_id(0)
    q = tl.program_id(1)
    h = q // GQ
    num_kv_heads = tl.num_programs(1) // GQ
    g = tl.load(HeadGroup + h)
    n = tl.load(KvLens + r * num_groups + g)
    n_split = tl.minimum(tl.load(Splits + g), MAX_S)
    chunk = tl.maximum(min_split, tl.cdiv(n, n_split))
    num_chunks = tl.cdiv(n, chunk)
    if num_chunks > 1:
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_chunks
        offs_d = tl.arange(0, D)
        row = ((r * num_kv_heads + h) * MAX_S + offs_s) * GQ + q % GQ
        lse = tl.load(MidLse + row, mask=mask_s, other=float("-inf"))
        o = tl.load(MidO + row[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
        w = tl.exp(lse - tl.max(lse, 0))
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(O + r * stride_ob + q * stride_oh + offs_d, out.to(O.dtype.element_ty))


# (block_n, num_warps, num_stages) of the split kernel: the H200 tune's pick (eval/results/bench_kernels.json, the
# kernel of 2026-12-02, anchor + a budget-1.0 shape: 0.48 ms, where (64, 4, 2) took 1.16 ms); benchmarks and serving
# both run it
DECODE_CONFIG = (128, 4, 2)
H200_SMS = 132  # streaming multiprocessors of the GPU the launch shapes are sized for
DECODE_PROGRAMS_PER_SM = 3  # programs of DECODE_CONFIG one SM holds at once (tests/test_kernels_compile.py)


def launch_order(head_budget: Sequence[float]) -> list[int]:
    """kv heads of a layer by descending (group) budget, ties by index: the ``head_order`` to launch with."""
    return sorted(range(len(head_budget)), key=lambda h: (-head_budget[h], h))


def csr_ranges(kv_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_starts, kv_lens) int32 of CSR lists ``kv_indptr`` ([N + 1] -> two [N])."""
    return kv_indptr[:-1].int(), (kv_indptr[1:] - kv_indptr[:-1]).int()


def _ranges_groups(kv_starts: torch.Tensor, kv_lens: torch.Tensor, batch: int) -> int:
    if kv_starts.shape != kv_lens.shape or kv_starts.dim() != 1 or kv_starts.shape[0] % batch:
        raise ValueError(f"kv_starts {tuple(kv_starts.shape)} / kv_lens {tuple(kv_lens.shape)} are not two [B*G] "
                         f"vectors for B={batch}")
    return kv_starts.shape[0] // batch


def _block_h(gq: int) -> int:
    return max(16, triton.next_power_of_2(gq))


def _decode_shapes(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_starts: torch.Tensor,
                   kv_lens: torch.Tensor, head_group: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(B, D, Hkv, G_q, groups) of a decode launch, the pool contract's shapes and strides checked."""
    B, hq, D = q.shape
    hkv = head_group.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_buffer and v_buffer must be contiguous along head_dim")
    return B, D, hkv, hq // hkv, _ranges_groups(kv_starts, kv_lens, B)


def paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    splits: torch.Tensor,
    *,
    head_order: torch.Tensor | None = None,
    max_splits: int,
    min_split_tokens: int,
    sm_scale: float,
    block_n: int = DECODE_CONFIG[0],
    num_warps: int = DECODE_CONFIG[1],
    num_stages: int = DECODE_CONFIG[2],
) -> torch.Tensor:
    """Decode attention of one layer over the head-group page pool; returns ``[B, Hq, D]`` like ``q``.

    q: [B, Hq, D]; k_buffer, v_buffer: [num_pages, H_p, page_size, D]; kv_starts, kv_lens: int32 [B*G], the
    (request, group) ranges of kv_indices (int32 slots); head_group, head_column: int32 [Hkv] for this layer; splits: int32 [G], the
    AOT split counts of the batch bucket; max_splits: the launch's split dimension (>= max(splits), a
    per-bucket constant); head_order: int32 [Hkv] permutation of the kv heads, the issue order (default
    0..Hkv-1; pass ``launch_order`` of the heads' group budgets). An empty (request, group) gives zeros.
    """
    if min_split_tokens < 1 or max_splits < 1:
        raise ValueError("min_split_tokens and max_splits must be >= 1")
    B, D, hkv, gq, num_groups = _decode_shapes(q, k_buffer, v_buffer, kv_starts, kv_lens, head_group)
    bh = _block_h(gq)
    page = k_buffer.shape[2]
    out = torch.empty_like(q)
    mid_o = torch.empty((B, hkv, max_splits, gq, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, hkv, max_splits, gq), dtype=torch.float32, device=q.device)
    if head_order is None:
        head_order = torch.arange(hkv, dtype=torch.int32, device=q.device)
    _decode_split_kernel[(max_splits, B, hkv)](
        q, k_buffer, v_buffer, out, mid_o, mid_lse,
        kv_starts, kv_lens, kv_indices, head_group, head_column, head_order, splits,
        sm_scale, num_groups, min_split_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=page, GQ=gq, BLOCK_H=bh, D=D, BLOCK_N=block_n, MAX_S=max_splits,
        num_warps=num_warps, num_stages=num_stages,
    )
    if max_splits == 1:  # every (request, kv head) is one chunk, written directly
        return out
    _decode_merge_kernel[(B, q.shape[1])](
        out, mid_o, mid_lse, kv_lens, head_group, splits,
        num_groups, min_split_tokens, out.stride(0), out.stride(1),
        GQ=gq, D=D, MAX_S=max_splits, BLOCK_S=triton.next_power_of_2(max_splits), num_warps=4,
    )
    return out


def gather_head_kv(
    buffer: torch.Tensor, slots: torch.Tensor, column: int
) -> torch.Tensor:
    """[n, D] tokens of one column at the given slots (pool layout ``[pages, H_p, page_size, D]``)."""
    page_size = buffer.shape[2]
    slots = slots.long()
    return buffer[slots // page_size, column, slots % page_size]


def paged_decode_torch(
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
) -> torch.Tensor:
    """Reference: per (request, kv head) softmax attention over its group's slot list, in float32."""
    B, hq, D = q.shape
    hkv = head_group.shape[0]
    gq = hq // hkv
    num_groups = _ranges_groups(kv_starts, kv_lens, B)
    out = torch.zeros(B, hq, D, dtype=torch.float32, device=q.device)
    for r in range(B):
        for h in range(hkv):
            g, c = int(head_group[h]), int(head_column[h])
            lo = int(kv_starts[r * num_groups + g])
            hi = lo + int(kv_lens[r * num_groups + g])
            if hi == lo:
                continue
            slots = kv_indices[lo:hi]
            k = gather_head_kv(k_buffer, slots, c).float()
            v = gather_head_kv(v_buffer, slots, c).float()
            qh = q[r, h * gq : (h + 1) * gq].float()
            p = torch.softmax(qh @ k.T * sm_scale, dim=-1)
            out[r, h * gq : (h + 1) * gq] = p @ v
    return out.to(q.dtype)
