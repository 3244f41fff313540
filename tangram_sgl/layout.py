"""Where each (layer, kv_head) lives: its head group and its column inside that group's pages."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from tangram_sgl.budget import quantize_budgets
from tangram_sgl.profile import TangramProfile


@dataclass(frozen=True)
class LayerSlots:
    """The kv heads of one layer: ``group[h]`` and ``column[h]`` for kv head h."""

    group: tuple[int, ...]
    column: tuple[int, ...]

    def groups(self) -> tuple[int, ...]:
        """Distinct groups this layer's heads belong to, ascending."""
        return tuple(sorted(set(self.group)))


@dataclass(frozen=True)
class HeadGroupLayout:
    """Static mapping (layer, kv_head) -> (group, column), plus each group's budget and width H_p.

    A page of group g holds ``heads_per_group`` columns x ``page_size`` tokens of K and of V; member i of
    group g (in profile order) uses column i. Columns past a group's member count are padding.
    """

    num_layers: int
    num_kv_heads: int
    heads_per_group: int
    page_size: int
    group_budget: tuple[float, ...]
    members: tuple[tuple[tuple[int, int], ...], ...]
    layers: tuple[LayerSlots, ...]

    @classmethod
    def from_profile(cls, profile: TangramProfile, page_size: int | None = None) -> HeadGroupLayout:
        L, H = profile.model.num_layers, profile.model.num_kv_heads
        group = [[-1] * H for _ in range(L)]
        column = [[-1] * H for _ in range(L)]
        for gi, g in enumerate(profile.groups):
            for ci, (li, hi) in enumerate(g.members):
                group[li][hi], column[li][hi] = gi, ci
        return cls(
            num_layers=L,
            num_kv_heads=H,
            heads_per_group=profile.heads_per_group,
            page_size=page_size or profile.page_size,
            group_budget=tuple(g.budget for g in profile.groups),
            members=tuple(g.members for g in profile.groups),
            layers=tuple(LayerSlots(tuple(group[li]), tuple(column[li])) for li in range(L)),
        )

    @property
    def num_groups(self) -> int:
        return len(self.group_budget)

    @cached_property
    def group_budget_quantized(self) -> np.ndarray:
        """int64 [G]: the group budgets in millionths (what every kept count is computed from)."""
        return quantize_budgets(self.group_budget)

    def head_group_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 [L, H]: group of each (layer, kv_head)."""
        return torch.tensor([s.group for s in self.layers], dtype=torch.int32, device=device)

    def head_column_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 [L, H]: column of each (layer, kv_head) inside its group's pages."""
        return torch.tensor([s.column for s in self.layers], dtype=torch.int32, device=device)
