"""Free-list allocator over the pages of one :class:`GroupPagePool` (page 0 is never handed out)."""

from __future__ import annotations

from collections.abc import Iterable


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Hands out page ids 1..num_pages-1; page 0 is the reserved null page (padding, CUDA-graph rows).

    The free list is a LIFO stack, so two runs of the same operations produce the same page ids.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray(b"\x01") * num_pages
        self._is_free[0] = 0

    @property
    def usable_pages(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` distinct free pages; raises :class:`PoolExhausted` (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} free of {self.usable_pages}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; freeing page 0, an unknown page or a free page raises."""
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not an allocatable page of a {self.num_pages}-page pool")
            if self._is_free[p]:
                raise ValueError(f"double free of page {p}")
            self._is_free[p] = 1
            self._free.append(p)

    def free_pages(self) -> list[int]:
        """Snapshot of the free page ids (for the invariant checker)."""
        return list(self._free)
