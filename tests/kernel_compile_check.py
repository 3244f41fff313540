"""Compile every Triton kernel for the H200 (sm_90) with Triton's code generator and bundled ptxas, no GPU needed, at
the block configurations the launch sites use and head dims 128 (Llama-3.1-8B) and 64 (SmolLM2, Qwen2.5). Run in
its own process without ``TRITON_INTERPRET`` (``test_kernels_compile.py`` does); prints one JSON object: the cases
compiled, the failures, and the kernels no case covers."""

from __future__ import annotations

import json
import sys

import triton
from tangram_sgl.kernels import (
    compaction,
    decode,
    extend,
    flashinfer_decode,
    pool_write,
    pseudo_pages,
    scoring,
    triton_kernels,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
HELPERS = {"_copy_rows"}  # jit functions called from kernels, compiled with them
DATA = {"Q", "K", "V", "O", "KNew", "VNew", "KSrc", "VSrc", "KStage", "VStage"}  # bf16 tensors
PARTIALS = {"MidO", "MidLse", "Lse", "S"}  # fp32 tensors


def signature(fn: triton.JITFunction, constexprs: dict) -> dict[str, str]:
    """Triton types by the kernels' naming: capitalised arguments are pointers (bf16 data, fp32 partials, int32
    indices), lower-case ones int32 scalars (fp32 for scales)."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name[0].isupper():
            sig[name] = "*bf16" if name in DATA else "*fp32" if name in PARTIALS else "*i32"
        else:
            sig[name] = "fp32" if "scale" in name else "i32"
    return sig


def cases(d: int, gq: int) -> list[tuple]:
    """(kernel, constexprs, num_warps, num_stages) as launched for head dim ``d`` and ``gq`` query heads per kv head."""
    block_h = max(16, triton.next_power_of_2(gq))
    return [
        (decode._decode_split_kernel, {"PAGE": 16, "GQ": gq, "BLOCK_H": block_h, "D": d, "BLOCK_N": 128, "MAX_S": 32},
         4, 2),
        (decode._decode_merge_kernel, {"GQ": gq, "D": d, "MAX_S": 32, "BLOCK_S": 32}, 4, 3),
        (extend._extend_kernel, {"PAGE": 16, "GQ": gq, "D": d, "BLOCK_M": 128, "BLOCK_N": 64, "SPLIT": False}, 8, 3),
        (extend._extend_kernel, {"PAGE": 16, "GQ": gq, "D": d, "BLOCK_M": 128, "BLOCK_N": 64, "SPLIT": True}, 8, 3),
        (extend._extend_merge_kernel, {"D": d, "BLOCK_S": 32}, 4, 3),
        (scoring._window_lse_kernel, {"GQ": gq, "D": d, "BLOCK_W": 32, "BLOCK_N": 64}, 4, 3),
        (scoring._window_scores_kernel, {"GQ": gq, "D": d, "BLOCK_W": 32, "BLOCK_N": 64}, 4, 3),
        (compaction._compact_kernel, {"PAGE": 16, "D": d, "BLOCK": 64}, 4, 3),
        (pool_write._scatter_kv_kernel, {"PAGE": 16, "D": d, "BLOCK": 32}, 4, 3),
        (pool_write._write_token_kv_kernel, {"PAGE": 16, "D": d, "BLOCK_H": 8}, 4, 3),
        (pseudo_pages._pseudo_pages_kernel, {"PAGE": 16, "HP": 4, "BLOCK": 1024}, 4, 3),
        (flashinfer_decode._pseudo_page_table_kernel, {"PAGE": 16, "HP": 4, "BLOCK": 128}, 4, 3),
    ]


def main() -> int:
    compiled, failures, covered = [], [], set()
    for d, gq in ((128, 4), (64, 3)):
        for fn, consts, warps, stages in cases(d, gq):
            name = f"{fn.__name__} d{d} {consts}"
            covered.add(fn.__name__)
            try:
                src = ASTSource(fn=fn, signature=signature(fn, consts), constexprs=consts)
                if not triton.compile(src, target=H200, options={"num_warps": warps, "num_stages": stages}).asm["cubin"]:
                    raise RuntimeError("no cubin")
                compiled.append(name)
            except Exception as e:  # noqa: BLE001 (every failure is reported)
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:1500]}")
    kernels = set(triton_kernels())
    print(json.dumps({"compiled": compiled, "failures": failures, "uncovered": sorted(kernels - HELPERS - covered)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
