"""Seam: ``DecodeCudaGraphRunner.can_run_graph`` (``sglang.srt.model_executor.runner.decode_cuda_graph_runner``).

AROUND hook. SGLang asks the decode graph runner whether a batch can replay a captured graph right before
replaying it, with the live ``ForwardBatch``; the attention backend itself only sees a replay view without
request ids. On a tangram backend the hook builds the batch's host step there
(:meth:`TangramAttnBackend.prepare_graph_step`) and declines the graph when the step's metadata does not
fit the static buffers, so SGLang runs that batch eagerly. Other backends are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

_CAN_RUN = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph"


def can_run_graph_around(original: Callable, self: Any, forward_batch: Any) -> bool:
    """AROUND DecodeCudaGraphRunner.can_run_graph (see module docstring)."""
    from tangram_sgl.attention.backend import TangramAttnBackend

    ok = original(self, forward_batch)
    backend = getattr(self, "attn_backend", None)
    if not ok or not isinstance(backend, TangramAttnBackend):
        return ok
    return backend.prepare_graph_step(forward_batch)


def register() -> None:
    HookRegistry.register(_CAN_RUN, can_run_graph_around, HookType.AROUND)
