"""Multi-turn serving throughput: stock SGLang vs tangram_sgl on the same model and load (issue 5, GPU).

For every server: start it once, then for every (context class, concurrency) replay long shared-context
sessions (a document of the class's length + question turns, ``tangram-sgl replay --workload long``) with the
history resent every turn, each replay from an empty prefix cache, then read what the server holds. Reported
per run: requests/s, output tokens/s, TTFT/TPOT percentiles, cache-hit ratio, errors, the server's
``max_total_num_tokens`` and GPU memory, and the sessions its KV memory holds at once (plot: throughput and
TTFT per server, ``<name>.png``; a context measured at several concurrencies also gets TTFT and throughput vs
load, ``<name>_load.png``):

- stock: ``max_total_num_tokens / tokens per session`` (full KV);
- tangram: the same, divided by the kept fraction the ``sglang:tangram_kv_kept_bytes / kv_full_bytes``
  gauges report after the run (pages actually in use over the same tokens as full KV).

Servers: ``stock:<attention backend>`` or ``tangram[@<extend kernel>]:<profile.json>`` (label: the extend
kernel and the profile stem).
``--duration S`` makes every replay a fixed window of S seconds (turns in flight at its end are cut, not
errors), so an overloaded server is measured over the same time as the others instead of timing out.
Each server start costs minutes, so on a device with a 10-minute command limit run one server per call
and merge the result files afterwards (``--merge``: same workload required; the summary is recomputed).

    python eval/bench_serving.py --model-path DIR --out DIR --servers stock:flashinfer tangram:P025.json \
        --contexts short=4096@8,32,128 mid=16384@64 long=49152 --concurrency 24 -- --load-format dummy
    python eval/bench_serving.py --merge A.json B.json --name bench_serving_long --out eval/results
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import requests
from results_io import save_figure, summary_row, write_result
from server_proc import (
    TEMPLATES,
    ServerProcess,
    gauge,
    graph_batches,
    parse_server_spec,
    prefill_chunk_rates,
    server_args,
)
from server_trace import TraceTrigger, summarize_trace
from tangram_sgl.patches.server_args import EXTEND_KERNELS

from tangram_sgl.profile import load_profile


def throughput_target(target_ratio: float | None, context: str) -> float | None:
    """Issue 5's targets: >= 3x stock at long contexts and mean budget 0.25; >= 0.95x (no tax) at 1.0."""
    if target_ratio == 1.0:
        return 0.95
    if target_ratio == 0.25 and context == "long":
        return 3.0
    return None


def sessions_target(target_ratio: float | None, context: str) -> float | None:
    """Issue 5's target: >= 3.5x stock's sessions in the same KV memory at long contexts and mean budget 0.25."""
    return 3.5 if target_ratio == 0.25 and context == "long" else None


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return int(out.split()[0])


def replay(url: str, model: str, tokenizer: str, run: dict, a: argparse.Namespace, out: Path,
           questions: int | None = None) -> dict:
    """``tangram-sgl replay`` of ``run``'s context and concurrency (sessions: the run's, ``--sessions``, else as
    many as the concurrency; ``questions``: else ``--questions``) against ``url``; its result document."""
    cmd = [sys.executable, "-m", "tangram_sgl.cli", "replay", "--workload", "long", "--doc-tokens",
           str(run["doc_tokens"]), "--num-sessions",
           str(run.get("sessions") or a.sessions or run["concurrency"]), "--num-questions",
           str(questions or a.questions), "--endpoint", url + "/v1", "--model", model, "--tokenizer", tokenizer,
           "--max-concurrency", str(run["concurrency"]),
           "--session-rate", "inf", "--max-tokens", str(a.max_tokens), "--output", str(out), "--no-progress",
           "--doc-text", a.doc_text]
    if a.ignore_eos:
        cmd.append("--ignore-eos")
    if a.duration:
        cmd += ["--duration", str(a.duration)]
    subprocess.run(cmd, check=False, timeout=a.replay_timeout, cwd=out.parent)
    return json.loads(out.read_text())


def parse_context(entry: str, default_loads: Sequence[int]) -> tuple[str, int, list[int]]:
    """(name, document tokens, concurrencies) of a ``--contexts`` entry ``name=tokens[@c1,c2,..]``; an entry
    without its own concurrencies runs at ``default_loads`` (``--concurrency``)."""
    spec, _, loads = entry.partition("@")
    name, _, tokens = spec.partition("=")
    return name, int(tokens), [int(x) for x in loads.split(",")] if loads else list(default_loads)


def load_plan(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(context name, document tokens, concurrency) of every replay one server start runs, in order."""
    plan = []
    for c in a.contexts:
        name, tokens, loads = parse_context(c, a.concurrency)
        plan += [(name, tokens, n) for n in loads]
    return plan


def flush_cache(url: str, timeout_s: float = 90.0) -> None:
    """Empty the server's prefix cache; SGLang refuses while requests (a cut window's last turns) still run."""
    deadline = time.time() + timeout_s
    while requests.post(url + "/flush_cache", timeout=60).status_code != 200:
        if time.time() > deadline:
            raise TimeoutError(f"/flush_cache refused for {timeout_s:.0f} s")
        time.sleep(2)


def traced(url: str, label: str, run: dict, a: argparse.Namespace) -> TraceTrigger | None:
    """With ``--trace-steps``, for a run ``--trace-at`` names: a started :class:`TraceTrigger` (profiling
    starts ``--trace-delay`` seconds after 3/4 of the run's concurrency first runs)."""
    if not a.trace_steps or f"{run['context']}@{run['concurrency']}" not in a.trace_at:
        return None
    trigger = TraceTrigger(url, a.out / "traces", max(1, run["concurrency"] * 3 // 4), a.trace_steps,
                           f"{label}_{run['context']}_c{run['concurrency']}", a.replay_timeout, a.trace_delay)
    trigger.start()
    return trigger


def trace_summary(trigger: TraceTrigger, a: argparse.Namespace, wait_s: float = 60.0) -> dict:
    """The summary of ``trigger``'s trace (SGLang writes it some seconds after the last traced step), or why
    there is none."""
    trigger.stop()
    trigger.join(10)
    if trigger.started_at is None:
        return {"error": trigger.error or "the profile was not started"}
    deadline = time.time() + wait_s
    while not (files := sorted(trigger.output_dir.glob(f"{trigger.profile_id}*.trace.json*"))):
        if time.time() > deadline:
            return {"error": f"no trace file in {trigger.output_dir} {wait_s:.0f} s after the replay"}
        time.sleep(2)
    return {"steps": a.trace_steps, **summarize_trace(files[0])}


def run_server(spec: str, plan: list[tuple[str, int, int]], a: argparse.Namespace) -> list[dict]:
    """One server start for ``spec``, an unmeasured warm-up replay (first-request compilation and allocation out
    of the measured windows), then one replay per (context, concurrency) of ``plan``, each from an empty prefix
    cache; one run dict per replay (its share of the server log parsed for prefill and decode lines)."""
    label, profile, extra = parse_server_spec(spec)
    args = server_args(a.model_path, profile=profile, extra=extra + list(a.server_extra),
                       chat_template=str(TEMPLATES / "plain-chat.jinja"))
    server = ServerProcess(args, a.out / f"server_bench_{label}.log", a.port)
    target = load_profile(profile).target_ratio if profile else None
    runs = [{"server": spec, "label": label, "context": ctx, "doc_tokens": n, "concurrency": c, "target_ratio": target}
            for ctx, n, c in plan]
    spans = []
    with server:
        try:
            ready_s = server.wait_ready()
        except Exception as e:  # noqa: BLE001 (recorded for every replay it prevented)
            for run in runs:
                run["error"] = f"{type(e).__name__}: {e}"
            ready_s = None
        if ready_s is not None and a.warmup:
            warm = {"doc_tokens": 1024, "concurrency": 2, "sessions": 2}
            try:
                doc = replay(server.url, server.served_model(), a.model_path, warm, a,
                             a.out / f"replay_{label}_warmup.json", questions=1)
                if not doc["summary"]["turns_ok"]:
                    raise TimeoutError("no warm-up turn finished (in the replay window, if one was set)")
            except Exception as e:  # noqa: BLE001 (the measured replays still run; each run says it)
                server.dump_stacks()
                for run in runs:
                    run["warmup_error"] = f"{type(e).__name__}: {e}"
        for run in runs if ready_s is not None else []:
            run["ready_s"] = ready_s
            since = len(server.log.read_text(errors="replace"))
            try:
                flush_cache(server.url)
                trigger = traced(server.url, label, run, a)
                t0 = time.time()
                out = a.out / f"replay_{label}_{run['context']}_c{run['concurrency']}.json"
                doc = replay(server.url, server.served_model(), a.model_path, run, a, out)
                run["replay_wall_s"] = time.time() - t0
                if trigger is not None:
                    run["trace"] = trace_summary(trigger, a)
                run["summary"] = doc["summary"]
                metrics = requests.get(server.url + "/metrics", timeout=30).text
                run["gpu_memory_used_mib"] = gpu_memory_used_mib()
                kept, full = gauge(metrics, "tangram_kv_kept_bytes"), gauge(metrics, "tangram_kv_full_bytes")
                run["kept_fraction"] = kept / full if kept is not None and full else (None if profile else 1.0)
                run["host_built_decode_steps"] = gauge(metrics, "tangram_host_built_decode_steps")
            except Exception as e:  # noqa: BLE001 (recorded; the other replays still go)
                server.dump_stacks()
                run["error"] = f"{type(e).__name__}: {e}"
            spans.append((since, len(server.log.read_text(errors="replace"))))
    log = server.log.read_text(errors="replace")
    m = re.search(r"max_total_num_tokens=(\d+)", log)
    for run, (since, end) in zip(runs, spans):
        run["max_total_num_tokens"] = int(m.group(1)) if m else None
        for kind in ("decode", "prefill"):
            run[f"{kind}_batches_logged"], run[f"{kind}_batches_in_graphs"] = graph_batches(
                log[since:end].splitlines(), kind.capitalize())
        run["prefill_chunk_tok_s"] = prefill_chunk_rates(log[:end], since)
        s = run.get("summary")
        if s and run["max_total_num_tokens"] and run.get("kept_fraction"):
            per_session = (s["prompt_tokens"] / max(s["turns_ok"], 1) + a.max_tokens)  # ~ the last turn's length
            run["sessions_in_memory"] = run["max_total_num_tokens"] / (per_session * run["kept_fraction"])
    return runs


WORKLOAD_ARGS = ("sessions", "questions", "concurrency", "max_tokens", "ignore_eos", "doc_text", "model_path",
                 "server_extra")  # and the contexts: each name the files share with one definition (_merged_contexts)


def _context_specs(doc: dict) -> list[str]:
    """A result file's ``--contexts`` entries (a run's file records the list as its ``str``, like every argument)."""
    value = doc["data"]["args"]["contexts"]
    return ast.literal_eval(value) if isinstance(value, str) else list(value)


def _merged_contexts(docs: list[dict]) -> list[str] | None:
    """Every context of the files as ``name=tokens@loads`` (the concurrencies any file measured it at, an entry
    without its own at the file's ``--concurrency``), in first-seen order; None if one name has two sizes."""
    sizes: dict[str, int] = {}
    loads: dict[str, set[int]] = {}
    for d in docs:
        default = [int(x) for x in str(_workload_arg(d, "concurrency")).split(",")]
        for c in _context_specs(d):
            name, tokens, ran = parse_context(c, default)
            if sizes.setdefault(name, tokens) != tokens:
                return None
            loads.setdefault(name, set()).update(ran)
    return [f"{name}={tokens}@{','.join(map(str, sorted(loads[name])))}" for name, tokens in sizes.items()]


def _window(doc: dict) -> float | None:
    """The replay window of a result file, None for unbounded; a file whose replays all finished every turn
    inside their window counts as unbounded (a longer or no window would have measured the same)."""
    runs = doc["data"]["runs"]
    duration = doc["data"]["args"].get("duration")
    finished = all("summary" in r and not r["summary"].get("turns_cut") for r in runs)
    return None if duration in (None, "None") or finished else float(duration)


def _workload_arg(doc: dict, key: str) -> object:
    """A recorded argument, ``concurrency`` as written before and after it took a list (``"24"``, ``"[24]"``)."""
    value = doc["data"]["args"].get(key)
    return str(value).strip("[]") if key == "concurrency" and value is not None else value


def merged_runs(paths: list[Path]) -> tuple[list[dict], dict, dict]:
    """(runs, workload args, {versions, device}) of several result files of this script, which must share
    one workload (some files may measure only some of its contexts), replay window (:func:`_window`) and device,
    and hold no traced run (``--trace-steps``) (else ValueError); each run keeps the command
    and date it was measured with. A later file's run of the same server label, context and concurrency
    replaces an earlier one (a re-measurement, e.g. after a change), noting the date it supersedes."""
    docs = [json.loads(p.read_text()) for p in paths]
    traced_runs = [f"{p.name}: {r['label']}" for p, d in zip(paths, docs) for r in d["data"]["runs"] if "trace" in r]
    if traced_runs:
        raise ValueError(f"traced runs pay the profiler's overhead and are not merged: {', '.join(traced_runs)}")
    first = docs[0]
    window_of = [_window(d) for d in docs]
    windows = {w for w in window_of if w is not None}
    longest_finished = max((r["summary"]["wall_s"] for d, w in zip(docs, window_of) if w is None
                            for r in d["data"]["runs"]), default=0.0)
    if len(windows) > 1 or (windows and longest_finished > min(windows)):
        given = ", ".join(str(d["data"]["args"].get("duration")) for d in docs)
        raise ValueError(f"the files' replay windows differ ({given} s) and the shorter ones cut turns or "
                         f"outlast a window")
    contexts = _merged_contexts(docs)
    for path, doc in zip(paths[1:], docs[1:]):
        diff = [k for k in WORKLOAD_ARGS if _workload_arg(doc, k) != _workload_arg(first, k)]
        if contexts is None:
            diff.append("contexts")
        if doc["device"] != first["device"]:
            diff.append("device")
        if diff:
            raise ValueError(f"{path} ran another workload than {paths[0]} ({', '.join(diff)} differ)")
    runs: dict[tuple, dict] = {}
    for p, d in zip(paths, docs):
        for r in d["data"]["runs"]:  # a merged file's runs keep the file they were measured in
            run = {"measured_by": {"file": p.name, "command": d["command"], "date": d["date"]}, **r}
            if "concurrency" not in run:  # files from before runs named theirs held one concurrency
                run["concurrency"] = int(_workload_arg(d, "concurrency"))
            log = p.parent / f"server_bench_{r['label']}_{r['context']}.log"  # beside its file, as they were named
            if "prefill_chunk_tok_s" not in run and log.exists():
                run["prefill_chunk_tok_s"] = prefill_chunk_rates(log.read_text(errors="replace"))
            key = (run["label"], run["context"], run["concurrency"])
            if key in runs:
                run["supersedes"] = runs[key]["measured_by"]["date"]
            runs[key] = run
    args = {**first["data"]["args"], "contexts": contexts}
    return list(runs.values()), args, {"versions": first["versions"], "device": first["device"]}


def load_names(runs: list[dict]) -> dict[tuple[str, int], str]:
    """Name of every (context, concurrency) in ``runs``: the context, plus ``x<concurrency>`` for contexts
    measured at several loads."""
    loads = list(dict.fromkeys((r["context"], r["concurrency"]) for r in runs))
    swept = {ctx for ctx, _ in loads if sum(c == ctx for c, _ in loads) > 1}
    return {(ctx, n): f"{ctx} x{n}" if ctx in swept else ctx for ctx, n in loads}


def short_label(run: dict) -> str:
    """``stock flashinfer`` / ``tangram r0.25 (triton)`` for plots: tangram runs name their extend kernel, the
    one ``tangram@<kernel>:`` gave or else the label's (runs recorded before labels named it ran Triton)."""
    kind, _, arg = run["server"].partition(":")
    if kind in ("stock", "stock-nooverlap"):
        return f"{kind} {arg}"
    ratio = run.get("target_ratio")
    name = f"tangram r{ratio:g}" if ratio is not None else run["label"]
    kernel = kind.partition("@")[2] or next((k for k in EXTEND_KERNELS if run["label"].startswith(f"tangram_{k}_")),
                                            "triton")
    label = run["label"]
    bcg = re.search(r"_bcg(\d*)_", label)  # bcg<N>: graphs for steps of at most N tokens
    graphs = "" if bcg is None else f", prefill graphs ≤ {bcg[1]} tokens" if bcg[1] else ", prefill graphs"
    decode = ", balanced decode" * ("_bal_" in label)
    return f"{name} ({kernel}{decode}{graphs}{', overlap' * ('_ov_' in label)})"


def plot(runs: list[dict], path: Path) -> None:
    """Output tokens/s and TTFT p50/p90 of every run that finished, one bar group per server and context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "summary" in r]
    names = load_names(done)
    labels = [f"{short_label(r).replace(' ', chr(10), 1).replace(' (', chr(10) + '(')}\n"
              f"{names[r['context'], r['concurrency']]}" for r in done]  # server kind, budget, kernel: own lines
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(11.0, 1.5 * len(done)), 4.4))
    a1.bar(labels, [r["summary"]["output_tokens_per_s"] for r in done], color="tab:blue")
    a1.set_ylabel("output tokens/s")
    a1.set_title("throughput")
    x = range(len(done))
    ttft = [r["summary"].get("ttft_s") or {} for r in done]
    a2.bar([i - 0.2 for i in x], [t.get("p50", 0) for t in ttft], width=0.4, label="p50")
    a2.bar([i + 0.2 for i in x], [t.get("p90", 0) for t in ttft], width=0.4, label="p90")
    a2.set_xticks(list(x), labels)
    a2.set_ylabel("TTFT (s)")
    a2.set_title("time to first token")
    a2.legend()
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=7)
    save_figure(fig, path)


def plot_load(runs: list[dict], path: Path) -> None:
    """TTFT p50 / p90 and output tokens/s vs concurrent sessions, one line per server, a panel pair per swept
    context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if "summary" in r]
    swept = [ctx for ctx in dict.fromkeys(r["context"] for r in done)
             if len({r["concurrency"] for r in done if r["context"] == ctx}) > 1]
    fig, axes = plt.subplots(len(swept), 2, figsize=(10, 3.6 * len(swept)), squeeze=False)
    for (a1, a2), ctx in zip(axes, swept):
        for i, server in enumerate(dict.fromkeys(r["server"] for r in done if r["context"] == ctx)):
            mine = sorted((r for r in done if r["context"] == ctx and r["server"] == server),
                          key=lambda r: r["concurrency"])
            x = [r["concurrency"] for r in mine]
            color, label = f"C{i}", short_label(mine[0])
            ttft = [r["summary"].get("ttft_s") or {} for r in mine]  # None: no turn finished in the window
            a1.plot(x, [t.get("p50", float("nan")) for t in ttft], "o-", color=color, label=f"{label} p50")
            a1.plot(x, [t.get("p90", float("nan")) for t in ttft], "o--", color=color, label=f"{label} p90")
            a2.plot(x, [r["summary"]["output_tokens_per_s"] for r in mine], "o-", color=color, label=label)
        shown = [y for line in a1.get_lines() for y in line.get_ydata() if y > 0]  # NaN compares False
        a1.set(xscale="log", yscale="log" if shown else "linear", xlabel="concurrent sessions", ylabel="TTFT (s)",
               title=f"{ctx} ({mine[0]['doc_tokens']}-token documents): time to first token")
        a2.set(xscale="log", xlabel="concurrent sessions", ylabel="output tokens/s", title=f"{ctx}: throughput")
        for ax in (a1, a2):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--servers", nargs="+", help="stock:<attention backend> | tangram:<profile>")
    p.add_argument("--merge", nargs="+", type=Path, help="result files of earlier runs to combine (no servers)")
    p.add_argument("--contexts", nargs="+", default=["short=4096", "mid=16384", "long=49152"],
                   help="name=document tokens[@concurrency,..] (default concurrency: --concurrency)")
    p.add_argument("--sessions", type=int, help="sessions per replay (default: as many as its concurrency)")
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32],
                   help="concurrent sessions; several values: one replay each (a load sweep, TTFT vs load)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--doc-text", choices=("essays", "vocab"), default="essays",
                   help="document text (vocab: the tokenizer's own words, for dummy-weight models)")
    p.add_argument("--duration", type=float, help="seconds of load per replay (a fixed window; default: all turns)")
    p.add_argument("--replay-timeout", type=float, default=480)
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unmeasured warm-up replay (2 sessions, 1k documents) after each server start")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="profile this many scheduler steps of the --trace-at replay through SGLang's /start_profile "
                        "(GPU kernel time per kernel name in the result; the run's throughput is then not merged)")
    p.add_argument("--trace-at", nargs="+", default=["short@8"],
                   help="CONTEXT@CONCURRENCY of each replay --trace-steps profiles")
    p.add_argument("--trace-delay", type=float, default=0.0,
                   help="seconds between the traced replay reaching 3/4 of its concurrency and the profile's start")
    p.add_argument("--port", type=int, default=30200)
    p.add_argument("--name", default="bench_serving")
    p.add_argument("server_extra", nargs="*", help="after --: more launch_server arguments for every server")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    measured_on = None
    if a.merge:
        runs, run_args, measured_on = merged_runs(a.merge)
        run_args["merged_from"] = list(dict.fromkeys(r["measured_by"]["file"] for r in runs))
    elif a.servers and a.model_path:
        run_args = {k: str(v) for k, v in vars(a).items()}
        runs = [run for spec in a.servers for run in run_server(spec, load_plan(a), a)]
    else:
        p.error("give --model-path and --servers, or --merge")
    summary = []
    for (ctx, conc), name in load_names(runs).items():
        mine = [r for r in runs if (r["context"], r["concurrency"]) == (ctx, conc) and "summary" in r]
        base = next((r for r in mine if r["server"].partition(":")[0] == "stock"), None)
        for r in mine:
            tput = r["summary"]["output_tokens_per_s"]
            summary.append(summary_row(f"{r['label']} {name}: output tokens/s", round(tput, 1), "tok/s"))
            later = r["summary"].get("later_turns")
            for key, what in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
                if later and later[key]:
                    summary.append(summary_row(f"{r['label']} {name}: later turns' {what} p50 ({later['turns']} turns)",
                                               round(later[key]["p50"] * 1000, 1), "ms"))
            if "gpu_busy_us" in r.get("trace", {}):
                t = r["trace"]
                summary.append(summary_row(f"{r['label']} {name}: traced, GPU busy per step ({t['steps']} steps; "
                                           f"tangram kernels {t['tangram_kernel_us'] / t['kernel_us']:.0%} of kernel "
                                           f"time)", round(t["gpu_busy_us"] / t["steps"] / 1000, 3), "ms"))
            if r.get("prefill_chunk_tok_s"):
                rates = r["prefill_chunk_tok_s"]
                summary.append(summary_row(
                    f"{r['label']} {name}: prefill tok/s of whole chunks, median (min {min(rates):.0f}, max "
                    f"{max(rates):.0f}, {len(rates)} chunks)", round(statistics.median(rates)), "tok/s"))
            if base is not None and r is not base:
                ratio = tput / base["summary"]["output_tokens_per_s"]
                target = throughput_target(r.get("target_ratio"), ctx)
                summary.append(summary_row(f"{r['label']} {name}: throughput vs {base['label']}", round(ratio, 2),
                                           "x", f">= {target}" if target else "report",
                                           ratio >= target if target else None))
                if r.get("sessions_in_memory") and base.get("sessions_in_memory"):
                    ratio = r["sessions_in_memory"] / base["sessions_in_memory"]
                    target = sessions_target(r.get("target_ratio"), ctx)
                    summary.append(summary_row(
                        f"{r['label']} {name}: sessions the KV pool holds vs {base['label']} (pool tokens / measured "
                        f"kept fraction per session)", round(ratio, 2), "x", f">= {target}" if target else "report",
                        ratio >= target if target else None))
    path = write_result(a.name, {"runs": runs, "args": run_args}, summary, directory=a.out, measured_on=measured_on)
    plot(runs, path.with_suffix(".png"))
    if any(len(n.split()) > 1 for n in load_names(runs).values()):
        plot_load(runs, path.with_name(path.stem + "_load.png"))
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
