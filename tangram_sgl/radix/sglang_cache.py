"""``TangramRadixCache``: SGLang 0.5.17's prefix-cache interface over the tangram segment tree.

The scheduler matches, locks, inserts (``cache_unfinished_req`` at chunk boundaries,
``cache_finished_req`` on finish or retraction) and evicts exactly as with ``RadixCache``; node handles
are :class:`~tangram_sgl.radix.tree.SegmentNode` objects. Differences, all from compression:
- a match ends at a node boundary (compressed segments are atomic; full ones split on page boundaries);
- ``device_indices`` of a match are null logical ids (the tree holds K/V in head-group pages, not under
  token ids; see ``tangram_sgl.pool.sglang_allocator``) — only their count is meaningful;
- sizes (evictable, protected, evicted) are full-KV-token equivalents of pages.
The request's K/V side (reserve -> per-layer writes -> commit -> decode appends) is driven by the memory
hook (``tangram_sgl.patches.memory_pool``) and the attention backend through the shared manager.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from tangram_sgl.pool.invariants import check_invariants
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.sglang_allocator import pages_to_tokens, tokens_to_pages
from tangram_sgl.radix.tree import SegmentNode

logger = logging.getLogger(__name__)
DEBUG_ENV = "TANGRAM_DEBUG_INVARIANTS"  # "1": run the invariant checker after every cache operation


class TangramCacheError(RuntimeError):
    """The scheduler asked the tangram cache for something it cannot do."""


class TangramRadixCache(BasePrefixCache):
    """Prefix cache whose nodes own compressed head-group segments (see module docstring)."""

    def __init__(self, params: CacheInitParams, manager: TangramKVManager):
        if params.disable:
            raise TangramCacheError("--kv-policy tangram needs the radix cache; do not pass --disable-radix-cache")
        if params.is_eagle:
            raise TangramCacheError("--kv-policy tangram does not support speculative decoding (EAGLE keys)")
        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = 1  # logical ids are per token; pool pages are per (owner, head group)
        self.manager = manager
        self.device = torch.device(getattr(params.token_to_kv_pool_allocator, "device", "cpu") or "cpu")
        self.root_node = manager.tree.root
        self.debug_invariants = os.environ.get(DEBUG_ENV) == "1"

    def _check(self) -> None:
        if self.debug_invariants:
            check_invariants(self.manager, deep=False)

    # ------------------------------------------------------------------ sizes (full-KV-token units)
    def _tokens(self, pages: int) -> int:
        return pages_to_tokens(self.manager, pages)

    def evictable_size(self) -> int:
        return self._tokens(self.manager.evictable_pages())

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        return self._tokens(self.manager.protected_pages())

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return self._tokens(self.manager.tree.tree_pages())

    # ------------------------------------------------------------------ tree operations
    def reset(self) -> None:
        if self.manager.requests or self.manager.external_locks:
            raise TangramCacheError(f"cannot flush the tangram cache while {len(self.manager.requests)} requests "
                                    f"run")
        self.manager.tree.evict(self.manager.tree.tree_pages())
        alloc, arena = self.manager.pool.allocator, self.manager.device_lists
        leaked = alloc.usable_pages - alloc.free_count()
        (logger.error if leaked or arena.used else logger.info)(
            "tangram cache flushed: %d of %d pages free, %d pages leaked, %d slot-arena entries leaked",
            alloc.free_count(), alloc.usable_pages, leaked, arena.used)
        self._check()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if key.extra_key is not None:
            raise TangramCacheError("the tangram radix cache has no extra_key namespaces (LoRA / cache_salt)")
        node, length = self.manager.tree.match(list(key.raw_token_ids()))
        return MatchResult(device_indices=torch.zeros(length, dtype=torch.int64, device=self.device),
                           last_device_node=node, last_host_node=node, best_match_node=node)

    def inc_lock_ref(self, node: SegmentNode) -> IncLockRefResult:
        if node is self.root_node:
            return IncLockRefResult(delta=0)
        before = self.manager.evictable_pages()
        self.manager.lock_node(node)
        return IncLockRefResult(delta=self._tokens(self.manager.evictable_pages()) - self._tokens(before))

    def dec_lock_ref(self, node: SegmentNode, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if node is self.root_node:
            return DecLockRefResult(delta=0)
        before = self.manager.evictable_pages()
        self.manager.unlock_node(node)
        return DecLockRefResult(delta=self._tokens(self.manager.evictable_pages()) - self._tokens(before))

    def evict(self, params: EvictParams) -> EvictResult:
        pages, _ = self.manager.tree.evict(tokens_to_pages(self.manager, params.num_tokens))
        self._check()
        return EvictResult(num_tokens_evicted=self._tokens(pages))

    # ------------------------------------------------------------------ request-level operations
    def _row(self, req: Any, end: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :end]

    def _resolve(self, req: Any) -> None:
        """The ids of the request's decoded tokens, which the attention backend opened without reading them."""
        start = self.manager.requests[req.rid].unresolved_from
        if start is not None:
            prompt = len(req.origin_input_ids)
            tail = list(req.origin_input_ids[start:]) + list(req.output_ids[max(0, start - prompt):])
            self.manager.resolve_tokens(req.rid, tail, offset=start)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Chunk boundary: publish the request's committed segments and move its lock to the new node."""
        rid = req.rid
        if rid not in self.manager.requests:
            raise TangramCacheError(f"request {rid!r} reached cache_unfinished_req without a tangram reservation")
        self.manager.commit_if_written(rid)
        if self.manager.requests[rid].pending is not None:
            raise TangramCacheError(f"request {rid!r}: its segment was not fully written by the attention backend")
        self._resolve(req)
        new_len = self.manager.checkpoint(rid).length
        row = self._row(req, len(req.get_fill_ids()))
        # the tree now owns [cache_protected_len, new_len): their logical ids go back, the row holds null ids
        self.token_to_kv_pool_allocator.free(row[req.cache_protected_len:new_len].to(torch.int64).clone())
        row[req.cache_protected_len:new_len] = 0
        req.prefix_indices = row.to(torch.int64).clone()
        req.cache_protected_len = new_len
        node = self.manager.requests[rid].node
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.last_node = node
        self._check()

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int, **kwargs: Any) -> None:
        """Finish (insert everything into the tree) or retract (``is_insert=False``: free everything)."""
        rid = req.rid
        if rid in self.manager.requests:
            self.manager.commit_if_written(rid)
            if not is_insert:
                self.manager.abort(rid)
            elif self.manager.requests[rid].pending is not None:
                raise TangramCacheError(f"request {rid!r} finished with a segment the attention backend did not "
                                        f"fully write")
            else:
                self._resolve(req)
                held = len(self.manager.requests[rid].token_ids)
                if held != kv_len_to_handle:  # overlap scheduling: both count the last token's in-flight KV
                    raise TangramCacheError(f"request {rid!r} finished with {kv_len_to_handle} tokens of KV in "
                                            f"SGLang's account but {held} in the tangram cache")
                self.manager.finish(rid)
        row = self._row(req, kv_len_to_handle)
        self.token_to_kv_pool_allocator.free(row[req.cache_protected_len:].to(torch.int64).clone())
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self._check()

    # ------------------------------------------------------------------ misc
    def pretty_print(self) -> None:
        for node in self.manager.tree.nodes():
            depth = len(self.manager.tree.path(node))
            print("  " * depth + repr(node))
        print(f"#tokens: {self.total_size()} (full-KV-token equivalents)")
