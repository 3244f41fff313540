"""Engine-agnostic radix tree over token ids whose nodes each own one :class:`Segment`.

Matching rule (documented in docs/arch/pool.md): a compressed segment is atomic — a match ends only at
node boundaries, because splitting it would need the tokens it dropped and its heads keep different
positions. A *full* segment (every group keeps every token: decoded tokens, or budget 1.0) may be split
at a slot index that is a multiple of ``page_size``, exactly like SGLang's ``RadixCache`` splits nodes.
Children are indexed by their first token; siblings may share a first token when at least one of them is
compressed (they cannot be merged). Eviction is LRU over unlocked leaves on a logical clock (one tick per
tree operation), frees every page of the evicted node, and cascades to parents that become leaves.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from tangram_sgl.pool.segment import Segment


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two int lists (C-level slice compares, binary search)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SegmentNode:
    """A tree node: one segment, its children by first token, a lock count and an LRU stamp; ``pages`` counts the
    segment's pages (a tree node's segment changes only when the tree splits it, which recounts them)."""

    _ids = itertools.count()

    def __init__(self, segment: Segment | None, parent: SegmentNode | None, stamp: int):
        self.id = next(SegmentNode._ids)
        self.segment = segment
        self.pages = segment.num_pages() if segment is not None else 0
        self.parent = parent
        self.children: dict[int, list[SegmentNode]] = {}
        self.lock_ref = 0
        self.last_access = stamp

    @property
    def tokens(self) -> list[int]:
        return self.segment.token_ids if self.segment is not None else []

    @property
    def end(self) -> int:
        """Absolute position just past this node's tokens (0 for the root)."""
        return self.segment.end if self.segment is not None else 0

    def is_leaf(self) -> bool:
        return not self.children

    def child_list(self) -> Iterator[SegmentNode]:
        for lst in self.children.values():
            yield from lst

    def __repr__(self) -> str:
        seg = self.segment
        what = "root" if seg is None else f"[{seg.start},{seg.end}) {'full' if seg.full else 'compressed'}"
        return f"SegmentNode(#{self.id} {what} lock={self.lock_ref})"


class SegmentTree:
    """The radix tree plus its size counters (pages and tokens, split into evictable and protected)."""

    def __init__(self, page_size: int, release: Callable[[Segment], None]):
        self.page_size = page_size
        self._release = release
        self.clock = 0
        self.root = SegmentNode(None, None, 0)
        self.root.lock_ref = 1  # never evicted, never counted
        self.evictable_pages = self.protected_pages = 0
        self.evictable_tokens = self.protected_tokens = 0

    # ------------------------------------------------------------------ traversal
    def nodes(self) -> Iterator[SegmentNode]:
        """Every node but the root."""
        stack = list(self.root.child_list())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.child_list())

    @staticmethod
    def path(node: SegmentNode) -> list[SegmentNode]:
        """Nodes from the root's child down to ``node`` (empty for the root)."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _touch_path(self, node: SegmentNode, stamp: int) -> None:
        while node is not None:
            node.last_access = stamp
            node = node.parent

    # ------------------------------------------------------------------ counters
    def _account(self, node: SegmentNode, sign: int) -> None:
        pages, tokens = sign * node.pages, sign * node.segment.n
        if node.lock_ref == 0:
            self.evictable_pages += pages
            self.evictable_tokens += tokens
        else:
            self.protected_pages += pages
            self.protected_tokens += tokens

    # ------------------------------------------------------------------ match
    def match(self, token_ids: Sequence[int], max_len: int | None = None) -> tuple[SegmentNode, int]:
        """Deepest node whose path is a prefix of ``token_ids[:max_len]``, and that path's token count.

        Full nodes are split at a page-aligned point when the query diverges inside them (as SGLang's
        ``RadixCache`` does); compressed nodes are matched whole or not at all.
        """
        query = list(token_ids[: len(token_ids) if max_len is None else max(0, max_len)])
        stamp = self._tick()
        node, i = self.root, 0
        node.last_access = stamp
        while i < len(query):
            best_full, split_at, split_node = None, 0, None
            for child in node.children.get(query[i], ()):  # the query sliced to the child: O(n) per match
                m = common_prefix(child.tokens, query[i: i + child.segment.n])
                if m == child.segment.n:
                    if best_full is None or m > best_full.segment.n:
                        best_full = child
                elif child.segment.full:
                    p = m // self.page_size * self.page_size
                    if p > split_at:
                        split_at, split_node = p, child
            if best_full is not None and best_full.segment.n >= split_at:
                node = best_full
                node.last_access = stamp
                i += node.segment.n
                continue
            if split_node is not None:
                node = self._split(split_node, split_at, stamp)
                i += split_at
            break
        return node, i

    def _split(self, node: SegmentNode, at: int, stamp: int) -> SegmentNode:
        """Cut a full node: a new node holds tokens [0, at) above ``node``, which keeps the rest."""
        head_seg, tail_seg = node.segment.split(at, self.page_size)
        parent = node.parent
        head = SegmentNode(head_seg, parent, stamp)
        head.lock_ref = node.lock_ref
        siblings = parent.children[node.tokens[0]]
        siblings[siblings.index(node)] = head
        node.segment, node.pages, node.parent = tail_seg, tail_seg.num_pages(), head
        node.last_access = stamp
        head.children = {tail_seg.token_ids[0]: [node]}
        return head

    # ------------------------------------------------------------------ insert
    def insert(self, parent: SegmentNode, segment: Segment) -> tuple[SegmentNode, int]:
        """Hang ``segment`` (which must start at ``parent.end``) below ``parent``; the tree takes its pages.

        Tokens already present (an identical compressed sibling, or a full node sharing a page-aligned
        prefix with a full segment) are deduplicated: the incoming copy of them is released. Returns the
        node holding the segment's last token and the number of deduplicated tokens.
        """
        if segment.start != parent.end:
            raise ValueError(f"segment starts at {segment.start} but its parent ends at {parent.end}")
        stamp = self._tick()
        self._touch_path(parent, stamp)
        node, seg, dup = parent, segment, 0
        while True:
            target, shared = self._find_shared(node, seg)
            if target is None:
                break
            if shared < target.segment.n:
                target = self._split(target, shared, stamp)
            target.last_access = stamp
            node = target
            if shared == seg.n:
                self._release(seg)
                return node, dup + shared
            head, seg = seg.split(shared, self.page_size)
            self._release(head)
            dup += shared
        child = SegmentNode(seg, node, stamp)
        node.children.setdefault(seg.token_ids[0], []).append(child)
        self._account(child, +1)
        return child, dup

    def _find_shared(self, node: SegmentNode, seg: Segment) -> tuple[SegmentNode | None, int]:
        """A child of ``node`` already holding a prefix of ``seg``, and that prefix's length (0: none)."""
        for child in node.children.get(seg.token_ids[0], ()):
            cs = child.segment
            if not seg.full or not cs.full:
                if cs.full == seg.full and cs.token_ids == seg.token_ids:
                    return child, seg.n
                continue
            m = common_prefix(cs.token_ids, seg.token_ids)
            ok = lambda p, n: p == n or p % self.page_size == 0
            p = m if ok(m, cs.n) and ok(m, seg.n) else m // self.page_size * self.page_size
            if p > 0:
                return child, p
        return None, 0

    # ------------------------------------------------------------------ locks
    def lock(self, node: SegmentNode) -> None:
        """Pin ``node`` and its ancestors against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._account(node, -1)
                node.lock_ref = 1
                self._account(node, +1)
            else:
                node.lock_ref += 1
            node = node.parent

    def unlock(self, node: SegmentNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked {node}")
            if node.lock_ref == 1:
                self._account(node, -1)
                node.lock_ref = 0
                self._account(node, +1)
            else:
                node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ evict
    def evictable_leaves(self) -> list[SegmentNode]:
        return [n for n in self.nodes() if n.is_leaf() and n.lock_ref == 0]

    def evict(self, amount: int, unit: str = "pages") -> tuple[int, int]:
        """Free least-recently-used unlocked leaves until ``amount`` pages (or tokens, with
        ``unit="tokens"``) are freed or nothing is evictable; returns (pages freed, tokens freed)."""
        if unit not in ("pages", "tokens"):
            raise ValueError(f"unit must be 'pages' or 'tokens', got {unit!r}")
        heap = [(n.last_access, n.id, n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        pages = tokens = 0
        while (pages if unit == "pages" else tokens) < amount and heap:
            _, _, node = heapq.heappop(heap)
            pages += node.pages
            tokens += node.segment.n
            self._delete_leaf(node)
            parent = node.parent
            if parent is not self.root and parent.is_leaf() and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return pages, tokens

    def _delete_leaf(self, node: SegmentNode) -> None:
        siblings = node.parent.children[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[node.tokens[0]]
        self._account(node, -1)
        self._release(node.segment)

    def tree_pages(self) -> int:
        return self.evictable_pages + self.protected_pages
