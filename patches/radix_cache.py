"""Seam: ``sglang.srt.mem_cache.registry`` — the ``tangram`` radix-cache backend.

Registered through ``register_radix_cache_backend``; selected by ``--radix-cache-backend tangram``
(which ``--kv-policy tangram`` sets). The factory wraps the :class:`TangramKVManager` that the pool
hook (``tangram_sgl.patches.memory_pool``) built into the allocator, after checking the profile against
the served model (a profile for another model stops the server with ``ProfileError``).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
from tangram_sgl.patches.memory_pool import TangramPoolError, served_profile

from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator
from tangram_sgl.radix.sglang_cache import TangramRadixCache

BACKEND_NAME = "tangram"


def create_tangram_tree_cache(ctx: Any) -> TangramRadixCache:
    """SGLang radix-cache factory for ``tangram`` (``ctx`` is a ``TreeCacheBuildContext``)."""
    profile = served_profile(ctx.model_config)
    allocator = ctx.params.token_to_kv_pool_allocator
    if not isinstance(allocator, TangramTokenAllocator):
        raise TangramPoolError(
            f"--radix-cache-backend tangram needs the tangram pool, but the allocator is "
            f"{type(allocator).__name__} (the pool hook did not run: is TANGRAM_KV_POLICY exported?)")
    layout = allocator.manager.layout
    if (layout.num_layers, layout.num_kv_heads, layout.heads_per_group) != (
            profile.model.num_layers, profile.model.num_kv_heads, profile.heads_per_group):
        raise TangramPoolError("the tangram pool was built from a different profile than --tangram-profile")
    return TangramRadixCache(ctx.params, allocator.manager)


def register() -> None:
    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, create_tangram_tree_cache)
