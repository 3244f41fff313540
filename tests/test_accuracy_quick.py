"""``eval/accuracy.py --quick``: the results envelope has its structure, and tangram's reference engine
at uniform budget 1.0 answers every turn exactly as dense full KV (transformers' attention and cache) does."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()  # the script sets --threads for the whole process
    yield
    torch.set_num_threads(before)


def _accuracy_module():
    spec = importlib.util.spec_from_file_location("eval_accuracy", ROOT / "eval" / "accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through the module's entry
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_full_equals_uniform_one(tmp_path):
    out = tmp_path / "accuracy_quick.json"
    _accuracy_module().main(["--quick", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert doc["name"] == "accuracy_quick" and doc["data"]["quick"] is True
    data = doc["data"]
    assert data["seed"] >= 1000 and data["calibration_seed"] == 0  # disjoint from the profiles' calibration

    turns = data["turns"]
    full = {(t["conversation"], t["turn"]): t for t in turns if t["method"] == "full"}
    uni = {(t["conversation"], t["turn"]): t for t in turns if t["method"] == "uniform"}
    assert len(full) == 4 and full.keys() == uni.keys()  # 2 conversations x 2 turns, each method
    for key, f in full.items():
        u = uni[key]
        assert f["error"] is None and u["error"] is None
        assert f["answer"] and u["answer"] == f["answer"], key  # budget 1.0 drops nothing
        assert u["prompt_tokens"] == f["prompt_tokens"]
        assert u["kept_fraction"] == 1.0 and u["pages_fraction"] >= 1.0  # page tails: >= full
        assert f["correct"] == (f["expected"].lower() in f["answer"].lower())
    assert data["answers_equal_to_full"] == {"uniform@1": 1.0}

    scores = data["scores"]
    assert set(scores) == {"full", "uniform@1"}
    for label, s in scores.items():
        cell = s["all"]
        assert cell["n"] == 4 and cell["hits"] == sum(
            t["correct"] for t in (full if label == "full" else uni).values()
        )
        assert cell["score"] == pytest.approx(cell["hits"] / 4)
        lo, hi = cell["ci95"]
        assert 0.0 <= lo <= cell["score"] <= hi <= 1.0 and hi - lo > 0.3  # n=4: a wide interval
        assert s["tasks"]["needle"]["n"] == 4
    assert scores["full"]["all"]["hits"] == scores["uniform@1"]["all"]["hits"]

    rows = doc["summary"]
    assert [r["metric"].split(" (")[0] for r in rows] == [
        "retrieval accuracy full",
        "retrieval accuracy uniform@1",
    ]
    assert all(r["unit"] == "% turns" and r["met"] is None for r in rows)
    assert rows[0]["value"] == pytest.approx(100 * scores["full"]["all"]["score"], abs=0.05)


def test_targets_rows_compare_tangram_to_uniform_and_full():
    acc = _accuracy_module()

    def cell(score: float) -> dict:
        return {"all": {"score": score, "n": 20, "kv_kept_fraction": 0.5}}

    scores = {
        "full": cell(0.60),
        "uniform@0.5": cell(0.50),
        "tangram@0.5": cell(0.56),
        "uniform@0.25": cell(0.40),
        "tangram@0.25": cell(0.35),
    }
    rows = {r["metric"].split(" (")[0].split()[-1]: r for r in acc.targets(scores, [0.5, 0.25])}
    assert rows["tangram@0.5"]["met"] is True  # 56 >= 50 and 56 >= 60 - 5
    assert rows["tangram@0.25"]["met"] is False  # 35 < 40
    assert "full - 5 pts" in rows["tangram@0.5"]["target"] and "full" not in rows["tangram@0.25"]["target"]
    scores["tangram@0.5"] = cell(0.54)  # >= uniform but 6 points below full
    rows = {r["metric"].split(" (")[0].split()[-1]: r for r in acc.targets(scores, [0.5, 0.25])}
    assert rows["tangram@0.5"]["met"] is False
    assert rows["full"]["met"] is None and rows["uniform@0.5"]["met"] is None


def test_pooled_runs_score_every_seed_and_pair_turns_within_a_seed(tmp_path):
    """``--pool``: two seeds' turns are scored together; a turn pairs only with the same seed's same turn (the two
    seeds reuse conversation numbers), one seed pooled twice is refused, and the command writes the pooled result
    with its figure."""
    mod = _accuracy_module()

    def turn(method, budget, conv, correct):
        return {"method": method, "budget": budget, "task": "kv", "conversation": conv, "turn": 0, "correct": correct,
                "error": None, "kept_fraction": budget, "pages_fraction": None}

    def run(seed, rows, name="run", **model_name):
        doc = {"data": {"seed": seed, "model": "m", "scorer": "snapkv", "sizes": {}, "max_new_tokens": 8,
                        "kv_tokens": 64, "turns": [turn(*r) for r in rows], **model_name}}
        path = tmp_path / f"{name}{seed}.json"
        path.write_text(json.dumps(doc))
        return path

    a = run(1000, [("full", 1.0, 0, True), ("uniform", 0.5, 0, True), ("tangram", 0.5, 0, False)])
    b = run(2000, [("full", 1.0, 0, True), ("uniform", 0.5, 0, False), ("tangram", 0.5, 0, True),
                   ("full", 1.0, 1, False), ("uniform", 0.5, 1, False), ("tangram", 0.5, 1, True)], model_name="smollm2")
    data, summary = mod.pool_results([a, b])
    assert data["seeds"] == [1000, 2000]
    assert {k: (v["all"]["n"], v["all"]["hits"]) for k, v in data["scores"].items()} == {
        "full": (3, 2), "uniform@0.5": (3, 1), "tangram@0.5": (3, 2)}
    assert data["paired"]["tangram@0.5 vs uniform@0.5"] == {
        "turns": 3, "only_tangram@0.5": 2, "only_uniform@0.5": 1, "mcnemar_exact_p": 1.0}
    met = {r["metric"].split(" (")[0]: r["met"] for r in summary}
    assert met["retrieval accuracy tangram@0.5"] is True  # 2/3 >= 1/3 and >= 2/3 - 5 points
    assert (data["budgets"], data["tasks"]) == ([0.5], ["kv"])
    with pytest.raises(SystemExit, match="pooled twice"):
        mod.pool_results([a, a])
    # a (no model_name: a run from before --model, SmolLM2's) pools with SmolLM2 runs, not with another model's
    qwen = run(3000, [("full", 1.0, 0, True)], model_name="qwen2.5-coder-0.5b")
    with pytest.raises(SystemExit, match="differ in model_name"):
        mod.pool_results([a, qwen])
    out = tmp_path / "pooled.json"  # the command: the result and its accuracy-vs-budget figure
    assert mod.main(["--pool", str(a), str(b), "--out", str(out)])["seeds"] == [1000, 2000]
    assert json.loads(out.read_text())["summary"] == summary and out.with_suffix(".png").stat().st_size > 0

    # --tangram-from: another profile's tangram turns replace the pooled ones, which stay as tangram-base
    def other(seed, rows, profile="p.json"):
        path = run(seed, rows, name=f"other_{profile}_")
        doc = json.loads(path.read_text())
        doc["data"]["methods"] = {f"tangram@{rows[0][1]:g}": {"profile": profile}}
        path.write_text(json.dumps(doc))
        return path

    a2 = other(1000, [("tangram", 0.5, 0, True)])
    b2 = other(2000, [("tangram", 0.5, 0, True), ("tangram", 0.5, 1, False)])
    data, summary = mod.pool_results([a, b], [a2, b2])
    assert data["tangram_profiles"] == {"tangram@0.5": "p.json"}
    assert [r["metric"].split(" (")[0] for r in summary][1:] == ["retrieval accuracy uniform@0.5",
                                                                   "retrieval accuracy tangram@0.5 [p]"]
    assert {k: v["all"]["hits"] for k, v in data["scores"].items()} == {
        "full": 2, "uniform@0.5": 1, "tangram@0.5": 2, "tangram-base@0.5": 2}
    assert data["paired"]["tangram@0.5 vs tangram-base@0.5"] == {
        "turns": 3, "only_tangram@0.5": 1, "only_tangram-base@0.5": 1, "mcnemar_exact_p": 1.0}
    assert data["scores"]["uniform@0.5"] == mod.pool_results([a, b])[0]["scores"]["uniform@0.5"]
    with pytest.raises(SystemExit, match="one run per pooled seed"):
        mod.pool_results([a, b], [a2])
    # a seed whose budgets lie in two files (Qwen's 0.5 and 0.25 runs): each budget's replacements match its seeds
    a25 = run(1000, [("uniform", 0.25, 0, True), ("tangram", 0.25, 0, False)], name="r025_")
    a2_25 = other(1000, [("tangram", 0.25, 0, True)], profile="p25.json")
    data, _ = mod.pool_results([a, a25, b], [a2, b2, a2_25])
    assert {k: v["all"]["hits"] for k, v in data["scores"].items() if "0.25" in k} == {
        "uniform@0.25": 1, "tangram@0.25": 1, "tangram-base@0.25": 0}
    with pytest.raises(SystemExit, match="one run per pooled seed"):  # 0.25 pooled at seed 1000 only
        mod.pool_results([a, a25, b], [a2, b2, a2_25, other(2000, [("tangram", 0.25, 0, True)], profile="p25.json")])
    with pytest.raises(SystemExit, match="different profiles"):
        mod.pool_results([a, b], [a2, other(2000, [("tangram", 0.5, 0, True)], profile="q.json")])
    with pytest.raises(SystemExit):  # argparse: --tangram-from needs --pool
        mod.parse_args(["--tangram-from", str(a2)])
