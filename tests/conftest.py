"""Fixtures shared by several test modules; on CPU, Triton kernels run interpreted.

``TRITON_INTERPRET`` must be set before triton is first imported, and library modules import it (the pool's
write kernel): set here, once for every test module, before any loads. ``TANGRAM_KERNEL_TEST_DEVICE=cuda`` or
``TANGRAM_ATTN_TEST_DEVICE=cuda`` (the GPU test stage sets both) runs them compiled.
"""

import os

if all(os.environ.get(v, "cpu") == "cpu" for v in ("TANGRAM_KERNEL_TEST_DEVICE", "TANGRAM_ATTN_TEST_DEVICE")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run a test with one torch thread (deterministic timing, no oversubscription on 2-core CI)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
