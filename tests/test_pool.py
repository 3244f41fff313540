"""Page allocator, exact reservation, compaction into head-group slots, decode, abort, refusal."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_pool_support import D, H, L, decode, prefill, token_kv, token_scores, toy_manager

from tangram_sgl.budget import kept_tokens, pages_for
from tangram_sgl.pool.invariants import InvariantViolation, check_invariants
from tangram_sgl.pool.page_allocator import PageAllocator, PoolExhausted
from tangram_sgl.pool.reservation import AdmissionError, pages_per_group
from tangram_sgl.selection import kept_positions_reference, pad_scores, select_kept_ragged


def test_allocator_never_hands_out_page_zero_and_rejects_bad_frees():
    a = PageAllocator(5)
    pages = a.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4] and a.free_count() == 0
    with pytest.raises(PoolExhausted):
        a.alloc(1)
    a.free([3])
    with pytest.raises(ValueError, match="double free"):
        a.free([3])
    with pytest.raises(ValueError, match="not an allocatable page"):
        a.free([0])
    with pytest.raises(PoolExhausted):
        a.alloc(2)
    assert a.free_count() == 1  # a failed alloc takes nothing
    assert a.alloc(1) == [3]  # LIFO: the page freed last comes back first


def test_allocator_refuses_a_bad_free_whole():
    """A free with a double or an out-of-range page frees none of its pages, so nothing is half-returned."""
    a = PageAllocator(6)
    pages = a.alloc(4)
    with pytest.raises(ValueError, match=f"double free of page {pages[0]}"):
        a.free([pages[1], pages[0], pages[0]])
    with pytest.raises(ValueError, match="not an allocatable page"):
        a.free([pages[1], 6])
    assert a.free_count() == 1 and sorted(a.free_pages() + pages) == [1, 2, 3, 4, 5]
    a.free(pages)
    assert a.free_count() == 5 and a.alloc(2) == pages[-2:]


def test_null_page_written_only_by_cuda_graph_padding():
    """Page 0 is never owned; its contents matter only before decode graphs exist (their padding rows write
    it): a write there without graph buffers is an invariant violation."""
    mgr = toy_manager(num_pages=16)
    check_invariants(mgr)
    mgr.pool.k_buffer[0, 0, 0, 0] = 1.0
    with pytest.raises(InvariantViolation, match="null page 0 was written"):
        check_invariants(mgr)
    mgr.null_page_is_padding_sink = True  # what DecodeGraphBuffers sets
    check_invariants(mgr)


def test_reservation_is_exact_per_group():
    mgr = toy_manager(num_pages=64)
    assert mgr.layout.group_budget == (1.0, 0.6, 0.3, 0.2)
    toks = list(range(100, 130))
    mgr.admit("a", toks)
    free0 = mgr.free_pages()
    counts = mgr.reserve("a", toks, decode_tokens=5)
    # k_g = min(n, ceil(b*n) + sink(2) + window(3)) for n = 30 at position 0
    assert counts == [30, 18 + 5, 9 + 5, 6 + 5]
    want = [pages_for(k, 4) + pages_for(5, 4) for k in counts]
    assert want == [10, 8, 6, 5]
    assert pages_per_group(mgr.layout, 30, 0, 5, 2, 3) == want
    assert free0 - mgr.free_pages() == sum(want)
    check_invariants(mgr)


def test_kept_counts_of_all_groups_at_once_equal_the_scalar_rule():
    """The vectorised k_g of every group (reservation's path) equals ``kept_tokens`` per budget, including
    segments shorter than the protected tokens, empty segments and budgets 0 / 1 / a millionth."""
    import random

    from tangram_sgl.budget import group_kept_tokens

    rng = random.Random(0)
    for _ in range(2000):
        budgets = [rng.choice([0.0, 1.0, 1e-6, 0.999999, rng.random(), round(rng.random(), 3)]) for _ in range(6)]
        n, start, sink, window = rng.randint(-1, 70000), rng.randint(0, 99999), rng.randint(0, 8), rng.randint(0, 64)
        assert group_kept_tokens(budgets, n, start, sink, window) == [
            kept_tokens(b, n, start, sink, window) for b in budgets]


def test_segment_is_compacted_into_its_slots_per_head():
    mgr = toy_manager(num_pages=64)
    toks = list(range(1, 41))
    mgr.admit("a", toks)
    prefill(mgr, "a", toks)
    k, v = token_kv(toks, 0, 40)
    s = token_scores(toks, 0, 40)
    for layer in range(L):
        for head in range(H):
            g = mgr.layout.layers[layer].group[head]
            kg = kept_tokens(mgr.layout.group_budget[g], 40, 0, 2, 3)
            want = torch.tensor(kept_positions_reference(s[layer, head].tolist(), kg, 0, 2, 3))
            gk, gv, pos = mgr.gather("a", layer, head)
            assert torch.equal(pos, want) and len(pos) == kg
            assert torch.equal(gk, k[layer, head, want]) and torch.equal(gv, v[layer, head, want])
    check_invariants(mgr)


def test_slot_lists_csr_addresses_the_kept_tokens():
    mgr = toy_manager(num_pages=64)
    for rid, toks in (("a", list(range(1, 30))), ("b", list(range(50, 61)))):
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks)
        decode(mgr, rid, 7)
    indptr, indices = mgr.slot_lists(["a", "b"])
    G = mgr.num_groups
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32 and len(indptr) == 2 * G + 1
    ps = mgr.page_size
    for r, rid in enumerate(["a", "b"]):
        for layer in range(L):
            slots_of = mgr.layout.layers[layer]
            for head in range(H):
                g, c = slots_of.group[head], slots_of.column[head]
                sl = indices[indptr[r * G + g]: indptr[r * G + g + 1]].long()
                got = mgr.pool.k_buffer[sl // ps, c, sl % ps]
                assert torch.equal(got, mgr.gather(rid, layer, head)[0])


def test_slot_lists_are_the_request_lists_in_request_group_order():
    """Requests of several segments (a shared tree prefix, own segments, decode tokens) and one with none yet:
    the CSR holds each request's per-group lists in (request, group) order."""
    mgr = toy_manager(num_pages=96)
    shared = list(range(1, 30))
    for rid, toks in (("a", shared), ("b", list(range(50, 61)))):
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks)
        decode(mgr, rid, 5)
    mgr.finish("a")
    mgr.admit("c", shared + [99] * 6)  # on a's cached path
    prefill(mgr, "c", [99] * 6)
    mgr.admit("d", [7, 8, 9])  # nothing committed yet
    rids = ["b", "c", "d"]
    indptr, indices = mgr.slot_lists(rids)
    want = [x for rid in rids for x in mgr.request_lists(rid)]
    assert indptr.tolist() == [0, *itertools.accumulate(len(x) for x in want)]
    assert indices.tolist() == torch.cat(want).tolist()


def test_decoded_ids_opened_unresolved_are_resolved_before_the_tree_keys_them():
    """A server step opens decode slots without the ids (``UNRESOLVED``): publishing them is refused until
    ``resolve_tokens`` gives them (from an offset, partially), a disagreeing id raises, and the finished tree
    holds the real ids (a later request matches them)."""
    from tangram_sgl.pool.request_kv import UNRESOLVED

    mgr = toy_manager(num_pages=64)
    prompt = list(range(1, 20))
    mgr.admit("a", prompt)
    prefill(mgr, "a", prompt, decode_tokens=3)
    for _ in range(3):
        mgr.open_decode_slots(["a"])
    assert mgr.requests["a"].token_ids[-3:] == [UNRESOLVED] * 3 and mgr.requests["a"].unresolved_from == 19
    check_invariants(mgr)
    with pytest.raises(ValueError, match="token 19 is 77 here"):
        mgr.requests["a"].token_ids[19] = 77  # as if a different id had been recorded
        mgr.resolve_tokens("a", [70, 71], offset=19)
    mgr.requests["a"].token_ids[19] = UNRESOLVED
    mgr.resolve_tokens("a", prompt)  # nothing decoded in it: nothing changes
    assert mgr.requests["a"].unresolved_from == 19
    mgr.resolve_tokens("a", [70, 71], offset=19)  # the third id is not known yet
    assert mgr.requests["a"].unresolved_from == 21 and mgr.requests["a"].decode.token_ids == [70, 71, UNRESOLVED]
    with pytest.raises(RuntimeError, match="no token id yet"):
        mgr.finish("a")
    mgr.resolve_tokens("a", prompt + [70, 71, 72])
    assert mgr.requests["a"].unresolved_from is None
    mgr.finish("a")
    check_invariants(mgr)
    assert mgr.admit("b", prompt + [70, 71, 72, 5], max_prefix_len=22).length == 22


def test_refused_with_a_clear_reason_and_nothing_allocated():
    mgr = toy_manager(num_pages=20)
    toks = list(range(1, 200))
    mgr.admit("big", toks)
    free0 = mgr.free_pages()
    with pytest.raises(AdmissionError, match=r"needs \d+ pages but only 19 are free and 0 evictable"):
        mgr.reserve("big", toks)
    assert mgr.free_pages() == free0
    mgr.abort("big")
    check_invariants(mgr)
    assert mgr.free_pages() == 19


def test_reservation_evicts_unlocked_nodes_but_never_a_locked_prefix():
    mgr = toy_manager(num_pages=40)
    a = list(range(1, 30))
    mgr.admit("a", a)
    prefill(mgr, "a", a)
    mgr.finish("a")
    held = mgr.evictable_pages()
    assert held > 0
    # a second conversation continuing "a" locks its prefix; a third, unrelated one needs more than is free
    mgr.admit("b", a + [99])
    assert mgr.evictable_pages() == 0 and mgr.protected_pages() == held
    mgr.admit("c", list(range(200, 260)))
    with pytest.raises(AdmissionError, match="pinned by running requests"):
        mgr.reserve("c", list(range(200, 260)))
    assert mgr.protected_pages() == held  # the locked prefix survived
    mgr.abort("c")
    mgr.abort("b")
    mgr.admit("d", list(range(300, 330)))
    prefill(mgr, "d", list(range(300, 330)))  # now the tree node is evicted to make room
    assert mgr.evictable_pages() == 0 and not list(mgr.tree.nodes())
    check_invariants(mgr)


def test_decode_allocates_on_demand_and_abort_frees_everything():
    mgr = toy_manager(num_pages=64)
    toks = list(range(1, 9))
    mgr.admit("a", toks)
    prefill(mgr, "a", toks, decode_tokens=0)
    before = mgr.free_pages()
    for t in range(5):
        decode(mgr, "a", 100 + t)
    # 5 decoded tokens at page_size 4 -> 2 pages in each of the 4 groups
    assert before - mgr.free_pages() == 2 * mgr.num_groups
    check_invariants(mgr)
    mgr.abort("a")
    check_invariants(mgr)
    assert mgr.free_pages() == mgr.pool.allocator.usable_pages


def test_decode_refused_when_the_pool_is_full():
    mgr = toy_manager(num_pages=12)
    toks = list(range(1, 13))
    mgr.admit("a", toks)
    prefill(mgr, "a", toks)
    with pytest.raises(AdmissionError, match="decode step"):
        for t in range(100):
            decode(mgr, "a", t)
    check_invariants(mgr)


def test_pool_buffers_follow_the_layout_contract():
    mgr = toy_manager(num_pages=10)
    assert mgr.pool.k_buffer.shape == (10, 2, 4, D) == mgr.pool.v_buffer.shape
    assert mgr.pool.page_bytes() == 2 * 2 * 4 * D * 4


def test_slot_list_cache_follows_every_growth():
    """GroupSlots caches its whole slot tensor; growing the list (decode append, new page, segment append)
    gives the new slots, never the stale tensor."""
    from tangram_sgl.pool.segment import GroupSlots, Segment

    gs = GroupSlots([5], 3)
    assert gs.slots(4).tolist() == [20, 21, 22] and gs.slots(4) is gs.slots(4)
    gs.length += 1
    assert gs.slots(4).tolist() == [20, 21, 22, 23]
    gs.pages.append(9)
    gs.length += 1
    assert gs.slots(4).tolist() == [20, 21, 22, 23, 36]
    a = Segment(0, [1] * 4, True, [GroupSlots([2], 4)])
    a.groups[0].slots(4)
    a.append(Segment(4, [1] * 2, True, [GroupSlots([7], 2)]), 4)
    assert a.groups[0].slots(4).tolist() == [8, 9, 10, 11, 28, 29]


def test_slot_tables_batch_equals_each_segments_group_lists():
    """``slot_tables`` of several segments at once (one repeated, one grown since its table was cached) holds
    each segment's group lists, concatenated group-major, with their lengths and offsets."""
    from tangram_sgl.pool.segment import GroupSlots, Segment, slot_tables

    a = Segment(0, [1] * 8, True, [GroupSlots([3, 4], 8), GroupSlots([6, 2], 8)])
    b = Segment(8, [1] * 3, False, [GroupSlots([9], 2), GroupSlots([], 0)])
    old = a.slot_table(4)
    a.append(Segment(8, [1] * 2, True, [GroupSlots([7], 2), GroupSlots([5], 2)]), 4)  # a grows: its cache is stale
    tables = slot_tables([a, b, a], 4)
    assert tables[0] is tables[2] and tables[0] is not old
    for seg, t in zip((a, b), tables):
        want = [gs.slots(4) for gs in seg.groups]
        assert t.lengths.tolist() == [len(x) for x in want]
        assert t.offsets.tolist() == [0, *itertools.accumulate(len(x) for x in want)][:-1]
        assert t.slots.tolist() == torch.cat(want).tolist()


def test_slot_tables_on_a_device_carry_pages_not_slots(monkeypatch):
    """Tables built for a device (``meta`` stands in for the GPU) send it page lists and list bounds, not the
    slots (page_size times as many); each table there has its segment's shape, and a second ask copies nothing."""
    from tangram_sgl.pool import segment

    sent = []
    monkeypatch.setattr(segment, "to_device", lambda t, dev: sent.append(t.numel()) or t.to(dev))
    segs = [segment.Segment(0, [1] * 64, True, [segment.GroupSlots(list(range(4 * g + 16 * i, 4 * g + 16 * i + 4)), 64)
                                                for g in range(3)]) for i in range(2)]
    tables = segment.slot_tables(segs, 16, torch.device("meta"))
    assert sent == [2 * 3 * 4 + 2 * 2 * 3]  # 24 pages, then each list's first page and length
    assert [t.slots.shape for t in tables] == [(3 * 64,)] * 2 and tables[0].slots.device.type == "meta"
    assert segment.slot_tables(segs, 16, torch.device("meta"))[1] is tables[1] and len(sent) == 1

def test_slot_lists_on_a_device_are_cached_per_list_state():
    """Lists read on another device (``meta`` stands in for the GPU) are copied there once per list state
    and dropped when the list grows; ``slot_lists`` concatenates the device copies (indptr stays on the host)."""
    from tangram_sgl.pool.segment import GroupSlots

    meta = torch.device("meta")
    gs = GroupSlots([5], 3)
    on_dev = gs.slots(4, device=meta)
    assert on_dev.device == meta and on_dev.shape == (3,) and gs.slots(4, device=meta) is on_dev
    gs.length += 1
    assert gs.slots(4, device=meta) is not on_dev and gs.slots(4, device=meta).shape == (4,)
    mgr = toy_manager(num_pages=64)
    for rid, toks in (("a", list(range(1, 12))), ("b", list(range(20, 27)))):
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks)
    host_indptr, host_indices = mgr.slot_lists(["a", "b"])
    indptr, indices = mgr.slot_lists(["a", "b"], meta)
    assert indptr.device.type == "cpu" and torch.equal(indptr, host_indptr)
    assert indices.device == meta and indices.shape == host_indices.shape


def test_whole_segments_written_together_equal_one_by_one():
    """Segments every group keeps whole (short turns) written for several requests in one batch per layer
    land exactly where per-request ``write_segment_layer`` puts them; a compressed segment is refused."""
    seqs = {"a": list(range(1, 4)), "b": list(range(10, 15))}  # shorter than sink + window: kept whole

    def filled(batched: bool):
        mgr = toy_manager(64)
        for rid, toks in seqs.items():
            mgr.admit(rid, toks)
            mgr.reserve(rid, toks)
        ks = [token_kv(toks, 0, len(toks)) for toks in seqs.values()]
        k = torch.cat([x[0] for x in ks], 2).permute(0, 2, 1, 3)  # [L, T, H, D] staging of both requests
        v = torch.cat([x[1] for x in ks], 2).permute(0, 2, 1, 3)
        if batched:
            plan = mgr.full_segment_writes(list(seqs), [0, 3])
            for layer in range(L):
                mgr.write_full_segments_layer(plan, layer, k[layer], v[layer])
        else:
            for (rid, toks), a in zip(seqs.items(), (0, 3)):
                for layer in range(L):
                    seg_k = k[layer, a:a + len(toks)].transpose(0, 1)
                    mgr.write_segment_layer(rid, layer, seg_k, v[layer, a:a + len(toks)].transpose(0, 1),
                                            torch.zeros(H, len(toks)))
        for rid in seqs:
            mgr.commit_segment(rid)
        check_invariants(mgr)
        return mgr

    one, both = filled(False), filled(True)
    assert torch.equal(one.pool.k_buffer, both.pool.k_buffer) and torch.equal(one.pool.v_buffer, both.pool.v_buffer)
    assert both.pool.k_buffer.abs().sum() > 0
    mgr = toy_manager(64)
    long = list(range(1, 30))
    mgr.admit("c", long)
    mgr.reserve("c", long)  # 29 tokens at budgets < 1: compressed
    with pytest.raises(ValueError, match="kept whole"):
        mgr.full_segment_writes(["c"], [0])


def test_compressed_segments_written_together_equal_one_by_one():
    """Compressed segments of different lengths and positions (one after a cached first turn, so its sink
    differs) selected and written for all requests in one batch per layer land exactly where per-request
    ``write_segment_layer`` puts them, with the same kept positions (also when committed together)."""
    first = list(range(200, 220))
    seqs = {"a": list(range(1, 30)), "b": list(range(40, 52)), "c": list(range(60, 101))}

    def filled(batched: bool):
        mgr = toy_manager(256)
        mgr.admit("b", first)
        prefill(mgr, "b", first)  # b's new segment starts at 20
        for rid, toks in seqs.items():
            if rid != "b":
                mgr.admit(rid, toks)
            mgr.reserve(rid, toks)
            assert not mgr.requests[rid].pending.full
        starts = {rid: len(mgr.requests[rid].token_ids) - len(toks) for rid, toks in seqs.items()}
        kvs = {rid: token_kv(mgr.requests[rid].token_ids, starts[rid], len(toks)) for rid, toks in seqs.items()}
        scores = {rid: token_scores(mgr.requests[rid].token_ids, starts[rid], len(toks)) for rid, toks in seqs.items()}
        k = torch.cat([kvs[r][0] for r in seqs], 2).permute(0, 2, 1, 3)  # [L, T, H, D] staging of all three
        v = torch.cat([kvs[r][1] for r in seqs], 2).permute(0, 2, 1, 3)
        offsets = [0, 29, 41]
        if batched:
            plan = mgr.compressed_segment_writes(list(seqs), offsets)
            for layer in range(L):
                mgr.write_compressed_segments_layer(plan, layer, k[layer], v[layer],
                                                    pad_scores([scores[r][layer] for r in seqs]))
        else:
            for rid in seqs:
                for layer in range(L):
                    mgr.write_segment_layer(rid, layer, kvs[rid][0][layer], kvs[rid][1][layer], scores[rid][layer])
        if batched:  # committed together too: one host copy of all their kept positions
            segs = dict(zip(seqs, mgr.commit_segments(list(seqs))))
        else:
            segs = {rid: mgr.commit_segment(rid) for rid in seqs}
        check_invariants(mgr)
        return mgr, segs

    (one, one_segs), (all_, all_segs) = filled(False), filled(True)
    assert torch.equal(one.pool.k_buffer, all_.pool.k_buffer) and torch.equal(one.pool.v_buffer, all_.pool.v_buffer)
    for rid in seqs:
        assert [x.tolist() for x in one_segs[rid].kept_on_host()] == [x.tolist() for x in all_segs[rid].kept_on_host()]
    assert all_.pool.k_buffer.abs().sum() > 0


@pytest.mark.parametrize("start,sink,window", [(0, 2, 3), (5, 8, 0), (100, 4, 7), (0, 0, 0)])
def test_batched_selection_equals_the_plain_reference(start, sink, window):
    """``select_kept_ragged`` (all heads, each its own k, ties on purpose) keeps exactly what the plain-Python
    rule keeps per head; a k below the protected count is refused."""
    g = torch.Generator().manual_seed(start + sink)
    n = 23
    scores = torch.randint(0, 5, (6, n), generator=g).float()  # many ties: broken by lower position
    prot = sum(1 for p in range(n) if start + p < sink or p >= n - window)
    ks = [prot, n, prot + 3, min(n, prot + 9), prot + 1, n - 1 if n - 1 >= prot else n]
    got = select_kept_ragged(scores, ks, start, sink, window)
    for h, k in enumerate(ks):
        assert got[h, :k].tolist() == kept_positions_reference(scores[h].tolist(), k, start, sink, window)
    if prot:
        with pytest.raises(ValueError, match="protected"):
            select_kept_ragged(scores, [prot - 1] * 6, start, sink, window)
