"""GPU kernel time of a serving run under load, through SGLang's own profiler endpoint (issues 5 and 8).

:class:`TraceTrigger` waits until the server runs at least ``min_running`` requests (its
``sglang:num_running_reqs`` gauge), then asks SGLang (``POST /start_profile``) to record ``num_steps`` scheduler
steps into ``output_dir``, where SGLang writes a Chrome trace (``*.trace.json.gz``). :func:`summarize_trace`
reduces one to GPU time per kernel name, total GPU busy time and the traced span, and marks tangram_sgl's own
Triton kernels, so a tangram server's decode and extend costs can be set beside stock's at the same load.
A traced replay pays the profiler's overhead: its throughput is not a measurement (``bench_serving.py --merge``
refuses traced runs).

    python eval/server_trace.py A.trace.json.gz [B.trace.json.gz ...]   # print each summary as JSON
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import requests
from tangram_sgl.kernels import triton_kernels
from trace_steps import analyse, load_events

RUNNING = re.compile(r"^sglang:num_running_reqs(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


class TraceTrigger(threading.Thread):
    """Background thread: once ``min_running`` requests run, wait ``delay_s`` (a later window of the load: the
    first steps are the opening wave of prefills), then profile ``num_steps`` steps (see module docstring).
    ``started_at`` (epoch seconds) is set if the profile was asked for, ``error`` if asking failed."""

    def __init__(self, url: str, output_dir: Path, min_running: int, num_steps: int, profile_id: str,
                 timeout_s: float, delay_s: float = 0.0):
        super().__init__(daemon=True)
        self.url, self.output_dir, self.min_running = url, Path(output_dir), min_running
        self.num_steps, self.profile_id, self.timeout_s, self.delay_s = num_steps, profile_id, timeout_s, delay_s
        self.started_at: float | None = None
        self.error: str | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        deadline = time.time() + self.timeout_s
        try:
            while not self._halt.is_set() and time.time() < deadline:
                m = RUNNING.search(requests.get(self.url + "/metrics", timeout=10).text)
                if m and float(m.group(1)) >= self.min_running:
                    if self._halt.wait(self.delay_s):
                        self.error = f"the replay ended within the {self.delay_s:.0f} s trace delay"
                        return
                    self.output_dir.mkdir(parents=True, exist_ok=True)
                    r = requests.post(self.url + "/start_profile", timeout=60, json={
                        "output_dir": str(self.output_dir), "num_steps": self.num_steps,
                        "activities": ["CPU", "GPU"], "profile_id": self.profile_id, "with_stack": False,
                        "record_shapes": False})
                    r.raise_for_status()
                    self.started_at = time.time()
                    return
                time.sleep(0.2)
            self.error = f"never saw {self.min_running} running requests"
        except requests.RequestException as e:
            self.error = f"{type(e).__name__}: {e}"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_trace(path: Path, top: int = 30) -> dict[str, Any]:
    """GPU kernels of a Chrome trace (``.json`` or ``.json.gz``): per name count and total µs (the ``top`` largest,
    tangram_sgl's own marked), their share of the kernel total, GPU busy time and span; per scheduler step kind its
    mean host, GPU and GPU-idle time, and the host's waits on the device (``trace_steps.py``)."""
    events = load_events(Path(path))
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError(f"{path}: no GPU kernel events (was the GPU activity recorded?)")
    ours = set(triton_kernels())  # tangram_sgl's own Triton kernels
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per[e["name"]][0] += 1
        per[e["name"]][1] += float(e["dur"])
    total = sum(t for _, t in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    tangram_us = sum(t for name, (_, t) in per.items() if name in ours)
    return {
        "file": Path(path).name,
        "kernel_launches": len(kernels),
        "kernel_us": round(total, 1),
        "gpu_busy_us": round(_busy_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels]), 1),
        "span_us": round(max(float(e["ts"]) + float(e["dur"]) for e in kernels) - min(float(e["ts"]) for e in kernels),
                         1),
        "tangram_kernel_us": round(tangram_us, 1),
        "top_kernels": [{"name": name[:160], "count": n, "total_us": round(t, 1), "share": round(t / total, 4),
                         "tangram": name in ours} for name, (n, t) in rows[:top]],
        "per_step_kind": (steps := analyse(events))["per_kind"],
        "host_waits": steps["waits"],
    }


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(summarize_trace(Path(arg)), indent=1))
