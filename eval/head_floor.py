"""A held-out probe of SmolLM2's needle gap at budget 0.5: do the heads tangram starves cost the later turns?

``eval/needle_retention.py`` ranks the heads whose keeping a fact's code goes with its later turn being answered.
This script chooses the top ``--heads`` of that ranking from the uniform run's rows of one set of seeds
(``--choose-seeds``), raises their tangram budgets to ``--floor``, scales every other head so the mean budget stays
the shipped profile's, and answers the needle conversations of the other seeds (``--eval-seeds``) with that profile
(``eval/accuracy.py --profile``). Each later turn is compared with the shipped tangram and uniform runs of the same
seeds (``accuracy_cpu_seed<S>_p31.json``). A diagnosis, not a profile to ship: the heads are picked from answers.

    python eval/head_floor.py --out eval/results/head_floor_p31.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

import accuracy
from needle_retention import needle_turns, predictive_heads
from results_io import RESULTS, summary_row, write_result

from tangram_sgl.profile import TangramProfile, load_profile
from tangram_sgl.profile_builder import build_profile

SCORER = "snapkv:pool_kernel=31"


def floored_budgets(budget: Sequence[Sequence[float]], heads: Sequence[tuple[int, int]],
                    floor: float) -> list[list[float]]:
    """``heads`` raised to at least ``floor``, every other head scaled down by one factor so the mean stays."""
    b = [list(row) for row in budget]
    total = sum(map(sum, b))
    for li, h in heads:
        b[li][h] = max(b[li][h], floor)
    others = [(li, h) for li in range(len(b)) for h in range(len(b[0])) if (li, h) not in set(heads)]
    rest = sum(b[li][h] for li, h in others)
    scale = (rest - (sum(map(sum, b)) - total)) / rest
    if scale <= 0:
        raise ValueError(f"raising {len(heads)} heads to {floor:g} leaves no budget for the others")
    for li, h in others:
        b[li][h] *= scale
    return b


def floored_profile(profile: TangramProfile, heads: Sequence[tuple[int, int]], floor: float) -> TangramProfile:
    """``profile`` with :func:`floored_budgets` as its budgets (regrouped, new AOT table; std 0, alpha 0)."""
    b = floored_budgets(profile.budget, heads, floor)
    return build_profile(profile.model, b, [[0.0] * len(r) for r in b], scorer=profile.scorer,
                         target_ratio=profile.target_ratio, alpha=0.0, sink_tokens=profile.sink_tokens,
                         recent_window=profile.recent_window, page_size=profile.page_size,
                         heads_per_group=profile.heads_per_group, grouping=profile.grouping,
                         created_by="eval/head_floor.py", notes={"floored_heads": [list(x) for x in heads],
                                                                 "floor": floor})


def later_turns(turns: list[dict], seed: int) -> dict[tuple, bool]:
    """(seed, conversation, turn) -> correct for turns 2-4 of one seed's needle turn records."""
    return {(seed, t["conversation"], t["turn"]): bool(t["correct"]) for t in turns if t["turn"] > 0}


def compare(probe: dict[tuple, bool], other: dict[tuple, bool]) -> dict:
    """Turns each answers alone on the common turns, with the exact McNemar p-value."""
    from scipy.stats import binomtest

    common = probe.keys() & other.keys()
    a = sum(probe[k] and not other[k] for k in common)
    b = sum(other[k] and not probe[k] for k in common)
    return {"turns": len(common), "only_probe": a, "only_other": b,
            "mcnemar_exact_p": round(float(binomtest(a, a + b).pvalue), 4) if a + b else 1.0}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--retention", type=Path, default=RESULTS / "needle_retention_p31.json",
                    help="eval/needle_retention.py's result (its rows carry each head's keeping, code_heads)")
    ap.add_argument("--choose-seeds", default="2000,3000,4000,5000,6000,7000,8000")
    ap.add_argument("--eval-seeds", default="9000,10000,11000,12000,13000,14000,15000")
    ap.add_argument("--heads", type=int, default=10, help="heads raised (default 10 of 90)")
    ap.add_argument("--floor", type=float, default=0.5, help="their least budget (default 0.5, uniform's)")
    ap.add_argument("--min-turns", type=int, default=10, help="turns kept and dropped a ranked head needs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "head_floor_p31.json")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    choose = {int(s) for s in args.choose_seeds.split(",")}
    seeds = [int(s) for s in args.eval_seeds.split(",")]
    if choose & set(seeds):
        raise SystemExit(f"seeds {sorted(choose & set(seeds))} would both choose the heads and test them")
    retention = json.loads(args.retention.read_text())["data"]
    shipped = load_profile(accuracy.shipped_profile_path("smollm2", retention["budget"], SCORER))
    uniform, tangram = (accuracy.MethodSpec(m, retention["budget"]).label for m in ("uniform", "tangram"))
    rows = [r for r in retention["rows"][uniform] if r["seed"] in choose]
    flat = [[retention["budget"]] * len(shipped.budget[0]) for _ in shipped.budget]
    ranked = predictive_heads({uniform: rows}, {uniform: flat}, retention["skip_layers"], args.min_turns)
    heads = [(c["layer"], c["head"]) for c in ranked[: args.heads]]
    profile = floored_profile(shipped, heads, args.floor)
    probe, shipped_runs, per_seed, turns = {}, {uniform: {}, tangram: {}, "full": {}}, [], []
    kept: dict[str, list[float]] = {"probe": [], uniform: [], tangram: []}
    with tempfile.TemporaryDirectory(prefix="head_floor_") as tmp:
        profile.save(Path(tmp) / "profile.json")
        for seed in seeds:
            out = Path(tmp) / f"seed{seed}.json"
            accuracy.main(["--tasks", "needle", "--methods", "tangram", "--budgets", f"{retention['budget']:g}",
                           "--seed", str(seed), "--scorer", SCORER, "--threads", str(args.threads),
                           "--profile", str(Path(tmp) / "profile.json"), "--out", str(out)])
            run = needle_turns(json.loads(out.read_text())["data"], tangram)
            turns += [{"seed": seed, **{k: t[k] for k in ("conversation", "turn", "expected", "answer", "correct",
                                                          "kept_fraction")}} for t in run]
            kept["probe"] += [t["kept_fraction"] for t in run]
            mine = later_turns(run, seed)
            probe.update(mine)
            base = json.loads((RESULTS / f"accuracy_cpu_seed{seed}_p31.json").read_text())["data"]
            cells = {"seed": seed, "probe": sum(mine.values())}
            for label, pooled in shipped_runs.items():
                theirs = needle_turns(base, label)
                later = later_turns(theirs, seed)
                pooled.update(later)
                cells[label] = sum(later.values())
                if label in kept:
                    kept[label] += [t["kept_fraction"] for t in theirs]
            per_seed.append(cells)
    n = len(probe)
    answered = {"probe": sum(probe.values()), **{label: sum(v.values()) for label, v in shipped_runs.items()}}
    pairs = {f"probe vs {label}": compare(probe, shipped_runs[label]) for label in (tangram, uniform)}
    names = {"probe": f"tangram with {len(heads)} heads raised to {args.floor:g} (probe)"} | {k: k for k in shipped_runs}
    summary = [summary_row(f"needle turns 2-4 of seeds {seeds[0]}-{seeds[-1]} answered (n={n}): {names[k]}", hits,
                           "turns") for k, hits in answered.items()]
    summary += [summary_row(f"{name}: exact McNemar p ({pr['only_probe']} turns only the probe answers, "
                            f"{pr['only_other']} only the other)", pr["mcnemar_exact_p"], "p") for name, pr in pairs.items()]
    summary += [summary_row(f"needle turns of seeds {seeds[0]}-{seeds[-1]}: KV kept, {names[k]}", round(mean(v), 4),
                            "fraction of full") for k, v in kept.items()]
    data = {
        "retention": args.retention.name, "choose_seeds": sorted(choose), "eval_seeds": seeds,
        "floor": args.floor, "heads": [{**c, "probe budget": profile.budget[c["layer"]][c["head"]],
                                        "shipped budget": shipped.budget[c["layer"]][c["head"]]}
                                       for c in ranked[: args.heads]],
        "mean_budget": {"probe": round(profile.mean_budget(), 6), "shipped": round(shipped.mean_budget(), 6)},
        "later_turns": n, "answered": answered,
        "kv_kept_fraction": {k: round(mean(v), 4) for k, v in kept.items()}, "paired": pairs, "per_seed": per_seed,
        "probe_budget": [list(r) for r in profile.budget], "probe_turns": turns,
    }
    write_result(args.out.stem, data, summary, directory=args.out.parent)
    print(json.dumps({"answered": answered, "paired": pairs}, indent=1))
    return data


if __name__ == "__main__":
    main()
