"""Which tokens each head keeps: protected tokens (sink, recent window) plus its own top scores."""

from __future__ import annotations

import torch


def protected_mask(n: int, start: int, sink: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [n]: positions of segment [start, start+n) that every head keeps (sink ∪ last ``window``)."""
    pos = torch.arange(start, start + n, device=device)
    return (pos < sink) | (pos >= start + n - window)


def select_kept(scores: torch.Tensor, k: int, start: int, sink: int, window: int) -> torch.Tensor:
    """int64 [H, k]: per head, the segment-relative positions kept, ascending.

    ``k`` comes from :func:`tangram_sgl.budget.kept_tokens` and is at least the protected count, so every
    protected position is kept and the remaining ``k - protected`` slots go to the highest scores
    (ties broken by lower position, so the choice is deterministic).
    """
    n = scores.shape[1]
    if not 0 <= k <= n:
        raise ValueError(f"cannot keep {k} of {n} tokens")
    prot = protected_mask(n, start, sink, window, scores.device)
    if k < int(prot.sum()):
        raise ValueError(f"k={k} is below the {int(prot.sum())} protected tokens")
    # Protected positions rank above every score; a stable sort breaks ties by lower position.
    key = scores.float().masked_fill(prot[None, :], float("inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values
