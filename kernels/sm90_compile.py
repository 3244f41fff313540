"""Compile every Triton kernel of this package for the H200 (sm_90) without a GPU, and read what it uses.

Triton's own code generator and bundled ptxas build each kernel at the block configuration its launch site uses,
for head dims 128 (Llama-3.1-8B) and 64 (SmolLM2, Qwen2.5), with the specialisation a launch gets: Triton marks
16-byte-aligned pointers and integer arguments divisible by 16 (``tt.divisibility``), and those hints decide
whether a gather is vectorised and pipelined through ``cp.async`` — a compile without them is another kernel
(the decode kernel then loads single bf16 elements, needs 255 registers and spills). Here every pointer and every
data stride carries the hint, as serving's tensors do. ``ptxas -v`` gives each kernel's registers, spill bytes and
shared memory, hence the programs one SM holds at once (what the AOT table's launch simulation assumes for decode).

Run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels): ``python -m
tangram_sgl.kernels.sm90_compile`` prints one JSON object. Under another installed Triton (e.g. the GPU
machine's 3.6, ``pip install --target DIR triton==3.6.0`` and ``PYTHONPATH=DIR``) it reports that version's code.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from tangram_sgl.kernels import (
    compaction,
    decode,
    decode_balanced,
    extend,
    flashinfer_decode,
    pool_write,
    pseudo_pages,
    scoring,
    triton_kernels,
)
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
HELPERS = {"_attend_range", "_copy_rows", "_sequence_lengths"}  # jit functions called from kernels, compiled with them
DATA = {"Q", "K", "V", "O", "KNew", "VNew", "KSrc", "VSrc", "KStage", "VStage"}  # bf16 tensors
PARTIALS = {"MidO", "MidLse", "Lse", "S"}  # fp32 tensors
UNALIGNED_STRIDES = {"stride_sr"}  # strides of index tables (a row of G slots): not a multiple of 16 in general
# an H100/H200 SM: 64K registers (allocated per warp in units of 256), 228 KB of shared memory (1 KB of it reserved
# per resident block), 64 warps, 32 blocks
SM_REGISTERS, SM_SHARED, SM_BLOCK_RESERVED, SM_WARPS, SM_BLOCKS = 65536, 233472, 1024, 64, 32


@dataclass(frozen=True)
class KernelResources:
    """One compiled case: ``registers`` a thread, ``spill_bytes`` (stores + loads), ``shared`` bytes a block, and the
    blocks an SM holds at once (``per_sm``, the tightest of registers, shared memory, warps and blocks)."""

    case: str
    registers: int
    spill_bytes: int
    shared: int
    num_warps: int
    per_sm: int


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


def launch_hints(fn: triton.JITFunction, sig: dict[str, str]) -> dict[tuple[int], list]:
    """The divisibility-16 hints of a serving launch: every pointer, every data stride."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name].startswith("*") or (name.startswith("stride_") and name not in UNALIGNED_STRIDES)}


def cases(d: int, gq: int) -> list[tuple]:
    """(kernel, constexprs, num_warps, num_stages) as launched for head dim ``d`` and ``gq`` query heads per kv head."""
    block_h = max(16, triton.next_power_of_2(gq))
    block_n, warps, stages = decode.DECODE_CONFIG
    ext_m, ext_n, ext_warps, ext_stages = extend.EXTEND_CONFIG
    return [
        (decode._decode_split_kernel, {"PAGE": 16, "GQ": gq, "BLOCK_H": block_h, "D": d, "BLOCK_N": block_n,
                                       "MAX_S": 32}, warps, stages),
        (decode._decode_merge_kernel, {"GQ": gq, "D": d, "MAX_S": 32, "BLOCK_S": 32}, 4, 3),
        (decode_balanced._balanced_split_kernel, {"PAGE": 16, "GQ": gq, "BLOCK_H": block_h, "D": d,
                                                  "BLOCK_N": block_n, "BLOCK_SEQ": 256}, warps, stages),
        (decode_balanced._balanced_merge_kernel, {"GQ": gq, "BLOCK_H": block_h, "D": d, "BLOCK_SEQ": 256}, 4, 3),
        (extend._extend_kernel, {"PAGE": 16, "GQ": gq, "D": d, "BLOCK_M": ext_m, "BLOCK_N": ext_n, "SPLIT": False},
         ext_warps, ext_stages),
        (extend._extend_kernel, {"PAGE": 16, "GQ": gq, "D": d, "BLOCK_M": ext_m, "BLOCK_N": ext_n, "SPLIT": True},
         ext_warps, ext_stages),
        (extend._extend_merge_kernel, {"D": d, "BLOCK_S": 32}, 4, 3),
        (scoring._window_lse_kernel, {"GQ": gq, "D": d, "BLOCK_W": 32, "BLOCK_N": 64}, 4, 3),
        (scoring._window_scores_kernel, {"GQ": gq, "D": d, "BLOCK_W": 32, "BLOCK_N": 64}, 4, 3),
        (compaction._compact_kernel, {"PAGE": 16, "D": d, "BLOCK": 64}, 4, 3),
        (pool_write._scatter_kv_kernel, {"PAGE": 16, "D": d, "BLOCK": 32}, 4, 3),
        (pool_write._write_token_kv_kernel, {"PAGE": 16, "D": d, "BLOCK_H": 8}, 4, 3),
        (pseudo_pages._pseudo_pages_kernel, {"PAGE": 16, "HP": 4, "BLOCK": 1024}, 4, 3),
        (flashinfer_decode._pseudo_page_table_kernel, {"PAGE": 16, "HP": 4, "BLOCK": 128}, 4, 3),
    ]


def blocks_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Blocks of ``num_warps`` warps one SM holds at once (registers, shared memory, warps and blocks limits)."""
    warp_regs = math.ceil(registers * 32 / 256) * 256
    return min(SM_REGISTERS // (warp_regs * num_warps), SM_SHARED // (shared + SM_BLOCK_RESERVED),
               SM_WARPS // num_warps, SM_BLOCKS)


def compile_case(fn: triton.JITFunction, constexprs: dict, num_warps: int, num_stages: int, case: str,
                 workdir: Path) -> KernelResources:
    """Compile one case for sm_90 with the launch hints; its resources from ``ptxas -v`` on the generated PTX."""
    sig = signature(fn, constexprs)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=launch_hints(fn, sig))
    kernel = triton.compile(src, target=H200, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = kernel.asm["ptx"]
    path = workdir / "kernel.ptx"
    path.write_text(ptx)
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    out = subprocess.run([get_ptxas(90).path, f"-arch={arch}", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                         capture_output=True, text=True, check=True)
    log = out.stdout + out.stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = sum(int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    shared = kernel.metadata.shared
    return KernelResources(case, registers, spill, shared, num_warps, blocks_per_sm(registers, shared, num_warps))


def check_all() -> dict:
    """Every case compiled: ``{"triton", "compiled": [KernelResources as dicts], "failures", "uncovered"}``."""
    compiled, failures, covered = [], [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for d, gq in ((128, 4), (64, 3)):
            for fn, consts, warps, stages in cases(d, gq):
                case = f"{fn.__name__} d{d} {consts} w{warps} s{stages}"
                covered.add(fn.__name__)
                try:
                    compiled.append(asdict(compile_case(fn, consts, warps, stages, case, Path(tmp))))
                except Exception as e:  # noqa: BLE001 (every failure is reported)
                    failures.append(f"{case}: {type(e).__name__}: {str(e)[:1500]}")
    uncovered = sorted(set(triton_kernels()) - HELPERS - covered)
    return {"triton": triton.__version__, "compiled": compiled, "failures": failures, "uncovered": uncovered}


if __name__ == "__main__":
    print(json.dumps(check_all()))
