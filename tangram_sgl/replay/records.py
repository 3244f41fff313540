"""Per-turn measurements, their summary, and the results JSON."""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class TurnRecord:
    """One turn of one session, as the driver saw it.

    Times are seconds. ``cached_tokens`` is the prompt prefix the engine reused from its cache (the
    endpoint's ``usage.prompt_tokens_details.cached_tokens``; None when the endpoint does not report it).
    ``cut``: the turn was in flight when a ``--duration`` replay ended; it is neither served nor an error.
    ``kv_bytes_kept`` / ``kv_bytes_pages`` / ``kv_bytes_full`` are filled by the reference engine only:
    K+V bytes of the tokens the conversation's heads keep after the turn, of the pages holding them, and of
    the same tokens uncompressed (see :class:`tangram_sgl.replay.reference_engine.KVFootprint`).
    """

    session: str
    turn: int
    start_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    answer: str = ""
    expected: str | None = None
    error: str | None = None
    kv_bytes_kept: int | None = None
    kv_bytes_pages: int | None = None
    kv_bytes_full: int | None = None
    cut: bool = False  # still running when a fixed-duration replay ended (neither served nor an error)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut


def _percentiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max())}


def _latency(records: Sequence[TurnRecord], name: str) -> dict[str, float] | None:
    """Percentiles of the turns' ``name`` figure (``ttft_s``, ``tpot_s``, ``latency_s``) where it was measured."""
    return _percentiles([v for r in records if (v := getattr(r, name)) is not None])


def summarize(records: Sequence[TurnRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, latency percentiles, cache hits and errors over all turns; the latency percentiles of the later
    turns (every turn after a conversation's first) apart too, the ones a prefix cache serves."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported)
    cut = sum(r.cut for r in records)
    summary: dict[str, Any] = {
        "turns": len(records),
        "turns_ok": len(ok),
        "turns_cut": cut,
        "errors": len(records) - len(ok) - cut,
        "sessions": len({r.session for r in records}),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "cached_tokens": cached if reported else None,
        "cache_hit_ratio": cached / sum(r.prompt_tokens or 0 for r in reported) if reported and prompt_tokens else None,
        "ttft_s": _latency(ok, "ttft_s"),
        "tpot_s": _latency(ok, "tpot_s"),
        "latency_s": _latency(ok, "latency_s"),
    }
    later = [r for r in ok if r.turn > 0]  # follow-up turns: their conversation's earlier turns can be cached
    if later:
        summary["later_turns"] = {"turns": len(later), "ttft_s": _latency(later, "ttft_s"),
                                  "tpot_s": _latency(later, "tpot_s")}
    with_kv = [r for r in ok if r.kv_bytes_kept is not None]
    if with_kv:
        last = {}
        for r in with_kv:  # a session's KV after its last turn
            last[r.session] = r
        kept = sum(r.kv_bytes_kept for r in last.values())
        pages = sum(r.kv_bytes_pages for r in last.values())
        full = sum(r.kv_bytes_full for r in last.values())
        summary["kv_bytes_kept"] = kept
        summary["kv_bytes_pages"] = pages
        summary["kv_bytes_full"] = full
        summary["kv_kept_fraction"] = kept / full if full else None
        summary["kv_pages_fraction"] = pages / full if full else None
    scored = [r for r in ok if r.expected]
    if scored:
        hits = sum(r.expected.lower() in r.answer.lower() for r in scored)
        summary["expected_answer_contained"] = {"turns": len(scored), "hits": hits}
    first_errors = sorted({r.error for r in records if r.error})[:5]
    if first_errors:
        summary["error_examples"] = first_errors
    return summary


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    import torch
    import transformers

    import tangram_sgl

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tangram_sgl": getattr(tangram_sgl, "__version__", "unknown"),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_results(path: str | Path, *, command: Sequence[str], mode: str, config: dict[str, Any],
                  workload: dict[str, Any], records: Sequence[TurnRecord], wall_s: float) -> dict[str, Any]:
    """Write the results JSON (command, versions, date, config, workload, per-turn records, summary)."""
    doc = {
        "format": "tangram-replay",
        "version": 1,
        "command": list(command),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "mode": mode,
        "environment": environment(),
        "config": config,
        "workload": workload,
        "summary": summarize(records, wall_s),
        "turns": [asdict(r) for r in records],
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
