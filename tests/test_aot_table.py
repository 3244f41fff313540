"""The AOT split table: balanced per-CTA work, bucket lookup, and shipped profiles built with the current rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tangram_sgl.aot_table import DEFAULT_TARGET_CTAS, build_aot_table
from tangram_sgl.profile import HeadGroup, load_profile

PROFILES = Path(__file__).resolve().parent.parent / "tangram_sgl" / "profiles"


def _groups(budgets):
    return [HeadGroup(members=((0, i),), budget=b) for i, b in enumerate(budgets)]


def test_work_per_cta_is_balanced_across_groups():
    # The anchor layer: one kv head of 8 at 1.0, the rest at 0.14.
    groups = _groups([1.0] + [0.14] * 7)
    table = build_aot_table(groups, 8)
    row = table.splits_for(32)
    per_cta = [g.budget / s for g, s in zip(groups, row)]
    assert max(per_cta) / min(per_cta) < 1.5, (row, per_cta)
    # ~target_ctas CTAs in flight for a batch of 32 (rounding up can only add)
    ctas = 32 * sum(row)
    assert DEFAULT_TARGET_CTAS <= ctas <= DEFAULT_TARGET_CTAS * 1.5


def test_splits_follow_budget_and_batch():
    groups = _groups([1.0, 0.5, 0.25, 0.25])
    table = build_aot_table(groups, 4, batch_buckets=(1, 8, 64), target_ctas=512, max_splits=16)
    assert table.splits[0] == (16, 16, 16, 16)  # clamped at max_splits for a single request
    mean = sum(g.budget for g in groups) / 4
    assert table.splits[1] == tuple(min(16, math.ceil(512 * g.budget / (8 * 4 * mean))) for g in groups)
    assert table.splits[2] == (4, 2, 1, 1)
    assert table.bucket_index(9) == 2 and table.bucket_index(1000) == 2 and table.bucket_index(1) == 0


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.r*.json")), ids=lambda p: p.name)
def test_shipped_profiles_carry_the_current_table(path):
    prof = load_profile(path)
    a = prof.aot_split
    assert a == build_aot_table(prof.groups, prof.model.num_kv_heads, batch_buckets=a.batch_buckets,
                                max_splits=a.max_splits, min_split_tokens=a.min_split_tokens)
