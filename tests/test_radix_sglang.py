"""The tangram radix cache inside SGLang 0.5.17's own interfaces (CPU): the same request-level trace through
SGLang's ``RadixCache`` and ``TangramRadixCache`` at budget 1.0 gives the same hits, evictions and sizes;
refusal with a reason; a profile for another model stops pool and cache construction."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
import torch
from test_pool_support import TOY_CONFIG, StepClock, prefill, token_kv, token_scores, toy_manager, toy_profile

from tangram_sgl.pool.invariants import check_invariants
from tangram_sgl.pool.reservation import AdmissionError
from tangram_sgl.profile import ProfileError


def _pools(mgr=None):
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator

    rtt = ReqToTokenPool(size=16, max_context_len=512, device="cpu", enable_memory_saver=False)
    if mgr is None:
        alloc = TokenToKVPoolAllocator(4096, torch.float16, "cpu", None, need_sort=False)
    else:
        tokens = mgr.pool.allocator.usable_pages * mgr.page_size // mgr.num_groups
        alloc = TangramTokenAllocator(mgr, tokens, 4096, torch.float16, "cpu")
    return rtt, alloc


def _params(rtt, alloc):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(disable=False, req_to_token_pool=rtt, token_to_kv_pool_allocator=alloc, page_size=1)


class Driver:
    """Calls a prefix cache the way SGLang's scheduler does (match, lock, alloc, insert, evict, release)."""

    def __init__(self, cache, mgr=None):
        self.cache, self.mgr, self.reqs = cache, mgr, {}

    def admit(self, rid, prompt):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]))))
        req = SimpleNamespace(
            rid=rid, origin_input_ids=array("q", prompt), output_ids=array("q"), extra_key=None, priority=0,
            req_pool_idx=None, prefix_indices=m.device_indices, last_node=m.last_device_node,
            cache_protected_len=len(m.device_indices), extend_range=None, full_untruncated_fill_ids=array("q", prompt),
            sampling_params=SimpleNamespace(max_new_tokens=0), inflight_middle_chunks=0, kv_committed_len=0)
        req.get_fill_ids = lambda r=req: (r.origin_input_ids + r.output_ids)[: r.extend_range.end]
        self.cache.inc_lock_ref(req.last_node)
        self.cache.req_to_token_pool.alloc([req])
        self.reqs[rid] = req
        return len(m.device_indices)

    def extend(self, rid, n, last):
        from sglang.srt.mem_cache.allocation import alloc_token_slots
        from tangram_sgl.patches.memory_pool import reserve_for_extend

        req = self.reqs[rid]
        start = len(req.prefix_indices)
        req.extend_range = SimpleNamespace(start=start, end=start + n)
        req.sampling_params.max_new_tokens = 3 if last else 0
        if self.mgr is not None:
            reserve_for_extend(SimpleNamespace(tree_cache=self.cache, reqs=[req]))
        ids = alloc_token_slots(self.cache, n)
        row = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[:start] = req.prefix_indices.to(torch.int32)
        row[start: start + n] = ids.to(torch.int32)
        req.prefix_indices = row[: start + n].to(torch.int64).clone()
        if self.mgr is not None:  # what the tangram attention backend does during the forward
            toks = self.mgr.requests[rid].token_ids
            k, v = token_kv(toks, start, n)
            s = token_scores(toks, start, n)
            for layer in range(k.shape[0]):
                self.mgr.write_segment_layer(rid, layer, k[layer], v[layer], s[layer])
            self.mgr.commit_segment(rid)
        if not last:
            self.cache.cache_unfinished_req(req, chunked=True)

    def decode(self, rid, token):
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        req = self.reqs[rid]
        pos = len(req.origin_input_ids) + len(req.output_ids)
        ids = alloc_token_slots(self.cache, 1)
        self.cache.req_to_token_pool.req_to_token[req.req_pool_idx, pos] = ids.to(torch.int32)
        req.output_ids.append(token)
        if self.mgr is not None:
            toks = self.mgr.requests[rid].token_ids + [token]
            k, v = token_kv(toks, pos, 1)
            self.mgr.append_decode(rid, token, k[:, :, 0], v[:, :, 0])

    def release(self, rid, insert=True):
        req = self.reqs.pop(rid)
        kv_len = len(req.origin_input_ids) + len(req.output_ids)
        self.cache.cache_finished_req(req, is_insert=insert, kv_len_to_handle=kv_len)
        self.cache.req_to_token_pool.free(req)
        return list(req.origin_input_ids + req.output_ids)

    def evict(self, n):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted


def test_same_trace_same_hits_and_evictions_as_sglang_radix_cache(monkeypatch):
    import sglang.srt.mem_cache.radix_cache as rc
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from tangram_sgl.radix.sglang_cache import DEBUG_ENV, TangramRadixCache

    monkeypatch.setattr(rc, "time", StepClock())
    monkeypatch.setenv(DEBUG_ENV, "1")  # the server-side debug flag: invariants inside every cache operation
    sg = Driver(RadixCache(_params(*_pools())))
    mgr = toy_manager(num_pages=6000, page_size=1, budget=1.0)
    tg = Driver(TangramRadixCache(_params(*_pools(mgr)), mgr), mgr)
    rng = random.Random(11)
    histories, running, nid, hits, evicted = [], {}, 0, 0, 0
    for step in range(1200):
        r = rng.random()
        if r < 0.25 and len(running) < 5:
            base = list(rng.choice(histories)) if histories and rng.random() < 0.75 else []
            if base and rng.random() < 0.3:
                base = base[: rng.randrange(1, len(base) + 1)]
            prompt = base + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 12))]
            h_sg, h_tg = sg.admit(nid, prompt), tg.admit(nid, prompt)
            assert h_sg == h_tg, f"step {step}: hit {h_tg} vs SGLang {h_sg}"
            hits += h_tg
            rest = len(prompt) - h_tg
            cut = rng.randrange(1, rest + 1)
            running[nid] = [c for c in (cut, rest - cut) if c] + [rng.randrange(0, 4)]
            nid += 1
        elif r < 0.35:
            n = rng.randrange(1, 40)
            e_sg, e_tg = sg.evict(n), tg.evict(n)
            assert e_sg == e_tg, f"step {step}: evicted {e_tg} vs SGLang {e_sg}"
            evicted += e_tg
        elif r < 0.4 and running:
            rid = rng.choice(list(running))
            del running[rid]
            sg.release(rid, insert=False)
            tg.release(rid, insert=False)
        elif running:
            rid = rng.choice(list(running))
            plan = running[rid]
            if len(plan) > 1:
                n = plan.pop(0)
                last = len(plan) == 1
                sg.extend(rid, n, last)
                tg.extend(rid, n, last)
            elif plan[0]:
                tok = rng.randrange(1, 6)
                sg.decode(rid, tok)
                tg.decode(rid, tok)
                plan[0] -= 1
            else:
                del running[rid]
                histories.append(sg.release(rid))
                assert tg.release(rid) == histories[-1]
        assert sg.cache.evictable_size() == tg.cache.evictable_size(), f"step {step}"
        assert sg.cache.protected_size() == tg.cache.protected_size(), f"step {step}"
        check_invariants(mgr)
    assert hits > 300 and evicted > 150


def test_request_that_cannot_fit_is_refused_with_a_reason():
    from tangram_sgl.patches.memory_pool import reserve_for_extend

    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    mgr = toy_manager(num_pages=30)
    d = Driver(TangramRadixCache(_params(*_pools(mgr)), mgr), mgr)
    d.admit("big", list(range(1, 300)))
    req = d.reqs["big"]
    req.extend_range = SimpleNamespace(start=0, end=299)
    with pytest.raises(AdmissionError, match=r"request 'big' .*needs \d+ pages but only 29 are free"):
        reserve_for_extend(SimpleNamespace(tree_cache=d.cache, reqs=[req]))
    d.release("big", insert=False)
    check_invariants(mgr)
    assert mgr.free_pages() == 29 and not mgr.requests


@pytest.fixture()
def profile_env(tmp_path, monkeypatch):
    path = tmp_path / "toy.json"
    toy_profile().save(path)
    monkeypatch.setenv("TANGRAM_KV_POLICY", "tangram")
    monkeypatch.setenv("TANGRAM_PROFILE", str(path))
    return path


def _configurator(config):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config), server_args=SimpleNamespace(tp_size=1),
        kv_cache_dtype=torch.float16, device="cpu", is_draft_worker=False,
        _build_req_to_token_pool=lambda max_num_reqs: ReqToTokenPool(max_num_reqs, 256, "cpu", False))


def test_pool_hook_builds_the_tangram_pool_with_sglangs_byte_budget(profile_env):
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext  # noqa: F401 — the real seam exists
    from tangram_sgl.patches.memory_pool import init_pools_around
    from tangram_sgl.patches.radix_cache import create_tangram_tree_cache

    from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator
    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    cfg = _configurator(TOY_CONFIG)
    sizes = SimpleNamespace(max_total_num_tokens=1000, max_running_requests=4)
    pools = init_pools_around(None, cfg, sizes=sizes, req_to_token_pool=None, token_to_kv_pool_allocator=None)
    alloc = pools.token_to_kv_pool_allocator
    assert isinstance(alloc, TangramTokenAllocator)
    pool = alloc.manager.pool
    # SGLang's byte budget for 1000 full-KV tokens (x 2 layers x 4 kv heads) = usable pages x H_p 2 x page 4
    assert (pool.num_pages - 1) * 2 * 4 == 1000 * 2 * 4
    assert pools.token_to_kv_pool.get_key_buffer(0) is pool.k_buffer
    with pytest.raises(RuntimeError, match="tangram attention backend"):
        pools.token_to_kv_pool.set_kv_buffer(None, None, None, None)
    # the scheduler sees the pool in full-KV-token units: 1000 usable pages x 4 tokens / 4 groups
    assert alloc.available_size() == 1000
    ctx = SimpleNamespace(model_config=cfg.model_config, params=_params(pools.req_to_token_pool, alloc))
    assert isinstance(create_tangram_tree_cache(ctx), TangramRadixCache)


def test_profile_for_another_model_stops_pool_and_cache_construction(profile_env):
    from tangram_sgl.patches.memory_pool import init_pools_around
    from tangram_sgl.patches.radix_cache import create_tangram_tree_cache

    other = dict(TOY_CONFIG, num_hidden_layers=3)
    sizes = SimpleNamespace(max_total_num_tokens=100, max_running_requests=2)
    with pytest.raises(ProfileError, match="num_layers.*profile for another model"):
        init_pools_around(None, _configurator(other), sizes=sizes, req_to_token_pool=None,
                          token_to_kv_pool_allocator=None)
    ctx = SimpleNamespace(model_config=SimpleNamespace(hf_config=other), params=None)
    with pytest.raises(ProfileError, match="profile for another model"):
        create_tangram_tree_cache(ctx)


def test_cache_without_the_tangram_pool_is_refused(profile_env):
    from tangram_sgl.patches.memory_pool import TangramPoolError
    from tangram_sgl.patches.radix_cache import create_tangram_tree_cache

    rtt, alloc = _pools()
    ctx = SimpleNamespace(model_config=SimpleNamespace(hf_config=TOY_CONFIG), params=_params(rtt, alloc))
    with pytest.raises(TangramPoolError, match="needs the tangram pool"):
        create_tangram_tree_cache(ctx)


def test_pool_hook_is_inert_without_the_policy(monkeypatch):
    from tangram_sgl.patches.memory_pool import init_pools_around

    monkeypatch.delenv("TANGRAM_KV_POLICY", raising=False)
    called = {}
    init_pools_around(lambda self, **kw: called.update(kw), None, sizes=1, req_to_token_pool=2,
                      token_to_kv_pool_allocator=3)
    assert called == {"sizes": 1, "req_to_token_pool": 2, "token_to_kv_pool_allocator": 3}


def test_available_size_holds_back_the_next_decode_pages():
    from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator

    mgr = toy_manager(num_pages=41)  # 40 usable pages, 4 groups of 2 heads, page_size 4
    alloc = TangramTokenAllocator(mgr, 40, 4096, torch.float16, "cpu")
    assert alloc.available_size() == 40 * 4 // 4
    toks = list(range(1, 9))
    mgr.admit("a", toks)
    prefill(mgr, "a", toks)  # no decode reserved: the first decode token needs a page in each of 4 groups
    assert mgr.next_decode_pages() == 4
    assert alloc.available_size() == (mgr.free_pages() - 4) * 4 // 4


def test_idle_pool_accounting_adds_up_exactly_as_sglangs_idle_check_demands():
    """SGLang's idle check: available + evictable + protected == max_total_num_tokens (strict by default)."""
    from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator, pool_pages_for_tokens
    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    T = 157  # not a multiple of anything: rounding must still add up
    mgr = toy_manager(num_pages=pool_pages_for_tokens(4, 4, T))
    rtt, _ = _pools()
    alloc = TangramTokenAllocator(mgr, T, 4096, torch.float16, "cpu")
    d = Driver(TangramRadixCache(_params(rtt, alloc), mgr), mgr)
    rng = random.Random(5)
    for rid in range(12):
        prompt = [rng.randrange(1, 9) for _ in range(rng.randrange(3, 30))]
        d.admit(rid, prompt)
        d.extend(rid, len(prompt) - len(d.reqs[rid].prefix_indices), True)
        for _ in range(rng.randrange(0, 4)):
            d.decode(rid, rng.randrange(1, 9))
        busy = alloc.available_size() + d.cache.evictable_size() + d.cache.protected_size()
        assert busy <= T  # never more than the pool while a request runs
        d.release(rid)
        assert alloc.available_size() + d.cache.evictable_size() + d.cache.protected_size() == T
        # and nothing is overstated: what is reported available really fits in free pages
        assert alloc.available_size() * mgr.num_groups <= mgr.free_pages() * mgr.page_size


def test_flush_reports_leaked_pages(caplog):
    """``/flush_cache`` (reset) with nothing running frees the whole tree and says how many pages are neither
    free nor owned (the soak's leak figure): 0 after served requests, the stray page when one leaks."""
    from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator
    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    mgr = toy_manager(num_pages=41)
    rtt, _ = _pools()
    d = Driver(TangramRadixCache(_params(rtt, TangramTokenAllocator(mgr, 40, 4096, torch.float16, "cpu")), mgr), mgr)
    for rid, prompt in enumerate([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9]]):
        d.admit(rid, prompt)
        d.extend(rid, len(prompt) - len(d.reqs[rid].prefix_indices), True)
        d.decode(rid, 3)
        d.release(rid)
    assert mgr.tree.tree_pages() > 0
    with caplog.at_level("INFO", logger="tangram_sgl.radix.sglang_cache"):
        d.cache.reset()
    assert "40 of 40 pages free, 0 pages leaked, 0 slot-arena entries leaked" in caplog.text
    mgr.pool.allocator.alloc(1)  # a page nobody owns
    caplog.clear()
    d.cache.reset()
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "1 pages leaked" in caplog.text


@pytest.mark.parametrize("page_size,heads_per_group,budget", [(1, 1, None), (4, 2, None), (16, 2, None),
                                                               (16, 4, 1.0), (16, 1, 0.3), (4, 3, None)])
def test_exact_reservation_never_exceeds_sglangs_admission_charge(page_size, heads_per_group, budget):
    """SGLang's PrefillAdder charges a request ceil_page(n) + max_new + page_size full-KV tokens; the pages the
    BEFORE-alloc_for_extend hook then reserves (any segment start, budgets, decode growth) never exceed that
    charge in full-KV-token equivalents, so a request SGLang admitted always gets its reservation."""
    from tangram_sgl.pool.reservation import pages_per_group
    from tangram_sgl.pool.sglang_allocator import pages_to_tokens

    mgr = toy_manager(page_size=page_size, heads_per_group=heads_per_group, budget=budget)
    rng = random.Random(page_size * 100 + heads_per_group)
    for _ in range(400):
        n, start, decode = rng.randint(1, 300), rng.choice([0, rng.randint(1, 500)]), rng.randint(0, 200)
        need = pages_to_tokens(mgr, sum(pages_per_group(mgr.layout, n, start, decode, mgr.sink_tokens,
                                                        mgr.recent_window)))
        charge = -(-n // page_size) * page_size + decode + page_size
        assert need <= charge, (n, start, decode, need, charge)
