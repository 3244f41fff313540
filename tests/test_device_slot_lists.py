"""Device-resident slot lists (``tangram_sgl.pool.device_slot_lists``): the arena allocator, and decode steps
whose lists are appended in place equal to the host-built lists through commits, checkpoints, retraction,
a fragmented arena (cleared and rebuilt) and an arena too small (the caller's host fallback)."""

from __future__ import annotations

import random
from numbers import Number

import numpy as np
import pytest
import torch
from test_pool_support import L, decode, prefill, token_kv, toy_manager
from torch.overrides import TorchFunctionMode

from tangram_sgl.pool.device_slot_lists import RangeAllocator
from tangram_sgl.pool.invariants import check_invariants


def test_range_allocator_first_fit_merge_and_double_free():
    a = RangeAllocator(100)
    x, y, z = a.alloc(30), a.alloc(30), a.alloc(30)
    assert (x, y, z) == (0, 30, 60) and a.alloc(20) is None and a.free_total == 10
    a.free(y, 30)
    assert a.alloc(31) is None and a.alloc(25) == 30  # first fit inside the hole
    a.free(30, 25)
    a.free(x, 30)  # merges with the hole on its right
    assert a.alloc(60) == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(60, 30) or a.free(60, 30)
    a.free(0, 60)
    assert a.free_total == 100 and a.alloc(100) == 0


def _decode_step(mgr, rids, rng):
    """One batched decode step as the attention backend runs it; returns the device ranges (or None)."""
    ids = [2 * rng.randrange(1, 25) for _ in rids]
    slots = mgr.open_decode_slots(rids, ids)
    for r, rid in enumerate(rids):
        toks = mgr.requests[rid].token_ids
        k, v = token_kv(toks, len(toks) - 1, 1)
        for layer in range(L):
            mgr.write_token_layer(slots[r:r + 1], layer, k[layer, :, 0][None], v[layer, :, 0][None])
    return mgr.device_slot_ranges(rids, slots)


def _assert_ranges_are_the_lists(mgr, rids, ranges):
    starts, lens = ranges
    G = mgr.num_groups
    for r, rid in enumerate(rids):
        for g, host in enumerate(mgr.request_lists(rid)):
            lo, n = int(starts[r * G + g]), int(lens[r * G + g])
            assert mgr.device_lists.arena[lo:lo + n].tolist() == host.tolist()


@pytest.mark.parametrize("arena,seed", [(None, 0), (None, 1), (300, 2), (120, 3)])
def test_decode_steps_read_the_host_lists(arena, seed):
    rng = random.Random(seed)
    mgr = toy_manager(3000, slot_arena_entries=arena)
    uploads = []
    upload = mgr.device_lists.upload
    mgr.device_lists.upload = lambda rids, *a: uploads.extend(rids) or upload(rids, *a)
    active: dict[int, list[int]] = {}
    fallbacks = steps = 0
    for turn in range(60):
        if len(active) < 4 or rng.random() < 0.15:  # a new request, often a later turn of an earlier one
            rid = turn
            base = rng.choice(list(active.values())) if active and rng.random() < 0.5 else []
            toks = base + [rng.randrange(1, 50) for _ in range(rng.randrange(5, 30))]
            m = mgr.admit(rid, toks, max_prefix_len=len(toks) - 1)
            prefill(mgr, rid, toks[m.length:], decode_tokens=rng.choice([0, 4]))
            active[rid] = toks
        roll = rng.random()
        if roll < 0.1:  # retraction or finish frees the request's arena block
            rid = rng.choice(list(active))
            mgr.abort(rid) if roll < 0.05 else mgr.finish(rid)
            del active[rid]
            assert rid not in mgr.device_lists.mirrors
        elif roll < 0.2:  # a chunk checkpoint or an odd (engine-path) decode: the lists change off the fast path
            rid = rng.choice(list(active))
            if roll < 0.15:
                prefill(mgr, rid, [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))])
                mgr.checkpoint(rid)
            else:
                decode(mgr, rid, 2 * rng.randrange(1, 25) + 1)
        rids = rng.sample(list(active), rng.randrange(1, len(active) + 1))
        ranges = _decode_step(mgr, rids, rng)
        steps += 1
        if ranges is None:
            fallbacks += 1
        else:
            _assert_ranges_are_the_lists(mgr, rids, ranges)
        check_invariants(mgr)
    if arena is None:  # roomy arena: most rows take the in-place append, none falls back
        assert fallbacks == 0 and len(uploads) < steps
    if arena == 120:  # too small for some batches: the caller is told (host lists), never given wrong ones
        assert fallbacks > 0
    for rid in list(active):
        mgr.finish(rid)
    assert not mgr.device_lists.mirrors and mgr.device_lists.ranges.free_total == mgr.device_lists.capacity


def _four_requests(arena):
    mgr = toy_manager(300, slot_arena_entries=arena)
    rng = random.Random(5)
    for rid in range(4):
        toks = [rng.randrange(1, 50) for _ in range(20)]
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks, decode_tokens=8)
    assert _decode_step(mgr, [0, 1, 2, 3], rng) is not None
    return mgr, rng


def test_a_steps_stale_requests_are_uploaded_together():
    """The first decode step after a prefill wave uploads every new request in one call (one slot_lists, one
    zero-fill, one scatter), not one call per request: session 16's trace showed 128 requests' per-request
    uploads holding the host 0.5 s while the GPU idled."""
    mgr = toy_manager(300)
    rng = random.Random(5)
    calls = []
    upload = mgr.device_lists.upload
    mgr.device_lists.upload = lambda rids, *a: calls.append(list(rids)) or upload(rids, *a)
    for rid in range(4):
        toks = [rng.randrange(1, 50) for _ in range(20 + 3 * rid)]
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks, decode_tokens=8 * (rid % 2))
    ranges = _decode_step(mgr, [2, 0, 3, 1], rng)
    assert calls == [[2, 0, 3, 1]]
    _assert_ranges_are_the_lists(mgr, [2, 0, 3, 1], ranges)
    prefill(mgr, 3, [rng.randrange(1, 50) for _ in range(5)])  # a new segment: only request 3 is stale
    mgr.checkpoint(3)
    ranges = _decode_step(mgr, [0, 1, 2, 3], rng)
    assert calls[1:] == [[3]]
    _assert_ranges_are_the_lists(mgr, [0, 1, 2, 3], ranges)
    check_invariants(mgr, deep=True)


class _HostValuesInIndexing(TorchFunctionMode):
    """Records indexing that, on a CUDA tensor, copies a host value over and waits for the GPU: a Python list as
    the index, or a Python number assigned through a tensor index (``t[idx] = 0``: the trace of session 25 caught
    one in each mixed decode step, up to 3 ms of host wait under the overlap scheduler)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, list) for i in index):
                self.seen.append(f"{func.__name__} with a list index")
            if (func is torch.Tensor.__setitem__ and isinstance(args[2], Number)
                    and any(isinstance(i, torch.Tensor) for i in index)):
                self.seen.append("__setitem__ of a Python number through a tensor index")
        return func(*args, **(kwargs or {}))


def test_a_mixed_decode_step_indexes_with_device_values_only():
    """A step that both uploads stale requests' lists (zero-filled blocks, one scatter) and appends to the others
    (a subset of the step's token slots) indexes only with tensors — what keeps it free of host waits on CUDA
    (``test_decode_step_build_never_synchronises_the_host`` checks the same on the GPU)."""
    mgr, rng = _four_requests(1 << 12)
    prefill(mgr, 2, [rng.randrange(1, 50) for _ in range(5)])  # request 2 is stale, 0, 1 and 3 append
    mgr.checkpoint(2)
    with _HostValuesInIndexing() as mode:
        ranges = _decode_step(mgr, [0, 1, 2, 3], rng)
    assert mode.seen == []
    _assert_ranges_are_the_lists(mgr, [0, 1, 2, 3], ranges)
    check_invariants(mgr, deep=True)


def test_fragmented_arena_is_cleared_and_rebuilt():
    """Free space split into holes too small for a block: the arena is cleared and the batch re-uploaded."""
    roomy, _ = _four_requests(None)
    sizes = {rid: m.size for rid, m in roomy.device_lists.mirrors.items()}
    mgr, rng = _four_requests(sum(sizes.values()))  # the four blocks fill the arena exactly
    assert mgr.device_lists.ranges.free_total == 0
    mgr.finish(1)
    mgr.finish(3)  # two holes: block 1's and block 3's
    big = [rng.randrange(1, 50) for _ in range(40)]
    mgr.admit(9, big)
    prefill(mgr, 9, big)
    need = sum(len(x) + r for x, r in zip(mgr.request_lists(9), mgr._decode_room(mgr.requests[9])))
    assert sizes[1] + sizes[3] >= need + mgr.num_groups > max(sizes[1], sizes[3])
    clears = []
    clear = mgr.device_lists.clear
    mgr.device_lists.clear = lambda: clears.append(1) or clear()
    ranges = _decode_step(mgr, [0, 2, 9], rng)
    assert ranges is not None and clears == [1]
    _assert_ranges_are_the_lists(mgr, [0, 2, 9], ranges)
    check_invariants(mgr)


def test_invariant_checker_catches_a_stale_device_list():
    mgr = toy_manager(100)
    toks = list(range(1, 21))
    mgr.admit("a", toks)
    prefill(mgr, "a", toks, decode_tokens=4)
    rng = random.Random(0)
    starts, _ = _decode_step(mgr, ["a"], rng)
    check_invariants(mgr)
    mgr.device_lists.arena[int(starts[0])] += 1
    with pytest.raises(AssertionError, match="differs from its host list"):
        check_invariants(mgr)
    mgr.device_lists.mirrors["ghost"] = mgr.device_lists.mirrors["a"]
    with pytest.raises(AssertionError, match="not running"):
        check_invariants(mgr)


def test_mirror_table_grows_and_reuses_rows():
    """Forty mirrored requests outgrow the mirrors' table twice (16 -> 32 -> 64 rows; every mirror's views
    follow), finished requests give their rows to new ones, and every decode step still reads the host lists."""
    mgr = toy_manager(3000)
    rng = random.Random(7)
    rids = list(range(40))
    for rid in rids:
        toks = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 12))]
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks, decode_tokens=6)
    for _ in range(2):
        ranges = _decode_step(mgr, rids, rng)
        _assert_ranges_are_the_lists(mgr, rids, ranges)
    dl = mgr.device_lists
    assert dl._table.shape[1] == 64 and len({m.row for m in dl.mirrors.values()}) == 40
    for m in dl.mirrors.values():  # each mirror's views are its row of the current table (appends included)
        assert np.shares_memory(m.lens, dl._table) and (m.lens == dl._table[2, m.row]).all()
    for rid in rids[:10]:
        mgr.finish(rid)
    for rid in range(40, 50):
        toks = [rng.randrange(1, 50) for _ in range(5)]
        mgr.admit(rid, toks)
        prefill(mgr, rid, toks, decode_tokens=6)
    live = list(range(10, 50))
    ranges = _decode_step(mgr, live, rng)
    _assert_ranges_are_the_lists(mgr, live, ranges)
    assert dl._table.shape[1] == 64 and len({m.row for m in dl.mirrors.values()}) == 40  # rows reused
    check_invariants(mgr, deep=True)
