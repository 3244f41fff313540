"""Tensor parallelism: one whole-model profile serves any TP size that divides (or is divided by) the kv heads.

SGLang gives TP rank r the kv heads ``[r*H/tp, (r+1)*H/tp)`` of every layer (when tp > H each kv head is
replicated on tp/H ranks). Head groups must live inside one rank's shard, so each rank regroups its own
heads (same H_p, same grouping mode, budgets from the profile) and rebuilds its AOT table for its local
head count. Every rank derives every other rank's shard from the same file, so the page demand the
schedulers use — the maximum over ranks — is identical on all ranks without any communication.
"""

from __future__ import annotations

from dataclasses import replace

from tangram_sgl.aot_table import build_aot_table
from tangram_sgl.budget import group_kept_tokens, pages_for
from tangram_sgl.grouping import group_heads
from tangram_sgl.profile import ModelIdentity, ProfileError, TangramProfile


def shard_kv_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """Global kv-head ids held by ``tp_rank`` (SGLang's split, replication when tp_size > heads)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % num_kv_heads == 0:
        return (tp_rank * num_kv_heads // tp_size,)
    raise ProfileError(f"model.num_kv_heads: {num_kv_heads} kv heads cannot be split over tp_size {tp_size} "
                       f"(neither divides the other)")


def rank_profile(profile: TangramProfile, tp_size: int, tp_rank: int) -> TangramProfile:
    """The profile as seen by one TP rank: its kv heads (renumbered 0..h-1), regrouped, AOT table rebuilt."""
    heads = shard_kv_heads(profile.model.num_kv_heads, tp_size, tp_rank)

    def local(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(row[h] for h in heads) for row in rows)

    budget = local(profile.budget)
    groups = group_heads(budget, profile.heads_per_group, profile.grouping)
    a = profile.aot_split
    model: ModelIdentity = replace(profile.model, num_kv_heads=len(heads),
                                   num_attention_heads=profile.model.num_attention_heads // tp_size)
    return replace(
        profile,
        model=model,
        mean=local(profile.mean),
        std=local(profile.std),
        budget=budget,
        groups=groups,
        aot_split=build_aot_table(groups, len(heads), batch_buckets=a.batch_buckets, max_splits=a.max_splits,
                                  min_split_tokens=a.min_split_tokens),
        notes={**profile.notes, "tp": {"tp_size": tp_size, "tp_rank": tp_rank, "global_kv_heads": list(heads)}},
    )


def segment_pages(profile: TangramProfile, n: int, start: int, page_size: int | None = None) -> int:
    """Pages one segment of n tokens at ``start`` needs on a rank holding ``profile`` (all groups)."""
    ps = page_size or profile.page_size
    kept = group_kept_tokens([g.budget for g in profile.groups], n, start, profile.sink_tokens,
                             profile.recent_window)
    return sum(pages_for(k, ps) for k in kept)


def agreed_segment_pages(profile: TangramProfile, tp_size: int, n: int, start: int) -> int:
    """The page demand every rank's scheduler uses for a segment: the maximum over all ranks' shards."""
    return max(segment_pages(rank_profile(profile, tp_size, r), n, start) for r in range(tp_size))
