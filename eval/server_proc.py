"""Start an SGLang server (stock or tangram) as a child process, wait until it serves, stop it.

Used by the GPU scripts (``serve_smoke.py``, ``exactness.py``, ...): one command starts the server, drives it
and collects its log. The server runs in its own process session, so on the device it outlives a command
that does not stop it (``eval/soak.py --phase start`` / ``--phase finish`` attach to it by ``pid``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import requests
from tangram_sgl.patches.server_args import DEFAULT_EXTEND_KERNEL, DEFAULT_PREFILL_GRAPH_MAX_TOKENS

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass
class ServerProcess:
    """A running ``sglang.launch_server``; ``log``: its stdout+stderr file."""

    args: list[str]
    log: Path
    port: int
    proc: subprocess.Popen | None = None
    started_s: float = field(default=0.0)
    pid: int | None = None  # the server's process (and session) id; set alone when attaching to a running one
    _sigterm: object = field(default=None, init=False, repr=False)  # the SIGTERM handler ``__enter__`` replaced

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Launch the server; refuses when something already answers on the port (a server left by a run that
        was cut off would otherwise answer the health checks and serve this run's load in its place)."""
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(f"port {self.port} is already in use (a server left running by an earlier, cut-off "
                                   f"run?): stop it or pick another --port")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--port", str(self.port), *self.args]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            # cwd: the log's folder, so a source checkout in the working directory cannot shadow the installed
            # package (patches/ and kernels/ only exist under tangram_sgl once installed)
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         cwd=self.log.parent)
        self.started_s, self.pid = time.time(), self.proc.pid
        return self

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        try:  # attached by pid (Linux): a process that exited but is not yet reaped counts as gone
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        """Seconds until ``/health_generate`` answers 200; raises with the log tail if the server dies."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"server exited before serving:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return time.time() - t0
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def served_model(self) -> str:
        """The model name the server answers to (``/v1/models``)."""
        return requests.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def dump_stacks(self, timeout_s: float = 60.0) -> bool:
        """Append every server process's Python stack (``py-spy dump --subprocesses``) to the log: what a stuck
        scheduler is doing. False when py-spy is not on PATH or the server is gone."""
        spy = shutil.which("py-spy")
        if spy is None or self.pid is None or not self.alive():
            return False
        try:
            out = subprocess.run([spy, "dump", "--pid", str(self.pid), "--subprocesses"], check=False,
                                 capture_output=True, text=True, timeout=timeout_s)
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired:
            text = f"py-spy dump did not finish in {timeout_s:.0f} s"
        with open(self.log, "a") as f:
            f.write(f"\n==== py-spy dump at {time.strftime('%H:%M:%S')} ====\n{text}\n")
        return True

    def stop(self) -> None:
        if self.pid is None or not self.alive():
            return
        os.killpg(self.pid, signal.SIGTERM)
        deadline = time.time() + 60
        while self.alive() and time.time() < deadline:
            if self.proc is not None:
                self.proc.poll()
            time.sleep(0.5)
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)

    def __enter__(self) -> Self:
        """Start; until ``__exit__``, SIGTERM (``timeout``'s signal) raises SystemExit in the main thread, so the
        server, in its own process session, is stopped with its driver rather than left holding the GPU."""
        self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            return self.start()
        except BaseException:
            signal.signal(signal.SIGTERM, self._sigterm)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGTERM, self._sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def server_args(model_path: str, *, profile: str | None, extra: Sequence[str] = (),
                chat_template: str | None = None) -> list[str]:
    """``launch_server`` arguments: the model, cache/metrics reporting, and tangram when ``profile`` is set."""
    args = ["--model-path", model_path, "--enable-cache-report", "--enable-metrics", "--log-level", "info"]
    if chat_template:
        args += ["--chat-template", chat_template]
    if profile:
        args += ["--kv-policy", "tangram", "--tangram-profile", profile]
    return args + list(extra)


def parse_server_spec(spec: str) -> tuple[str, str | None, list[str]]:
    """(label, tangram profile or None, launch arguments) of ``stock:<attention backend>``,
    ``stock-nooverlap:<attention backend>`` (without SGLang's overlap scheduler), ``tangram:<profile.json>`` or
    ``tangram@<extend kernel>:<profile.json>`` (tangram's defaults), ``tangram-bcg...`` (breakable prefill CUDA graphs
    for every step size), ``tangram-bcg<N>...`` (for steps of at most N tokens, ``--cuda-graph-max-bs-prefill N``:
    question turns replay graphs, document chunks run eagerly; N = 1024 is tangram's default since session 27),
    ``tangram-eager...`` (no prefill graphs: tangram's default through session 26, sessions 18-19 aside) and
    ``tangram-nooverlap...`` (the defaults with ``--disable-overlap-schedule``), each optionally followed by
    ``-balanced`` (``--tangram-decode-kernel balanced``), the server specs the eval scripts take. A tangram label
    names the extend kernel (the default one included), has ``bal_`` for the token-balanced decode, ``bcg_``
    (``bcg<N>_``) when breakable prefill CUDA graphs run, the default's included, and ``ov_`` when the overlap
    scheduler runs (the default since session 16): labels name what ran, so results from before a default changed
    keep their meaning."""
    kind, _, arg = spec.partition(":")
    kind, _, extend_kernel = kind.partition("@")
    if kind == "stock" and arg and not extend_kernel:
        return f"stock_{arg}", None, ["--attention-backend", arg]
    if kind == "stock-nooverlap" and arg and not extend_kernel:
        return f"stock_{arg}_nooverlap", None, ["--attention-backend", arg, "--disable-overlap-schedule"]
    variant = re.fullmatch(r"tangram(?:-(bcg)(\d*)|-(eager)|-(nooverlap))?(-balanced)?", kind)
    if variant and arg:
        bcg, max_tokens, eager, nooverlap, balanced = variant.groups()
        flags = ["--tangram-extend-kernel", extend_kernel] if extend_kernel else []
        flags += ["--tangram-decode-kernel", "balanced"] if balanced else []
        if bcg:
            flags += ["--cuda-graph-backend-prefill", "breakable"]
            flags += ["--cuda-graph-max-bs-prefill", max_tokens] if max_tokens else []
        elif eager:
            flags += ["--cuda-graph-backend-prefill", "disabled"]
        else:
            bcg, max_tokens = "bcg", str(DEFAULT_PREFILL_GRAPH_MAX_TOKENS)
        if nooverlap:
            flags.append("--disable-overlap-schedule")
        tags = "bal_" * bool(balanced) + f"bcg{max_tokens}_" * bool(bcg) + "ov_" * (not nooverlap)
        return f"tangram_{extend_kernel or DEFAULT_EXTEND_KERNEL}_{tags}{Path(arg).stem}", arg, flags
    raise ValueError(f"server spec {spec!r}: expected stock:<attention backend>, stock-nooverlap:<attention "
                     f"backend> or tangram[-bcg|-bcg<max tokens>|-eager|-nooverlap][-balanced][@<extend kernel>]:"
                     f"<profile.json>")


PREFILL_LINE = re.compile(r"Prefill batch.*#new-token: (\d+).*input throughput \(token/s\): ([\d.]+)")
CHUNK_SIZE = re.compile(r"chunked_prefill_size=(\d+)")


def prefill_chunk_rates(log: str, since: int = 0) -> list[float]:
    """Input tok/s SGLang logged for every prefill batch of exactly one chunk (``chunked_prefill_size`` from
    the server-args dump at the top of the log), in order, from character ``since`` on: how prefill speed
    moves along long documents."""
    m = CHUNK_SIZE.search(log)
    if not m:
        return []
    return [float(r) for n, r in PREFILL_LINE.findall(log, since) if int(n) == int(m.group(1))]


def graph_batches(log: Sequence[str], kind: str) -> tuple[int, int]:
    """(``kind`` = ``Decode`` / ``Prefill`` batch lines of a server log, those SGLang ran as a CUDA-graph replay:
    ``cuda graph: True``)."""
    lines = [ln for ln in log if f"{kind} batch" in ln]
    return len(lines), sum("cuda graph: True" in ln for ln in lines)


def gauge(metrics: str, name: str) -> float | None:
    """Value of ``sglang:<name>`` (its first series) in a ``/metrics`` text, or None."""
    m = re.search(rf"^sglang:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics, re.MULTILINE)
    return float(m.group(1)) if m else None
