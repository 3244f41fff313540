"""Where one forward step's new segments go, for all its rows at once (one batch of device work per layer).

A step's staging K/V is ``[T, H_kv, D]``, its rows' new tokens ragged along T. Two plans, built once per step
from the rows' :class:`~tangram_sgl.pool.reservation.PendingSegment`s:

- :class:`FullSegmentWrites`: segments every group keeps whole (short turns, budget 1.0): token i of head h
  goes to its reserved slot, no selection;
- :class:`CompressedWrites`: segments that drop tokens: per layer, the rows' scores are padded into one
  ``[R, H, n_max]`` tensor, one selection ranks every head of every row (``select_kept_padded``), and one
  gather/scatter writes all kept tokens. Every entry (row, layer, kv head, rank among the head's kept) is laid
  out layer-major across rows, so a layer's entries are one slice; the targets come from each segment's
  :class:`~tangram_sgl.pool.reservation.SegmentWrites`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sgl.pool.device_copy import to_device
from tangram_sgl.pool.reservation import PendingSegment


@dataclass(frozen=True)
class FullSegmentWrites:
    """Where every layer's K/V of segments that keep every token go, for several requests at once, as
    ``GroupPagePool.scatter`` entries: entry i of layer l copies staging row ``token[i]`` of kv head ``head[i]``
    to slot ``slot[l, i]``, column ``column[l, i]`` (i runs over heads, then the N new tokens)."""

    rids: list[Hashable]
    slot: torch.Tensor  # int64 [L, H*N] on the pool's device
    column: torch.Tensor  # int64 [L, H*N]
    token: torch.Tensor  # int64 [H*N]: rows of the step's staging K/V
    head: torch.Tensor  # int64 [H*N]

    @classmethod
    def build(cls, rids: Sequence[Hashable], slots: torch.Tensor, columns: torch.Tensor,
              tokens: torch.Tensor) -> FullSegmentWrites:
        """From ``slots [L, H, N]`` (head h's slot of each new token in layer l), ``columns [L, H]`` and the
        tokens' staging rows ``[N]``."""
        layers, hkv, n = slots.shape
        return cls(list(rids), slots.reshape(layers, -1), columns[:, :, None].expand(-1, -1, n).reshape(layers, -1),
                   tokens.repeat(hkv), torch.arange(hkv, device=tokens.device).repeat_interleave(n))


@dataclass(frozen=True)
class CompressedWrites:
    """The kept-token writes of several compressed pending segments (see module docstring).

    Entries of layer l: ``[bounds[l], bounds[l+1])`` of ``row`` (index into ``pendings``), ``head``, ``rank``,
    ``group``, ``column``, ``slot`` (int64, on the pool's device). Per row: ``offsets`` (its first staging
    row), ``counts`` ``[R, L, H]`` kept tokens per head, ``protected`` bool ``[R, n_max]``.
    ``kept`` int32 ``[R, G, H_p, kmax]`` holds the rows' kept positions; each pending segment's
    ``kept_table`` is a view of its row, so one scatter per layer fills them all.
    """

    pendings: list[PendingSegment]
    bounds: list[int]
    row: torch.Tensor
    head: torch.Tensor
    rank: torch.Tensor
    group: torch.Tensor
    column: torch.Tensor
    slot: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor
    protected: torch.Tensor
    kept: torch.Tensor

    @classmethod
    def build(cls, pendings: Sequence[PendingSegment], offsets: Sequence[int], num_layers: int,
              device: torch.device) -> CompressedWrites:
        """From the rows' pending segments (each with its ``writes`` prepared) and their first staging rows."""
        per = [p.writes for p in pendings]
        if any(w is None for w in per):
            raise ValueError("every pending segment needs its SegmentWrites (TangramKVManager prepares them)")
        # layer-major across rows, a permutation of the rows' own entries: piece (layer l, row r) is row r's
        # entries [bounds_r[l], bounds_r[l+1]), which start at own_start[r] in the rows' concatenation
        own = np.asarray([w.bounds for w in per], dtype=np.int64)  # [R, L+1]
        own_start = np.cumsum(own[:, -1]) - own[:, -1]
        piece_len = (own[:, 1:] - own[:, :-1]).T.reshape(-1)  # [L*R], layer-major
        piece_src = (own_start[:, None] + own[:, :-1]).T.reshape(-1)
        piece_dst = np.cumsum(piece_len) - piece_len
        perm = np.repeat(piece_src - piece_dst, piece_len) + np.arange(int(piece_len.sum()))
        rows = np.repeat(np.tile(np.arange(len(per)), num_layers), piece_len)
        bounds = [0, *np.cumsum(piece_len.reshape(num_layers, len(per)).sum(1)).tolist()]
        perm = to_device(torch.from_numpy(perm), device)

        def gathered(name: str) -> torch.Tensor:
            return torch.cat([getattr(w, name) for w in per])[perm]

        kept_widths = [p.kept_table.shape[-1] for p in pendings]
        g, hp = pendings[0].kept_table.shape[:2]
        kept = torch.full((len(pendings), g, hp, max(kept_widths)), -1, dtype=torch.int32, device=device)
        for r, (p, width) in enumerate(zip(pendings, kept_widths)):
            kept[r, :, :, :width] = p.kept_table  # anything already written (by another plan) carries over
            p.kept_table = kept[r, :, :, :width]
        return cls(list(pendings), bounds, to_device(torch.from_numpy(rows), device),
                   gathered("head"), gathered("rank"), gathered("group"), gathered("column"), gathered("slot"),
                   to_device(torch.tensor(list(offsets), dtype=torch.long), device),
                   torch.stack([w.counts for w in per]),
                   torch.nn.utils.rnn.pad_sequence([p.protected for p in pendings], batch_first=True), kept)

    @classmethod
    def single(cls, pend: PendingSegment) -> CompressedWrites:
        """The plan of one segment whose staging rows start at 0 (its own entries, no permutation)."""
        w = pend.writes
        if w is None:
            raise ValueError("the pending segment needs its SegmentWrites (TangramKVManager prepares them)")
        dev = w.slot.device
        return cls([pend], w.bounds, torch.zeros_like(w.head), w.head, w.rank, w.group,
                   w.column, w.slot, torch.zeros(1, dtype=torch.long, device=dev), w.counts[None],
                   pend.protected[None], pend.kept_table[None])
