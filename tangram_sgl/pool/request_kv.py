"""What the manager holds per running request (:class:`RequestKV`) and what a prefix match returns."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from tangram_sgl.pool.reservation import PendingSegment
from tangram_sgl.pool.segment import Segment
from tangram_sgl.radix.tree import SegmentNode, SegmentTree

UNRESOLVED = -1  # token id of a decoded token whose id is not known yet (open_decode_slots without ids)


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: the deepest matched node and the number of tokens its path covers."""

    node: SegmentNode
    length: int

    def segments(self) -> list[Segment]:
        return [n.segment for n in SegmentTree.path(self.node)]


@dataclass
class RequestKV:
    """Everything one running request holds: a locked tree prefix plus its own pages."""

    rid: Hashable
    node: SegmentNode
    token_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    pending: PendingSegment | None = None
    decode: Segment | None = None
    spare: list[list[int]] = field(default_factory=list)  # reserved decode pages per group, not yet used
    version: int = 0  # bumped whenever the slot lists change other than by appending decoded tokens
    decode_page_row: np.ndarray | None = None  # int64 [G]: the decode segment's current page per group, x page size
    unresolved_from: int | None = None  # first decoded position whose token id is not known yet (UNRESOLVED)

    @property
    def prefix_len(self) -> int:
        return self.node.end

    @property
    def decoded_tokens(self) -> int:
        """Tokens in the open decode segment (every group keeps each of them)."""
        return self.decode.n if self.decode is not None else 0

    def group_page_lists(self) -> Iterable[tuple[int, list[int]]]:
        """(group, pages) of every page list the request owns: its segments, the segment being written,
        its decoded tokens and its reserved decode pages (in that order)."""
        for seg in self.segments:
            yield from enumerate(gs.pages for gs in seg.groups)
        if self.pending is not None:
            yield from enumerate(gs.pages for gs in self.pending.groups)
        if self.decode is not None:
            yield from enumerate(gs.pages for gs in self.decode.groups)
        yield from enumerate(self.spare)

    def owned_pages(self) -> Iterable[int]:
        for _, pages in self.group_page_lists():
            yield from pages
