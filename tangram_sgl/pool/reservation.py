"""Exact page demand of a segment, and the pages a request holds while its segment is being written.

Group g keeps ``k_g = kept_tokens(b_g, n, start, sink, window)`` tokens of an n-token segment, so the
segment needs exactly ``pages_for(k_g, page_size)`` pages in g — known before any score is computed.
Decode growth needs ``pages_for`` of the decoded token count in every group (decoded tokens are kept by
all groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from tangram_sgl.budget import kept_tokens_quantized, pages_for
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.device_copy import to_device
from tangram_sgl.pool.segment import GroupSlots, Segment


class AdmissionError(RuntimeError):
    """A request cannot be given its pages even after evicting every unlocked radix-tree node."""


def kept_counts(layout: HeadGroupLayout, n: int, start: int, sink: int, window: int) -> np.ndarray:
    """int64 ``[G]``: k_g for every group g of an n-token segment starting at absolute position ``start``."""
    return kept_tokens_quantized(layout.group_budget_quantized, n, start, sink, window)


def segment_kept_counts(layout: HeadGroupLayout, n: int, start: int, sink: int, window: int) -> list[int]:
    """:func:`kept_counts` as a list."""
    return kept_counts(layout, n, start, sink, window).tolist()


def pages_per_group(
    layout: HeadGroupLayout, n_new: int, start: int, decode_tokens: int, sink: int, window: int
) -> list[int]:
    """Pages per group for a segment of ``n_new`` tokens at ``start`` plus ``decode_tokens`` decoded ones."""
    ps = layout.page_size
    kept = kept_counts(layout, n_new, start, sink, window)
    return (pages_for(kept, ps) + pages_for(decode_tokens, ps)).tolist()


@dataclass(frozen=True)
class SegmentWrites:
    """Where every layer's kept tokens of one segment go, fixed before any score is known.

    One entry per (layer, kv head, rank j < k of the head's group), layer-major; layer l's entries are
    ``[bounds[l], bounds[l+1])``. ``head``, ``rank``, ``group``, ``column``, ``slot`` (int64, on the pool's
    device): the entry's kv head, its rank among the head's kept tokens, the head's group and column, and the
    reserved slot. ``counts`` int64 ``[L, H_kv]``: k of each (layer, kv head). Built once per segment, so a
    layer's write is a few gathers and scatters, with no host-to-device copy (which would wait for the GPU).
    """

    bounds: list[int]
    counts: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    group: torch.Tensor
    column: torch.Tensor
    slot: torch.Tensor

    @classmethod
    def build(cls, kept_counts: list[int], layer_groups: list[list[int]], head_group: torch.Tensor,
              head_column: torch.Tensor, slot_table: torch.Tensor) -> SegmentWrites:
        """From k_g per group, each layer's kv head -> group list (host), the same maps as ``[L, H]`` device
        tensors (group, column) and the ``[G, max k]`` reserved slots."""
        L, H = head_group.shape
        per_head = [[kept_counts[g] for g in row] for row in layer_groups]
        bounds = [0]
        for row in per_head:
            bounds.append(bounds[-1] + sum(row))
        dev = slot_table.device
        counts = to_device(torch.tensor(per_head, dtype=torch.long), dev)
        flat = counts.flatten()
        lh = torch.repeat_interleave(torch.arange(L * H, device=dev), flat, output_size=bounds[-1])
        rank = torch.arange(bounds[-1], device=dev) - (torch.cumsum(flat, 0) - flat)[lh]
        group, column = head_group.flatten().long()[lh], head_column.flatten().long()[lh]
        return cls(bounds, counts, lh % H, rank, group, column, slot_table[group, rank])


@dataclass
class PendingSegment:
    """Pages reserved for a segment whose K/V is being written layer by layer.

    On the pool's device while it is written: ``slot_table`` int64 ``[G, max k_g]`` (group g's reserved
    slots for kept tokens 0..k_g-1), ``kept_table`` int32 ``[G, H_p, max k_g]`` (the kept positions of each
    member, filled layer by layer, -1 elsewhere), copied to the host at commit (one copy for all rows of a
    step: ``TangramKVManager.commit_segments``), and its :class:`SegmentWrites` and protected-position mask
    (built at reservation for a segment that drops tokens; on first use for one kept whole).
    """

    start: int
    token_ids: list[int]
    kept_counts: list[int]
    groups: list[GroupSlots]
    layers_written: set[int]
    slot_table: torch.Tensor
    kept_table: torch.Tensor
    writes: SegmentWrites | None = None
    protected: torch.Tensor | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors the reservation put on the pool's device. Made in a scheduler hook, read by the forward:
        under overlap scheduling those run on different CUDA streams, so the forward marks them
        (``record_stream``) lest the caching allocator reuse their memory while its kernels still read them."""
        w = self.writes
        return [self.slot_table, self.kept_table, *([] if self.protected is None else [self.protected]),
                *([] if w is None else [w.counts, w.head, w.rank, w.group, w.column, w.slot])]

    def host_kept(self, members: list[int], table: torch.Tensor) -> list[torch.Tensor]:
        """Per group g: int32 ``[members[g], k_g]`` kept positions, from ``table``: a host copy of ``kept_table``."""
        return [table[g, :m, :k] for g, (m, k) in enumerate(zip(members, self.kept_counts))]

    @cached_property
    def full(self) -> bool:
        """Every group keeps every token (asked per row several times a step; the counts never change)."""
        return all(k == len(self.token_ids) for k in self.kept_counts)

    def to_segment(self, num_layers: int, members: list[int], kept_host: torch.Tensor | None) -> Segment:
        """The committed segment (``members[g]``: group g's member count; ``kept_host``: the host copy of
        ``kept_table``, None for a segment kept whole); every layer must have been written."""
        missing = sorted(set(range(num_layers)) - self.layers_written)
        if missing:
            raise RuntimeError(f"segment [{self.start}, {self.start + len(self.token_ids)}) is missing the K/V "
                               f"of layers {missing[:8]}{'...' if len(missing) > 8 else ''}")
        for gs, k in zip(self.groups, self.kept_counts):
            gs.length = k
        full = self.full
        return Segment(self.start, self.token_ids, full, self.groups,
                       None if full else self.host_kept(members, kept_host))
