"""Ragged extend (prefill / chunked prefill) attention over a compressed prefix plus the new tokens.

Each request r has ``n_new = qo_indptr[r+1] - qo_indptr[r]`` new tokens whose full K/V sit in staging
(``k_new``/``v_new`` ``[total_new, Hkv, D]``, ragged with the same ``qo_indptr``). A new token attends to
the compressed prefix of its kv head's group (the slot list ``kv_indices[kv_indptr[r*G+g] : ...]`` as in
decode, no mask) and causally to the new tokens up to itself.

Launch: grid ``(B, Hkv, ceil(max_new / tokens_per_block) * S)``. A program holds ``BLOCK_M`` rows: row i is
token ``i // G_q`` of its block and query head ``i % G_q`` of kv head h, so the query heads of a kv head
share every K/V load.

Split-KV (S > 1): program (r, h, blk * S + s) reads the s-th of S equal chunks of its prefix list; the last one
also reads the new tokens (causal), so every row has at least its own token. Each writes a partial (output,
log-sum-exp) and a merge kernel combines them. A question-sized extend over a long prefix (a turn's question
after a 4k-token history: one request, 8 kv heads, one token block) is otherwise 8 programs each walking the
whole prefix: 176 us a layer on the H200 against FlashInfer's 22 us (session 16's trace). S is chosen on the host
from the grid and the longest prefix (:func:`extend_splits`); big chunks keep S = 1 and the direct write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from tangram_sgl.kernels.decode import H200_SMS, _attend_range, gather_head_kv

# split-KV of question-sized extends: enough programs for the H200's SMs, chunks of at least 256 prefix tokens
EXTEND_TARGET_PROGRAMS = 2 * H200_SMS
EXTEND_MIN_SPLIT_TOKENS = 256
EXTEND_MAX_SPLITS = 32
# (block_m, block_n, num_warps, num_stages): the fastest of six on the H200 for question turns and compressed chunks,
# 1.1-1.3x the former 64 x 64 x 4 x 2 (eval/results/bench_extend.json); serving and the benchmarks run it
EXTEND_CONFIG = (128, 64, 8, 3)


def token_blocks(max_new_tokens: int, block_m: int, gq: int) -> int:
    """Programs per (request, kv head) of an extend launch before prefix splits: ``block_m // gq`` new tokens each."""
    return max(1, triton.cdiv(max_new_tokens, block_m // gq))


def extend_splits(batch: int, kv_heads: int, blocks: int, max_prefix: int) -> int:
    """Prefix splits S of an extend launch (``blocks``: :func:`token_blocks`): 1 when ``batch * kv_heads * blocks``
    programs already fill the GPU, else enough to reach ``EXTEND_TARGET_PROGRAMS``, capped so a chunk of the longest
    prefix keeps at least ``EXTEND_MIN_SPLIT_TOKENS`` tokens (and at ``EXTEND_MAX_SPLITS``)."""
    want = -(-EXTEND_TARGET_PROGRAMS // max(1, batch * kv_heads * blocks))
    return max(1, min(want, -(-max_prefix // EXTEND_MIN_SPLIT_TOKENS), EXTEND_MAX_SPLITS))


# data-dependent ints are not specialised (Triton would compile a variant per value == 1 / multiple of 16 mid-serving)
@triton.jit(do_not_specialize=["num_splits", "total_new"])
def _extend_kernel(
    Q, KNew, VNew, K, V, O, MidO, MidLse,
    QoIndptr, KvIndptr, KvIndices, HeadGroup, HeadColumn,
    sm_scale, num_groups, num_splits, total_new,
    stride_qt, stride_qh, stride_nt, stride_nh, stride_ot, stride_oh,
    stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
    PAGE: tl.constexpr, GQ: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2) // num_splits
    s = tl.program_id(2) % num_splits
    TOKS: tl.constexpr = BLOCK_M // GQ
    qo_start = tl.load(QoIndptr + r)
    n_new = tl.load(QoIndptr + r + 1) - qo_start
    t0 = blk * TOKS
    if t0 < n_new:
        g = tl.load(HeadGroup + h)
        c = tl.load(HeadColumn + h).to(tl.int64)
        kv_start = tl.load(KvIndptr + r * num_groups + g)
        n_pre = tl.load(KvIndptr + r * num_groups + g + 1) - kv_start
        offs_m = tl.arange(0, BLOCK_M)
        tok = t0 + offs_m // GQ
        head = h * GQ + offs_m % GQ
        mask_m = (offs_m < TOKS * GQ) & (tok < n_new)
        offs_d = tl.arange(0, D)
        q_ptr = (qo_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(Q + q_ptr, mask=mask_m[:, None], other=0.0)
        q = q.to(K.dtype.element_ty)  # unscaled: the scale multiplies the fp32 dot product, as SGLang's kernels
        chunk = tl.cdiv(n_pre, num_splits)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, n_pre)
        acc, m_i, l_i = _attend_range(q, K, V, KvIndices, kv_start, c, lo, hi, sm_scale,
                                      stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
                                      PAGE, BLOCK_M, D, BLOCK_N)
        t_end = tl.minimum(n_new, t0 + TOKS)
        if s == num_splits - 1:  # the new tokens, causal: the last split's
            for start in range(0, t_end, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                mask_n = offs_n < t_end
                row = (qo_start + offs_n).to(tl.int64) * stride_nt + h * stride_nh
                # the new tokens in the pool's dtype, as the prefix (and as later steps will read them)
                k = tl.load(KNew + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
                k = k.to(K.dtype.element_ty)
                visible = mask_n[None, :] & (offs_n[None, :] <= tok[:, None])
                qk = tl.where(visible, tl.dot(q, tl.trans(k)) * sm_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(qk - m_new[:, None])
                v = tl.load(VNew + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
                v = v.to(V.dtype.element_ty)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
        if SPLIT:  # partial (output, lse) of this chunk; an empty chunk: lse -inf, weighed 0 by the merge
            mid = (s * total_new + qo_start + tok).to(tl.int64) * (GQ * tl.num_programs(1)) + head
            has = l_i > 0
            tl.store(MidO + mid[:, None] * D + offs_d[None, :], acc / tl.where(has, l_i, 1.0)[:, None],
                     mask=mask_m[:, None])
            tl.store(MidLse + mid, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf")), mask=mask_m)
        else:
            o_ptr = (qo_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(O + o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=mask_m[:, None])


@triton.jit(do_not_specialize=["num_splits", "total_new"])
def _extend_merge_kernel(O, MidO, MidLse, num_splits, total_new, stride_ot, stride_oh,
                         D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (t, q): new token t, query head q; its S partials in one round of loads."""
    t = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    hq = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, D)
    mid = (offs_s * total_new + t) * hq + q
    lse = tl.load(MidLse + mid, mask=mask_s, other=float("-inf"))
    o = tl.load(MidO + mid[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    w = tl.exp(lse - tl.max(lse, 0))
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + t * stride_ot + q * stride_oh + offs_d, out.to(O.dtype.element_ty))


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_new_tokens: int,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    *,
    sm_scale: float,
    max_prefix: int | None = None,
    num_splits: int | None = None,
    block_m: int = EXTEND_CONFIG[0],
    block_n: int = EXTEND_CONFIG[1],
    num_warps: int = EXTEND_CONFIG[2],
    num_stages: int = EXTEND_CONFIG[3],
) -> torch.Tensor:
    """Attention of the new tokens of one layer; returns ``[total_new, Hq, D]`` like ``q`` (block config:
    :data:`EXTEND_CONFIG` by default).

    q: [total_new, Hq, D]; k_new, v_new: [total_new, Hkv, D] (staging, full KV of the new tokens);
    qo_indptr: int32 [B + 1]; max_new_tokens: a host bound on the per-request new-token count (sets the
    grid); k_buffer, v_buffer, kv_indptr ([B*G + 1]), kv_indices, head_group, head_column as in decode.
    ``num_splits``: the prefix splits S (see the module docstring); default :func:`extend_splits` of the grid
    and ``max_prefix`` (a host bound on the longest (request, group) list; None: no split).
    """
    _, hq, D = q.shape
    hkv = head_group.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    gq = hq // hkv
    if block_m < max(16, gq):
        raise ValueError(f"block_m={block_m} must be >= max(16, G_q={gq})")
    B = qo_indptr.shape[0] - 1
    if (kv_indptr.shape[0] - 1) % B:
        raise ValueError(f"kv_indptr has {kv_indptr.shape[0]} entries, not B*G+1 for B={B}")
    num_groups = (kv_indptr.shape[0] - 1) // B
    out = torch.empty_like(q)
    blocks = token_blocks(max_new_tokens, block_m, gq)
    if num_splits is None:
        num_splits = 1 if max_prefix is None else extend_splits(B, hkv, blocks, max_prefix)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    total = q.shape[0]
    mid_o = mid_lse = out  # unused placeholders when S == 1
    if num_splits > 1:
        mid_o = torch.empty((num_splits, total, hq, D), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((num_splits, total, hq), dtype=torch.float32, device=q.device)
    _extend_kernel[(B, hkv, blocks * num_splits)](
        q, k_new, v_new, k_buffer, v_buffer, out, mid_o, mid_lse,
        qo_indptr, kv_indptr, kv_indices, head_group, head_column,
        sm_scale, num_groups, num_splits, total,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=k_buffer.shape[2], GQ=gq, D=D, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=num_splits > 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and total:
        _extend_merge_kernel[(total, hq)](out, mid_o, mid_lse, num_splits, total, out.stride(0), out.stride(1),
                                          D=D, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4)
    return out


def warm_up_extend(num_q_heads: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor, head_group: torch.Tensor,
                   head_column: torch.Tensor, num_groups: int, q_dtype: torch.dtype) -> int:
    """Compile every variant of :func:`extend_attention` a server can launch over its pool buffers (``k_buffer`` /
    ``v_buffer`` ``[pages, H_p, page, D]``, only read through slot lists, all empty here) with one layer's
    ``head_group`` / ``head_column``: the direct write (S = 1) and each merge width of S = 2 ..
    ``EXTEND_MAX_SPLITS``. Otherwise the first step of each kind compiles mid-serving (~1 s each on the H200).
    Returns the number of launches."""
    dev, D, hkv = k_buffer.device, k_buffer.shape[-1], head_group.shape[0]
    q = torch.zeros((1, num_q_heads, D), dtype=q_dtype, device=dev)
    kv_new = torch.zeros((1, hkv, D), dtype=q_dtype, device=dev)  # the step's own K/V: the model's dtype
    qo_indptr = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    kv_indptr = torch.zeros(num_groups + 1, dtype=torch.int32, device=dev)
    splits = [1] + [1 << i for i in range(1, EXTEND_MAX_SPLITS.bit_length())]
    for s in splits:
        extend_attention(q, kv_new, kv_new, qo_indptr, 1, k_buffer, v_buffer, kv_indptr, kv_indptr[:0], head_group,
                         head_column, sm_scale=1.0, num_splits=s)
    return len(splits)


def extend_attention_torch(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    *,
    sm_scale: float,
) -> torch.Tensor:
    """Reference: per (request, kv head), softmax over [prefix slots ; causal new tokens], float32."""
    hq = q.shape[1]
    hkv = head_group.shape[0]
    gq = hq // hkv
    B = qo_indptr.shape[0] - 1
    num_groups = (kv_indptr.shape[0] - 1) // B
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for r in range(B):
        a, b = int(qo_indptr[r]), int(qo_indptr[r + 1])
        n = b - a
        if n == 0:
            continue
        for h in range(hkv):
            g, c = int(head_group[h]), int(head_column[h])
            lo, hi = int(kv_indptr[r * num_groups + g]), int(kv_indptr[r * num_groups + g + 1])
            slots = kv_indices[lo:hi]
            k = torch.cat([gather_head_kv(k_buffer, slots, c), k_new[a:b, h]]).float()
            v = torch.cat([gather_head_kv(v_buffer, slots, c), v_new[a:b, h]]).float()
            n_pre = hi - lo
            visible = torch.ones(n, n_pre + n, dtype=torch.bool, device=q.device)
            visible[:, n_pre:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            qh = q[a:b, h * gq : (h + 1) * gq].float()  # [n, gq, D]
            logits = torch.einsum("tjd,kd->tjk", qh, k) * sm_scale
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            out[a:b, h * gq : (h + 1) * gq] = torch.einsum("tjk,kd->tjd", logits.softmax(-1), v)
    return out.to(q.dtype)
