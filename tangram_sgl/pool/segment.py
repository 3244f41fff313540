"""What one owner (a running request or a radix-tree node) holds: segments and their per-group slot lists.

A :class:`Segment` is the KV of ``n`` consecutive tokens starting at absolute position ``start``: the new
tokens of one prefill chunk, or decoded tokens. For every head group ``g`` it owns a page list; slot ``j`` of
that list (``pages[j // page_size] * page_size + j % page_size``) holds, in every column ``c`` of ``g``, the
j-th kept token of member ``c``. ``kept[g]`` lists those positions (int32, segment-relative, ascending,
``[members, k_g]``); a position a head does not list is dropped for that head. A *full* segment keeps every
token in every group (decoded tokens, or a budget that keeps all); it stores no ``kept`` tensors and is the
only kind that may be split (at a slot index that is a multiple of ``page_size``: a page has one owner).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from tangram_sgl.kernels.pieces import piece_positions
from tangram_sgl.pool.device_copy import to_device


@dataclass
class GroupSlots:
    """One (owner, group) slot list: ``length`` slots in use on ``pages`` (capacity ``len(pages)*page_size``).

    Lists only grow (pages appended, ``length`` raised) or are replaced whole, so the slot tensor of the
    whole list is cached under ``(length, len(pages), last page)``, on the host and on every device it was
    asked for: every step re-reads the same committed lists, and a list reaches the GPU once per state
    (4 bytes per slot beside the slot's K/V).
    """

    pages: list[int] = field(default_factory=list)
    length: int = 0
    _cached: tuple[tuple[int, int, int, int], dict[torch.device, torch.Tensor]] | None = field(
        default=None, repr=False, compare=False)

    def slots(self, page_size: int, begin: int = 0, end: int | None = None,
              device: torch.device | None = None) -> torch.Tensor:
        """int32 slot ids of slots ``[begin, end)`` (default: all in use), the kernels' index type, on
        ``device`` (default: the host)."""
        dev = torch.device("cpu") if device is None else torch.device(device)
        whole = begin == 0 and end is None
        if whole:
            key = (self.length, len(self.pages), self.pages[-1] if self.pages else -1, page_size)
            if self._cached is None or self._cached[0] != key:
                self._cached = (key, {torch.device("cpu"): self._compute(page_size, 0, self.length)})
            copies = self._cached[1]
            if dev not in copies:
                copies[dev] = to_device(copies[torch.device("cpu")], dev)
            return copies[dev]
        return to_device(self._compute(page_size, begin, self.length if end is None else end), dev)

    def _compute(self, page_size: int, begin: int, end: int) -> torch.Tensor:
        j = torch.arange(begin, end, dtype=torch.long)
        pages = torch.tensor(self.pages, dtype=torch.long)
        return (pages[j // page_size] * page_size + j % page_size if len(j) else j).to(torch.int32)


@dataclass(frozen=True)
class SlotTable:
    """A segment's slot lists of every group: ``slots[offsets[g] : offsets[g] + lengths[g]]`` is group g's."""

    slots: torch.Tensor  # int32, on the device it was asked for
    lengths: np.ndarray  # int64 [G], host
    offsets: np.ndarray  # int64 [G], host


def page_list_slots(pages: torch.Tensor, first_page: torch.Tensor, lens: torch.Tensor, page_size: int,
                    total: int) -> torch.Tensor:
    """Ragged slot lists laid end to end, list i's slot j being
    ``pages[first_page[i] + j // page_size] * page_size + j % page_size`` (its tokens fill its pages in order);
    computed where the inputs are (one device; ``total = lens.sum()``, a host int: no device sync)."""
    starts = torch.cumsum(lens, 0) - lens
    owner = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)
    j = torch.arange(total, device=lens.device) - starts[owner]  # each slot's index within its list
    return pages[first_page[owner] + torch.div(j, page_size, rounding_mode="floor")] * page_size + j % page_size


def slot_tables(segments: Sequence[Segment], page_size: int, device: torch.device | None = None) -> list[SlotTable]:
    """:meth:`Segment.slot_table` of each of ``segments``; the tables missing on ``device`` are built together,
    there: their page lists travel (one copy, 1/page_size of the slots) and expand into slots on ``device``."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    unique = list({id(s): s for s in segments}.values())  # a tree node is on many requests' paths
    for s in unique:
        if s._tables is None or s._tables[0] != (s.n, page_size):
            s._tables = ((s.n, page_size), {})
    missing = [s for s in unique if dev not in s._tables[1]]
    if missing:
        G = len(missing[0].groups)
        lists = [gs for s in missing for gs in s.groups]  # list i: segment i // G, group i % G
        lens = np.fromiter((gs.length for gs in lists), dtype=np.int64, count=len(lists))
        npages = np.fromiter((len(gs.pages) for gs in lists), dtype=np.int64, count=len(lists))
        pages = np.fromiter(chain.from_iterable(gs.pages for gs in lists), dtype=np.int64, count=int(npages.sum()))
        meta = to_device(torch.from_numpy(np.concatenate([pages, np.cumsum(npages) - npages, lens])), dev)
        slots = page_list_slots(*meta.split([len(pages), len(lists), len(lists)]), page_size,
                                int(lens.sum())).to(torch.int32)
        seg_lens = lens.reshape(-1, G)
        offsets = np.cumsum(seg_lens, axis=1) - seg_lens
        bounds = np.concatenate([[0], np.cumsum(seg_lens.sum(axis=1))]).tolist()
        for i, s in enumerate(missing):
            s._tables[1][dev] = SlotTable(slots[bounds[i]:bounds[i + 1]], seg_lens[i], offsets[i])
    return [s._tables[1][dev] for s in segments]


@dataclass
class Segment:
    """KV of tokens ``[start, start + n)`` held as one slot list per head group (see module docstring)."""

    start: int
    token_ids: list[int]
    full: bool
    groups: list[GroupSlots]
    kept: list[torch.Tensor] | None = None  # read through kept_on_host(): its copy from the GPU may be in flight
    kept_ready: torch.cuda.Event | None = field(default=None, repr=False, compare=False)
    _tables: tuple[tuple[int, int], dict[torch.device, SlotTable]] | None = field(default=None, repr=False,
                                                                                 compare=False)

    @property
    def n(self) -> int:
        return len(self.token_ids)

    def slot_table(self, page_size: int, device: torch.device | None = None) -> SlotTable:
        """All groups' slot lists as one int32 tensor on ``device`` (default: the host; group-major) with host
        per-group lengths and offsets, cached per device: a segment's lists change only together with its
        token count (decode growth, :meth:`append`), so a step reads each committed segment once per state,
        not once per group. :func:`slot_tables` fills many segments' caches at once."""
        return slot_tables([self], page_size, device)[0]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def pages(self) -> Iterator[int]:
        for gs in self.groups:
            yield from gs.pages

    def num_pages(self) -> int:
        return sum(len(gs.pages) for gs in self.groups)

    def kept_on_host(self) -> list[torch.Tensor] | None:
        """``kept`` once its device-to-host copy (made at commit without waiting) has landed."""
        if self.kept_ready is not None:
            self.kept_ready.synchronize()
            self.kept_ready = None
        return self.kept

    def kept_positions(self, group: int, column: int) -> torch.Tensor:
        """int32 segment-relative positions kept by member ``column`` of ``group``, ascending."""
        if self.full:
            return torch.arange(self.groups[group].length, dtype=torch.int32)
        kept = self.kept_on_host()
        assert kept is not None
        return kept[group][column]

    def can_split(self, at: int, page_size: int) -> bool:
        """A full segment splits at ``0 < at < n`` when ``at`` starts a page of every group's slot list."""
        return self.full and 0 < at < self.n and at % page_size == 0

    def split(self, at: int, page_size: int) -> tuple[Segment, Segment]:
        """(tokens [0, at), tokens [at, n)) sharing no page; only for :meth:`can_split` points."""
        if not self.can_split(at, page_size):
            raise ValueError(f"cannot split a {'full' if self.full else 'compressed'} {self.n}-token segment "
                             f"at {at} (page_size {page_size})")
        cut = at // page_size
        head = Segment(self.start, self.token_ids[:at], True,
                       [GroupSlots(gs.pages[:cut], at) for gs in self.groups])
        tail = Segment(self.start + at, self.token_ids[at:], True,
                       [GroupSlots(gs.pages[cut:], gs.length - at) for gs in self.groups])
        return head, tail

    def can_append(self, other: Segment, page_size: int) -> bool:
        """``other`` can be merged onto this one: both full, adjacent, and this one ends on a page boundary."""
        return (self.full and other.full and self.end == other.start and self.n % page_size == 0
                and all(len(gs.pages) * page_size == gs.length for gs in self.groups))

    def append(self, other: Segment, page_size: int) -> None:
        """Merge ``other`` (see :meth:`can_append`) into this segment; ``other`` must not be used again."""
        if not self.can_append(other, page_size):
            raise ValueError("segments are not adjacent full page-aligned segments")
        self.token_ids = self.token_ids + other.token_ids
        for mine, theirs in zip(self.groups, other.groups):
            mine.pages = mine.pages + theirs.pages
            mine.length += theirs.length


def csr_slot_lists(owners: Sequence[Sequence[Segment]], num_groups: int, page_size: int,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR ``(indptr [R*G+1] on the host, indices on device)`` int32 of several owners' lists: (owner r, group g)
    is the concatenation of group g's lists of ``owners[r]``'s segments, in order.

    Built from each segment's cached all-groups slot table on ``device`` (:func:`slot_tables`): the host handles
    O(owners x segments) objects and numpy arrays of (owner, group, segment) pieces; one gather on the device puts
    the pieces in CSR order (no host copy of whole lists, no per-(group, segment) calls).
    """
    G = num_groups
    flat = slot_tables([s for row in owners for s in row], page_size, device)  # (owner, segment) order
    indptr = torch.zeros(len(owners) * G + 1, dtype=torch.int32)
    if not flat:
        return indptr, torch.empty(0, dtype=torch.int32, device=device)
    # pieces (owner, group, segment), from [S, G] arrays of all the segments in (owner, segment) order
    nseg = np.fromiter((len(row) for row in owners), dtype=np.int64, count=len(owners))
    first = np.cumsum(nseg) - nseg  # each owner's first segment
    row = np.repeat(np.arange(len(owners)), nseg)
    lens = np.stack([t.lengths for t in flat])  # [S, G]
    seg_base = np.cumsum([0] + [t.slots.numel() for t in flat])[:-1]
    srcs = np.stack([t.offsets for t in flat]) + seg_base[:, None]
    place = (first[row] * G)[:, None] + np.arange(G)[None, :] * nseg[row][:, None] + \
        (np.arange(len(flat)) - first[row])[:, None]  # [S, G]: the piece's rank in (owner, group, segment)
    piece_len, piece_src = np.empty(lens.size, dtype=np.int64), np.empty(lens.size, dtype=np.int64)
    piece_len[place.reshape(-1)], piece_src[place.reshape(-1)] = lens.reshape(-1), srcs.reshape(-1)
    group_lens = np.zeros((len(owners), G), dtype=np.int64)
    np.add.at(group_lens, row, lens)
    indptr[1:] = torch.from_numpy(np.cumsum(group_lens.reshape(-1)))
    total = int(indptr[-1])
    if total == 0:
        return indptr, torch.empty(0, dtype=torch.int32, device=device)
    keep = piece_len > 0
    piece_len, piece_src = piece_len[keep], piece_src[keep]
    piece_dst = np.cumsum(piece_len) - piece_len  # pieces are already in output order
    slots = torch.cat([t.slots for t in flat])
    meta = to_device(torch.from_numpy(np.stack([piece_src - piece_dst, piece_len])), slots.device)
    return indptr, slots[piece_positions(meta[0], meta[1], total)]  # shift: source - destination
