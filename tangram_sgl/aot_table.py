"""Build the ahead-of-time split-KV table from group budgets.

Formula (per batch-size bucket B; group g with budget b_g; H kv heads per layer; b̄ the mean budget a
head is reserved at, i.e. the member-weighted mean of group budgets):

    S_g(B) = clamp(ceil(target_ctas * b_g / (B * H * b̄)), 1, max_splits)

Why: one decode launch for a layer has B*H (request, kv head) work items; a head of group g holds
~b_g*n tokens, so the layer's total KV is ~B*H*b̄*n tokens. Cutting it into ``target_ctas`` equal chunks
gives chunk ~B*H*b̄*n/target_ctas tokens, and a head of group g needs b_g*n/chunk = the formula's splits
— independent of n, so it can be fixed offline. Every CTA then reads about the same number of tokens
whatever its group (the load balance), and the launch keeps ~target_ctas CTAs in flight (default 8 per
SM of the H200's 132 so that the tail of uneven CTAs stays short). Normalising by b̄ matters: with a
mean budget of 0.25 the total work is a quarter of full KV, and splitting as if it were full would leave
the few full-budget heads as the long pole. At run time the kernel cuts a (request, group) of retained
length n into chunks of max(min_split_tokens, ceil(n/S_g)) tokens, so short contexts do not pay merge
cost for tiny splits. Buckets are the decode batch sizes CUDA graphs capture; a batch uses the smallest
bucket >= its size, so each captured graph has one fixed split table (fixed launch shape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tangram_sgl.profile import AotSplitTable, HeadGroup

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
DEFAULT_TARGET_CTAS = 8 * 132
DEFAULT_MAX_SPLITS = 32
DEFAULT_MIN_SPLIT_TOKENS = 256


def build_aot_table(
    groups: Sequence[HeadGroup],
    num_kv_heads: int,
    *,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    target_ctas: int = DEFAULT_TARGET_CTAS,
    max_splits: int = DEFAULT_MAX_SPLITS,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
) -> AotSplitTable:
    """Splits per (bucket, group) following the module's formula."""
    members = sum(len(g.members) for g in groups)
    mean_budget = sum(len(g.members) * g.budget for g in groups) / members
    rows = []
    for b in batch_buckets:
        per_budget = target_ctas / (b * num_kv_heads * mean_budget)
        rows.append(tuple(min(max_splits, max(1, math.ceil(per_budget * g.budget - 1e-9))) for g in groups))
    return AotSplitTable(
        min_split_tokens=min_split_tokens,
        max_splits=max_splits,
        batch_buckets=tuple(batch_buckets),
        splits=tuple(rows),
    )
