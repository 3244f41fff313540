"""Invariant checker for a :class:`TangramKVManager` (tests; the server runs it behind a debug flag).

Checked: every allocatable page is exactly one of free / owned by a tree node / owned by a running request
(free + tree + requests = total, no page twice, page 0 never owned); every (owner, group) holds exactly
``pages_for(k_g)`` pages (no over-allocation); k_g follows the budget rule and kept positions are valid;
tree structure (positions chain, child index, counters, lock counts; ``deep``: no key an unresolved decoded
token id) and request token bookkeeping (unresolved ids only from ``unresolved_from`` on); the
device slot-list mirrors (only of running requests, arena blocks disjoint and accounted; ``deep``: each
mirror up to date with its request's lists holds a prefix of them, and the batched ``slot_lists`` CSR of
all running requests equals their per-group ``request_lists``).
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import torch

from tangram_sgl.budget import pages_for
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.request_kv import UNRESOLVED
from tangram_sgl.pool.reservation import segment_kept_counts
from tangram_sgl.pool.segment import Segment
from tangram_sgl.radix.tree import SegmentTree


class InvariantViolation(AssertionError):
    """The pool, tree or a request is in an inconsistent state."""


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


def _check_segment(mgr: TangramKVManager, seg: Segment, owner: object, deep: bool) -> None:
    ps = mgr.page_size
    for g, gs in enumerate(seg.groups):
        if len(gs.pages) != -(-gs.length // ps):
            _fail(f"{owner}: group {g} holds {len(gs.pages)} pages for {gs.length} slots (page_size {ps})")
    if seg.full:
        if any(gs.length != seg.n for gs in seg.groups):
            _fail(f"{owner}: full segment of {seg.n} tokens has group lengths {[gs.length for gs in seg.groups]}")
        return
    if not deep:
        return
    want = segment_kept_counts(mgr.layout, seg.n, seg.start, mgr.sink_tokens, mgr.recent_window)
    got = [gs.length for gs in seg.groups]
    if got != want:
        _fail(f"{owner}: kept counts {got} differ from the budget rule {want}")
    for g, kept in enumerate(seg.kept_on_host() or []):
        if kept.shape != (len(mgr.layout.members[g]), want[g]):
            _fail(f"{owner}: group {g} kept positions have shape {tuple(kept.shape)}")
        if kept.numel() and (kept.min() < 0 or kept.max() >= seg.n or (kept[:, 1:] <= kept[:, :-1]).any()):
            _fail(f"{owner}: group {g} kept positions are not ascending positions inside the segment")


def _check_device_lists(mgr: TangramKVManager, deep: bool) -> None:
    dl = mgr.device_lists
    stray = [rid for rid in dl.mirrors if rid not in mgr.requests]
    if stray:
        _fail(f"device slot lists of requests that are not running (leaked arena blocks): {stray[:4]!r}")
    blocks = sorted((m.block, m.size) for m in dl.mirrors.values() if m.size)
    if any(a + n > b for (a, n), (b, _) in pairwise(blocks)):
        _fail("two requests' arena blocks overlap")
    if sum(n for _, n in blocks) + dl.ranges.free_total != dl.capacity:
        _fail(f"arena: {sum(n for _, n in blocks)} entries in blocks + {dl.ranges.free_total} free != "
              f"{dl.capacity}")
    for rid, m in dl.mirrors.items():
        req = mgr.requests[rid]
        if any(n > c for n, c in zip(m.lens, m.caps)) or m.tokens > len(req.token_ids):
            _fail(f"request {rid!r}: device lists {m.lens} beyond their regions {m.caps} or its tokens")
        if deep and m.version == req.version:
            for g, host in enumerate(mgr.request_lists(rid)):
                if dl.read(rid, g).tolist() != host[:m.lens[g]].tolist():
                    _fail(f"request {rid!r}: device slot list of group {g} differs from its host list")
    if deep and mgr.requests:  # the batched CSR the extend steps read equals the per-group lists
        rids = list(mgr.requests)
        indptr, indices = mgr.slot_lists(rids)
        want = [x for rid in rids for x in mgr.request_lists(rid)]
        if indptr.tolist() != [0, *torch.cumsum(torch.tensor([len(x) for x in want]), 0).tolist()] or (
                indices.tolist() != torch.cat(want).tolist()):
            _fail(f"slot_lists of {rids[:4]!r} differ from their per-group request_lists")


def check_invariants(mgr: TangramKVManager, deep: bool = True) -> None:
    """Raise :class:`InvariantViolation` on the first broken invariant.

    ``deep=False`` skips re-deriving every compressed segment's k_g and kept positions (they are fixed at
    commit); page ownership, exact page counts, tree structure, counters and locks are always checked.
    """
    alloc = mgr.pool.allocator
    tree = mgr.tree
    owners: list[tuple[object, list[int]]] = [("free list", alloc.free_pages())]

    counters = Counter()
    for node in tree.nodes():
        seg = node.segment
        where = node
        if seg.start != node.parent.end:
            _fail(f"{where}: starts at {seg.start}, parent ends at {node.parent.end}")
        if node not in node.parent.children.get(seg.token_ids[0], ()):
            _fail(f"{where}: not indexed under its first token in its parent")
        if node.lock_ref < 0:
            _fail(f"{where}: negative lock count")
        if node.pages != seg.num_pages():
            _fail(f"{where}: counts {node.pages} pages, its segment holds {seg.num_pages()}")
        _check_segment(mgr, seg, where, deep)
        kind = "evictable" if node.lock_ref == 0 else "protected"
        counters[kind + "_pages"] += seg.num_pages()
        counters[kind + "_tokens"] += seg.n
        owners.append((where, list(seg.pages())))
    for name in ("evictable_pages", "protected_pages", "evictable_tokens", "protected_tokens"):
        if getattr(tree, name) != counters[name]:
            _fail(f"tree counter {name} = {getattr(tree, name)}, recount = {counters[name]}")

    locks = Counter()
    holders = [r.node for r in mgr.requests.values()]
    holders += [n for n, c in mgr.external_locks.items() for _ in range(c)]
    for node in holders:
        while node is not tree.root:
            locks[node] += 1
            node = node.parent
    for node in tree.nodes():
        if node.lock_ref != locks[node]:
            _fail(f"tree {node!r}: lock_ref {node.lock_ref} but {locks[node]} holders below it")
        if deep and UNRESOLVED in node.segment.token_ids:
            _fail(f"tree {node!r}: a key is an unresolved decoded token id")

    reachable = set(tree.nodes())
    for rid, req in mgr.requests.items():
        where = f"request {rid!r}"
        if req.node is not tree.root and req.node not in reachable:
            _fail(f"{where}: its prefix node {req.node!r} is not in the tree")
        toks = [t for n in SegmentTree.path(req.node) for t in n.segment.token_ids]
        pos = req.node.end
        for seg in req.segments + ([req.decode] if req.decode is not None else []):
            if seg.start != pos:
                _fail(f"{where}: segment starts at {seg.start}, expected {pos}")
            _check_segment(mgr, seg, where, deep)
            toks += seg.token_ids
            pos = seg.end
        if req.pending is not None:
            if req.pending.start != pos:
                _fail(f"{where}: pending segment starts at {req.pending.start}, expected {pos}")
            for g, (gs, k) in enumerate(zip(req.pending.groups, req.pending.kept_counts)):
                if len(gs.pages) != pages_for(k, mgr.page_size):
                    _fail(f"{where}: pending group {g} holds {len(gs.pages)} pages for k={k}")
            toks += req.pending.token_ids
        if toks != req.token_ids:
            _fail(f"{where}: token bookkeeping differs from its segments")
        known = req.token_ids if req.unresolved_from is None else req.token_ids[:req.unresolved_from]
        if UNRESOLVED in known:
            _fail(f"{where}: an unresolved token id before its first unresolved position {req.unresolved_from}")
        owners.append((where, list(req.owned_pages())))

    all_pages = [p for _, pages in owners for p in pages]
    if len(set(all_pages)) != len(all_pages) or 0 in all_pages:
        seen: dict[int, object] = {}
        for where, pages in owners:
            for p in pages:
                if p == 0:
                    _fail(f"{where!r} holds the reserved null page 0")
                if p in seen:
                    _fail(f"page {p} is held by both {seen[p]!r} and {where!r}")
                seen[p] = where
    if not mgr.null_page_is_padding_sink and (mgr.pool.k_buffer[0].any() or mgr.pool.v_buffer[0].any()):
        _fail("the null page 0 was written (no CUDA-graph padding rows exist to write it)")
    if len(all_pages) != alloc.usable_pages:
        _fail(f"free + tree + requests = {len(all_pages)} pages, pool has {alloc.usable_pages}")
    held = sum(len(pages) for where, pages in owners if isinstance(where, str) and where.startswith("request "))
    if mgr.request_pages() != held:
        _fail(f"request_pages() = {mgr.request_pages()}, recount of the requests' pages = {held}")
    _check_device_lists(mgr, deep)
