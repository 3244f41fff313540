"""Seeded randomised stress of the pool + radix tree: >= 50,000 operations, invariants after every one,
token-by-token reference check at every finish (and at every checkpoint)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest
from test_pool_support import L, decode, token_kv, token_scores, toy_manager

from tangram_sgl.pool.invariants import check_invariants
from tangram_sgl.pool.reference_store import ReferenceKVStore, check_request
from tangram_sgl.pool.reservation import AdmissionError
from tangram_sgl.radix.tree import SegmentTree


@dataclass
class Active:
    chunks: list[list[int]]
    decode_target: int
    decode_reserved: int
    decoded: int = 0
    layer: int = -1          # -1: next op reserves; 0..L-1: next layer to write; L: next op commits
    next_token: int = 0


@dataclass
class Stats:
    ops: int = 0
    admitted: int = 0
    finished: int = 0
    refused: int = 0
    retracted: int = 0
    decode_retracted: int = 0
    checkpoints: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    evicted_pages: int = 0
    pressure_evictions: int = 0
    counts: dict = field(default_factory=dict)


def run_stress(seed: int, num_ops: int, num_pages: int = 400, **profile_kw) -> Stats:
    rng = random.Random(seed)
    mgr = toy_manager(num_pages, **profile_kw)
    ref = ReferenceKVStore(mgr.layout, mgr.sink_tokens, mgr.recent_window)
    systems = [[rng.randrange(1, 50) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    histories: list[list[int]] = []
    active: dict[int, Active] = {}
    st = Stats()
    next_rid = 0

    def bump(name: str) -> None:
        st.ops += 1
        st.counts[name] = st.counts.get(name, 0) + 1

    def retire(rid: int) -> None:
        mgr.abort(rid)
        ref.drop(rid)
        del active[rid]

    while st.ops < num_ops:
        r = rng.random()
        if (r < 0.12 and len(active) < 8) or not active:
            # new conversation, next turn, or branch (a history picked twice = two branches of one turn)
            if histories and rng.random() < 0.7:
                base = rng.choice(histories[-30:])
                if len(base) > 100:  # conversation too long for the toy pool: start over
                    base = list(rng.choice(systems))
            else:
                base = list(rng.choice(systems)) if rng.random() < 0.6 else []
            # 3% of requests are too long to ever fit the pool: they must be refused, not crash
            extra = rng.randrange(1, 30) if rng.random() > 0.03 else 2000
            toks = base + [rng.randrange(1, 50) for _ in range(extra)]
            rid, next_rid = next_rid, next_rid + 1
            m = mgr.admit(rid, toks, max_prefix_len=len(toks) - 1)
            bump("admit")
            segs = m.segments()
            ref.begin(rid, toks[: m.length], [(s.start, s.end, s.full) for s in segs])
            rest = toks[m.length:]
            cuts = []
            while rest:
                c = rng.randrange(4, 24) if extra < 2000 else 2000
                cuts.append(rest[:c])
                rest = rest[c:]
            target = rng.randrange(0, 12)
            # decode growth reserved up front, half of it, or none (then decode allocates on demand)
            active[rid] = Active(cuts, target, rng.choice([target, target // 2, 0]))
            st.admitted += 1
            if extra < 2000:
                st.hit_tokens += m.length
                st.prompt_tokens += len(toks)
        elif r < 0.17 and histories:
            q = rng.choice(histories)
            node, n = mgr.tree.match(q[: rng.randrange(1, len(q) + 1)])
            path_tokens = [t for x in SegmentTree.path(node) for t in x.tokens]
            assert path_tokens == q[:n]
            bump("match")
        elif r < 0.19:
            p, _ = mgr.tree.evict(rng.randrange(1, 30))
            st.evicted_pages += p
            bump("evict")
        elif r < 0.21:
            rid = rng.choice(list(active))
            retire(rid)
            st.retracted += 1
            bump("retract")
        else:
            rid = rng.choice(list(active))
            a = active[rid]
            if a.chunks:
                chunk = a.chunks[0]
                req_toks = mgr.requests[rid].token_ids
                if a.layer == -1:
                    dec = a.decode_reserved if len(a.chunks) == 1 else 0
                    short = sum(mgr.pages_needed(rid, len(chunk), dec)) > mgr.free_pages()
                    try:
                        mgr.reserve(rid, chunk, dec)
                    except AdmissionError as e:
                        assert "evictable" in str(e)
                        retire(rid)
                        st.refused += 1
                        bump("refuse")
                        check_invariants(mgr)
                        continue
                    a.layer = 0
                    st.pressure_evictions += short
                    bump("reserve")
                elif a.layer < L:
                    start = len(req_toks) - len(chunk)
                    k, v = token_kv(req_toks, start, len(chunk))
                    s = token_scores(req_toks, start, len(chunk))
                    mgr.write_segment_layer(rid, a.layer, k[a.layer], v[a.layer], s[a.layer])
                    a.layer += 1
                    bump("write_layer")
                else:
                    start = len(req_toks) - len(chunk)
                    mgr.commit_segment(rid)
                    ref.add_segment(rid, chunk, *token_kv(req_toks, start, len(chunk)),
                                    token_scores(req_toks, start, len(chunk)))
                    a.chunks.pop(0)
                    a.layer = -1
                    bump("commit")
                    if a.chunks:
                        mgr.checkpoint(rid)
                        ref.publish(rid)
                        check_request(mgr, ref, rid)
                        st.checkpoints += 1
                        bump("checkpoint")
            elif a.decoded < a.decode_target:
                try:
                    decode(mgr, rid, rng.randrange(1, 50), ref)
                except AdmissionError:
                    retire(rid)
                    st.decode_retracted += 1
                    bump("decode_retract")
                    check_invariants(mgr)
                    continue
                a.decoded += 1
                bump("decode")
            else:
                check_request(mgr, ref, rid)
                histories.append(mgr.requests[rid].token_ids)
                mgr.finish(rid)
                ref.publish(rid)
                ref.drop(rid)
                del active[rid]
                st.finished += 1
                bump("finish")
        check_invariants(mgr, deep=st.ops % 50 == 0)

    for rid in list(active):
        retire(rid)
    mgr.tree.evict(mgr.pool.allocator.usable_pages)
    check_invariants(mgr)
    assert mgr.free_pages() == mgr.pool.allocator.usable_pages, "pages leaked"
    assert not list(mgr.tree.nodes())
    return st


def test_stress_50k_compressed():
    t0 = time.perf_counter()
    st = run_stress(seed=1234, num_ops=50_000)
    dt = time.perf_counter() - t0
    print(f"\n50k ops in {dt:.1f}s: {st}")
    assert st.ops >= 50_000
    # the run must exercise every path, not just pass vacuously
    assert st.finished > 500 and st.checkpoints > 100 and st.refused + st.decode_retracted > 10
    assert st.retracted > 100 and st.evicted_pages > 0 and st.pressure_evictions > 100
    assert st.hit_tokens > 0.2 * st.prompt_tokens


@pytest.mark.parametrize("page_size,budget", [(1, 1.0), (4, 1.0), (3, None)])
def test_stress_other_geometries(page_size, budget):
    st = run_stress(seed=7 + page_size, num_ops=4_000, page_size=page_size, budget=budget)
    assert st.finished > 30 and st.hit_tokens > 0
