"""Per-head token scores for compression: the SnapKV observation-window scorer.

``snapkv_scores_torch`` is the reference every faster implementation is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
