"""Seam: ``SchedulerMetricsReporter.report_decode_stats`` (``sglang.srt.managers.scheduler_components``).

AFTER hook. Every ``--decode-log-interval`` decode steps, where SGLang logs its "Decode batch" line, a
scheduler on the tangram radix cache logs a :class:`KVUsage` line (pages per head group in use, kept bytes
vs full KV, prefix hit tokens, slot-arena use) and, with ``--enable-metrics``, sets the ``sglang:tangram_*`` gauges that
SGLang's ``/metrics`` endpoint serves (prometheus multiprocess mode, most recent value).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from tangram_sgl.pool.usage import KVUsage, kv_usage

logger = logging.getLogger(__name__)
_REPORT_DECODE = ("sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter."
                  "report_decode_stats")
_GAUGES: dict[str, Any] = {}


def _gauges() -> dict[str, Any]:
    if not _GAUGES:
        from prometheus_client import Gauge

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(f"sglang:tangram_{name}", doc, labels, multiprocess_mode="mostrecent")

        _GAUGES.update(
            pages=gauge("pages_in_use", "Pages in use per head group (tree + running requests)", ("group",)),
            kept=gauge("kv_kept_bytes", "Bytes of the tangram pages in use (K and V)"),
            full=gauge("kv_full_bytes", "Bytes the same tokens would take in a full KV cache"),
            saved=gauge("kv_saved_bytes", "Full-KV bytes minus kept bytes"),
            hits=gauge("prefix_hit_tokens", "Tokens matched in the tangram radix tree at admission (cumulative)"),
            arena=gauge("slot_arena_used_entries", "Device slot-list arena entries held by running requests"),
            fallback=gauge("host_built_decode_steps", "Decode steps whose slot lists did not fit the device "
                                                      "arena and were built on the host (cumulative)"),
        )
    return _GAUGES


def export(usage: KVUsage) -> None:
    """Set the ``sglang:tangram_*`` gauges from ``usage``."""
    g = _gauges()
    for group, pages in enumerate(usage.pages_by_group):
        g["pages"].labels(group=str(group)).set(pages)
    g["kept"].set(usage.kept_bytes)
    g["full"].set(usage.full_kv_bytes)
    g["saved"].set(usage.saved_bytes)
    g["hits"].set(usage.prefix_hit_tokens)
    g["arena"].set(usage.arena_used)
    g["fallback"].set(usage.arena_fallback_steps)


def report_decode_stats_after(result: Any, reporter: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER SchedulerMetricsReporter.report_decode_stats (see module docstring)."""
    from tangram_sgl.radix.sglang_cache import TangramRadixCache

    cache = getattr(reporter.scheduler, "tree_cache", None)
    if not isinstance(cache, TangramRadixCache) or reporter.forward_ct_decode % reporter.decode_log_interval:
        return
    usage = kv_usage(cache.manager)
    if reporter.is_stats_logging_rank:
        logger.info(usage.log_line())
    if reporter.enable_metrics:
        export(usage)


def register() -> None:
    HookRegistry.register(_REPORT_DECODE, report_decode_stats_after, HookType.AFTER)
