"""Budget-sorted head grouping: pack H_p kv heads with similar budgets into one page table.

``per_layer``: within each layer, sort heads by budget (descending) and chunk into groups of H_p; a layer
whose head count is not a multiple of H_p gets a last, smaller group (its empty columns are padding).
``cross_layer``: sort all (layer, head) pairs by budget and chunk the whole list; groups may span layers.

Over-allocation (the cost of grouping): sum over groups of H_p * b_g - sum of head budgets, as a fraction
of full KV (all L*H heads at budget 1). Padding columns count as over-allocation because a page always
holds H_p columns.
"""

from __future__ import annotations

from collections.abc import Sequence

from tangram_sgl.profile import GROUPINGS, HeadGroup


def group_heads(budget: Sequence[Sequence[float]], heads_per_group: int, grouping: str) -> tuple[HeadGroup, ...]:
    """Partition all (layer, kv_head) into budget-sorted groups of at most ``heads_per_group``."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    if heads_per_group <= 0:
        raise ValueError(f"heads_per_group must be positive, got {heads_per_group}")

    def key(lh: tuple[int, int]) -> tuple[float, int, int]:
        # Descending budget; ties broken by position so the result is deterministic.
        return (-budget[lh[0]][lh[1]], lh[0], lh[1])

    if grouping == "per_layer":
        pools = [sorted(((li, hi) for hi in range(len(row))), key=key) for li, row in enumerate(budget)]
    else:
        pools = [sorted(((li, hi) for li, row in enumerate(budget) for hi in range(len(row))), key=key)]
    groups = []
    for heads in pools:
        for i in range(0, len(heads), heads_per_group):
            members = tuple(heads[i : i + heads_per_group])
            groups.append(HeadGroup(members=members, budget=max(budget[li][hi] for li, hi in members)))
    return tuple(groups)


def over_allocation(budget: Sequence[Sequence[float]], groups: Sequence[HeadGroup], heads_per_group: int) -> float:
    """(sum_g H_p*b_g - sum_h b_h) / (L*H): reserved-but-unneeded KV as a fraction of full KV."""
    total_heads = sum(len(row) for row in budget)
    need = sum(sum(row) for row in budget)
    reserved = sum(heads_per_group * g.budget for g in groups)
    return (reserved - need) / total_heads
