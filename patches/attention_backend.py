"""Seam: ``sglang.srt.layers.attention.attention_registry`` — the ``tangram`` attention backend.

Registers the name in SGLang's attention-backend registry and in the ``--attention-backend`` choices.
The factory builds :class:`tangram_sgl.attention.backend.TangramAttnBackend` (imported lazily, when a model
runner selects the backend). Settings the backend cannot serve (full or torch.compile prefill CUDA graphs, TP > 1,
speculative decoding, ...) fail at model-runner construction with
:class:`tangram_sgl.attention.servable.TangramNotServable` naming the flag to change, never a silent fallback.
"""

from __future__ import annotations

import os
from typing import Any

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
from tangram_sgl.patches.server_args import ENV_DECODE_KERNEL, ENV_EXTEND_KERNEL

BACKEND_NAME = "tangram"


def create_tangram_backend(runner: Any) -> Any:
    """SGLang attention-backend factory for ``tangram`` (``runner``: SGLang's ``ModelRunner``)."""
    from tangram_sgl.attention.backend import TangramAttnBackend

    return TangramAttnBackend(runner, extend_kernel=os.environ.get(ENV_EXTEND_KERNEL),
                              decode_kernel=os.environ.get(ENV_DECODE_KERNEL))


def register() -> None:
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_tangram_backend)
