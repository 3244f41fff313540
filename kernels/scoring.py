"""Per-head token scores for compression: the SnapKV observation-window scorer.

``snapkv_scores_torch`` (one segment) is the reference every faster implementation is tested against;
``snapkv_scores_ragged`` is the Triton version for several segments of a step's staging at once, with
``snapkv_scores_ragged_torch`` as its per-segment reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def snapkv_scores_torch(q_obs: torch.Tensor, k: torch.Tensor, *, scale: float, pool_kernel: int = 7,
                        causal: bool = True) -> torch.Tensor:
    """SnapKV scores of a segment's keys, one row per kv head.

    q_obs: [Hq, w, D] queries of the observation window, Hq = G * Hkv.
    k:     [Hkv, n, D] the segment's keys. ``causal``: the window is the last w of the n positions (w <= n) and
           attends causally inside itself; ``causal=False``: the window lies after the segment (a later turn's
           question, profiling only) and every query sees every key.
    Returns float32 [Hkv, n]: softmax attention of each window query over the segment's keys,
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
    if causal:
        qpos = torch.arange(n - w, n, device=k.device)[:, None]
        kpos = torch.arange(n, device=k.device)[None, :]
        logits = logits.masked_fill(kpos > qpos, float("-inf"))
    probs = logits.softmax(dim=-1).mean(dim=1)  # [Hq, n]
    scores = probs.view(hkv, g, n).mean(dim=1)
    if pool_kernel > 1:
        scores = F.max_pool1d(scores[:, None, :], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0, :]
    return scores


def snapkv_scores_ragged_torch(q: torch.Tensor, k: torch.Tensor, q_start: torch.Tensor, k_start: torch.Tensor,
                               lens: torch.Tensor, n_max: int, *, obs_window: int, scale: float,
                               pool_kernel: int = 7) -> torch.Tensor:
    """Reference of :func:`snapkv_scores_ragged`: :func:`snapkv_scores_torch` per row, padded with -inf."""
    out = torch.full((len(lens), k.shape[1], n_max), float("-inf"), dtype=torch.float32, device=k.device)
    for r, (qs, ks, n) in enumerate(zip(q_start.tolist(), k_start.tolist(), lens.tolist())):
        w = min(obs_window, n)
        out[r, :, :n] = snapkv_scores_torch(q[qs:qs + w].transpose(0, 1), k[ks:ks + n].transpose(0, 1), scale=scale,
                                            pool_kernel=pool_kernel)
    return out


@triton.jit
def _window_lse_kernel(
    Q, K, Lse, QStart, KStart, Lens, obs, scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GQ: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Log-sum-exp of each window query's causal logits over its row's keys; one program per (row, q head)."""
    r = tl.program_id(0)
    hq = tl.program_id(1)
    kh = hq // GQ
    n = tl.load(Lens + r)
    w = tl.minimum(obs, n)
    q0 = tl.load(QStart + r).to(tl.int64)
    k0 = tl.load(KStart + r).to(tl.int64)
    offs_w = tl.arange(0, BLOCK_W)
    mask_w = offs_w < w
    offs_d = tl.arange(0, D)
    q = tl.load(Q + (q0 + offs_w)[:, None] * stride_qt + hq * stride_qh + offs_d[None, :], mask=mask_w[:, None],
                other=0.0)
    q_pos = n - w + offs_w
    m_i = tl.full([BLOCK_W], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_W], tl.float32)
    for start in range(0, n, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + (k0 + offs_n)[:, None] * stride_kt + kh * stride_kh + offs_d[None, :],
                    mask=(offs_n < n)[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & (offs_n < n)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(qk - m_new[:, None]), 1)
        m_i = m_new
    tl.store(Lse + (r * tl.num_programs(1) + hq) * BLOCK_W + offs_w, m_i + tl.log(l_i))


@triton.jit(do_not_specialize=["n_max"])  # a step's longest segment: not a compile per value
def _window_scores_kernel(
    Q, K, Lse, S, QStart, KStart, Lens, obs, scale, n_max, num_hq,
    stride_qt, stride_qh, stride_kt, stride_kh,
    GQ: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Mean over window queries and the GQ query heads of each key's softmax probability; one program per
    (row, kv head, key block); blocks past the row's length exit."""
    r = tl.program_id(0)
    kh = tl.program_id(1)
    n = tl.load(Lens + r)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(2) * BLOCK_N < n:
        w = tl.minimum(obs, n)
        q0 = tl.load(QStart + r).to(tl.int64)
        k0 = tl.load(KStart + r).to(tl.int64)
        mask_n = offs_n < n
        offs_w = tl.arange(0, BLOCK_W)
        mask_w = offs_w < w
        offs_d = tl.arange(0, D)
        q_pos = n - w + offs_w
        k = tl.load(K + (k0 + offs_n)[:, None] * stride_kt + kh * stride_kh + offs_d[None, :], mask=mask_n[:, None],
                    other=0.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_w[:, None] & mask_n[None, :]
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(GQ):
            hq = kh * GQ + j
            q = tl.load(Q + (q0 + offs_w)[:, None] * stride_qt + hq * stride_qh + offs_d[None, :],
                        mask=mask_w[:, None], other=0.0)
            lse = tl.load(Lse + (r * num_hq + hq) * BLOCK_W + offs_w)
            qk = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            p = tl.where(visible, tl.exp(qk - lse[:, None]), 0.0)
            total += tl.sum(p, 0)
        tl.store(S + (r * tl.num_programs(1) + kh) * n_max + offs_n, total / (w * GQ), mask=mask_n)


def snapkv_scores_ragged(q: torch.Tensor, k: torch.Tensor, q_start: torch.Tensor, k_start: torch.Tensor,
                         lens: torch.Tensor, n_max: int, *, obs_window: int, scale: float, pool_kernel: int = 7,
                         block_n: int = 64) -> torch.Tensor:
    """SnapKV scores of several segments in one launch pair (same rule as :func:`snapkv_scores_torch`).

    q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]`` (positions along dim 0, head_dim contiguous; e.g. a step's staging).
    Row r: keys ``k[k_start[r] : k_start[r] + lens[r]]``, window queries ``q[q_start[r] : q_start[r] + w_r]``
    with ``w_r = min(obs_window, lens[r])`` (int32/int64 device tensors; every ``lens[r] >= 1``);
    ``n_max >= max(lens)``, a host bound. Returns float32 ``[R, Hkv, n_max]``, ``-inf`` past each row's length
    (max-pooled along positions with an odd ``pool_kernel``, as SnapKV clusters).
    """
    _, hq, D = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    if obs_window < 1:
        raise ValueError(f"obs_window must be >= 1, got {obs_window}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous along head_dim")
    R = len(lens)
    bw = max(16, triton.next_power_of_2(obs_window))
    q = q.to(k.dtype)
    lse = torch.empty((R, hq, bw), dtype=torch.float32, device=k.device)
    rows = (q_start, k_start, lens, obs_window, scale)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    _window_lse_kernel[(R, hq)](q, k, lse, *rows, *strides, GQ=hq // hkv, D=D, BLOCK_W=bw, BLOCK_N=block_n)
    scores = torch.full((R, hkv, n_max), float("-inf"), dtype=torch.float32, device=k.device)
    _window_scores_kernel[(R, hkv, triton.cdiv(n_max, block_n))](
        q, k, lse, scores, *rows, n_max, hq, *strides, GQ=hq // hkv, D=D, BLOCK_W=bw, BLOCK_N=block_n
    )
    if pool_kernel > 1:  # pooling spreads a row's last scores into its padding: mask that again
        scores = F.max_pool1d(scores.view(R * hkv, 1, n_max), pool_kernel, stride=1,
                              padding=pool_kernel // 2).view(R, hkv, n_max)
        past_end = torch.arange(n_max, device=k.device) >= lens.to(k.device)[:, None, None]
        scores = scores.masked_fill(past_end, float("-inf"))
    return scores
