"""Seam: ``PrefillCudaGraphRunner.capture`` (``sglang.srt.model_executor.runner.prefill_cuda_graph_runner``).

AROUND hook. With ``--cuda-graph-backend-prefill breakable`` SGLang captures the transformer body once per
token bucket, running forwards whose batches carry no requests (``ForwardBatch.rids`` is None; warm-up and
capture both). On a tangram backend the hook holds :meth:`TangramAttnBackend.prefill_capture` for the whole
capture, so those batches get attention that touches no cache; outside it such a batch is still refused.
Replays need nothing here: SGLang builds each live batch's metadata eagerly and runs attention eagerly
between the captured segments. Other backends are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

_CAPTURE = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture"


def capture_around(original: Callable, self: Any) -> Any:
    """AROUND PrefillCudaGraphRunner.capture (see module docstring)."""
    from tangram_sgl.attention.backend import TangramAttnBackend

    backend = self.model_runner.attn_backend
    if not isinstance(backend, TangramAttnBackend):
        return original(self)
    with backend.prefill_capture():
        return original(self)


def register() -> None:
    HookRegistry.register(_CAPTURE, capture_around, HookType.AROUND)
