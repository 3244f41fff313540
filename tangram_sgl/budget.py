"""The one budget rule every component shares: how many tokens of a segment a head group keeps.

A segment is the new tokens of one prefill (a turn's prompt beyond the matched prefix). Group g with
budget b_g keeps

    k_g(n) = min(n, ceil(b_g * n) + protected)

tokens of an n-token segment starting at absolute position ``start``, where ``protected`` counts the
conversation's first ``sink`` tokens that fall inside the segment plus the segment's last ``window``
tokens (a token in both is counted once). Budgets are quantised to 1e-6 so that ceil() is exact
integer arithmetic and identical on every process and machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BUDGET_QUANTUM = 1_000_000


def quantize_budget(budget: float) -> int:
    """Budget fraction as an integer number of millionths (the unit all page maths uses)."""
    return round(budget * BUDGET_QUANTUM)


def protected_tokens(n: int, start: int, sink: int, window: int) -> int:
    """Tokens of segment [start, start+n) that are always kept: sink tokens ∪ the last ``window``."""
    if n <= 0:
        return 0
    recent = min(n, window)
    sink_in_segment = max(0, min(sink, start + n) - start)
    # The sink range [start, start+sink_in_segment) and the window [start+n-recent, start+n) overlap
    # when the segment is short.
    overlap = max(0, sink_in_segment - (n - recent))
    return recent + sink_in_segment - overlap


def kept_tokens(budget: float, n: int, start: int, sink: int, window: int) -> int:
    """k_g(n): tokens a group of budget ``budget`` keeps of an n-token segment starting at ``start``."""
    if n <= 0:
        return 0
    q = quantize_budget(budget)
    scored = -(-q * n // BUDGET_QUANTUM)  # ceil(budget * n), exact
    return min(n, scored + protected_tokens(n, start, sink, window))


def quantize_budgets(budgets: Sequence[float]) -> np.ndarray:
    """int64 millionths of every budget (:func:`quantize_budget` of each)."""
    return np.array([quantize_budget(b) for b in budgets], dtype=np.int64)


def kept_tokens_quantized(q: np.ndarray, n: int, start: int, sink: int, window: int) -> np.ndarray:
    """:func:`kept_tokens` of every budget of ``q`` (:func:`quantize_budgets`) at once, int64, the same integers."""
    if n <= 0:
        return np.zeros(len(q), dtype=np.int64)
    return np.minimum(n, -(-q * n // BUDGET_QUANTUM) + protected_tokens(n, start, sink, window))


def group_kept_tokens(budgets: Sequence[float], n: int, start: int, sink: int, window: int) -> list[int]:
    """k_g for every group budget of an n-token segment starting at absolute position ``start``."""
    return kept_tokens_quantized(quantize_budgets(budgets), n, start, sink, window).tolist()


def pages_for(tokens: int | np.ndarray, page_size: int) -> int | np.ndarray:
    """Pages needed to hold ``tokens`` tokens (elementwise for an array of counts)."""
    return -(-tokens // page_size)
