"""The profiling pipeline: score calibration samples once, then derive budgets for any target ratio.

Scores depend only on the model, the scorer and the samples, so several target ratios (and the search for
the threshold ratio) reuse one forward pass per sample.

Budget modes:

- ``nominal``: the threshold ratio r equals the target ratio; the mean *budget* then exceeds the target by
  the alpha*std safety margin.
- ``matched`` (default): r is chosen by bisection as the largest ratio whose mean head budget
  (mean over heads of min(1, mean + alpha*std)) does not exceed the target, so the profile reserves, on
  average over heads, the target fraction of the KV cache (grouping padding comes on top and is reported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from tangram_sgl.aot_table import DEFAULT_MIN_SPLIT_TOKENS
from tangram_sgl.profile import ModelIdentity, TangramProfile
from tangram_sgl.profile_builder import build_profile, head_budgets
from tangram_sgl.profiler.capture import SegmentScoreCapture
from tangram_sgl.profiler.retention import SCOPES, SegmentScores, retention_stats, segment_scores
from tangram_sgl.profiler.segments import TokenizedSample
from tangram_sgl.scorers import make_scorer

BUDGET_MODES = ("matched", "nominal")
# segment: each segment scored by its own window; conversation: also by every later turn's window (retention.py)
RETENTIONS = ("segment", "conversation")
_BISECT_STEPS = 40


@dataclass(frozen=True)
class ProfileSettings:
    """Everything besides the model and samples that determines a profile."""

    scorer: str = "snapkv"
    alpha: float = 2.0
    scope: str = ""  # "" = the scorer's default_scope
    budget_mode: str = "matched"
    retention: str = "segment"
    sink_tokens: int = 4
    recent_window: int = 32
    page_size: int = 16
    heads_per_group: int = 4
    grouping: str = "cross_layer"
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.scope:
            object.__setattr__(self, "scope", make_scorer(self.scorer).default_scope)
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.budget_mode not in BUDGET_MODES:
            raise ValueError(f"budget_mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}")
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {RETENTIONS}, got {self.retention!r}")


def collect_scores(model: Any, samples: Sequence[TokenizedSample], settings: ProfileSettings,
                   progress: bool = True) -> list[list[SegmentScores]]:
    """One forward per sample; returns per sample, per segment, the candidate scores of all heads."""
    return collect_scores_multi(model, samples, [settings.scorer], settings.sink_tokens, settings.recent_window,
                                progress, later_windows=settings.retention == "conversation")[settings.scorer]


def collect_scores_multi(model: Any, samples: Sequence[TokenizedSample], scorers: Sequence[str], sink: int,
                         window: int, progress: bool = True,
                         later_windows: bool = False) -> dict[str, list[list[SegmentScores]]]:
    """Like :func:`collect_scores` for several scorers at once (one forward per sample serves them all)."""
    out: dict[str, list[list[SegmentScores]]] = {name: [] for name in scorers}
    with SegmentScoreCapture(model, [make_scorer(n) for n in scorers], window, later_windows) as cap:
        for s in tqdm(samples, desc=f"profiling ({', '.join(scorers)})", unit="sample", disable=not progress):
            per_scorer = cap.run(s.ids, s.segments)
            for name, per_layer in zip(scorers, per_scorer):
                out[name].append([
                    segment_scores([layer[si] for layer in per_layer], a, sink, window)
                    for si, (a, _) in enumerate(s.segments)
                ])
    return out


def _mean_budget(scores: list[list[SegmentScores]], ratio: float, settings: ProfileSettings) -> float:
    mean, std = retention_stats(scores, ratio, settings.scope)
    b = head_budgets(mean.tolist(), std.tolist(), settings.alpha)
    return sum(map(sum, b)) / sum(map(len, b))


def threshold_ratio(scores: list[list[SegmentScores]], target: float, settings: ProfileSettings) -> float:
    """The threshold ratio for ``target`` under the settings' budget mode (see module docstring)."""
    if settings.budget_mode == "nominal":
        return target
    lo, hi = 0.0, 1.0
    if _mean_budget(scores, hi, settings) <= target:
        return hi
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if _mean_budget(scores, mid, settings) <= target:
            lo = mid
        else:
            hi = mid
    if lo == 0.0:
        raise ValueError(f"no threshold ratio reaches a mean budget <= {target}: the alpha*std margin alone "
                         f"exceeds it (alpha={settings.alpha}); use budget_mode='nominal' or a smaller alpha")
    return lo


def profile_from_scores(model: ModelIdentity, scores: list[list[SegmentScores]], target: float,
                        settings: ProfileSettings, *, created_by: str) -> TangramProfile:
    """Budgets (mean + alpha*std of retention), groups and AOT table for one target ratio."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target ratio must lie in (0, 1], got {target}")
    r = threshold_ratio(scores, target, settings)
    mean, std = retention_stats(scores, r, settings.scope)
    mean_l = [[round(x, 6) for x in row] for row in mean.tolist()]
    std_l = [[round(x, 6) for x in row] for row in std.tolist()]
    notes = {
        "retention": "kept fraction of a segment under a shared top-ratio threshold "
                     "(docs/arch/profiler.md)",
        "retention_windows": settings.retention,
        "threshold_scope": settings.scope,
        "budget_mode": settings.budget_mode,
        "threshold_ratio": round(r, 6),
        "gqa_aggregation": "mean over the query heads of a kv head",
    }
    notes.update(settings.notes)
    return build_profile(
        model, mean_l, std_l,
        scorer=settings.scorer, target_ratio=target, alpha=settings.alpha, num_samples=len(scores),
        sink_tokens=settings.sink_tokens, recent_window=settings.recent_window, page_size=settings.page_size,
        heads_per_group=settings.heads_per_group, grouping=settings.grouping, created_by=created_by, notes=notes,
        min_split_tokens=settings.min_split_tokens,
    )

