"""Registers, spills, shared memory and resident programs per SM of every Triton kernel compiled for the H200 (issue 8),
without a GPU: ``tangram_sgl.kernels.sm90_compile`` at the served launch configurations, plus the decode kernel at
each block config the tune of ``bench_kernels.py`` times (so a tune's times can be read against occupancy).

The GPU machine runs Triton 3.6; to report its code, put that Triton first on the path:

    pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36 python eval/kernel_resources.py --out eval/results
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import triton
from bench_kernels import TUNE_CONFIGS
from results_io import RESULTS, summary_row, write_result
from tangram_sgl.kernels.decode import DECODE_CONFIG, H200_SMS
from tangram_sgl.kernels.decode_balanced import BALANCED_PROGRAMS
from tangram_sgl.kernels.sm90_compile import cases, check_all, compile_case

from tangram_sgl.aot_table import DECODE_WAVE_CTAS


def decode_configs(configs: list[tuple[int, int, int]]) -> list[dict]:
    """The served decode case at head dim 128 (Llama-3.1-8B's 4 query heads per kv head) at each (block_n, warps,
    stages)."""
    kernel, served, _, _ = cases(128, 4)[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for block_n, warps, stages in configs:
            res = compile_case(kernel, {**served, "BLOCK_N": block_n}, warps, stages, f"({block_n}, {warps}, {stages})",
                               Path(tmp))
            rows.append({"config": [block_n, warps, stages], **asdict(res)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="kernel_resources")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_resources: unset TRITON_INTERPRET (the interpreter replaces the kernels it compiles)")
    served = check_all()
    if served["failures"]:
        sys.exit("kernels failed to compile:\n" + "\n".join(served["failures"]))
    configs = decode_configs(list(TUNE_CONFIGS))
    decode = next(k for k in served["compiled"] if k["case"].startswith("_decode_split_kernel d128"))
    balanced = next(k for k in served["compiled"] if k["case"].startswith("_balanced_split_kernel d128"))
    extend = [k for k in served["compiled"] if k["case"].startswith("_extend_kernel d128")]
    slots = DECODE_WAVE_CTAS // H200_SMS
    summary = [
        summary_row(f"decode kernel {DECODE_CONFIG} at d128, Triton {triton.__version__}: resident programs per SM "
                    f"({decode['registers']} registers, {decode['shared'] // 1024} KB shared)", decode["per_sm"],
                    target=f"= {slots} (the AOT simulation's)", met=decode["per_sm"] == slots),
        summary_row(f"token-balanced decode kernel at d128, Triton {triton.__version__}: resident programs per SM "
                    f"({balanced['registers']} registers, {balanced['shared'] // 1024} KB shared)", balanced["per_sm"],
                    target=f"= {BALANCED_PROGRAMS // H200_SMS} (its launch, {BALANCED_PROGRAMS} programs, one wave)",
                    met=balanced["per_sm"] * H200_SMS == BALANCED_PROGRAMS),
        summary_row(f"register spills over {len(served['compiled'])} served kernel cases, Triton {triton.__version__}",
                    sum(k["spill_bytes"] for k in served["compiled"]), "bytes", target="0",
                    met=not any(k["spill_bytes"] for k in served["compiled"])),
        summary_row(f"extend kernel at d128, Triton {triton.__version__}: resident programs per SM "
                    f"({max(k['registers'] for k in extend)} registers, {extend[0]['shared'] // 1024} KB shared)",
                    min(k["per_sm"] for k in extend)),
    ]
    data = {"target": "sm_90 (H200), compiled on this machine", "triton": triton.__version__,
            "triton_path": str(Path(triton.__file__).parent), "served": served["compiled"],
            "decode_configs": configs}
    path = write_result(args.name, data, summary, directory=Path(args.out))
    for r in configs:
        print(f"decode {tuple(r['config'])}: {r['registers']} registers, {r['spill_bytes']} B spilled, "
              f"{r['shared'] // 1024} KB shared, {r['per_sm']} per SM")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
