"""Tangram figures for logs and ``/metrics``: :func:`kv_usage` against the pool's own accounting, and the
``report_decode_stats`` seam that logs them and sets the ``sglang:tangram_*`` gauges."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from prometheus_client import REGISTRY, generate_latest
from tangram_sgl.patches.metrics import report_decode_stats_after
from test_radix_sglang import _params, _pools
from transformers import LlamaConfig

from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.usage import kv_usage
from tangram_sgl.profile import ModelIdentity
from tangram_sgl.profile_builder import build_profile
from tangram_sgl.radix.sglang_cache import TangramRadixCache

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def _manager() -> TangramKVManager:
    cfg = LlamaConfig(vocab_size=64, hidden_size=4 * HEAD_DIM, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=KV_HEADS)
    ident = ModelIdentity.from_config(cfg)
    profile = build_profile(ident, [[0.2, 0.9], [0.5, 0.3]], [[0.0, 0.0]] * LAYERS, scorer="snapkv",
                            target_ratio=0.4, alpha=0.0, page_size=4, heads_per_group=2, sink_tokens=1,
                            recent_window=2)
    return TangramKVManager.from_profile(profile, 64, dtype=torch.float32)


def _prefill(kv: TangramKVManager, rid: str, ids: list[int], seed: int) -> None:
    """Admit ``rid`` on ``ids``, write and commit its new segment (random K/V and scores)."""
    have = kv.admit(rid, ids).length
    kv.reserve(rid, ids[have:])
    g = torch.Generator().manual_seed(seed)
    n = len(ids) - have
    for layer in range(LAYERS):
        k = torch.randn(KV_HEADS, n, HEAD_DIM, generator=g)
        kv.write_segment_layer(rid, layer, k, k.clone(), torch.rand(KV_HEADS, n, generator=g))
    kv.commit_segment(rid)


def test_usage_matches_the_pool_and_counts_prefix_hits():
    kv = _manager()
    _prefill(kv, "A", list(range(1, 41)), seed=0)
    u = kv_usage(kv)
    in_use = kv.pool.allocator.usable_pages - kv.free_pages()
    assert sum(u.pages_by_group) == in_use and u.tokens == 40 and u.prefix_hit_tokens == 0
    page_bytes = 2 * kv.layout.heads_per_group * kv.page_size * HEAD_DIM * 4
    assert u.kept_bytes == in_use * page_bytes
    assert u.full_kv_bytes == 40 * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    assert 0 < u.kept_bytes < u.full_kv_bytes and u.saved_bytes == u.full_kv_bytes - u.kept_bytes
    assert u.arena_used == 0 and u.arena_capacity == kv.device_lists.capacity
    kv.device_slot_ranges(["A"], kv.open_decode_slots(["A"], [5]))  # a decode step mirrors A's lists
    u = kv_usage(kv)
    assert u.arena_used == kv.device_lists.mirrors["A"].size >= sum(len(x) for x in kv.request_lists("A"))
    assert "slot arena" in u.log_line() and u.arena_fallback_steps == 0
    kv.finish("A")
    assert kv_usage(kv).arena_used == 0
    _prefill(kv, "B", list(range(1, 41)) + [7] * 9, seed=1)
    u = kv_usage(kv)
    assert u.prefix_hit_tokens == 40 and u.tokens == 41 + 9  # the tree: A + its decoded token; B: 9 new
    assert sum(u.pages_by_group) == kv.pool.allocator.usable_pages - kv.free_pages()
    assert "prefix hit tokens 40" in u.log_line()


def test_decode_stats_seam_logs_and_exports_the_figures(caplog):
    kv = _manager()
    cache = TangramRadixCache(_params(*_pools(kv)), kv)
    _prefill(kv, "A", list(range(1, 30)), seed=2)
    reporter = SimpleNamespace(scheduler=SimpleNamespace(tree_cache=cache), forward_ct_decode=80,
                               decode_log_interval=40, is_stats_logging_rank=True, enable_metrics=True)
    with caplog.at_level(logging.INFO, logger="tangram_sgl.patches.metrics"):
        report_decode_stats_after(None, reporter)
    assert any("tangram KV: 29 tokens" in r.message for r in caplog.records)
    text = generate_latest(REGISTRY).decode()
    u = kv_usage(kv)
    assert f"sglang:tangram_kv_saved_bytes {float(u.saved_bytes)}" in text
    assert 'sglang:tangram_pages_in_use{group="0"}' in text
    assert "sglang:tangram_slot_arena_used_entries" in text and "sglang:tangram_host_built_decode_steps" in text
    caplog.clear()
    reporter.forward_ct_decode = 81  # between log intervals: nothing
    with caplog.at_level(logging.INFO, logger="tangram_sgl.patches.metrics"):
        report_decode_stats_after(None, reporter)
    assert not caplog.records
    stock = SimpleNamespace(**{**vars(reporter), "forward_ct_decode": 80,
                               "scheduler": SimpleNamespace(tree_cache=object())})
    with caplog.at_level(logging.INFO, logger="tangram_sgl.patches.metrics"):
        report_decode_stats_after(None, stock)  # a stock cache: the seam does nothing
    assert not caplog.records
