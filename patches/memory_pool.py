"""Seams: SGLang's KV pool construction and per-batch allocation, for ``--kv-policy tangram``.

* AROUND ``KVCacheConfigurator._init_pools`` (``sglang.srt.mem_cache.kv_cache_configurator``): in the
  target worker of a tangram server, build SGLang's ``ReqToTokenPool``, one :class:`TangramKVManager`
  (its :class:`GroupPagePool` holds exactly SGLang's ``max_total_num_tokens`` full-KV tokens:
  ``ceil(T * G / page_size)`` usable pages, the bytes of full KV for T tokens when ``G * H_p == L * H``;
  padding columns of a last, partial group add their share), the KV-less logical-id allocator
  (:class:`TangramTokenAllocator`, the scheduler's memory view) and :class:`TangramKVCache`. The profile
  is checked against the served model here: a profile for another model stops construction.
* BEFORE ``alloc_for_extend`` (``sglang.srt.mem_cache.allocation``): for every request of an extend
  batch on a tangram cache, attach it to its matched node and reserve exactly the pages of its next
  segment (+ decode growth on its last chunk). Eviction happens inside; a request that cannot fit even
  after eviction raises :class:`AdmissionError` with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from tangram_sgl.patches.server_args import ENV_POLICY, ENV_PROFILE

from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator, pool_pages_for_tokens
from tangram_sgl.pool.sglang_kv_cache import TangramKVCache
from tangram_sgl.profile import TangramProfile, load_profile

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools"
_ALLOC_FOR_EXTEND = "sglang.srt.mem_cache.allocation.alloc_for_extend"
LOGICAL_IDS_PER_TOKEN = 4  # logical ids are free of K/V; more of them than full-KV tokens lets compression pay
# decode growth reserved up front is clipped like SGLang's own estimate; beyond it decode pages come on demand
CLIP_MAX_NEW_TOKENS = int(os.environ.get("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "4096"))


class TangramPoolError(RuntimeError):
    """The tangram pool cannot be built for this server configuration."""


def tangram_active() -> bool:
    return os.environ.get(ENV_POLICY) == "tangram"


def served_profile(model_config: Any) -> TangramProfile:
    """The profile named by ``--tangram-profile``, checked against the served model (``ProfileError``)."""
    path = os.environ.get(ENV_PROFILE)
    if not path:
        raise TangramPoolError("--kv-policy tangram is active but no --tangram-profile reached this process")
    return load_profile(path, model_config.hf_config)


def build_tangram_pools(configurator: Any, max_total_num_tokens: int, max_running_requests: int) -> dict:
    """``req_to_token_pool``, ``token_to_kv_pool``, ``token_to_kv_pool_allocator`` for a tangram server."""
    profile = served_profile(configurator.model_config)
    tp = getattr(configurator.server_args, "tp_size", 1)
    if tp != 1:
        raise TangramPoolError(f"--kv-policy tangram's pool is built for tp_size 1 here, got --tp {tp}")
    num_pages = pool_pages_for_tokens(profile.num_groups, profile.page_size, max_total_num_tokens)
    manager = TangramKVManager.from_profile(profile, num_pages, dtype=configurator.kv_cache_dtype,
                                            device=configurator.device)
    logical = max_total_num_tokens * LOGICAL_IDS_PER_TOKEN
    kv_cache = TangramKVCache(manager, logical, configurator.device)
    allocator = TangramTokenAllocator(manager, max_total_num_tokens, logical, configurator.kv_cache_dtype,
                                      configurator.device, kv_cache)
    req_to_token_pool = configurator._build_req_to_token_pool(max_num_reqs=max_running_requests)
    return {"req_to_token_pool": req_to_token_pool, "token_to_kv_pool": kv_cache,
            "token_to_kv_pool_allocator": allocator}


def init_pools_around(original: Callable, self: Any, *, sizes: Any, req_to_token_pool: Any,
                      token_to_kv_pool_allocator: Any) -> Any:
    """AROUND KVCacheConfigurator._init_pools (target worker of a tangram server only)."""
    if not tangram_active():
        return original(self, sizes=sizes, req_to_token_pool=req_to_token_pool,
                        token_to_kv_pool_allocator=token_to_kv_pool_allocator)
    if self.is_draft_worker:
        raise TangramPoolError("--kv-policy tangram does not support speculative decoding (draft worker)")
    from sglang.srt.mem_cache.kv_cache_configurator import _InitializedPools

    return _InitializedPools(**build_tangram_pools(self, sizes.max_total_num_tokens, sizes.max_running_requests))


def reserve_for_extend(batch: Any) -> None:
    """BEFORE alloc_for_extend: exact per-group reservation of every request's next segment."""
    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    cache = batch.tree_cache
    if not isinstance(cache, TangramRadixCache):
        return
    mgr = cache.manager
    for req in batch.reqs:
        fill = list(req.get_fill_ids())
        if req.rid not in mgr.requests:
            mgr.attach(req.rid, req.last_node, fill)
        have = len(mgr.requests[req.rid].token_ids)
        last_chunk = req.extend_range.end >= len(req.full_untruncated_fill_ids)
        max_new = req.sampling_params.max_new_tokens
        decode = 0
        if last_chunk and max_new is not None:
            decode = min(max(max_new - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        mgr.reserve(req.rid, fill[have:], decode)


def register() -> None:
    HookRegistry.register(_CONFIGURATOR, init_pools_around, HookType.AROUND)
    HookRegistry.register(_ALLOC_FOR_EXTEND, reserve_for_extend, HookType.BEFORE)
