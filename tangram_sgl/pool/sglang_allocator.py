"""SGLang-facing token allocator for the tangram pool (SGLang 0.5.17).

SGLang's token-level indices (``req_to_token``, ``out_cache_loc``) keep working, but as *logical* ids
with no K/V behind them: the K/V of a token lives in per-(owner, head group) slot lists, and which
tokens a head dropped is explicit in the segment's kept-position lists (see ``tangram_sgl.pool.segment``).
A per-token map to one slot cannot exist, because the heads of a group keep different positions.
Logical ids are held only by running requests for their own tokens; tokens owned by the radix tree
carry the null id 0 in ``req_to_token``.

Memory is reported to the scheduler in *full-KV-token equivalents*: a token kept by every group costs
one slot in each of the G groups, i.e. ``G / page_size`` pages. The pool is sized so that its usable
pages hold exactly the scheduler's ``max_total_num_tokens`` T such tokens; evictable, protected and
request-held pages are reported rounded up and ``available_size`` is the rest of T, so SGLang's idle
check (available + evictable + protected == T) holds exactly while no size is ever overstated. SGLang's
admission estimate (extend + max_new tokens at full cost) is conservative, so the exact per-group
reservation (``TangramKVManager.reserve``) fits what the scheduler admitted. The pages running requests
need for their next decode step (beyond their reserved decode pages) are held back too, so SGLang's
``check_decode_mem`` retracts in time.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from tangram_sgl.budget import pages_for
from tangram_sgl.pool.kv_manager import TangramKVManager


def pages_to_tokens(mgr: TangramKVManager, pages: int) -> int:
    """Full-KV-token equivalents of ``pages`` pages (rounded up)."""
    return -(-pages * mgr.page_size // mgr.num_groups)


def tokens_to_pages(mgr: TangramKVManager, tokens: int) -> int:
    """Pages that hold ``tokens`` full-KV tokens (rounded up)."""
    return pages_for(tokens * mgr.num_groups, mgr.page_size)


def pool_pages_for_tokens(num_groups: int, page_size: int, max_total_tokens: int) -> int:
    """Pool size (null page included) whose usable pages hold ``max_total_tokens`` full-KV tokens."""
    return pages_for(max_total_tokens * num_groups, page_size) + 1


class TangramTokenAllocator(TokenToKVPoolAllocator):
    """Logical token ids (page size 1, no K/V) whose availability is bounded by the tangram pool."""

    def __init__(self, manager: TangramKVManager, max_total_tokens: int, logical_size: int, dtype: torch.dtype,
                 device: str, kvcache: object = None):
        have = pages_to_tokens(manager, manager.pool.allocator.usable_pages)
        if have < max_total_tokens:
            raise ValueError(f"the tangram pool holds {have} full-KV tokens, fewer than the {max_total_tokens} "
                             f"the scheduler is told about")
        self.manager = manager
        self.max_total_tokens = max_total_tokens
        super().__init__(logical_size, dtype, device, kvcache, need_sort=False)

    def available_size(self) -> int:
        """T minus (rounded-up) tree, request-held and next-decode pages; capped by free logical ids."""
        m = self.manager
        used = (pages_to_tokens(m, m.evictable_pages()) + pages_to_tokens(m, m.protected_pages())
                + pages_to_tokens(m, m.request_pages() + m.next_decode_pages()))
        return max(0, min(super().available_size(), self.max_total_tokens - used))

    def debug_print(self) -> str:
        m = self.manager
        return (f"tangram pool: {m.free_pages()} free, {m.evictable_pages()} evictable, {m.protected_pages()} "
                f"protected, {m.request_pages()} held by requests (pages of {m.page_size} tokens x "
                f"{m.layout.heads_per_group} heads)")
