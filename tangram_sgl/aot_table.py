"""Build the ahead-of-time split-KV table from group budgets.

Formula (per batch-size bucket B, group g with budget b_g, model with H kv heads per layer):

    S_full(B) = clamp(ceil(target_ctas / (B * H)), 1, max_splits)     # splits a full-budget head gets
    S_g(B)    = clamp(ceil(S_full(B) * b_g), 1, S_full(B))

Why: a decode launch for one layer has B*H (request, kv-head) work items. ``target_ctas`` (default two
waves of the H200's 132 SMs) is the number of CTAs that keeps every SM busy; a full head gets enough
splits for that. A head's retained length is ~b_g*n, so giving it ceil(S_full*b_g) splits keeps each
CTA's share of KV (~n/S_full tokens) equal across groups: the load is balanced without looking at the
runtime lengths. At run time the kernel cuts a (request, group) of retained length n into chunks of
max(min_split_tokens, ceil(n/S_g)) tokens, so short contexts do not pay merge cost for tiny splits.
Buckets are the decode batch sizes CUDA graphs capture; a batch uses the smallest bucket >= its size,
so each captured graph has one fixed split table (fixed launch shape).
"""

from __future__ import annotations

import math
from typing import Sequence

from tangram_sgl.profile import AotSplitTable, HeadGroup

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
DEFAULT_TARGET_CTAS = 2 * 132
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
    rows = []
    for b in batch_buckets:
        s_full = min(max_splits, max(1, math.ceil(target_ctas / (b * num_kv_heads))))
        rows.append(tuple(min(s_full, max(1, math.ceil(s_full * g.budget - 1e-9))) for g in groups))
    return AotSplitTable(
        min_split_tokens=min_split_tokens,
        max_splits=max_splits,
        batch_buckets=tuple(batch_buckets),
        splits=tuple(rows),
    )
