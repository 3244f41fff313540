"""Index helper for moving consecutive pieces of a flat tensor between two layouts in one indexing operation."""

from __future__ import annotations

import torch


def piece_positions(shift: torch.Tensor, count: torch.Tensor, total: int) -> torch.Tensor:
    """Positions ``i + shift[p]`` for every position ``i < total`` of consecutive pieces ``p`` of
    ``count[p]`` entries (both on one device; ``total = count.sum()``, a host int: no device sync) — the
    gather or scatter index that moves pieces between two layouts in one indexing operation."""
    return torch.arange(total, device=shift.device) + torch.repeat_interleave(shift, count, output_size=total)
