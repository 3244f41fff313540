"""What the tangram pool holds right now, in the figures a serving engineer watches (logs, ``/metrics``).

:func:`kv_usage` walks the radix tree's segments and the running requests' own pages once; the figures:
pages in use per head group, the bytes of those pages, the bytes the same tokens would take as SGLang's
full KV cache (every head keeps every token), the tokens served from the tree at admission so far, and
the device slot-list arena (entries in use, decode steps that did not fit it and were built on the host).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tangram_sgl.pool.kv_manager import TangramKVManager


@dataclass(frozen=True)
class KVUsage:
    """A snapshot of the pool (see module docstring)."""

    pages_by_group: tuple[int, ...]
    free_pages: int
    tokens: int  # tokens whose K/V is held: tree segments + running requests' own tokens
    kept_bytes: int  # bytes of the pages in use (K and V)
    full_kv_bytes: int  # the same tokens in a full KV cache (K and V, every layer and kv head)
    prefix_hit_tokens: int  # cumulative tokens matched in the tree when requests started
    arena_used: int  # device slot-list arena entries held by running requests' mirrors
    arena_capacity: int
    arena_fallback_steps: int  # cumulative decode steps whose lists were built on the host (arena full)

    @property
    def saved_bytes(self) -> int:
        return self.full_kv_bytes - self.kept_bytes

    def log_line(self) -> str:
        p = self.pages_by_group
        ratio = self.kept_bytes / self.full_kv_bytes if self.full_kv_bytes else 0.0
        return (f"tangram KV: {self.tokens} tokens in {sum(p)} pages (per group min/mean/max "
                f"{min(p)}/{sum(p) / len(p):.1f}/{max(p)}, {self.free_pages} free), kept {self.kept_bytes / 2**30:.3f} "
                f"GiB = {ratio:.2f}x full KV (saved {self.saved_bytes / 2**30:.3f} GiB), prefix hit tokens "
                f"{self.prefix_hit_tokens}, slot arena {self.arena_used}/{self.arena_capacity} "
                f"({self.arena_fallback_steps} host-built decode steps)")


def _group_page_lists(mgr: TangramKVManager) -> Iterator[tuple[int, list[int]]]:
    """(group, pages) of every page list in use: tree segments, then what each running request owns."""
    for node in mgr.tree.nodes():
        yield from enumerate(gs.pages for gs in node.segment.groups)
    for req in mgr.requests.values():
        yield from req.group_page_lists()


def kv_usage(mgr: TangramKVManager) -> KVUsage:
    """Snapshot of ``mgr``'s pool (tree + running requests)."""
    by_group = [0] * mgr.num_groups
    for g, pages in _group_page_lists(mgr):
        by_group[g] += len(pages)
    tokens = sum(node.segment.n for node in mgr.tree.nodes())
    tokens += sum(len(req.token_ids) - req.prefix_len for req in mgr.requests.values())
    k = mgr.pool.k_buffer
    lay = mgr.layout
    token_bytes = 2 * lay.num_layers * lay.num_kv_heads * k.shape[-1] * k.element_size()
    dl = mgr.device_lists
    return KVUsage(tuple(by_group), mgr.free_pages(), tokens, sum(by_group) * mgr.pool.page_bytes(),
                   tokens * token_bytes, mgr.prefix_hit_tokens, dl.used, dl.capacity, mgr.arena_fallback_steps)
