"""GPU-resident slot lists of running requests, appended in place: what decode attention reads.

Rebuilding every (request, group) slot list on the host and copying it to the device each decode step costs
O(kept tokens of the batch) (millions of entries at long contexts). Instead, each mirrored request owns
one block of a fixed int32 ``arena`` (allocated once, so CUDA graphs can read it at a fixed address),
holding one region per group: ``[start_g, start_g + cap_g)``, of which the first ``len_g`` entries equal the
host list. A request's lists only ever grow at their end, so a decode step is O(requests x groups) of host
work: the new token's slot per group is scattered on the device at ``start_g + len_g`` and ``len_g`` rises.

A request is (re)uploaded whole (:meth:`DeviceSlotLists.upload`, all of a step's such requests together) when it is
new, when its lists changed in another way since the last sync (a committed segment, a checkpoint that deduplicated
tree pages, decode tokens appended by a mixed batch), or when a region is full. ``cap_g`` leaves room for the
decode tokens already reserved for it plus one page. When the arena has no room even after it is cleared (every
mirror is rebuilt on demand), :meth:`upload` returns False and the caller falls back to host-built lists for that
step (logged: a slow path, not a silent one).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tangram_sgl.kernels.pieces import piece_positions
from tangram_sgl.pool.device_copy import to_device


class RangeAllocator:
    """First-fit allocation of integer ranges in ``[0, capacity)``; freed ranges merge with neighbours."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts: list[int] = []  # free ranges [start, end), sorted by start
        self._ends: list[int] = []
        self.reset()

    @property
    def free_total(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def alloc(self, n: int) -> int | None:
        """Start of a free range of ``n`` (> 0) entries, or None when no free range is that long."""
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            if e - s >= n:
                if e - s == n:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + n
                return s
        return None

    def free(self, start: int, n: int) -> None:
        end = start + n
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < end) or (i and self._ends[i - 1] > start):
            raise RuntimeError(f"range [{start}, {end}) freed twice or never allocated")
        if i and self._ends[i - 1] == start:  # merge with the left neighbour
            i -= 1
            self._ends[i] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == end:  # and with the right one
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]

    def reset(self) -> None:
        """Everything free again."""
        self._starts, self._ends = ([0], [self.capacity]) if self.capacity else ([], [])


@dataclass
class SlotMirror:
    """One request's block of the arena: per group a region start, capacity and mirrored length (int64 ``[G]``
    views of row ``row`` of the owner's mirror table, so a decode step's bookkeeping is a few array operations
    for the whole batch); ``version`` and ``tokens``: the request's list version and token count when the
    mirror was last synced."""

    block: int
    size: int
    row: int
    starts: np.ndarray
    caps: np.ndarray
    lens: np.ndarray
    version: int
    tokens: int


class DeviceSlotLists:
    """The arena and the mirrors of running requests (see module docstring)."""

    def __init__(self, capacity: int, num_groups: int, device: torch.device | str):
        self.num_groups = num_groups
        self.arena = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.ranges = RangeAllocator(capacity)
        self.mirrors: dict[Hashable, SlotMirror] = {}
        self._table = np.zeros((3, 0, num_groups), dtype=np.int64)  # (starts, caps, lens) x mirror row x group
        self._free_rows: list[int] = []

    @property
    def capacity(self) -> int:
        return self.arena.numel()

    @property
    def used(self) -> int:
        """Arena entries held by mirrors' blocks."""
        return self.capacity - self.ranges.free_total

    def ready_for_step(self, rids: Sequence[Hashable], versions: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Per row, whether the mirror of ``rids[r]`` can serve a decode step at ``tokens[r]`` tokens (the new
        token included) without an upload: synced to list version ``versions[r]`` at ``tokens[r]`` tokens, or
        at one fewer with room in every region for the new token's slot (:meth:`append`)."""
        ready = np.zeros(len(rids), dtype=bool)
        behind, rows = [], []
        for r, (rid, version, n) in enumerate(zip(rids, versions, tokens)):
            m = self.mirrors.get(rid)
            if m is None or m.version != version:
                continue
            if m.tokens == n:
                ready[r] = True
            elif m.tokens == n - 1:
                behind.append(r)
                rows.append(m.row)
        if behind:
            ready[behind] = (self._table[2, rows] < self._table[1, rows]).all(axis=1)
        return ready

    def _take_row(self) -> int:
        if not self._free_rows:  # grow the table; the mirrors' row views move with it
            old = self._table.shape[1]
            table = np.zeros((3, max(16, 2 * old), self.num_groups), dtype=np.int64)
            table[:, :old] = self._table
            self._table = table
            self._free_rows = list(range(table.shape[1] - 1, old - 1, -1))
            for m in self.mirrors.values():
                m.starts, m.caps, m.lens = self._table[:, m.row]
        return self._free_rows.pop()

    def upload(self, rids: Sequence[Hashable], lens: np.ndarray, slots: torch.Tensor, rooms: np.ndarray,
               versions: Sequence[int], tokens: Sequence[int]) -> bool:
        """Mirror the whole lists of the distinct ``rids`` — ``slots``: int32, each request's groups' lists one after
        another, the requests in order (``lens[r, g]`` entries: ``TangramKVManager.slot_lists`` of them), best on the
        arena's device — with ``rooms[r, g]`` spare entries per group (zeros), in one zero-fill and one scatter for
        the whole batch. False, mirroring none of them, when the arena cannot hold them even after clearing every
        mirror."""
        for rid in rids:
            self.drop(rid)
        lens = np.asarray(lens, dtype=np.int64).reshape(len(rids), self.num_groups)
        caps = lens + np.asarray(rooms, dtype=np.int64).reshape(lens.shape)
        sizes = caps.sum(axis=1)
        blocks = self._alloc_blocks(sizes)
        if blocks is None and self.ranges.free_total >= sizes.sum():  # fragmented: rebuild every mirror on demand
            self.clear()
            blocks = self._alloc_blocks(sizes)
        if blocks is None:
            return False
        starts = blocks[:, None] + np.cumsum(caps, axis=1) - caps
        flat_lens = lens.reshape(-1)
        # pieces: each block (zeroed), then each list (entry j of list i from slots[src_i + j] to starts_i + j)
        meta = to_device(torch.from_numpy(np.concatenate([blocks - (np.cumsum(sizes) - sizes), sizes,
                                                          starts.reshape(-1) - (np.cumsum(flat_lens) - flat_lens),
                                                          flat_lens])), self.arena.device)
        zero_shift, zero_count, shift, count = meta.split([len(rids), len(rids), lens.size, lens.size])
        if sizes.sum():  # index_fill_, not ``arena[idx] = 0``: that copies the 0 from the host and waits for the GPU
            self.arena.index_fill_(0, piece_positions(zero_shift, zero_count, int(sizes.sum())), 0)
        if flat_lens.sum():
            self.arena[piece_positions(shift, count, int(flat_lens.sum()))] = slots.to(self.arena.device, torch.int32)
        for r, rid in enumerate(rids):
            row = self._take_row()
            self._table[:, row] = (starts[r], caps[r], lens[r])
            self.mirrors[rid] = SlotMirror(int(blocks[r]), int(sizes[r]), row, *self._table[:, row], versions[r],
                                           tokens[r])
        return True

    def _alloc_blocks(self, sizes: np.ndarray) -> np.ndarray | None:
        """A block start per size (0 for an empty one), or None — allocating nothing — when one does not fit."""
        blocks = np.zeros(len(sizes), dtype=np.int64)
        for r, size in enumerate(sizes):
            block = self.ranges.alloc(int(size)) if size else 0
            if block is None:
                for b, n in zip(blocks[:r], sizes[:r]):
                    if n:
                        self.ranges.free(int(b), int(n))
                return None
            blocks[r] = block
        return blocks

    def _rows(self, rids: Sequence[Hashable]) -> np.ndarray:
        return np.fromiter((self.mirrors[rid].row for rid in rids), dtype=np.int64, count=len(rids))

    def append(self, rids: Sequence[Hashable], token_slots: torch.Tensor) -> None:
        """Append row r's slot ``token_slots[r, g]`` (device ``[R, G]``) to each group's list of ``rids[r]``
        (distinct requests; every region must have room: :meth:`ready_for_step`)."""
        rows = self._rows(rids)
        pos = (self._table[0, rows] + self._table[2, rows]).reshape(-1)
        self._table[2, rows] += 1
        for rid in rids:
            self.mirrors[rid].tokens += 1
        idx = to_device(torch.from_numpy(pos), self.arena.device)
        self.arena[idx] = token_slots.reshape(-1).to(torch.int32)

    def ranges_of(self, rids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """Host int32 ``(starts [R*G], lens [R*G])`` of the mirrored lists of ``rids``, row-major."""
        rows = self._rows(rids)
        return tuple(torch.from_numpy(self._table[f, rows].reshape(-1).astype(np.int32)) for f in (0, 2))

    def read(self, rid: Hashable, g: int) -> torch.Tensor:
        """Host copy of ``rid``'s mirrored list of group ``g`` (for the invariant checker)."""
        m = self.mirrors[rid]
        return self.arena[int(m.starts[g]): int(m.starts[g] + m.lens[g])].cpu()

    def drop(self, rid: Hashable) -> None:
        """Forget ``rid``'s mirror and free its block (no-op when it has none)."""
        m = self.mirrors.pop(rid, None)
        if m is not None:
            self._free_rows.append(m.row)
            if m.size:
                self.ranges.free(m.block, m.size)

    def clear(self) -> None:
        self.mirrors.clear()
        self.ranges.reset()
        self._free_rows = list(range(self._table.shape[1] - 1, -1, -1))
