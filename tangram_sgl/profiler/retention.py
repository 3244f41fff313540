"""Per-head retention: the fraction of a segment a head keeps when a shared top-ratio threshold is applied.

Definition (per sample, per segment of n tokens, threshold ratio r):

1. Protected tokens (the conversation's first ``sink`` tokens inside the segment and the segment's last
   ``window`` tokens) are kept by every head and are not ranked; the other C tokens are candidates.
2. The scorer's candidate scores of all heads in the *scope* are pooled (scope ``layer``: the H kv heads
   of one layer, K = round(r*H*n) slots; scope ``global``: all L*H heads, K = round(r*L*H*n) slots, capped
   at the number of candidates). The K highest scores survive; ties at the threshold share the remaining
   slots in proportion to each head's tied count (so equal scores give equal retention): a tied candidate
   survives with probability (slots left) / (tied candidates).
3. *Conversation retention* scores a segment once per window (its own, then each later turn's question,
   ``SegmentScoreCapture(later_windows=True)``) and applies step 2 to each; a candidate is kept when it
   survives under any window, i.e. with probability 1 - prod over windows of (1 - p_window). With one window
   (*segment retention*) that is step 2's survival itself.
4. Head h keeps kept_h (the sum of its candidates' probabilities); its segment retention is kept_h / n, the
   quantity the runtime budget rule reserves (k_g(n) = ceil(b_g*n) + protected).

A sample's retention is the token-weighted mean over its segments (sum kept / sum n). With one window and
averaged over heads, retention equals r (until the candidate cap binds), so r is the nominal kept fraction and
heads that concentrate their score on few tokens get less than r, heads with flat scores more. Under several
windows a head whose top tokens stay the same across questions keeps about r, one whose top tokens move with
the question keeps more (the matched budget mode lowers r so the mean budget stays on target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram_sgl.selection import protected_mask

SCOPES = ("layer", "global")


@dataclass
class SegmentScores:
    """Candidate scores [W, L, H, C] of one segment under W windows (descending-sorted pooled copies are built
    lazily)."""

    scores: torch.Tensor
    n: int
    _sorted: dict | None = None

    def sorted_pool(self, scope: str) -> torch.Tensor:
        """Pooled candidate scores in descending order: [W, L, H*C] for ``layer``, [W, 1, L*H*C] for ``global``."""
        if self._sorted is None:
            self._sorted = {}
        if scope not in self._sorted:
            W, L = self.scores.shape[:2]
            flat = self.scores.reshape(W, L if scope == "layer" else 1, -1)
            self._sorted[scope] = flat.sort(dim=2, descending=True).values
        return self._sorted[scope]


def segment_scores(per_layer: list[torch.Tensor], start: int, sink: int, window: int) -> SegmentScores:
    """Stack one segment's per-layer scores [W, H, n] and drop its protected positions."""
    scores = torch.stack(per_layer, dim=1)  # [W, L, H, n]
    n = scores.shape[-1]
    keep = ~protected_mask(n, start, sink, window)
    return SegmentScores(scores=scores[..., keep].contiguous(), n=n)


def segment_kept(seg: SegmentScores, ratio: float, scope: str) -> torch.Tensor:
    """float64 [L, H]: candidates each head keeps at threshold ratio ``ratio`` (ties shared fairly; a candidate
    counts as kept when it survives under any of the segment's windows)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    _, L, H, C = seg.scores.shape
    if C == 0:
        return torch.zeros(L, H, dtype=torch.float64)
    pool = seg.sorted_pool(scope)  # [W, P, M]
    heads_in_pool = H if scope == "layer" else L * H
    k = min(pool.shape[2], round(ratio * heads_in_pool * seg.n))
    if k <= 0:
        return torch.zeros(L, H, dtype=torch.float64)
    tau = pool[:, :, k - 1, None, None]  # [W, P, 1, 1]: one threshold per window and pool
    gt, eq = (seg.scores > tau).double(), (seg.scores == tau).double()  # [W, L, H, C]
    pool_dims = (2, 3) if scope == "layer" else (1, 2, 3)
    share = (k - gt.sum(dim=pool_dims, keepdim=True)) / eq.sum(dim=pool_dims, keepdim=True)  # tied survival
    survive = gt + eq * share
    return (1.0 - (1.0 - survive).prod(dim=0)).sum(dim=-1)


def sample_retention(segments: list[SegmentScores], ratio: float, scope: str) -> torch.Tensor:
    """float64 [L, H]: sum over segments of kept / sum of segment lengths."""
    kept = sum(segment_kept(s, ratio, scope) for s in segments)
    return kept / sum(s.n for s in segments)


def retention_stats(samples: list[list[SegmentScores]], ratio: float, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) over samples of per-head retention, each [L, H] float64 (std with ddof=1 when >1 sample)."""
    r = torch.stack([sample_retention(s, ratio, scope) for s in samples])
    std = r.std(dim=0, unbiased=True) if len(samples) > 1 else torch.zeros_like(r[0])
    return r.mean(dim=0), std
