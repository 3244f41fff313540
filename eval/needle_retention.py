"""Do the needle task's later facts survive turn 1's compression? Tangram vs uniform at the same mean budget.

The accuracy run's needle conversations (``eval/accuracy.py``: a document with four "access code" facts, one
question per turn) compress the document once, in turn 1, with question 1 in the scorer's observation window;
questions 2-4 then read what survived. This script replays turn 1's prefill of those conversations through the
CPU reference engine (the same pool, scorer and selection as the accuracy run) under the uniform profile and the
shipped tangram profile at one budget, and counts, for every fact, the (layer, kv head) pairs that keep all of
its code's tokens, and all of its vault name's and code's tokens (what a question names and what it asks). With
the accuracy run's per-seed result files (``--turns``) it also splits the later turns by whether the method
answered them, so retention can be read beside correctness, and ranks the heads whose keeping a fact's code
best goes with its turn being answered (``predictive_heads``), with each method's keep rate and budget there.

    python eval/needle_retention.py --seeds 2000,3000 --out eval/results/needle_retention_p31.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

from accuracy import FULL_SIZES, SCORER_SLUGS, MethodSpec, build_runner, needle_task
from results_io import RESULTS, save_figure, summary_row, write_result

DEFAULT_SEEDS = (2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000, 12000, 13000, 14000, 15000)


def fact_token_positions(tok: Any, messages: list[dict[str, str]], prompt_ids: Sequence[int],
                         facts: Sequence[tuple[str, str]]) -> list[dict[str, list[int]]]:
    """Positions in ``prompt_ids`` of each (name, code) fact's tokens: ``code`` spells the code and ``name`` the
    vault's name in "The access code of the <name> vault is <code>." (the tokens overlapping their characters)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(prompt_ids):
        raise RuntimeError("the chat template's text does not re-tokenize to the prompt's ids")
    covering = lambda lo, hi: [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < hi and e > lo]
    out = []
    for name, code in facts:
        sentence = f"The access code of the {name} vault is {code}."
        at = text.find(sentence)
        if at < 0 or text.find(sentence, at + 1) >= 0:
            raise RuntimeError(f"fact {sentence!r} not found exactly once in the prompt")
        name_at, code_at = at + sentence.index(f" {name} ") + 1, at + sentence.rindex(code)
        out.append({"name": covering(name_at, name_at + len(name)), "code": covering(code_at, code_at + len(code))})
    return out


_QUESTION = re.compile(r"access code of the (.+?) vault\?")


def conversation_facts(conv: Any) -> list[tuple[str, str]]:
    """(vault name, code) asked in each turn of a needle conversation."""
    names = [_QUESTION.findall(t.user) for t in conv.turns]
    if any(len(n) != 1 for n in names):
        raise RuntimeError(f"{conv.id}: expected one vault question per turn, found {names}")
    return [(n[0], t.expected) for n, t in zip(names, conv.turns)]


def heads_keeping(engine: Any, prompt_ids: Sequence[int], positions: Sequence[int]) -> list[list[bool]]:
    """[layer][kv head]: whether that head's cache (after turn 1) holds every one of ``positions``."""
    lay = engine.layout
    segs = [s for s in engine.kv.match(prompt_ids).segments() if s.start <= min(positions) and max(positions) < s.end]
    if len(segs) != 1:
        raise RuntimeError(f"expected one cached segment over positions {positions}, found {len(segs)}")
    seg = segs[0]
    want = torch.tensor([p - seg.start for p in positions], dtype=torch.int32)
    keeps = [[False] * lay.num_kv_heads for _ in range(lay.num_layers)]
    for g, members in enumerate(lay.members):
        for c, (li, hi) in enumerate(members):
            keeps[li][hi] = bool(torch.isin(want, seg.kept_positions(g, c)).all())
    return keeps


def needle_turns(data: dict, label: str) -> list[dict]:
    """One accuracy result's needle-task turn records of method ``label``."""
    return [t for t in data["turns"] if t["task"] == "needle" and MethodSpec(t["method"], t["budget"]).label == label]


def turn_correctness(paths: Sequence[Path], labels: Sequence[str]) -> dict[tuple, bool]:
    """(label, seed, conversation, turn) -> correct, from accuracy runs' per-seed result files."""
    out = {}
    for p in paths:
        data = json.loads(p.read_text())["data"]
        out.update({(label, data["seed"], t["conversation"], t["turn"]): bool(t["correct"])
                    for label in labels for t in needle_turns(data, label)})
    return out


TOP_HEADS = 10
MEASURES = {"code": "every token of the code", "name_and_code": "every token of the vault's name and of its code"}


def summarize(rows: list[dict], measure: str) -> dict:
    """Per fact index: mean deep heads keeping ``measure``, overall and split by the method's correctness."""
    out = {}
    for q in sorted({r["fact"] for r in rows}):
        mine = [r for r in rows if r["fact"] == q]
        cell = {"facts": len(mine), "deep_heads_mean": round(mean(r[measure] for r in mine), 2),
                "kept_by_no_deep_head": sum(r[measure] == 0 for r in mine)}
        for ok, word in ((True, "correct"), (False, "wrong")):
            if sel := [r[measure] for r in mine if r.get("correct") is ok]:
                cell[f"deep_heads_mean_when_{word}"] = round(mean(sel), 2)
                cell[f"turns_{word}"] = len(sel)
        out[str(q)] = cell
    return out


def by_outcome(rows: dict[str, list[dict]], measure: str) -> list[dict]:
    """Later facts (turns 2-4) split by which methods answered them: each method's mean deep-head count there."""
    (a, ra), (b, rb) = rows.items()
    key = lambda r: (r["seed"], r["conversation"], r["fact"])
    other = {key(r): r for r in rb}
    cells: dict[tuple[bool, bool], list[tuple[int, int]]] = {}
    for r in ra:
        o = other.get(key(r))
        if r["fact"] > 0 and o is not None and "correct" in r and "correct" in o:
            cells.setdefault((r["correct"], o["correct"]), []).append((r[measure], o[measure]))
    return [{f"{a} correct": ca, f"{b} correct": cb, "turns": len(v),
             f"{a} deep heads": round(mean(x for x, _ in v), 2), f"{b} deep heads": round(mean(y for _, y in v), 2)}
            for (ca, cb), v in sorted(cells.items())]


def predictive_heads(rows: dict[str, list[dict]], budgets: dict[str, list[list[float]]], skip_layers: int,
                     min_turns: int = 20) -> list[dict]:
    """Per head of layers >= ``skip_layers``: the later turns (facts 2-4, every method's pooled) answered when it
    kept the fact's code against when it dropped it, each method's keep rate and budget; heads with at least
    ``min_turns`` turns each way, the widest difference first (``code_heads``: one bit per head, layer-major)."""
    later = {label: [r for r in rs if r["fact"] > 0 and "correct" in r] for label, rs in rows.items()}
    heads = len(next(iter(budgets.values()))[0])
    out = []
    for j in range(skip_layers * heads, len(next(r for rs in later.values() for r in rs)["code_heads"])):
        kept = [r["correct"] for rs in later.values() for r in rs if r["code_heads"][j] == "1"]
        dropped = [r["correct"] for rs in later.values() for r in rs if r["code_heads"][j] == "0"]
        if min(len(kept), len(dropped)) < min_turns:
            continue
        cell = {"layer": j // heads, "head": j % heads, "turns_kept": len(kept), "turns_dropped": len(dropped),
                "answered_when_kept": round(mean(kept), 3), "answered_when_dropped": round(mean(dropped), 3),
                "difference": round(mean(kept) - mean(dropped), 3)}
        for label, rs in later.items():
            cell[f"{label} keeps"] = round(mean(r["code_heads"][j] == "1" for r in rs), 3)
            cell[f"{label} budget"] = budgets[label][j // heads][j % heads]
        out.append(cell)
    return sorted(out, key=lambda c: -c["difference"])


def plot(by_fact: dict, skip_layers: int, path: Path, title: str) -> None:
    """One panel per measure: bars of the mean deep heads keeping each fact, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_fact), figsize=(5.2 * len(by_fact), 3.8), sharey=True)
    for ax, (measure, per_label) in zip(axes, by_fact.items()):
        facts = sorted({int(q) for cells in per_label.values() for q in cells})
        width = 0.8 / len(per_label)
        for i, (label, cells) in enumerate(per_label.items()):
            ax.bar([f + i * width for f in facts], [cells[str(f)]["deep_heads_mean"] for f in facts], width,
                   label=label)
        ax.set_xticks([f + width * (len(per_label) - 1) / 2 for f in facts],
                      [f"fact {f + 1}\n(turn {f + 1})" for f in facts])
        ax.set_title(f"keeping {MEASURES[measure]}", fontsize=9)
    axes[0].set_ylabel(f"heads of layers >= {skip_layers} (mean)")
    axes[0].legend()
    save_figure(fig, path, title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)),
                    help="accuracy task seeds (default: the fourteen of accuracy_cpu_p31_pooled)")
    ap.add_argument("--samples", type=int, default=8, help="needle conversations per seed (default 8, as accuracy)")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--scorer", choices=sorted(SCORER_SLUGS), default="snapkv:pool_kernel=31")
    ap.add_argument("--skip-layers", type=int, default=2,
                    help="count heads of layers >= this (the pool-31 profile gives layers 0-1 ~0.77 at 0.5)")
    ap.add_argument("--turns", nargs="*", type=Path, default=None, metavar="JSON",
                    help="accuracy result files whose needle turns give each later fact's correctness "
                         "(default, with the pool-31 scorer: eval/results/accuracy_cpu_seed<S>_p31.json for each "
                         "seed, where present)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "needle_retention_p31.json")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    from tqdm import tqdm

    from tangram_sgl.models import load_model_dir, resolve_model_dir

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    p31 = args.scorer == "snapkv:pool_kernel=31"  # the scorer of the per-seed runs (budgets 0.5 and 0.25)
    turn_files = args.turns if args.turns is not None else [
        p for s in seeds if p31 and (p := RESULTS / f"accuracy_cpu_seed{s}_p31.json").is_file()]
    specs = [MethodSpec("uniform", args.budget), MethodSpec("tangram", args.budget)]
    correct = turn_correctness(turn_files, [s.label for s in specs])
    model_dir = resolve_model_dir("smollm2")
    model, tok = load_model_dir(model_dir)
    count_tokens = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
    convs = {s: needle_task(args.samples, FULL_SIZES, count_tokens, s) for s in seeds}
    t0 = time.perf_counter()
    rows: dict[str, list[dict]] = {}
    budgets: dict[str, list[list[float]]] = {}
    deep = lambda keeps: sum(map(sum, keeps[args.skip_layers:]))  # heads of layers >= skip_layers keeping
    with tqdm(total=len(specs) * len(seeds) * args.samples, desc="turn-1 prefills", unit="conv") as bar:
        for spec in specs:
            runner, _ = build_runner(spec, model, None, tok, 4096, args.scorer, "smollm2")
            engine = runner.engine
            rows[spec.label] = []
            budgets[spec.label] = [list(b) for b in engine.profile.budget]
            for seed in seeds:
                for conv in convs[seed]:
                    messages = conv.messages_for_turn(0, [])
                    ids = engine.chat_prompt(messages)
                    engine.generate((seed, conv.id), ids, 1)  # turn 1's prefill: the document's compression
                    for q, pos in enumerate(fact_token_positions(tok, messages, ids, conversation_facts(conv))):
                        code = heads_keeping(engine, ids, pos["code"])
                        both = heads_keeping(engine, ids, pos["name"] + pos["code"])
                        row = {"seed": seed, "conversation": conv.id, "fact": q, "name_tokens": len(pos["name"]),
                               "code_tokens": len(pos["code"]), "code_all_layers": sum(map(sum, code)),
                               "code": deep(code), "name_and_code": deep(both),
                               "code_heads": "".join("01"[k] for layer in code for k in layer)}
                        if (key := (spec.label, seed, conv.id, q)) in correct:
                            row["correct"] = correct[key]
                        rows[spec.label].append(row)
                    bar.update(1)
            del runner, engine
    deep_heads = (model.config.num_hidden_layers - args.skip_layers) * model.config.num_key_value_heads
    by_fact = {m: {label: summarize(r, m) for label, r in rows.items()} for m in MEASURES}
    summary = [
        summary_row(f"needle facts 2-4 of turn 1's document: heads of layers >= {args.skip_layers} (of {deep_heads}) "
                    f"keeping {MEASURES[m]}, {label} (n={len(later)})", round(mean(x[m] for x in later), 2),
                    "heads (mean)")
        for m in MEASURES for label, r in rows.items() if (later := [x for x in r if x["fact"] > 0])
    ]
    predictive = predictive_heads(rows, budgets, args.skip_layers) if correct else []
    if top := predictive[:TOP_HEADS]:
        summary += [summary_row(f"needle facts 2-4: the {len(top)} heads whose keeping the code best predicts an "
                                f"answer (of {len(predictive)} with >= 20 turns each way): {label} keeps the code there",
                                round(mean(c[f"{label} keeps"] for c in top), 3), "fraction of turns")
                    for label in rows]
        summary.append(summary_row(
            f"needle facts 2-4: the {len(top)} heads' mean difference, answered when kept - when dropped",
            round(mean(c["difference"] for c in top), 3), "fraction of turns"))
    data = {
        "model": f"SmolLM2-135M-Instruct ({model_dir.name}, float32, CPU)",
        "scorer": args.scorer, "budget": args.budget, "seeds": seeds, "samples_per_seed": args.samples,
        "skip_layers": args.skip_layers, "deep_heads": deep_heads, "turn_files": [p.name for p in turn_files],
        "definition": "a (layer, kv head) keeps a fact when every token overlapping the characters measured (the "
                      "code; the vault's name and the code) is in its cache after turn 1 (the compressed document "
                      "segment); counts are over heads of layers >= skip_layers; fact 0 is asked in turn 1, facts 1-3 "
                      "in turns 2-4, after the compression",
        "measures": MEASURES,
        "by_fact": by_fact,
        "by_outcome": {m: by_outcome(rows, m) for m in MEASURES},
        "predictive_heads": predictive,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_result(args.out.stem, data, summary, directory=args.out.parent)
    plot(by_fact, args.skip_layers, args.out.with_suffix(".png"),
         f"SmolLM2-135M, needle task, {len(seeds)} seeds x {args.samples}, {args.scorer} @ {args.budget:g}:\n"
         f"each fact after turn 1's compression")
    print(json.dumps({"by_fact": by_fact, "by_outcome": data["by_outcome"], "predictive_heads": predictive[:TOP_HEADS]},
                     indent=1))
    return data


if __name__ == "__main__":
    main()
