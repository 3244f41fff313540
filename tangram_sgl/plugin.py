"""The SGLang plugin entry point (group ``sglang.srt.plugins``), run by ``load_plugins()`` in every process.

Each ``tangram_sgl.patches`` module owns one SGLang seam and exposes ``register()``. Registration is
idempotent: SGLang may call ``load_plugins()`` more than once per process.
"""

from __future__ import annotations

from tangram_sgl.patches import (
    attention_backend,
    cuda_graph,
    memory_pool,
    metrics,
    prefill_graph,
    radix_cache,
    server_args,
)

SEAMS = (server_args, attention_backend, memory_pool, radix_cache, cuda_graph, prefill_graph, metrics)


def register() -> None:
    """Register every tangram_sgl hook and backend with SGLang."""
    for seam in SEAMS:
        seam.register()
