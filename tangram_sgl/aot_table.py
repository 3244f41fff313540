"""Build the ahead-of-time split-KV table from group budgets.

Formula (per batch-size bucket B; group g with budget b_g; H kv heads per layer; b̄ the mean budget a
head is reserved at, i.e. the member-weighted mean of group budgets; t the bucket's CTA target):

    S_g(B) = clamp(ceil(t * b_g / (B * H * b̄)), 1, max_splits)

Why: one decode launch for a layer has B*H (request, kv head) work items; a head of group g holds
~b_g*n tokens, so the layer's total KV is ~B*H*b̄*n tokens. Cutting it into t equal chunks
gives chunk ~B*H*b̄*n/t tokens, and a head of group g needs b_g*n/chunk = the formula's splits
— independent of n, so it can be fixed offline. Every CTA then reads about the same number of tokens
whatever its group (the load balance). Normalising by b̄ matters: with a mean budget of 0.25 the total work is
a quarter of full KV, and splitting as if it were full would leave the few full-budget heads as the long pole.
At run time the kernel cuts a (request, group) of retained length n into chunks of max(min_split_tokens,
ceil(n/S_g)) tokens, so short contexts do not pay merge cost for tiny splits. Buckets are the decode batch sizes
CUDA graphs capture; a batch uses the smallest bucket >= its size, so each captured graph has one fixed split
table (fixed launch shape).

The target t of each bucket is the candidate (2 to 16 CTAs per SM of the H200's 132) whose table gives the
shortest simulated launch (:func:`decode_makespan`): the launch's programs, longest first, on the
``DECODE_WAVE_CTAS`` program slots the GPU runs at once, each costing its tokens plus ``PER_PROGRAM_TOKENS``, at a
reference context of ``REFERENCE_CONTEXT`` tokens. Why: a launch just over a whole number of waves leaves most
slots idle for its last wave. The slots (3 per SM) are what fits the H200's measured target studies of sessions
8-16 (batch 8-128, 4k and 32k contexts, budgets 1.0 and 0.25: the simulated choice was within 3.2 % of the best
measured target in all 12 cases, mean 0.9 %, held there by ``tests/test_aot_table.py``, where the former fixed target
of 8 CTAs per SM lost 6 % on average and up to 14 %; 2 or 4 slots per SM fit far worse); they are what the served decode config (128, 4, 2) compiles to
at head dim 128 and bf16 (160 registers and 72 KB of shared memory a program under the H200's Triton 3.6:
``eval/results/kernel_resources.json``; ``tests/test_kernels_compile.py`` holds the two together).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tangram_sgl.kernels.decode import DECODE_PROGRAMS_PER_SM, H200_SMS
from tangram_sgl.profile import AotSplitTable, HeadGroup

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
TARGET_CANDIDATES = tuple(k * H200_SMS for k in (2, 4, 6, 8, 12, 16))
DECODE_WAVE_CTAS = DECODE_PROGRAMS_PER_SM * H200_SMS
PER_PROGRAM_TOKENS = 256
REFERENCE_CONTEXT = 8192
DEFAULT_MAX_SPLITS = 32
DEFAULT_MIN_SPLIT_TOKENS = 256


def splits_for_target(budgets: Sequence[float], target_ctas: float, batch: int, num_kv_heads: int,
                      mean_budget: float, max_splits: int) -> tuple[int, ...]:
    """The module's formula: S_g for every group budget of ``budgets``."""
    per_budget = target_ctas / (batch * num_kv_heads * mean_budget)
    return tuple(min(max_splits, max(1, math.ceil(per_budget * b - 1e-9))) for b in budgets)


def decode_makespan(head_budgets: Sequence[float], head_splits: Sequence[int], batch: int, *,
                    context: int = REFERENCE_CONTEXT, min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
                    wave_ctas: int = DECODE_WAVE_CTAS, per_program_tokens: int = PER_PROGRAM_TOKENS) -> float:
    """Simulated duration, in tokens read, of one layer's decode launch: each of ``batch`` requests' kv heads keeps
    round(budget * context) tokens, cut as the kernel cuts them (chunks of max(min_split_tokens, ceil(n / S))); the
    programs, longest first (the kernel's launch order), each go to the least-loaded of ``wave_ctas`` slots."""
    jobs: Counter[int] = Counter()
    for b, s in zip(head_budgets, head_splits):
        n = max(1, round(b * context))
        chunk = max(min_split_tokens, -(-n // s))
        full, last = divmod(n, chunk)
        jobs[chunk + per_program_tokens] += full * batch
        if last:
            jobs[last + per_program_tokens] += batch
    loads = np.zeros(wave_ctas)
    for work, count in sorted(jobs.items(), reverse=True):  # identical programs: whole rounds, then the rest
        rounds, rest = divmod(count, wave_ctas)
        loads += rounds * work
        loads.sort()
        loads[:rest] += work
    return float(loads.max())


def _layer_heads(groups: Sequence[HeadGroup]) -> list[tuple[int, ...]]:
    """Per layer, the group index of each of its kv heads (heads in order)."""
    by_layer: dict[int, dict[int, int]] = {}
    for g, group in enumerate(groups):
        for layer, head in group.members:
            by_layer.setdefault(layer, {})[head] = g
    return [tuple(heads[h] for h in sorted(heads)) for _, heads in sorted(by_layer.items())]


def build_aot_table(
    groups: Sequence[HeadGroup],
    num_kv_heads: int,
    *,
    batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
    target_ctas: int | None = None,
    max_splits: int = DEFAULT_MAX_SPLITS,
    min_split_tokens: int = DEFAULT_MIN_SPLIT_TOKENS,
) -> AotSplitTable:
    """Splits per (bucket, group) following the module's formula, each bucket at the simulated best of
    ``TARGET_CANDIDATES`` (or at ``target_ctas`` for every bucket, for target studies)."""
    members = sum(len(g.members) for g in groups)
    mean_budget = sum(len(g.members) * g.budget for g in groups) / members
    budgets = [g.budget for g in groups]
    layers = Counter(_layer_heads(groups))  # distinct layer compositions, simulated once each

    def simulated(splits: tuple[int, ...], batch: int) -> float:
        return sum(n * decode_makespan([budgets[g] for g in heads], [splits[g] for g in heads], batch,
                                       min_split_tokens=min_split_tokens) for heads, n in layers.items())

    rows = []
    for b in batch_buckets:
        tables = [splits_for_target(budgets, t, b, num_kv_heads, mean_budget, max_splits)
                  for t in ((target_ctas,) if target_ctas else TARGET_CANDIDATES)]
        rows.append(min(tables, key=lambda s: (round(simulated(s, b)), sum(s))))  # ties: fewer programs
    return AotSplitTable(
        min_split_tokens=min_split_tokens,
        max_splits=max_splits,
        batch_buckets=tuple(batch_buckets),
        splits=tuple(rows),
    )
