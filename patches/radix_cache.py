"""Seam: ``sglang.srt.mem_cache.registry`` — the ``tangram`` radix-cache backend.

Registered through ``register_radix_cache_backend``; selected by ``--radix-cache-backend tangram``
(which ``--kv-policy tangram`` sets).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

from tangram_sgl.patches.attention_backend import TangramNotServable

BACKEND_NAME = "tangram"


def create_tangram_tree_cache(ctx: Any) -> Any:
    """SGLang radix-cache factory for ``tangram`` (``ctx`` is a ``TreeCacheBuildContext``)."""
    raise TangramNotServable(
        "--kv-policy tangram: the tangram radix cache is not wired into SGLang in this build "
        "(tracked by the head-group page pool issue)."
    )


def register() -> None:
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_tangram_tree_cache)
