"""Radix tree over compressed segments: multi-turn hits, branch sharing, atomic compressed nodes, page-aligned
splits of full nodes, dedup, LRU eviction; and, at budget 1.0, the same hits and evictions as SGLang's own
``RadixCache`` on one operation trace."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import torch
from test_pool_support import StepClock, decode, prefill, toy_manager

from tangram_sgl.pool.invariants import check_invariants
from tangram_sgl.pool.reference_store import ReferenceKVStore, check_request
from tangram_sgl.radix.tree import SegmentTree, common_prefix


def run_turn(mgr, rid, prompt, n_decode, ref=None):
    m = mgr.admit(rid, prompt, max_prefix_len=len(prompt) - 1)
    if ref is not None:
        ref.begin(rid, prompt[: m.length], [(s.start, s.end, s.full) for s in m.segments()])
    prefill(mgr, rid, prompt[m.length:], n_decode, ref)
    for t in range(n_decode):
        decode(mgr, rid, 500 + t, ref)
    if ref is not None:
        check_request(mgr, ref, rid)
    history = list(mgr.requests[rid].token_ids)
    mgr.finish(rid)
    if ref is not None:
        ref.publish(rid)
        ref.drop(rid)
    return m.length, history


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(999)) + [5]) == 999


def test_next_turn_hits_the_previous_turns_compressed_prefix():
    mgr = toy_manager(num_pages=200)
    ref = ReferenceKVStore(mgr.layout, mgr.sink_tokens, mgr.recent_window)
    hit, hist = run_turn(mgr, "t0", list(range(1, 40)), 6, ref)
    assert hit == 0
    hit, hist2 = run_turn(mgr, "t1", hist + list(range(60, 75)), 4, ref)
    assert hit == len(hist)  # whole previous turn: compressed prompt + its decoded tokens
    hit, _ = run_turn(mgr, "t2", hist2 + [80, 81], 2, ref)
    assert hit == len(hist2)
    check_invariants(mgr)


def test_two_branches_share_the_turn_they_start_from():
    mgr = toy_manager(num_pages=200)
    ref = ReferenceKVStore(mgr.layout, mgr.sink_tokens, mgr.recent_window)
    _, hist = run_turn(mgr, "root", list(range(1, 40)), 5, ref)
    shared = mgr.match(hist)
    assert shared.length == len(hist)
    pages_before = mgr.pool.allocator.usable_pages - mgr.free_pages()
    for b, last in (("x", 1), ("y", 2)):
        m = mgr.admit(b, hist + [70, 71, 72, last])
        assert m.node is shared.node  # both branches stand on the very same node
        ref.begin(b, hist, [(s.start, s.end, s.full) for s in m.segments()])
        prefill(mgr, b, [70, 71, 72, last], 0, ref)
    for b in ("x", "y"):
        check_request(mgr, ref, b)
    # the shared prefix is stored once: the two branches added only their own segments
    own = sum(s.num_pages() for b in ("x", "y") for s in mgr.requests[b].segments)
    assert mgr.pool.allocator.usable_pages - mgr.free_pages() == pages_before + own
    assert shared.node.lock_ref == 2
    check_invariants(mgr)


def test_compressed_node_is_atomic_and_full_node_splits_on_page_boundaries():
    mgr = toy_manager(num_pages=200)  # page_size 4
    prompt = list(range(1, 31))
    _, hist = run_turn(mgr, "a", prompt, 10)
    (comp, dec) = SegmentTree.path(mgr.match(hist).node)
    assert not comp.segment.full and dec.segment.full and dec.segment.n == 10
    # diverging inside the compressed node: only the root matches
    assert mgr.match(prompt[:20] + [999]).length == 0
    # diverging after 7 of the 10 decoded tokens: the full node splits at 4 (a page boundary), not 7
    m = mgr.match(hist[:37] + [999])
    assert m.length == 34 and m.node.segment.n == 4 and m.node.segment.full
    assert [n.segment.n for n in SegmentTree.path(mgr.match(hist).node)] == [30, 4, 6]
    check_invariants(mgr)


def test_identical_compressed_segment_is_deduplicated():
    mgr = toy_manager(num_pages=200)
    p = list(range(1, 30))
    for rid in ("a", "b"):
        mgr.admit(rid, p)
        prefill(mgr, rid, p)
    free_before = mgr.free_pages()
    own_b = mgr.requests["b"].segments[0].num_pages()
    mgr.finish("a")
    mgr.finish("b")  # b's copy is released, the tree keeps one node
    assert len(list(mgr.tree.nodes())) == 1
    assert mgr.free_pages() == free_before + own_b
    check_invariants(mgr)


def test_lru_eviction_frees_whole_nodes_cascades_and_spares_locked_ones():
    mgr = toy_manager(num_pages=300)
    _, h1 = run_turn(mgr, "a", list(range(1, 20)), 3)
    _, h2 = run_turn(mgr, "b", list(range(100, 120)), 3)
    _, _ = run_turn(mgr, "c", h1 + [7, 8, 9], 0)
    mgr.admit("lock", h2 + [5])  # pins b's path
    pages, tokens = mgr.tree.evict(1)
    assert tokens == 3 and pages > 0  # the least recently used unlocked leaf is c's new segment [7, 8, 9]
    _, tokens = mgr.tree.evict(10_000)
    assert tokens == len(h1)  # then a's decode node and its prompt node (cascade)
    assert list(mgr.tree.nodes()) and mgr.tree.evictable_pages == 0
    assert mgr.match(h2).length == len(h2)
    check_invariants(mgr)


# --------------------------------------------------------------------------- SGLang equivalence


class _RecordingAllocator:
    """Stands in for SGLang's KV allocator: the radix cache only frees through it."""

    device = "cpu"

    def __init__(self):
        self.freed = 0

    def free_segment(self, idx, start_pos=0):
        self.freed += len(idx)

    def free_segments(self, segs):
        for idx, _ in segs:
            self.freed += len(idx)


def _sglang_cache():
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=_RecordingAllocator(), page_size=1))


def _leaf_paths_sglang(cache):
    out, stack = set(), [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(node.key.token_ids)
        if not node.children and node is not cache.root_node:
            out.add(path)
        stack.extend((c, path) for c in node.children.values())
    return out


def _leaf_paths_tangram(mgr):
    return {tuple(t for n in SegmentTree.path(x) for t in n.tokens) for x in mgr.tree.nodes() if x.is_leaf()}


def test_budget_one_behaves_like_sglang_radix_cache(monkeypatch):
    import sglang.srt.mem_cache.radix_cache as rc
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    monkeypatch.setattr(rc, "time", StepClock())
    sg = _sglang_cache()
    mgr = toy_manager(num_pages=4000, page_size=1, budget=1.0)
    G = mgr.num_groups
    rng = random.Random(3)
    histories, running, next_rid = [], {}, 0
    hits = evictions = 0

    def key(toks):
        return RadixKey(array("q", toks))

    def sg_lock_move(req, toks):
        res = sg.insert(InsertParams(key=key(toks), value=torch.arange(len(toks))))
        new = sg.match_prefix(MatchPrefixParams(key=key(toks))).last_device_node
        sg.dec_lock_ref(req.sg_node)
        sg.inc_lock_ref(new)
        req.sg_node = new
        return res

    for step in range(1500):
        r = rng.random()
        if r < 0.25 and len(running) < 5:
            base = rng.choice(histories) if histories and rng.random() < 0.75 else []
            if rng.random() < 0.3 and base:
                base = base[: rng.randrange(1, len(base) + 1)]  # diverge inside a node: split
            prompt = base + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
            rid, next_rid = next_rid, next_rid + 1
            m_sg = sg.match_prefix(MatchPrefixParams(key=key(prompt[:-1])))
            sg.inc_lock_ref(m_sg.last_device_node)
            m = mgr.admit(rid, prompt, max_prefix_len=len(prompt) - 1)
            assert m.length == len(m_sg.device_indices), f"step {step}: hit {m.length} vs {len(m_sg.device_indices)}"
            hits += m.length
            rest = prompt[m.length:]
            cut = rng.randrange(1, len(rest) + 1)
            running[rid] = SimpleNamespace(sg_node=m_sg.last_device_node, chunks=[rest[:cut], rest[cut:]],
                                           n_decode=rng.randrange(0, 6))
        elif r < 0.35:
            n = rng.randrange(1, 40)
            got_sg = sg.evict(EvictParams(num_tokens=n)).num_tokens_evicted
            pages, tokens = mgr.tree.evict(n, unit="tokens")
            assert tokens == got_sg and pages == G * tokens, f"step {step}: evicted {tokens} vs {got_sg}"
            evictions += tokens
        elif r < 0.4 and running:
            rid = rng.choice(list(running))
            sg.dec_lock_ref(running.pop(rid).sg_node)
            mgr.abort(rid)
        elif running:
            rid = rng.choice(list(running))
            req = running[rid]
            if req.chunks and req.chunks[0]:
                prefill(mgr, rid, req.chunks.pop(0))
                if req.chunks and req.chunks[0]:  # chunk boundary: both caches publish the prefix so far
                    mgr.checkpoint(rid)
                    sg_lock_move(req, mgr.requests[rid].token_ids)
            elif req.n_decode:
                decode(mgr, rid, rng.randrange(1, 6))
                req.n_decode -= 1
            else:
                toks = list(mgr.requests[rid].token_ids)
                sg.insert(InsertParams(key=key(toks), value=torch.arange(len(toks))))
                sg.dec_lock_ref(req.sg_node)
                mgr.finish(rid)
                del running[rid]
                histories.append(toks)
        assert sg.evictable_size() == mgr.tree.evictable_tokens, f"step {step}"
        assert sg.protected_size() == mgr.tree.protected_tokens, f"step {step}"
        assert _leaf_paths_sglang(sg) == _leaf_paths_tangram(mgr), f"step {step}"
        check_invariants(mgr)
    assert hits > 500 and evictions > 200  # the trace exercised both
