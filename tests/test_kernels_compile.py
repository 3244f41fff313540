"""Every Triton kernel compiles for the H200 (sm_90) on the CPU machine, with a serving launch's specialisation
(``tangram_sgl.kernels.sm90_compile``, in a process without the interpreter the other tests use): a compile error
found only on the lent GPU costs a session's device time. The compiled code must not spill registers, and the decode
kernel's programs resident per SM must be what the AOT table's launch simulation assumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tangram_sgl.kernels.decode import H200_SMS
from tangram_sgl.kernels.decode_balanced import BALANCED_PROGRAMS

from tangram_sgl.aot_table import DECODE_WAVE_CTAS

RESULTS = Path(__file__).resolve().parent.parent / "eval" / "results"


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tangram_sgl.kernels.sm90_compile"], env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled):
    assert not compiled["failures"], "\n".join(compiled["failures"])
    assert not compiled["uncovered"], f"kernels without a compile case: {compiled['uncovered']}"
    assert len(compiled["compiled"]) == 28


def test_no_kernel_spills_registers(compiled):
    spilled = [(k["case"], k["spill_bytes"]) for k in compiled["compiled"] if k["spill_bytes"]]
    assert not spilled, f"register spills (Triton {compiled['triton']}): {spilled}"


def test_decode_kernel_occupancy_is_the_aot_simulations(compiled):
    """The AOT table picks each bucket's CTA target by simulating 3 resident decode programs per SM (fitted to the
    H200's target studies); the served decode config at head dim 128 must compile to exactly that."""
    decode = [k for k in compiled["compiled"] if k["case"].startswith("_decode_split_kernel d128")]
    assert len(decode) == 1
    assert decode[0]["per_sm"] == DECODE_WAVE_CTAS // H200_SMS, decode[0]


def test_balanced_decode_launches_one_wave_on_the_gpus_triton():
    """``BALANCED_PROGRAMS`` is as many programs as the H200 holds at once under its Triton (3.6), as
    ``eval/kernel_resources.py`` last read them (CI's Triton compiles this kernel with fewer registers)."""
    found = json.loads((RESULTS / "kernel_resources.json").read_text())["data"]
    balanced = [k for k in found["served"] if k["case"].startswith("_balanced_split_kernel d128")]
    assert found["triton"] == "3.6.0" and len(balanced) == 1
    assert balanced[0]["per_sm"] * H200_SMS == BALANCED_PROGRAMS, balanced[0]
