"""GPU soak (issue 6): mixed multi-turn load at overload on a tangram server, invariants checked throughout.

The server runs with ``TANGRAM_DEBUG_INVARIANTS=1`` (the pool/tree invariant checker after every cache
operation: a leaked or doubly-owned page fails the operation) and a small ``--max-total-tokens`` so the
load is about twice what fits. For ``--minutes``: replay waves of long-document and short multi-turn
sessions (``tangram-sgl replay``), while a poller samples ``/metrics`` (tangram pages in use, kept bytes)
every few seconds and a disconnector opens streaming requests and drops them mid-generation. At the end
the tree is flushed (``/flush_cache``: the cache logs how many pages are then neither free nor owned) and
one request checks that the server still serves. ``--soft-watchdog-timeout 30`` makes SGLang dump the
scheduler's stacks if one batch runs over 30 s. Before the load, one request sampled with top-p pays FlashInfer's
first-use JIT build of its sampling kernels, timed apart: on a fresh machine that build held the scheduler 87 s
inside the first wave (session 25's dump; the unexplained 92 s stall of session 19). SGLang samples a batch through
FlashInfer only when some row filters (top-k or top-p): a greedy replay row (top-k 1) beside a disconnector's row
(temperature 1) does, the disconnector's row alone does not (multinomial in torch) — session 27's warm-up, a
disconnector-like request, missed the build, which then stalled the first wave 76 s.

Reported: turns served, errors (with examples), client disconnects, invariant violations and tracebacks
in the server log, pages leaked after the final flush, the longest gap between scheduler batches, pages
in use over time (plot), and whether the server still answered at the end.

    python eval/soak.py --model-path DIR --profile P.json --out DIR --minutes 10 -- --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import requests
from results_io import save_figure, summary_row, write_result
from server_proc import TEMPLATES, ServerProcess, gauge, server_args


def poll_metrics(url: str, stop: threading.Event, samples: list[dict], every_s: float, t0: float) -> None:
    while not stop.wait(every_s):
        try:
            text = requests.get(url + "/metrics", timeout=10).text
        except requests.RequestException:
            continue
        pages = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("sglang:tangram_pages_in_use{"))
        samples.append({"t_s": time.time() - t0, "pages_in_use": pages,
                        "kept_bytes": gauge(text, "tangram_kv_kept_bytes"),
                        "running": gauge(text, "num_running_reqs"), "queued": gauge(text, "num_queue_reqs")})


def disconnect_body(model: str, max_tokens: int = 512) -> dict:
    """The disconnector's streamed chat request (SGLang's default sampling: temperature 1)."""
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "tell a long story about the harbour " * 50}]}


def warm_up_sampling(url: str, model: str) -> float:
    """Seconds one short request sampled with top-p took: FlashInfer's sampling kernels built at their first use."""
    t = time.time()
    body = {**disconnect_body(model, 4), "top_p": 0.9}  # a filter, so SGLang samples through FlashInfer
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass
    return time.time() - t


def disconnect_clients(url: str, model: str, stop: threading.Event, counts: dict) -> None:
    """Streaming chat requests dropped after a few chunks (a client going away mid-generation); one that sees
    no chunk within 120 s under overload gives up (also a disconnect, counted apart)."""
    body = disconnect_body(model)
    while not stop.wait(2.0):
        try:
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=(10, 120)) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 5:
                        break
            counts["disconnects"] += 1
        except requests.ReadTimeout:
            counts["gave_up_waiting"] += 1
        except requests.RequestException as e:
            counts["disconnect_errors"] += 1
            counts.setdefault("examples", []).append(str(e)[:200])


STATE = Path("/tmp/tangram_soak")  # the server log and the load so far between --phase start and finish ($OUT is
# emptied before every device command; /tmp lasts as long as the machine)
BATCH_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (?:Prefill|Decode) batch")
FLUSH_LINE = re.compile(r"tangram cache flushed: \d+ of \d+ pages free, (\d+) pages leaked, (\d+) slot-arena entries")


def longest_stall_s(log: str) -> float:
    """The longest gap between two consecutive batch log lines (the scheduler busy in one step, or idle)."""
    times = [datetime.fromisoformat(m.group(1)) for m in map(BATCH_LINE.match, log.splitlines()) if m]
    return max(((b - a).total_seconds() for a, b in pairwise(times)), default=0.0)


def replay_wave(url: str, model: str, tokenizer: str, wave: int, a: argparse.Namespace) -> dict:
    out = a.out / f"soak_wave{wave}.json"
    long_wave = wave % 2 == 0
    cmd = [sys.executable, "-m", "tangram_sgl.cli", "replay", "--endpoint", url + "/v1", "--model", model,
           "--tokenizer", tokenizer, "--max-concurrency", str(a.concurrency), "--session-rate", "inf",
           "--max-tokens", "48", "--ignore-eos", "--output", str(out), "--no-progress", "--seed", str(wave),
           "--workload", "long", "--num-questions", "4", "--doc-text", a.doc_text,
           "--doc-tokens", str(a.long_doc_tokens if long_wave else 512),
           "--num-sessions", str(a.concurrency if long_wave else 2 * a.concurrency)]
    subprocess.run(cmd, check=False, timeout=a.minutes * 60 + 300, cwd=a.out)
    return json.loads(out.read_text())["summary"] if out.exists() else {"errors": -1, "turns": 0, "turns_ok": 0}


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s["t_s"] for s in samples], [s["pages_in_use"] for s in samples], label="tangram pages in use")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("pages")
    ax2 = ax.twinx()
    ax2.plot([s["t_s"] for s in samples], [s["running"] or 0 for s in samples], color="tab:orange", alpha=0.6,
             label="running requests")
    ax2.set_ylabel("running requests")
    ax.set_title("soak: pages in use under overload")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--long-doc-tokens", type=int, default=8192)
    p.add_argument("--doc-text", choices=("essays", "vocab"), default="essays",
                   help="document text (vocab: the tokenizer's own words, for dummy-weight models)")
    p.add_argument("--max-total-tokens", type=int, default=40_000,
                   help="pool size in full-KV tokens: about half the kept KV of a long wave at budget 0.25")
    p.add_argument("--port", type=int, default=30300)
    p.add_argument("--phase", choices=("all", "start", "finish"), default="all",
                   help="start: start the server and load it for --minutes, leaving it running; finish: load the "
                        "server --phase start left for --minutes more, then flush, check and report (a soak longer "
                        "than one device command: the server's own process session outlives the first)")
    p.add_argument("server_extra", nargs="*", help="after --: more launch_server arguments")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ["TANGRAM_DEBUG_INVARIANTS"] = "1"  # inherited by the server's scheduler process
    if a.phase == "finish":  # the server and the load so far, left by --phase start
        data = json.loads((STATE / "state.json").read_text())
        server = ServerProcess(data.pop("server_args"), Path(data.pop("log")), data.pop("port"), pid=data.pop("pid"))
        if not server.alive():
            raise SystemExit(f"the soak's server (pid {server.pid}) is gone: the machine was given back between "
                             f"--phase start and --phase finish")
    else:
        args = server_args(a.model_path, profile=a.profile, chat_template=str(TEMPLATES / "plain-chat.jinja"),
                           extra=["--max-total-tokens", str(a.max_total_tokens), "--decode-log-interval", "10",
                                  "--soft-watchdog-timeout", "30", *a.server_extra])  # a batch over 30 s dumps stacks
        log_dir = STATE if a.phase == "start" else a.out
        STATE.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(args, log_dir / "server_soak.log", a.port).start()
        data = {"args": {k: str(v) for k, v in vars(a).items()}, "t0": time.time(), "waves": [], "samples": [],
                "disconnects": {"disconnects": 0, "gave_up_waiting": 0, "disconnect_errors": 0}}
        try:
            data["ready_s"] = server.wait_ready()
        except Exception:
            server.stop()
            raise
    waves, samples, counts = data["waves"], data["samples"], data["disconnects"]
    model = server.served_model()
    if a.phase != "finish":
        data["sampling_warmup_s"] = warm_up_sampling(server.url, model)
        data["load_log_offset"] = len(server.log.read_text(errors="replace"))  # stalls are counted from here on
    stop = threading.Event()
    threads = [threading.Thread(target=poll_metrics, args=(server.url, stop, samples, 3.0, data["t0"]), daemon=True),
               threading.Thread(target=disconnect_clients, args=(server.url, model, stop, counts), daemon=True)]
    for t in threads:
        t.start()
    load_start = time.time()
    while time.time() < load_start + a.minutes * 60 and server.alive():  # the last wave may run past it
        waves.append(replay_wave(server.url, model, a.model_path, len(waves), a))
    data["load_minutes"] = data.get("load_minutes", 0.0) + (time.time() - load_start) / 60
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if a.phase == "start":  # leave the server running for --phase finish (its own session outlives this command)
        (STATE / "state.json").write_text(json.dumps({**data, "server_args": server.args, "log": str(server.log),
                                                      "port": server.port, "pid": server.pid}))
        shutil.copy(server.log, a.out / "server_soak_start.log")
        print(f"soak: {len(waves)} waves so far, server pid {server.pid} left running for --phase finish")
        return 0
    data["server_alive"] = server.alive()
    if data["server_alive"]:
        data["flush"] = requests.post(server.url + "/flush_cache", timeout=60).status_code
        r = requests.post(server.url + "/generate", json={"text": "still there ?", "sampling_params": {
            "max_new_tokens": 8}}, timeout=120)
        data["after_soak_request"] = r.status_code
    server.stop()
    if server.log.parent != a.out:
        shutil.copy(server.log, a.out / "server_soak.log")
    log = server.log.read_text(errors="replace")
    data["invariant_violations"] = log.count("InvariantViolation")
    data["tracebacks"] = log.count("Traceback (most recent call last)")
    flushed = FLUSH_LINE.findall(log)
    data["leaked_after_flush"] = {"pages": int(flushed[-1][0]), "arena_entries": int(flushed[-1][1])} if flushed else None
    data["longest_stall_s"] = longest_stall_s(log[data["load_log_offset"]:])
    turns = sum(w.get("turns_ok", 0) for w in waves)
    errors = sum(max(w.get("errors", 0), 0) for w in waves)
    plot(samples, a.out / "soak.png")
    lf = data["leaked_after_flush"]
    leaked = -1 if lf is None else lf["pages"] + lf["arena_entries"]  # -1: the flush line is missing
    summary = [
        summary_row("soak: minutes of load", data["load_minutes"], "min", ">= 10", data["load_minutes"] >= 10),
        summary_row("soak: turns served", turns, "turns"),
        summary_row("soak: replay errors", errors, "", "0", errors == 0),
        summary_row("soak: client disconnects mid-generation", counts["disconnects"] + counts["gave_up_waiting"], ""),
        summary_row("soak: pages leaked after the final flush", leaked, "pages", "0", leaked == 0),
        summary_row("soak: longest gap between scheduler batches under load", data["longest_stall_s"], "s"),
        summary_row("soak: first request sampled with top-p (FlashInfer's sampling JIT on a fresh machine)",
                    data["sampling_warmup_s"], "s"),
        summary_row("soak: invariant violations + server tracebacks", data["invariant_violations"] + data["tracebacks"],
                    "", "0", data["invariant_violations"] + data["tracebacks"] == 0),
        summary_row("soak: server serves after the soak", float(data.get("after_soak_request") == 200), "", "1",
                    data.get("after_soak_request") == 200),
    ]
    path = write_result("soak", data, summary, directory=a.out)
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
