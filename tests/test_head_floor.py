"""``eval/head_floor.py``: raising chosen heads' budgets keeps the mean budget; the turn-paired comparison."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))

import accuracy
from head_floor import compare, floored_budgets, floored_profile

from tangram_sgl.profile import load_profile


def test_floored_budgets_raise_the_heads_and_keep_the_mean():
    budget = [[0.1, 0.2, 0.9], [0.3, 0.95, 0.05]]
    out = floored_budgets(budget, [(0, 0), (1, 2)], 0.5)
    assert out[0][0] == 0.5 and out[1][2] == 0.5
    assert sum(map(sum, out)) == pytest.approx(sum(map(sum, budget)))
    ratios = [out[li][h] / budget[li][h] for li, h in ((0, 1), (0, 2), (1, 0), (1, 1))]
    assert max(ratios) == pytest.approx(min(ratios)) and ratios[0] < 1
    assert floored_budgets(budget, [(0, 2)], 0.5) == budget  # a head already above the floor changes nothing
    with pytest.raises(ValueError, match="no budget for the others"):
        floored_budgets(budget, [(0, 0), (0, 1), (1, 0), (1, 2)], 1.0)


def test_floored_profile_of_the_shipped_profile_keeps_its_mean_and_layout():
    shipped = load_profile(accuracy.shipped_profile_path("smollm2", 0.5, "snapkv:pool_kernel=31"))
    probe = floored_profile(shipped, [(13, 1), (11, 0)], 0.5)
    assert probe.budget[13][1] == pytest.approx(0.5, abs=1e-6) and probe.budget[11][0] == pytest.approx(0.5, abs=1e-6)
    assert probe.mean_budget() == pytest.approx(shipped.mean_budget(), abs=1e-5)
    assert (probe.scorer, probe.page_size, probe.heads_per_group) == (shipped.scorer, shipped.page_size,
                                                                     shipped.heads_per_group)
    assert probe.budget[0][0] < shipped.budget[0][0]  # paid for by the others


def test_compare_counts_turns_only_one_side_answers():
    probe = {1: True, 2: True, 3: False, 4: True}
    other = {1: True, 2: False, 3: True, 4: False, 5: True}
    assert compare(probe, other) == {"turns": 4, "only_probe": 2, "only_other": 1, "mcnemar_exact_p": 1.0}


def test_accuracy_profile_serves_one_budget():
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--profile", "p.json", "--budgets", "0.5,0.25"])
    assert accuracy.parse_args(["--profile", "p.json", "--budgets", "0.5"]).profile == Path("p.json")
