"""Seam: ``sglang.srt.layers.attention.attention_registry`` — the ``tangram`` attention backend.

Registers the name in SGLang's attention-backend registry and in the ``--attention-backend`` choices.
The backend class (``TangramAttnBackend``: per-(layer, group) metadata from lengths and the AOT table,
extend + scoring + compaction, split-KV decode) is the serving issue's work; until it exists, selecting
the backend fails at model-runner construction with :class:`TangramNotServable`, never a silent fallback.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

BACKEND_NAME = "tangram"


class TangramNotServable(RuntimeError):
    """The tangram KV policy was selected but this build cannot serve it."""


def create_tangram_backend(runner: Any) -> Any:
    """SGLang attention-backend factory for ``tangram``."""
    raise TangramNotServable(
        "--kv-policy tangram: the tangram attention backend is not implemented in this tangram_sgl build "
        "(GPU serving is tracked by the 'End-to-end serving on the H200' issue). Serve without "
        "--kv-policy tangram, or use `tangram-sgl replay` for the CPU reference engine."
    )


def register() -> None:
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_tangram_backend)
