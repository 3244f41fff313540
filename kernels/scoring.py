"""Per-head token scores for compression: the SnapKV observation-window scorer.

``snapkv_scores_torch`` is the reference every faster implementation is tested against;
``snapkv_scores`` is the Triton version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def snapkv_scores_torch(q_obs: torch.Tensor, k: torch.Tensor, *, scale: float, pool_kernel: int = 7) -> torch.Tensor:
    """SnapKV scores of a segment's keys, one row per kv head.

    q_obs: [Hq, w, D] queries of the segment's last w tokens (the observation window), Hq = G * Hkv.
    k:     [Hkv, n, D] the segment's keys (w <= n; the window is the last w of the n positions).
    Returns float32 [Hkv, n]: softmax attention of each window query over keys (causal inside the window),
    averaged over the window's queries and over the G query heads that share a kv head (GQA), then
    max-pooled along positions with an odd ``pool_kernel`` (SnapKV's clustering).
    """
    hq, w, _ = q_obs.shape
    hkv, n, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    g = hq // hkv
    kk = k.float().repeat_interleave(g, dim=0)  # [Hq, n, D]
    logits = torch.einsum("hwd,hnd->hwn", q_obs.float(), kk) * scale
    qpos = torch.arange(n - w, n, device=k.device)[:, None]
    kpos = torch.arange(n, device=k.device)[None, :]
    logits = logits.masked_fill(kpos > qpos, float("-inf"))
    probs = logits.softmax(dim=-1).mean(dim=1)  # [Hq, n]
    scores = probs.view(hkv, g, n).mean(dim=1)
    if pool_kernel > 1:
        scores = F.max_pool1d(scores[:, None, :], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0, :]
    return scores


@triton.jit
def _window_lse_kernel(
    Q, K, Lse, n, w, scale,
    stride_qh, stride_qw, stride_kh, stride_kn,
    GQ: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Log-sum-exp of each window query's causal logits over the segment's keys; one program per q head."""
    hq = tl.program_id(0)
    kh = hq // GQ
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < w
    offs_d = tl.arange(0, D)
    q = tl.load(Q + hq * stride_qh + offs_w[:, None] * stride_qw + offs_d[None, :], mask=mask_w[:, None], other=0.0)
    q_pos = n - w + offs_w
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    for start in range(0, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + kh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=(offs_n < n)[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & (offs_n < n)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(qk - m_new[:, None]), 1)
        m_i = m_new
    tl.store(Lse + hq * BLOCK_W + offs_w, m_i + tl.log(l_i))


@triton.jit
def _window_scores_kernel(
    Q, K, Lse, S, n, w, scale,
    stride_qh, stride_qw, stride_kh, stride_kn,
    GQ: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Mean over window queries and the GQ query heads of each key's softmax probability."""
    kh = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < w
    offs_d = tl.arange(0, D)
    q_pos = n - w + offs_w
    k = tl.load(K + kh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    visible = (offs_n[None, :] <= q_pos[:, None]) & mask_w[:, None] & mask_n[None, :]
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(GQ):
        hq = kh * GQ + j
        q = tl.load(Q + hq * stride_qh + offs_w[:, None] * stride_qw + offs_d[None, :], mask=mask_w[:, None], other=0.0)
        lse = tl.load(Lse + hq * BLOCK_W + offs_w)
        qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        p = tl.where(visible, tl.exp(qk - lse[:, None]), 0.0)
        total += tl.sum(p, 0)
    tl.store(S + kh * n + offs_n, total / (w * GQ), mask=mask_n)


def snapkv_scores(
    q_obs: torch.Tensor, k: torch.Tensor, *, scale: float, pool_kernel: int = 7, block_n: int = 64
) -> torch.Tensor:
    """Triton version of :func:`snapkv_scores_torch` (same arguments and result; max-pool in torch).

    Two passes over the keys: the window queries' log-sum-exp, then each key's probability summed over
    the window and the query heads of its kv head. Nothing of size [Hq, w, n] is materialized.
    """
    hq, w, D = q_obs.shape
    hkv, n, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if not 1 <= w <= n:
        raise ValueError(f"window {w} must be in [1, n={n}]")
    if q_obs.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q_obs and k must be contiguous along head_dim")
    gq = hq // hkv
    bw = max(16, triton.next_power_of_2(w))
    q_obs = q_obs.to(k.dtype)
    lse = torch.empty((hq, bw), dtype=torch.float32, device=k.device)
    args = (q_obs.stride(0), q_obs.stride(1), k.stride(0), k.stride(1))
    _window_lse_kernel[(hq,)](q_obs, k, lse, n, w, scale, *args, GQ=gq, D=D, BLOCK_W=bw, BLOCK_N=block_n)
    scores = torch.empty((hkv, n), dtype=torch.float32, device=k.device)
    _window_scores_kernel[(hkv, triton.cdiv(n, block_n))](
        q_obs, k, lse, scores, n, w, scale, *args, GQ=gq, D=D, BLOCK_W=bw, BLOCK_N=block_n
    )
    if pool_kernel > 1:
        scores = F.max_pool1d(scores[:, None, :], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0, :]
    return scores
