"""Assemble a :class:`TangramProfile` from per-head retention statistics (grouping and AOT table included)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tangram_sgl.aot_table import build_aot_table
from tangram_sgl.grouping import group_heads, over_allocation
from tangram_sgl.profile import GROUPINGS, ModelIdentity, TangramProfile

MIN_BUDGET = 1e-3  # budgets are fractions in (0, 1]; a head that needs nothing still keeps a sliver


def head_budgets(mean: Sequence[Sequence[float]], std: Sequence[Sequence[float]], alpha: float) -> list[list[float]]:
    """budget = clip(mean + alpha*std, MIN_BUDGET, 1), rounded to 1e-6 (the budget quantum)."""
    return [
        [round(min(1.0, max(MIN_BUDGET, m + alpha * s)), 6) for m, s in zip(mrow, srow)]
        for mrow, srow in zip(mean, std)
    ]


def build_profile(
    model: ModelIdentity,
    mean: Sequence[Sequence[float]],
    std: Sequence[Sequence[float]],
    *,
    scorer: str,
    target_ratio: float,
    alpha: float = 2.0,
    num_samples: int = 0,
    sink_tokens: int = 4,
    recent_window: int = 32,
    page_size: int = 16,
    heads_per_group: int = 4,
    grouping: str = "cross_layer",
    synthetic: bool = False,
    created_by: str = "",
    notes: dict[str, Any] | None = None,
    **aot_kwargs: Any,
) -> TangramProfile:
    """Budgets from (mean, std), budget-sorted groups, and the AOT split table, as one profile."""
    budget = head_budgets(mean, std, alpha)
    by_mode = {mode: group_heads(budget, heads_per_group, mode) for mode in GROUPINGS}
    if grouping not in by_mode:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    groups = by_mode[grouping]
    all_notes = {
        "over_allocation": {
            mode: round(over_allocation(budget, g, heads_per_group), 6) for mode, g in by_mode.items()
        }
    }
    all_notes.update(notes or {})
    return TangramProfile(
        model=model,
        scorer=scorer,
        target_ratio=target_ratio,
        alpha=alpha,
        num_samples=num_samples,
        sink_tokens=sink_tokens,
        recent_window=recent_window,
        page_size=page_size,
        heads_per_group=heads_per_group,
        grouping=grouping,
        mean=tuple(tuple(float(x) for x in r) for r in mean),
        std=tuple(tuple(float(x) for x in r) for r in std),
        budget=tuple(tuple(r) for r in budget),
        groups=groups,
        aot_split=build_aot_table(groups, model.num_kv_heads, **aot_kwargs),
        synthetic=synthetic,
        created_by=created_by,
        notes=all_notes,
    )


def uniform_profile(config: Any, budget: float = 1.0, **kwargs: Any) -> TangramProfile:
    """Every head at the same budget (budget 1.0 is the exactness reference: nothing is dropped)."""
    model = ModelIdentity.from_config(config)
    mean = [[budget] * model.num_kv_heads for _ in range(model.num_layers)]
    std = [[0.0] * model.num_kv_heads for _ in range(model.num_layers)]
    kwargs.setdefault("scorer", "snapkv")
    kwargs.setdefault("target_ratio", budget)
    kwargs.setdefault("created_by", f"uniform_profile(budget={budget})")
    return build_profile(model, mean, std, alpha=0.0, **kwargs)
