"""The GPU eval scripts' host-side logic, testable without a GPU: attaching to and stopping a server process
left running by an earlier command, the soak's log figures, merging one-server bench results, the scheduler's
py-spy profile summary, the README's generated tables."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EVAL = Path(__file__).resolve().parent.parent / "eval"
sys.path.insert(0, str(EVAL))

import accuracy_server
import bench_serving
import report
import scheduler_profile
import soak
import trace_steps
from server_proc import ServerProcess


def test_server_left_running_is_attached_by_pid_and_stopped(tmp_path):
    """What ``soak.py --phase finish`` does with the server ``--phase start`` left in its own session."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        attached = ServerProcess([], tmp_path / "log", 0, pid=proc.pid)
        assert attached.alive()
        attached.stop()
        proc.wait(timeout=10)  # reap the zombie this test's process owns
        assert not attached.alive()
    finally:
        proc.kill()


def test_a_server_is_not_started_on_a_port_something_already_serves(tmp_path):
    """A server left by a cut-off run would answer the new run's health checks and serve its load."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = ServerProcess([], tmp_path / "log", busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="already in use"):
            server.start()
        assert server.proc is None and not (tmp_path / "log").exists()


def test_sigterm_stops_the_server_a_with_block_started(tmp_path, monkeypatch):
    """``timeout`` ends a driver with SIGTERM: the server, in its own session, must go with it."""
    def start(self):
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.pid = self.proc.pid
        return self

    monkeypatch.setattr(ServerProcess, "start", start)
    before = signal.getsignal(signal.SIGTERM)
    server = ServerProcess([], tmp_path / "log", 0)
    with pytest.raises(SystemExit), server:
        assert server.alive()
        os.kill(os.getpid(), signal.SIGTERM)
        server.proc.wait(timeout=10)  # interrupted by the handler's SystemExit
    assert not server.alive()
    assert signal.getsignal(signal.SIGTERM) is before


def test_soak_log_figures():
    lines = ["[2026-12-02 20:48:31] Prefill batch, #new-seq: 1, #new-token: 1120",
             "[2026-12-02 20:48:40] INFO:     127.0.0.1 - GET /metrics",
             "[2026-12-02 20:50:00] Decode batch, #running-req: 15",
             "[2026-12-02 20:50:01] Decode batch, #running-req: 15",
             ("[2026-12-02 20:52:57] tangram cache flushed: 99 of 100 pages free, 1 pages leaked, 0 slot-arena "
              "entries leaked")]
    log = "\n".join(lines)
    assert soak.longest_stall_s(log) == 89.0
    assert soak.FLUSH_LINE.findall(log) == [("1", "0")]


def test_soak_sampling_warm_up_filters_so_flashinfer_samples_it(monkeypatch):
    """SGLang samples a batch through FlashInfer (whose kernels JIT-build at first use) only when a row filters with
    top-k or top-p; an unfiltered temperature-1 request is sampled in torch and warms nothing."""
    sent = []

    class Streamed:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def raise_for_status(self):
            pass

        def iter_lines(self):
            return iter(())

    monkeypatch.setattr(soak.requests, "post", lambda url, json, **kw: sent.append(json) or Streamed())
    soak.warm_up_sampling("http://server", "m")
    (body,) = sent
    assert body.get("temperature", 1.0) > 0 and (body.get("top_p", 1.0) < 1.0 or body.get("top_k", -1) > 1)


def _bench_file(path: Path, sessions: str, device: str = "NVIDIA H200", duration: str = "240",
                cut: int = 0, wall_s: float = 240.0, date: str = "2026-12-02", label: str = "stock_flashinfer",
                contexts: tuple[str, ...] = ("long=49152",)) -> Path:
    args = {k: "x" for k in bench_serving.WORKLOAD_ARGS} | {"sessions": sessions, "duration": duration,
                                                           "concurrency": "24", "contexts": str(list(contexts))}
    run = {"server": "stock:flashinfer", "label": label, "context": "long", "doc_tokens": 49152,
           "summary": {"output_tokens_per_s": 100.0, "ttft_s": None, "turns_cut": cut, "wall_s": wall_s}}
    path.write_text(json.dumps({"name": path.stem, "command": "c", "versions": {"sglang": "0.5.17"}, "device": device,
                                "date": date, "data": {"runs": [run], "args": args}}))
    return path


def test_bench_results_merge_only_with_the_same_workload_and_device(tmp_path):
    a, b = _bench_file(tmp_path / "a.json", "24"), _bench_file(tmp_path / "b.json", "24", label="other")
    runs, _, measured_on = bench_serving.merged_runs([a, b])
    assert len(runs) == 2 and runs[1]["measured_by"]["file"] == "b.json" and measured_on["device"] == "NVIDIA H200"
    again = _bench_file(tmp_path / "a2.json", "24", date="2026-12-03")  # a re-measurement of a's run replaces it
    runs = bench_serving.merged_runs([a, b, again])[0]
    assert [(r["label"], r["measured_by"]["file"], r.get("supersedes")) for r in runs] == [
        ("stock_flashinfer", "a2.json", "2026-12-02"), ("other", "b.json", None)]
    with pytest.raises(ValueError, match="sessions differ"):
        bench_serving.merged_runs([a, _bench_file(tmp_path / "c.json", "16")])
    listed = _bench_file(tmp_path / "l.json", "24", label="listed")  # --concurrency recorded as a list since session 13
    doc = json.loads(listed.read_text())
    doc["data"]["args"]["concurrency"] = "[24]"
    listed.write_text(json.dumps(doc))
    assert len(bench_serving.merged_runs([a, listed])[0]) == 2
    doc["data"]["args"]["concurrency"] = "[8, 24]"
    listed.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="concurrency differ"):
        bench_serving.merged_runs([a, listed])
    with pytest.raises(ValueError, match="device differ"):
        bench_serving.merged_runs([a, _bench_file(tmp_path / "d.json", "24", device="NVIDIA H100")])
    # a file measuring only some of the contexts merges (the workload keeps them all, each at every load a file ran
    # it at); another definition does not. Files record the contexts as the str of the list, as runs write them
    both = _bench_file(tmp_path / "e.json", "24", contexts=("short=4096@128", "long=49152"))
    assert bench_serving.merged_runs([both, a])[1]["contexts"] == ["short=4096@128", "long=49152@24"]
    some = _bench_file(tmp_path / "s.json", "24", contexts=("short=4096@8,32",))
    assert bench_serving.merged_runs([both, some])[1]["contexts"] == ["short=4096@8,32,128", "long=49152@24"]
    with pytest.raises(ValueError, match="contexts differ"):
        bench_serving.merged_runs([a, _bench_file(tmp_path / "f.json", "24", contexts=("long=65536",))])


def test_bench_load_sweep_is_summarised_and_plotted_per_concurrency(tmp_path):
    """Several concurrencies of one context: each load compares with stock at the same load, and a TTFT-vs-load
    plot is written; runs of files from before per-run concurrency take their file's."""
    old = json.loads(_bench_file(tmp_path / "old.json", "24").read_text())
    assert bench_serving.merged_runs([tmp_path / "old.json"])[0][0]["concurrency"] == 24
    runs = []
    for server, label, tput in (("stock:flashinfer", "stock_flashinfer", 10.0), ("tangram:p.json", "tangram_p", 30.0)):
        for conc in (8, 32):
            runs.append({"server": server, "label": label, "context": "short", "doc_tokens": 4096, "concurrency": conc,
                         "target_ratio": None if server.startswith("stock") else 0.25,
                         "summary": {"output_tokens_per_s": tput * conc, "turns_cut": 0, "wall_s": 60.0,
                                     "ttft_s": {"p50": 0.1 * conc, "p90": 0.2 * conc}}})
    runs[1]["summary"]["later_turns"] = {"turns": 128, "ttft_s": {"p50": 0.0625}, "tpot_s": {"p50": 0.0082}}
    old["data"] = {"runs": runs, "args": old["data"]["args"] | {"concurrency": "[8, 32]"}}
    (tmp_path / "sweep.json").write_text(json.dumps(old))
    bench_serving.main(["--merge", str(tmp_path / "sweep.json"), "--name", "m", "--out", str(tmp_path / "o")])
    rows = {r["metric"]: r["value"] for r in json.loads((tmp_path / "o" / "m.json").read_text())["summary"]}
    assert rows["tangram_p short x8: throughput vs stock_flashinfer"] == 3.0
    assert rows["stock_flashinfer short x32: output tokens/s"] == 320.0
    assert rows["stock_flashinfer short x32: later turns' TTFT p50 (128 turns)"] == 62.5
    assert rows["stock_flashinfer short x32: later turns' TPOT p50 (128 turns)"] == 8.2
    assert not any("later turns" in m for m in rows if "x8" in m)  # files from before the figure: no row
    assert (tmp_path / "o" / "m_load.png").stat().st_size > 10_000


class FakeServer:
    """bench_serving's view of a started server (what ServerProcess gives it), without a process."""

    url = "http://fake"

    def __init__(self, args, log, port):
        self.log = log
        log.write_text("chunked_prefill_size=8192 max_total_num_tokens=100000\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_ready(self):
        return 1.5

    def served_model(self):
        return "m"

    def dump_stacks(self):
        with self.log.open("a") as f:
            f.write("==== py-spy dump ====\n")
        return True


def test_bench_server_warms_up_then_replays_every_load_from_a_flushed_cache(tmp_path, monkeypatch):
    """One server start per spec: an unmeasured warm-up, then per (context, concurrency) a flush and a replay,
    each run parsing only its own share of the server log."""
    calls = []
    def fake_replay(url, model, tokenizer, run, a, out, questions=None):
        calls.append(("replay", run["doc_tokens"], run["concurrency"], run.get("sessions"), questions))
        with (a.out / "server_bench_stock_flashinfer.log").open("a") as log:
            log.write("Decode batch, #running-req: 2, cuda graph: True\n" * run["concurrency"])
            log.write("Prefill batch, #new-token: 23, cuda graph: True\n"
                      "Prefill batch, #new-token: 8192, cuda graph: False\n")
        return {"summary": {"prompt_tokens": 1000, "turns_ok": 2, "output_tokens_per_s": 5.0,
                            "ttft_s": {"p50": 0.1, "p90": 0.2}}}

    monkeypatch.setattr(bench_serving, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serving, "replay", fake_replay)
    monkeypatch.setattr(bench_serving, "flush_cache", lambda url: calls.append(("flush",)))
    monkeypatch.setattr(bench_serving, "gpu_memory_used_mib", lambda: None)
    monkeypatch.setattr(bench_serving.requests, "get", lambda url, timeout: type("R", (), {"text": ""}))
    bench_serving.main(["--model-path", "m", "--servers", "stock:flashinfer", "--contexts", "short=4096@2,8",
                        "mid=16384", "--concurrency", "3", "--out", str(tmp_path), "--name", "b"])
    assert calls == [("replay", 1024, 2, 2, 1), ("flush",), ("replay", 4096, 2, None, None), ("flush",),
                     ("replay", 4096, 8, None, None), ("flush",), ("replay", 16384, 3, None, None)]
    runs = json.loads((tmp_path / "b.json").read_text())["data"]["runs"]
    assert [(r["context"], r["concurrency"], r["decode_batches_logged"]) for r in runs] == [
        ("short", 2, 2), ("short", 8, 8), ("mid", 3, 3)]
    assert all((r["prefill_batches_logged"], r["prefill_batches_in_graphs"]) == (2, 1) for r in runs)
    assert all(r["max_total_num_tokens"] == 100000 and "error" not in r for r in runs)



def test_a_stuck_server_is_reported_with_its_stacks(tmp_path, monkeypatch):
    """A warm-up that finishes no turn, and a replay whose cache flush times out (a scheduler stuck in one long
    call, session 15), are each an error of the runs, with the server's Python stacks in its log."""
    monkeypatch.setattr(bench_serving, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serving, "replay", lambda *a, **k: {"summary": {"turns_ok": 0}})

    def stuck(url):
        raise TimeoutError("read timed out")

    monkeypatch.setattr(bench_serving, "flush_cache", stuck)
    bench_serving.main(["--model-path", "m", "--servers", "stock:flashinfer", "--contexts", "short=4096@8",
                        "--out", str(tmp_path), "--name", "s"])
    run = json.loads((tmp_path / "s.json").read_text())["data"]["runs"][0]
    assert run["warmup_error"].startswith("TimeoutError: no warm-up turn finished")
    assert run["error"] == "TimeoutError: read timed out"
    assert (tmp_path / "server_bench_stock_flashinfer.log").read_text().count("py-spy dump") == 2


def test_server_stacks_are_dumped_into_its_log(tmp_path, monkeypatch):
    spy = tmp_path / "bin" / "py-spy"
    spy.parent.mkdir()
    spy.write_text('#!/bin/sh\necho "Thread 1 (idle): $@"\n')
    spy.chmod(0o755)
    monkeypatch.setenv("PATH", f"{spy.parent}:/usr/bin:/bin")
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        server = ServerProcess([], tmp_path / "log", 0, pid=proc.pid)
        (tmp_path / "log").write_text("server log\n")
        assert server.dump_stacks()
        assert f"Thread 1 (idle): dump --pid {proc.pid} --subprocesses" in (tmp_path / "log").read_text()
        monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
        assert not server.dump_stacks()  # no py-spy: nothing to add, and no error
    finally:
        proc.kill()


def _fake_sglang(running: int):
    """An HTTP server answering as SGLang does: ``/metrics`` with ``running`` requests running, and
    ``/start_profile``, after which a Chrome trace (one tangram and one other kernel) lands in its output_dir."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = f'sglang:num_running_reqs{{model_name="m"}} {running}.0\n'.encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            events = [{"cat": "kernel", "name": "_decode_split_kernel", "ts": 0, "dur": 300.0},
                      {"cat": "kernel", "name": "nvjet_gemm", "ts": 100, "dur": 900.0}]
            with gzip.open(Path(req["output_dir"]) / f"{req['profile_id']}-TP-0.trace.json.gz", "wt") as f:
                json.dump({"traceEvents": events}, f)
            self.send_response(200)
            self.end_headers()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _traced_bench(tmp_path, monkeypatch, running: int, contexts: str, *args: str) -> list[dict]:
    """bench_serving with --trace-steps 4 against the fake SGLang (``running`` requests running); its runs."""
    httpd = _fake_sglang(running)
    monkeypatch.setattr(FakeServer, "url", f"http://127.0.0.1:{httpd.server_address[1]}")
    monkeypatch.setattr(bench_serving, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serving, "replay", lambda *a, **k: __import__("time").sleep(1) or {
        "summary": {"prompt_tokens": 1, "turns_ok": 1, "output_tokens_per_s": 5.0, "ttft_s": {"p50": 0.1, "p90": 0.2}}})
    monkeypatch.setattr(bench_serving, "flush_cache", lambda url: None)
    monkeypatch.setattr(bench_serving, "gpu_memory_used_mib", lambda: None)
    bench_serving.main(["--model-path", "m", "--servers", "stock:flashinfer", "--contexts", contexts, "--no-warmup",
                        "--trace-steps", "4", "--replay-timeout", "3", "--out", str(tmp_path), "--name", "t", *args])
    httpd.shutdown()
    return json.loads((tmp_path / "t.json").read_text())["data"]["runs"]


@pytest.mark.parametrize("running, traced", [(6, True), (5, False)])
def test_bench_traces_the_named_replay_once_it_is_loaded(tmp_path, monkeypatch, running, traced):
    """--trace-steps: once 3/4 of the --trace-at replay's sessions run, SGLang's profiler is started; the run
    carries the trace's kernel summary (tangram kernels marked) and a traced file is never merged."""
    _traced_bench(tmp_path, monkeypatch, running, "short=4096@8,32")
    doc = json.loads((tmp_path / "t.json").read_text())
    trace = doc["data"]["runs"][0]["trace"]
    assert "trace" not in doc["data"]["runs"][1]  # only the --trace-at replay (default short@8)
    if not traced:
        assert trace == {"error": "never saw 6 running requests"}
        return
    assert (trace["steps"], trace["kernel_us"], trace["gpu_busy_us"], trace["tangram_kernel_us"]) == (4, 1200, 1000, 300)
    assert [k["tangram"] for k in trace["top_kernels"]] == [False, True]
    rows = {r["metric"]: r["value"] for r in doc["summary"]}
    assert rows["stock_flashinfer short x8: traced, GPU busy per step (4 steps; tangram kernels 25% of kernel time)"] \
        == 0.25
    with pytest.raises(ValueError, match="not merged"):
        bench_serving.merged_runs([tmp_path / "t.json"])


def test_bench_traces_every_replay_trace_at_names(tmp_path, monkeypatch):
    """Both ends of a load range traced in one server start: each named replay gets its own trigger."""
    runs = _traced_bench(tmp_path, monkeypatch, 6, "short=4096@8,16,32", "--trace-at", "short@8", "short@32")
    assert runs[0]["trace"]["steps"] == 4 and "trace" not in runs[1]
    assert runs[2]["trace"] == {"error": "never saw 24 running requests"}  # the fake server runs 6

def test_bench_results_merge_across_windows_only_when_the_window_cut_nothing(tmp_path):
    """A run that finished every turn inside a shorter window measured what a longer one would have."""
    cut = _bench_file(tmp_path / "a.json", "24", duration="240", cut=24, wall_s=240.0)
    finished = _bench_file(tmp_path / "b.json", "24", duration="200", wall_s=100.0, label="other")
    assert len(bench_serving.merged_runs([cut, finished])[0]) == 2
    merged = tmp_path / "merged.json"  # a merged file merges again, each run keeping where it was measured
    doc = json.loads(cut.read_text())
    doc["data"]["runs"] = bench_serving.merged_runs([cut, finished])[0]
    merged.write_text(json.dumps(doc))
    assert [r["measured_by"]["file"] for r in bench_serving.merged_runs([merged])[0]] == ["a.json", "b.json"]
    with pytest.raises(ValueError, match="windows differ"):
        bench_serving.merged_runs([cut, _bench_file(tmp_path / "c.json", "24", duration="200", cut=3, wall_s=200.0)])
    with pytest.raises(ValueError, match="windows differ"):  # finished, but after the other file's window closed
        bench_serving.merged_runs([_bench_file(tmp_path / "d.json", "24", duration="90", cut=5, wall_s=90.0), finished])


def test_accuracy_server_rebuilds_the_cpu_runs_conversations():
    """The GPU accuracy check replays exactly the conversations the committed CPU run scored (same turns,
    same expected answers), so its answers can be compared turn by turn."""
    from transformers import AutoTokenizer

    from tangram_sgl.models import smollm2_model_dir

    cpu = json.loads((EVAL / "results" / "accuracy_cpu_n16.json").read_text())["data"]
    convs = accuracy_server.rebuild_conversations(cpu, AutoTokenizer.from_pretrained(str(smollm2_model_dir())))
    rebuilt = {(c.id, i): t.expected for c in convs for i, t in enumerate(c.turns)}
    assert rebuilt == {(r["conversation"], r["turn"]): r["expected"] for r in cpu["turns"]}


def _cpu_run(path: Path, budget: float, seed: int = 2000) -> Path:
    data = {"model": "m", "quick": True, "seed": seed, "tasks": ["needle"], "samples_per_task": 2, "sizes": [64],
            "max_new_tokens": 8,
            "turns": [{"method": "tangram", "budget": budget, "conversation": "c0", "turn": 0, "answer": "a"}]}
    path.write_text(json.dumps({"data": data}))
    return path


def test_accuracy_server_joins_cpu_runs_of_the_same_conversations_only(tmp_path):
    """Runs of one seed at other budgets join into one set of turns; a run over other conversations is refused."""
    joined = accuracy_server.load_cpu_runs([_cpu_run(tmp_path / "a.json", 0.5), _cpu_run(tmp_path / "b.json", 0.25)])
    assert sorted(t["budget"] for t in joined["turns"]) == [0.25, 0.5]
    with pytest.raises(SystemExit, match="differs in seed"):
        accuracy_server.load_cpu_runs([tmp_path / "a.json", _cpu_run(tmp_path / "c.json", 0.25, seed=3000)])


def test_accuracy_server_replays_name_their_machine_without_the_cut_off_run(tmp_path):
    """``--replays`` of a run cut off before it wrote its result: the machine comes from the replay files, which
    must agree; a missing replay is an error."""
    env = {"torch": "2.11.0+cu130", "tangram_sgl": "0.1.0", "platform": "Linux", "gpu": "NVIDIA H100 80GB HBM3"}
    for label in ("stock_triton", "tangram_x"):
        (tmp_path / f"replay_accuracy_{label}.json").write_text(json.dumps({"environment": env}))
    machine = accuracy_server.replays_machine(tmp_path, "acc", ["stock_triton", "tangram_x"])
    assert machine["device"] == "NVIDIA H100 80GB HBM3" and machine["versions"]["torch"] == "2.11.0+cu130"
    with pytest.raises(SystemExit, match="no replay of server tangram_y"):
        accuracy_server.replays_machine(tmp_path, "acc", ["stock_triton", "tangram_y"])
    (tmp_path / "replay_accuracy_tangram_x.json").write_text(json.dumps({"environment": {**env, "gpu": "H200"}}))
    with pytest.raises(SystemExit, match="different machines"):
        accuracy_server.replays_machine(tmp_path, "acc", ["stock_triton", "tangram_x"])
    (tmp_path / "acc.json").write_text(json.dumps({"versions": {"sglang": "0.5.17"}, "device": "NVIDIA H200"}))
    assert accuracy_server.replays_machine(tmp_path, "acc", ["stock_triton"])["device"] == "NVIDIA H200"



def test_server_specs():
    from server_proc import parse_server_spec

    assert parse_server_spec("stock:flashinfer") == ("stock_flashinfer", None, ["--attention-backend", "flashinfer"])
    assert parse_server_spec("stock-nooverlap:flashinfer") == (
        "stock_flashinfer_nooverlap", None, ["--attention-backend", "flashinfer", "--disable-overlap-schedule"])
    # tangram's defaults: labelled with what they run (prefill graphs up to 1024 tokens, overlap)
    assert parse_server_spec("tangram:/p/x.r1.json") == ("tangram_mixed_bcg1024_ov_x.r1", "/p/x.r1.json", [])
    assert parse_server_spec("tangram@triton:/p/x.json") == (
        "tangram_triton_bcg1024_ov_x", "/p/x.json", ["--tangram-extend-kernel", "triton"])
    assert parse_server_spec("tangram-eager@flashinfer:/p/x.json") == (
        "tangram_flashinfer_ov_x", "/p/x.json", ["--tangram-extend-kernel", "flashinfer", "--cuda-graph-backend-prefill",
                                                 "disabled"])
    assert parse_server_spec("tangram-bcg:/p/x.json") == (
        "tangram_mixed_bcg_ov_x", "/p/x.json", ["--cuda-graph-backend-prefill", "breakable"])
    assert parse_server_spec("tangram-bcg1024@triton:/p/x.json") == (
        "tangram_triton_bcg1024_ov_x", "/p/x.json", ["--tangram-extend-kernel", "triton", "--cuda-graph-backend-prefill",
                                                     "breakable", "--cuda-graph-max-bs-prefill", "1024"])
    assert parse_server_spec("tangram-nooverlap:/p/x.json") == (
        "tangram_mixed_bcg1024_x", "/p/x.json", ["--disable-overlap-schedule"])
    assert parse_server_spec("tangram-balanced:/p/x.json") == (
        "tangram_mixed_bal_bcg1024_ov_x", "/p/x.json", ["--tangram-decode-kernel", "balanced"])
    assert parse_server_spec("tangram-eager-balanced@triton:/p/x.json") == (
        "tangram_triton_bal_ov_x", "/p/x.json", ["--tangram-extend-kernel", "triton", "--tangram-decode-kernel",
                                                "balanced", "--cuda-graph-backend-prefill", "disabled"])
    with pytest.raises(ValueError, match="expected stock"):
        parse_server_spec("tangram-bcgx:/p/x.json")
    with pytest.raises(ValueError, match="expected stock"):
        parse_server_spec("stock@flashinfer:triton")


def test_plot_labels_are_short():
    assert bench_serving.short_label({"server": "stock:flashinfer"}) == "stock flashinfer"
    assert bench_serving.short_label({"server": "stock-nooverlap:flashinfer"}) == "stock-nooverlap flashinfer"
    # the label names the default kernel; labels from before it did (only the profile stem) ran Triton
    assert bench_serving.short_label({"server": "tangram:/p/x.json", "label": "tangram_flashinfer_x",
                                      "target_ratio": 0.25}) == "tangram r0.25 (flashinfer)"
    assert bench_serving.short_label({"server": "tangram:/p/x.json", "label": "tangram_x",
                                      "target_ratio": 0.25}) == "tangram r0.25 (triton)"
    assert bench_serving.short_label({"server": "tangram@flashinfer:/p/x.json", "label": "tangram_flashinfer_x",
                                      "target_ratio": 1.0}) == "tangram r1 (flashinfer)"
    assert bench_serving.short_label({"server": "tangram-bcg:/p/x.json", "label": "tangram_flashinfer_bcg_x",
                                      "target_ratio": 1.0}) == "tangram r1 (flashinfer, prefill graphs)"
    assert bench_serving.short_label({"server": "tangram-eager:/p/x.json", "label": "tangram_mixed_ov_x",
                                      "target_ratio": 1.0}) == "tangram r1 (mixed, overlap)"
    assert bench_serving.short_label({"server": "tangram:/p/x.json", "label": "tangram_mixed_bcg_ov_x",
                                      "target_ratio": 1.0}) == "tangram r1 (mixed, prefill graphs, overlap)"
    assert bench_serving.short_label({"server": "tangram-bcg1024:/p/x.json", "label": "tangram_mixed_bcg1024_ov_x",
                                      "target_ratio": 1.0}) == "tangram r1 (mixed, prefill graphs ≤ 1024 tokens, overlap)"
    assert bench_serving.short_label({"server": "tangram-balanced:/p/x.json", "label": "tangram_mixed_bal_bcg1024_ov_x",
                                      "target_ratio": 0.25}) == (
        "tangram r0.25 (mixed, balanced decode, prefill graphs ≤ 1024 tokens, overlap)")


def test_prefill_chunk_rates_from_a_server_log():
    from server_proc import prefill_chunk_rates

    lines = ("server_args=ServerArgs(model_path='m', chunked_prefill_size=8192, page_size=16)",
             "[t] Prefill batch, #new-seq: 1, #new-token: 16, #cached-token: 0, input throughput (token/s): 13.24",
             ("[t] Prefill batch, #new-seq: 2, #new-token: 8192, #cached-token: 6, cuda graph: False, input "
              "throughput (token/s): 27463.52"),
             "[t] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, input throughput (token/s): 21202.88",
             "[t] Decode batch, #running-req: 16, gen throughput (token/s): 14.00")
    log = "\n".join(lines)
    assert prefill_chunk_rates(log) == [27463.52, 21202.88]
    assert prefill_chunk_rates(log.split("\n", 1)[1]) == []  # no chunk size logged: nothing to compare against


def test_scheduler_profile_shares(tmp_path):
    """Inclusive shares per function, and our host time charged to the deepest tangram_sgl line of each stack."""
    loop = "run (sglang/srt/managers/scheduler.py:10);"
    raw = "\n".join([
        loop + "available_size (/x/tangram_sgl/pool/sglang_allocator.py:62);request_pages (/x/tangram_sgl/pool/kv_manager.py:140) 6",
        loop + "available_size (/x/tangram_sgl/pool/sglang_allocator.py:62) 1",
        loop + "_normalize_decode_outputs (sglang/srt/b.py:931) 3",
    ])
    path = tmp_path / "raw.txt.gz"
    path.write_bytes(gzip.compress(raw.encode()))
    stacks = scheduler_profile.read_stacks(path)
    s = scheduler_profile.summarize(stacks, top=10)
    assert s["samples"] == 10 and s["in_tangram_sgl"] == 0.7
    assert dict(s["inclusive"])["available_size (tangram_sgl/pool/sglang_allocator.py)"] == 0.7
    assert dict(s["tangram_sgl_lines"]) == {"request_pages (tangram_sgl/pool/kv_manager.py:140)": 0.6,
                                           "available_size (tangram_sgl/pool/sglang_allocator.py:62)": 0.1}
    assert scheduler_profile.function_share(s, stacks, "_normalize_decode_outputs") == 0.3
    scheduler_profile.main([f"r1={path}", "--name", "prof", "--out", str(tmp_path)])
    rows = {r["metric"]: r["value"] for r in json.loads((tmp_path / "prof.json").read_text())["summary"]}
    assert rows["r1: scheduler samples in tangram_sgl code (10 samples)"] == 70.0


def test_exactness_repeats_a_server_given_twice_and_splits_out_first_turns(tmp_path, monkeypatch):
    """``exact_ov_restart``: the same spec twice is a restart, held to bit equality; first turns (no cached
    history) are counted apart from later ones."""
    import exactness

    answers = {"tangram_mixed_bcg1024_ov_p": [[{"output_ids": [1, 2], "logprobs": [-0.1, -0.2]},
                                               {"output_ids": [3, 4], "logprobs": [-0.3, -0.4]}]],
               "tangram_mixed_bcg1024_p": [[{"output_ids": [1, 2], "logprobs": [-0.1, -0.25]},
                                            {"output_ids": [3, 5], "logprobs": [-0.3, -0.4]}]]}
    served = []

    class Server(FakeServer):
        def __init__(self, args, log, port):
            super().__init__(args, log, port)
            served.append("--disable-overlap-schedule" not in args)

    monkeypatch.setattr(exactness, "ServerProcess", Server)
    monkeypatch.setattr(exactness, "collect", lambda url, tok, convs, n: answers[
        "tangram_mixed_bcg1024_ov_p" if served[-1] else "tangram_mixed_bcg1024_p"])
    monkeypatch.setitem(sys.modules, "transformers", type("T", (), {"AutoTokenizer": type(
        "A", (), {"from_pretrained": staticmethod(lambda path: None)})}))
    exactness.main(["--model-path", "m", "--out", str(tmp_path), "--name", "e", "--runs", "tangram:p.json",
                    "tangram:p.json", "tangram-nooverlap:p.json"])
    doc = json.loads((tmp_path / "e.json").read_text())
    restart, plain = (doc["data"]["comparisons"][k]
                      for k in ("tangram_mixed_bcg1024_ov_p_restart", "tangram_mixed_bcg1024_p"))
    assert restart["identical_turns"] == 2 and restart["max_logprob_diff_on_agreeing_prefix"] == 0
    assert (plain["identical_turns"], plain["identical_first_turns"]) == (1, 1)
    assert plain["max_logprob_diff_first_turns"] == pytest.approx(0.05)
    assert [(r["target"], r["met"]) for r in doc["summary"][:2]] == [("1.0", True), ("<= 1e-2", True)]


def test_trace_steps_charge_gpu_idle_to_the_step_that_ends_it_and_list_host_waits():
    """A synthetic trace: a decode step whose two kernels run back to back, then an extend step whose first kernel
    starts 500 us after the GPU went idle (the host waited in get_next_batch_to_run meanwhile)."""
    def span(name, ts, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1}

    def kernel(corr, launch_ts, ts, dur):
        return [{**span("cudaLaunchKernel", launch_ts, 5, "cuda_runtime"), "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur, "tid": 7,
                 "args": {"correlation": corr}}]

    events = [span("step[DECODE bs=8]", 0, 100), *kernel(1, 10, 50, 200), *kernel(2, 20, 250, 100),
              span("scheduler.get_next_batch_to_run", 120, 700),
              {**span("cudaStreamSynchronize", 130, 600, "cuda_runtime"), "args": {}},
              span("step[EXTEND bs=1 toks=20]", 830, 300), *kernel(3, 840, 850, 1000)]
    res = trace_steps.analyse(events)
    decode, extend = res["steps"]
    assert (decode["gpu_ms"], decode["gpu_idle_ms"], decode["gaps"]) == (0.3, 0.0, 0)
    assert (extend["gpu_ms"], extend["gpu_idle_ms"], extend["gaps"]) == (1.0, 0.5, 1)
    assert res["per_kind"]["EXTEND"] == {"steps": 1, "mean_host_ms": 0.3, "mean_gpu_ms": 1.0, "mean_gpu_idle_ms": 0.5}
    assert res["waits"] == {"cudaStreamSynchronize in scheduler.get_next_batch_to_run": {"count": 1, "ms": 0.6}}


def test_bench_step_host_measures_admission_on_the_host(tmp_path):
    """``bench_step_host --host-only`` (the CPU figures of the scheduler's per-request hooks): every session's
    context goes into the radix tree (finish), then a question turn on it is matched whole, attached and reserved."""
    import bench_step_host

    assert bench_step_host.main(["--host-only", "--requests", "2", "--context", "64", "--chunk", "32", "--head-dim",
                                 "4", "--steps", "2", "--questions", "5", "--device", "cpu", "--out", str(tmp_path),
                                 "--name", "t"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())["data"]
    adm = data["admission_us"]
    assert adm.pop("matched") == [64 + 2] * 2  # the whole context and both decoded tokens come from the tree
    assert {k: len(v) for k, v in adm.items()} == {"finish": 2, "match": 2, "attach": 2, "reserve": 2}
    assert all(t > 0 for v in adm.values() for t in v)


def test_readme_tables_are_generated_from_the_committed_results(monkeypatch):
    """The README's two tables are what ``eval/report.py`` makes of eval/results/*.json now (a result added or changed
    without rerunning it fails here), and a headline whose metric is gone from its result fails loudly."""
    readme = (report.ROOT / "README.md").read_text()
    for start, end, body in ((report.HEAD_START, report.HEAD_END, report.headline_table()),
                             (report.START, report.END, report.table())):
        assert readme[readme.index(start) + len(start):readme.index(end)].strip() == body
    assert "| 5 | budget 1.0 >= 0.95x stock: short class" in readme  # one open target, as measured
    monkeypatch.setattr(report, "HEADLINES", ((5, "t", [("bench_serving_long", "no such metric")]),))
    with pytest.raises(KeyError, match="bench_serving_long.json has no summary metric 'no such metric'"):
        report.headline_table()


def test_probe_anchor_cache_gives_each_list_its_own_pages():
    """``eval/probe_decode.py``'s anchor layer: the 1.0 head's list and the two 0.14 lists per request, every slot
    on a page of its own list, page 0 unused."""
    import probe_decode

    c = probe_decode.anchor_cache(3, 512, "cpu", torch.float32)
    lens = c["kv_lens"].tolist()
    assert lens == [512, 108, 108] * 3 and c["kept_tokens"] == 3 * (512 + 7 * 108)
    pages = [set((c["kv_indices"][s:s + n] // probe_decode.PAGE).tolist())
             for s, n in zip(c["kv_starts"].tolist(), lens)]
    assert all(not (a & b) for i, a in enumerate(pages) for b in pages[i + 1:])
    assert 0 not in set().union(*pages) and c["kv_indices"].unique().numel() == sum(lens)


def test_probe_rows_time_only_the_given_rows_at_any_shape(tmp_path, monkeypatch):
    """``probe_decode.py --rows`` (stage ``rows``): only the given AOT rows, each checked against the first row's
    output; ``--low-budget 1.0`` gives every head the whole context; a malformed row is refused."""
    import probe_decode

    c = probe_decode.anchor_cache(2, 300, "cpu", torch.float32, low_budget=1.0)
    assert c["kv_lens"].tolist() == [300] * 6
    monkeypatch.setattr(sys, "argv", ["probe_decode.py", "--batch", "1", "--context", "520", "--rows", "3/1/1,1/1/1",
                                      "--out", str(tmp_path), "--name", "rows"])
    probe_decode.main()
    doc = json.loads((tmp_path / "rows.json").read_text())
    assert list(doc["data"]["cases"]) == ["AOT split, row 3/1/1", "AOT split, row 1/1/1"]
    assert doc["data"]["cases"]["AOT split, row 1/1/1"]["max_abs_diff_vs_first_case"] < 1e-5
    assert doc["data"]["low_budget"] == 0.14 and doc["summary"] == []  # no GPU, no timings
    monkeypatch.setattr(sys, "argv", ["probe_decode.py", "--rows", "3/1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        probe_decode.main()


def test_rooflines_divide_by_the_measuring_gpus_own_bandwidth():
    """An H100's decode times are not held to the H200's 4.8 TB/s (session 31's H100 files first were)."""
    from results_io import peak_hbm_bytes_per_s

    assert peak_hbm_bytes_per_s("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_hbm_bytes_per_s("NVIDIA H200") == 4.8e12
    assert peak_hbm_bytes_per_s("cpu (x86_64)") == 4.8e12


def test_flashinfer_columns_are_copied_only_from_a_run_on_the_same_gpu(tmp_path, capsys):
    """``bench_kernels.py --fi-from``: another GPU's FlashInfer times are no baseline for ours, so none are copied."""
    from bench_kernels import copied_fi_columns

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"versions": {"gpu": "NVIDIA H200"}, "results": [
        {"batch": 32, "context": 32768, "mean_budget": 0.25, "triton_ms": 0.27, "fi_full_tc_run_ms": 0.98}]}))
    same = copied_fi_columns(str(earlier), "NVIDIA H200")
    assert same == {(32, 32768, 0.25): {"fi_full_tc_run_ms": 0.98, "fi_columns_from": str(earlier)}}
    assert copied_fi_columns(str(earlier), "NVIDIA H100 80GB HBM3") == {}
    assert "NOT copied" in capsys.readouterr().out
