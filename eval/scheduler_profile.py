"""Where SGLang's scheduler process spends its time: py-spy's collapsed stacks summarized (issue 5).

The H200 grid stages can record the scheduler with py-spy (``PYSPY_WINDOWS`` in ``eval/device/gpu_checks.sh``:
``py-spy record --format raw``, one line per distinct stack with its sample count). This turns each such
file into shares of its samples: per function (inclusive: the stacks it is on), and per line of
``tangram_sgl`` code that is the deepest frame of ours on a stack (where our host time goes, callee
included). Writes ``<out>/<name>.json``; its summary rows give the share of every file's samples in
``tangram_sgl`` code and in each of ``--watch``'s functions.

    python eval/scheduler_profile.py r1=pyspy_r1.txt.gz stock=pyspy_stock.txt --provenance grid_r1.json \
        --name scheduler_profile_grid
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

from results_io import RESULTS, summary_row, write_result

OURS = "tangram_sgl/"
# summary rows: SGLang's waits for a step's results (tolist: decode without overlap, prefill; overlap: synchronize)
# and the memory check the scheduler makes many times per step
WATCH = ("_normalize_decode_outputs", "process_batch_result_prefill", "synchronize", "available_size")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    """{stack (outermost first): samples} of a py-spy raw file (gzipped when its name ends in .gz)."""
    stacks: Counter[tuple[str, ...]] = Counter()
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    for line in text.splitlines():
        if line.strip():
            stack, count = line.rsplit(" ", 1)
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def _short(frame: str, keep_line: bool) -> str:
    """``func (pkg/mod.py[:line])`` with the path cut after site-packages / the package root."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    path = re.sub(r"^.*?(site-packages/|/(?=tangram_sgl/))", "", m["file"])
    return f"{m['func']} ({path}{':' + m['line'] if keep_line and m['line'] else ''})"


def summarize(stacks: Counter[tuple[str, ...]], top: int) -> dict:
    total = sum(stacks.values())
    inclusive: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for stack, n in stacks.items():
        for f in {_short(f, False) for f in stack}:
            inclusive[f] += n
        deepest = [i for i, f in enumerate(stack) if OURS in f]
        if deepest:
            ours[_short(stack[deepest[-1]], True)] += n

    def shares(c: Counter[str]) -> list[list]:
        return [[k, round(v / total, 4)] for k, v in c.most_common(top)]

    return {"samples": total, "in_tangram_sgl": round(sum(ours.values()) / total, 4),
            "inclusive": shares(inclusive), "tangram_sgl_lines": shares(ours)}


def function_share(summary: dict, stacks: Counter[tuple[str, ...]], func: str) -> float:
    hit = sum(n for stack, n in stacks.items() if any(_short(f, False).startswith(func + " (") for f in stack))
    return round(hit / summary["samples"], 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="label=path of py-spy raw files")
    p.add_argument("--top", type=int, default=40, help="rows kept per table")
    p.add_argument("--watch", nargs="*", default=list(WATCH), help="functions given a summary row each")
    p.add_argument("--name", default="scheduler_profile")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--provenance", type=Path, help="a result file of the same device run (e.g. the grid's JSON): "
                   "its versions and device are recorded (default: this machine's)")
    a = p.parse_args(argv)
    data, summary = {}, []
    for spec in a.files:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"{spec!r}: give label=path")
        stacks = read_stacks(Path(path))
        if not stacks:
            p.error(f"{path}: no stacks")
        s = summarize(stacks, a.top)
        s["watched"] = {f: function_share(s, stacks, f) for f in a.watch}
        data[label] = s
        summary.append(summary_row(f"{label}: scheduler samples in tangram_sgl code ({s['samples']} samples)",
                                   round(100 * s["in_tangram_sgl"], 1), "%"))
        summary += [summary_row(f"{label}: scheduler samples in {f}", round(100 * v, 1), "%")
                    for f, v in s["watched"].items() if v]
    measured = None
    if a.provenance:
        doc = json.loads(a.provenance.read_text())
        measured = {"versions": doc["versions"], "device": doc["device"]}
    print("wrote", write_result(a.name, data, summary, directory=a.out, measured_on=measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
