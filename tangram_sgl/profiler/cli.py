"""``tangram-sgl profile`` (real budgets from a model) and ``tangram-sgl synth`` (synthetic budgets)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tangram_sgl.aot_table import DEFAULT_MIN_SPLIT_TOKENS
from tangram_sgl.profile import GROUPINGS, ModelIdentity, TangramProfile, validate_for_model
from tangram_sgl.profiler.calibration import SOURCE_SPLITS, TASKS, calibration_set
from tangram_sgl.profiler.pipeline import (
    BUDGET_MODES,
    RETENTIONS,
    ProfileSettings,
    collect_scores,
    profile_from_scores,
)
from tangram_sgl.profiler.plots import plot_profile
from tangram_sgl.profiler.retention import SCOPES
from tangram_sgl.profiler.segments import tokenize_conversation
from tangram_sgl.scorers import SCORERS, make_scorer


def _out_paths(out: str, ratios: list[float]) -> list[Path]:
    if len(ratios) > 1 and "{ratio}" not in out:
        raise SystemExit("--out must contain '{ratio}' when several --ratio values are given")
    return [Path(out.replace("{ratio}", f"{r:g}")) for r in ratios]


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ratio", type=float, nargs="+", required=True, help="target kept ratio(s) in (0, 1]")
    p.add_argument("--out", required=True, help="profile JSON path ('{ratio}' is replaced per ratio)")
    p.add_argument("--alpha", type=float, default=2.0, help="budget = min(1, mean + alpha*std) (default 2)")
    p.add_argument("--heads-per-group", type=int, default=4, help="H_p, kv heads per page group (default 4)")
    p.add_argument("--grouping", choices=GROUPINGS, default="cross_layer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--min-split-tokens", type=int, default=DEFAULT_MIN_SPLIT_TOKENS)
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG next to the profile")


def _write(profile: TangramProfile, path: Path, plot: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    if plot:
        plot_profile(profile, path.with_suffix(".png"))
    oa = profile.notes.get("over_allocation", {})
    print(f"wrote {path}: mean head budget {profile.mean_budget():.4f}, reserved {profile.allocated_fraction():.4f} "
          f"of full KV, {profile.num_groups} groups; over-allocation per_layer {oa.get('per_layer')}, "
          f"cross_layer {oa.get('cross_layer')}")


# ------------------------------------------------------------------------------------------- profile


def _scorer_spec(spec: str) -> str:
    try:
        make_scorer(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="'smollm2', an HF model directory, or a .gguf file")
    _add_layout_args(p)
    p.add_argument("--scorer", type=_scorer_spec, default="snapkv",
                   help=f"one of {sorted(SCORERS)}, optionally with parameters: snapkv:pool_kernel=31")
    p.add_argument("--scope", choices=SCOPES, default=None,
                   help="threshold scope for retention (default: the scorer's; snapkv: global)")
    p.add_argument("--budget-mode", choices=BUDGET_MODES, default="matched",
                   help="matched: mean head budget = target; nominal: threshold ratio = target")
    p.add_argument("--retention", choices=RETENTIONS, default="segment",
                   help="segment: each turn's tokens ranked by that turn's own window; conversation: a token also "
                        "counts as kept when a later calibration turn's question would keep it")
    p.add_argument("--samples", type=int, default=50, help="calibration conversations (default 50)")
    p.add_argument("--tokens", type=int, default=1536, help="approximate tokens per conversation")
    p.add_argument("--turns", type=int, default=3, help="turns (segments) per conversation")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--source-split", choices=SOURCE_SPLITS, default="all",
                   help="draw source documents from all / the even half / the odd half (disjoint sets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sink", type=int, default=4, help="sink tokens always kept (default 4)")
    p.add_argument("--window", type=int, default=32, help="recent window / observation window (default 32)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")


def run_profile(args: argparse.Namespace) -> int:
    from tangram_sgl.models import load_model_dir, resolve_model_dir

    paths = _out_paths(args.out, args.ratio)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model_dir(model_dir)
    model.set_attn_implementation("sdpa")  # scores come from the capture hooks, not attention weights
    model.to(device)
    convs = calibration_set(args.samples, seed=args.seed, target_tokens=args.tokens, turns=args.turns,
                            tasks=tuple(args.tasks), source_split=args.source_split)
    samples = [tokenize_conversation(tok, c) for c in convs]
    lengths = [s.num_tokens for s in samples]
    settings = ProfileSettings(
        scorer=args.scorer, alpha=args.alpha, scope=args.scope or "", budget_mode=args.budget_mode,
        retention=args.retention, sink_tokens=args.sink, recent_window=args.window, page_size=args.page_size,
        heads_per_group=args.heads_per_group, grouping=args.grouping, min_split_tokens=args.min_split_tokens,
        notes={"calibration": {
            "tasks": list(args.tasks), "seed": args.seed, "samples": args.samples, "turns": args.turns,
            "target_tokens": args.tokens, "source_split": args.source_split,
            "tokens_mean": round(statistics.mean(lengths), 1), "tokens_min": min(lengths),
            "tokens_max": max(lengths),
        }},
    )
    print(f"profiling {model_dir} on {device}: {len(samples)} conversations, "
          f"{statistics.mean(lengths):.0f} tokens on average, scorer {settings.scorer}, scope {settings.scope}, "
          f"{settings.retention} retention")
    t0 = time.perf_counter()
    scores = collect_scores(model, samples, settings)
    print(f"scored in {time.perf_counter() - t0:.1f}s")
    ident = ModelIdentity.from_config(model_dir)
    for ratio, path in zip(args.ratio, paths):
        prof = profile_from_scores(ident, scores, ratio, settings,
                                   created_by=f"tangram-sgl profile --model {Path(model_dir).name}")
        validate_for_model(prof, model_dir)
        _write(prof, path, not args.no_plot)
    return 0


# --------------------------------------------------------------------------------------------- synth


def add_synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="model directory or config.json (dummy weights are fine)")
    _add_layout_args(p)
    p.add_argument("--seed", type=int, default=0)


def run_synth(args: argparse.Namespace) -> int:
    from tangram_sgl.profiler.synthetic import synthetic_profile

    for ratio, path in zip(args.ratio, _out_paths(args.out, args.ratio)):
        prof = synthetic_profile(args.config, ratio, seed=args.seed, alpha=args.alpha,
                                 heads_per_group=args.heads_per_group, grouping=args.grouping,
                                 page_size=args.page_size, min_split_tokens=args.min_split_tokens)
        validate_for_model(prof, args.config)
        _write(prof, path, not args.no_plot)
    return 0
