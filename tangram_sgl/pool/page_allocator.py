"""Free-list allocator over the pages of one :class:`GroupPagePool` (page 0 is never handed out)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free."""


class PageAllocator:
    """Hands out page ids 1..num_pages-1; page 0 is the reserved null page (padding, CUDA-graph rows).

    The free list is a LIFO stack, so two runs of the same operations produce the same page ids. It and the
    free flags are numpy arrays: a reservation takes hundreds of pages and an eviction returns thousands, each in a
    few vector operations on the scheduler's path.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int64)  # free pages in [:_top], taken from the top
        self._top = num_pages - 1
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[0] = False

    @property
    def usable_pages(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def free_count(self) -> int:
        return self._top

    def alloc(self, n: int) -> list[int]:
        """``n`` distinct free pages; raises :class:`PoolExhausted` (allocating nothing) if fewer are free."""
        return self.alloc_array(n).tolist()

    def alloc_array(self, n: int) -> np.ndarray:
        """:meth:`alloc` as an int64 array (a copy)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            raise PoolExhausted(f"asked for {n} pages, {self._top} free of {self.usable_pages}")
        pages = self._stack[self._top - n:self._top].copy()
        self._top -= n
        self._is_free[pages] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; freeing page 0, an unknown page or a free page raises (nothing is freed)."""
        arr = np.fromiter(pages, dtype=np.int64)
        bad = arr[(arr <= 0) | (arr >= self.num_pages)]
        if bad.size:
            raise ValueError(f"page {int(bad[0])} is not an allocatable page of a {self.num_pages}-page pool")
        uniq, counts = np.unique(arr, return_counts=True)
        double = uniq[self._is_free[uniq] | (counts > 1)]
        if double.size:
            raise ValueError(f"double free of page {int(double[0])}")
        self._is_free[arr] = True
        self._stack[self._top:self._top + arr.size] = arr
        self._top += arr.size

    def free_pages(self) -> list[int]:
        """Snapshot of the free page ids (for the invariant checker)."""
        return self._stack[:self._top].tolist()
