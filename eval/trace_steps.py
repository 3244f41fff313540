"""Where a traced server's time goes, step by step: reads a PyTorch profiler trace (SGLang's ``/start_profile``, as
``bench_serving --trace-steps`` takes it) and reports, per scheduler step (``step[...]`` annotation), its host time,
the GPU time of the kernels it launched, and the GPU idle time before them; and every host wait on the device
(stream / event synchronisations) by the scheduler phase it happened in.

GPU idle is charged to the step whose kernel ended the gap: a step whose host work outruns the GPU shows idle time,
a step the GPU waits for after a synchronisation elsewhere shows it too (the wait is listed under ``waits``).

    python eval/trace_steps.py eval/results/traces/*.trace.json.gz --out eval/results/traces
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from statistics import mean

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
MIN_GAP_US = 20.0  # shorter GPU gaps are launch latency, not idle time


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def _enclosing(spans: list[dict], starts: list[float], e: dict) -> list[dict]:
    """The spans (sorted by start) on ``e``'s thread that contain its start, outermost first."""
    i = bisect.bisect_right(starts, e["ts"])
    return [s for s in spans[:i] if s["tid"] == e["tid"] and s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]


def analyse(events: list[dict]) -> dict:
    """Per-step rows, per-kind means and the host waits of one trace (see module docstring)."""
    spans = sorted((e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    span_starts = [s["ts"] for s in spans]
    steps = [s for s in spans if s["name"].startswith("step[")]
    step_starts = [s["ts"] for s in steps]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}

    def step_of(launch: dict | None) -> int | None:
        if launch is None:
            return None
        i = bisect.bisect_right(step_starts, launch["ts"]) - 1
        s = steps[i] if i >= 0 else None
        return i if s and s["tid"] == launch["tid"] and launch["ts"] <= s["ts"] + s["dur"] else None

    gpu_us, idle_us, gaps = Counter(), Counter(), Counter()
    busy_end = None
    for e in sorted((e for e in events if e.get("cat") in GPU_CATS and e.get("ph") == "X"), key=lambda e: e["ts"]):
        i = step_of(launches.get(e.get("args", {}).get("correlation")))
        if i is not None:
            gpu_us[i] += e["dur"]
            if busy_end is not None and e["ts"] - busy_end > MIN_GAP_US:
                idle_us[i] += e["ts"] - busy_end
                gaps[i] += 1
        busy_end = e["ts"] + e["dur"] if busy_end is None else max(busy_end, e["ts"] + e["dur"])
    rows = [{"step": s["name"], "start_ms": round((s["ts"] - steps[0]["ts"]) / 1e3, 2),
             "host_ms": round(s["dur"] / 1e3, 3), "gpu_ms": round(gpu_us[i] / 1e3, 3),
             "gpu_idle_ms": round(idle_us[i] / 1e3, 3), "gaps": gaps[i]} for i, s in enumerate(steps)]
    kinds: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        kinds[r["step"].split()[0].removeprefix("step[")].append(r)
    per_kind = {k: {"steps": len(v), **{f"mean_{f}": round(mean(r[f] for r in v), 3)
                                        for f in ("host_ms", "gpu_ms", "gpu_idle_ms")}} for k, v in kinds.items()}
    waits: dict[str, dict] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for e in events:
        if e.get("name") in WAITS and e.get("ph") == "X":
            where = " > ".join(s["name"] for s in _enclosing(spans, span_starts, e)) or "(no annotation)"
            w = waits[f"{e['name']} in {where}"]
            w["count"] += 1
            w["ms"] = round(w["ms"] + e["dur"] / 1e3, 3)
    return {"steps": rows, "per_kind": per_kind, "waits": dict(waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="profiler traces (.json or .json.gz)")
    ap.add_argument("--out", type=Path, required=True, help="directory for <trace name>.steps.json")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for path in a.traces:
        res = {"trace": path.name, **analyse(load_events(path))}
        name = path.name.removesuffix(".gz").removesuffix(".json").removesuffix(".trace")
        (a.out / f"{name}.steps.json").write_text(json.dumps(res, indent=1))
        print(path.name)
        for kind, k in res["per_kind"].items():
            print(f"  {kind}: {k}")
        for where, w in sorted(res["waits"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  wait {where}: {w['count']} x, {w['ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
