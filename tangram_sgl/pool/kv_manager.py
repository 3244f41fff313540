"""The engine-agnostic facade a model runner (or the CPU replay engine) drives.

Life of a request: ``admit`` (match the tree, lock the prefix) -> ``reserve`` (exact pages for the new
segment and its decode growth; evicts unlocked tree nodes if needed, else :class:`AdmissionError`) ->
``write_segment_layer`` for every layer (scores -> ``select_kept`` -> compact into the reserved slots) ->
``commit_segment`` -> ``append_decode`` per generated token (or ``open_decode_slots`` + ``write_token_layer``
per layer, as the attention backend does) -> ``finish`` (segments go into the tree) or
``abort`` (retract: everything the request owns is freed). ``checkpoint`` publishes committed segments at
a chunk boundary. ``slot_lists`` gives attention kernels the per-(request, group) CSR slot lists;
``device_slot_ranges`` gives a decode step the same lists kept on the device and appended in place
(:mod:`tangram_sgl.pool.device_slot_lists`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from tangram_sgl.budget import pages_for
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.device_copy import to_device, to_host
from tangram_sgl.pool.device_slot_lists import DeviceSlotLists
from tangram_sgl.pool.group_page_pool import GroupPagePool
from tangram_sgl.pool.request_kv import UNRESOLVED, PrefixMatch, RequestKV
from tangram_sgl.pool.reservation import AdmissionError, PendingSegment, SegmentWrites, kept_counts
from tangram_sgl.pool.segment import GroupSlots, Segment, csr_slot_lists
from tangram_sgl.pool.step_writes import CompressedWrites, FullSegmentWrites
from tangram_sgl.profile import TangramProfile
from tangram_sgl.radix.tree import SegmentNode, SegmentTree
from tangram_sgl.selection import protected_mask, select_kept_padded


class TangramKVManager:
    """Pool + radix tree + running requests, with exact reservation (see module docstring)."""

    def __init__(
        self,
        layout: HeadGroupLayout,
        num_pages: int,
        head_dim: int,
        *,
        sink_tokens: int,
        recent_window: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        slot_arena_entries: int | None = None,
    ):
        """``slot_arena_entries``: size of the device slot-list arena (default: twice the pool's slots)."""
        self.layout = layout
        self.page_size = layout.page_size
        self.num_groups = layout.num_groups
        self.sink_tokens = sink_tokens
        self.recent_window = recent_window
        self.pool = GroupPagePool(layout, num_pages, head_dim, dtype, device)
        self.tree = SegmentTree(layout.page_size, self._release_segment)
        self.requests: dict[Hashable, RequestKV] = {}
        self.external_locks: Counter[SegmentNode] = Counter()
        self.prefix_hit_tokens = 0  # cumulative tokens matched in the tree by admit / attach
        arena = 2 * num_pages * layout.page_size if slot_arena_entries is None else slot_arena_entries
        self.device_lists = DeviceSlotLists(arena, layout.num_groups, self.pool.device)
        self.arena_fallback_steps = 0  # decode steps whose lists did not fit the arena (built on the host)
        self.null_page_is_padding_sink = False  # set once CUDA-graph padding rows write their K/V into page 0
        # on the pool's device: write_token_layer is pure device work (CUDA-graph capturable)
        self._head_group = layout.head_group_tensor(self.pool.device).long()
        self._head_column = layout.head_column_tensor(self.pool.device).long()

    @classmethod
    def from_profile(cls, profile: TangramProfile, num_pages: int, *, page_size: int | None = None,
                     head_dim: int | None = None, dtype: torch.dtype = torch.float16,
                     device: torch.device | str = "cpu", slot_arena_entries: int | None = None) -> TangramKVManager:
        layout = HeadGroupLayout.from_profile(profile, page_size)
        return cls(layout, num_pages, head_dim or profile.model.head_dim, sink_tokens=profile.sink_tokens,
                   recent_window=profile.recent_window, dtype=dtype, device=device,
                   slot_arena_entries=slot_arena_entries)

    # ------------------------------------------------------------------ accounting (pages)
    def free_pages(self) -> int:
        return self.pool.allocator.free_count()

    def evictable_pages(self) -> int:
        return self.tree.evictable_pages

    def protected_pages(self) -> int:
        return self.tree.protected_pages

    def request_pages(self) -> int:
        """Pages running requests hold: every allocated page is the tree's or a request's (an invariant
        ``check_invariants`` recounts), so this is O(1) for the scheduler's frequent memory checks."""
        alloc = self.pool.allocator
        return alloc.usable_pages - alloc.free_count() - self.tree.evictable_pages - self.tree.protected_pages

    def next_decode_pages(self) -> int:
        """Pages the next decode step of every request (without a pending segment) takes from the free
        list: one per group whose decode slots are full and that has no spare reserved page left."""
        need = 0
        for req in self.requests.values():
            if req.pending is not None:
                continue
            if req.decoded_tokens % self.page_size == 0:
                need += sum(1 for sp in req.spare if not sp)
        return need

    def _release_segment(self, seg: Segment) -> None:
        self.pool.allocator.free(seg.pages())

    def _ensure_free(self, need: int, what: str) -> None:
        """Make ``need`` pages free, evicting unlocked tree nodes; :class:`AdmissionError` if impossible."""
        free = self.free_pages()
        if need <= free:
            return
        evictable = self.tree.evictable_pages
        if need > free + evictable:
            raise AdmissionError(
                f"{what}: needs {need} pages but only {free} are free and {evictable} evictable in the radix "
                f"tree (pool {self.pool.allocator.usable_pages} pages of {self.page_size} tokens x "
                f"{self.layout.heads_per_group} heads; {self.tree.protected_pages} pinned by running requests' "
                f"prefixes, {self.request_pages()} held by running requests)")
        self.tree.evict(need - free)

    # ------------------------------------------------------------------ match / admit
    def match(self, token_ids: Sequence[int], max_len: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids[:max_len]`` (node boundaries, see radix.tree)."""
        node, length = self.tree.match(token_ids, max_len)
        return PrefixMatch(node, length)

    def admit(self, rid: Hashable, token_ids: Sequence[int], max_prefix_len: int | None = None) -> PrefixMatch:
        """Match ``token_ids`` and lock the matched prefix for a new request ``rid``."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already running")
        m = self.match(token_ids, max_prefix_len)
        self.tree.lock(m.node)
        self.prefix_hit_tokens += m.length
        self.requests[rid] = RequestKV(rid, m.node, list(token_ids[: m.length]),
                                       spare=[[] for _ in range(self.num_groups)])
        return m

    def attach(self, rid: Hashable, node: SegmentNode, token_ids: Sequence[int]) -> PrefixMatch:
        """Start request ``rid`` on a prefix an engine already matched (``node``, e.g. SGLang's
        ``req.last_node``); ``token_ids`` must begin with that node's path."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already running")
        prefix = list(token_ids[: node.end])
        if any(prefix[n.segment.start: n.end] != n.tokens for n in SegmentTree.path(node)):  # node by node
            raise ValueError(f"request {rid!r}: its tokens do not start with the matched prefix ({node.end} tokens)")
        self.tree.lock(node)
        self.prefix_hit_tokens += node.end
        self.requests[rid] = RequestKV(rid, node, prefix, spare=[[] for _ in range(self.num_groups)])
        return PrefixMatch(node, node.end)

    def lock_node(self, node: SegmentNode) -> None:
        """Lock held by the caller itself (e.g. SGLang's scheduler), not by a request of this manager."""
        self.tree.lock(node)
        self.external_locks[node] += 1

    def unlock_node(self, node: SegmentNode) -> None:
        if self.external_locks[node] <= 0:
            raise RuntimeError(f"unlock_node of {node} that holds no external lock")
        self.external_locks[node] -= 1
        if not self.external_locks[node]:
            del self.external_locks[node]
        self.tree.unlock(node)

    # ------------------------------------------------------------------ reserve / write / commit
    def pages_needed(self, rid: Hashable, n_new: int, decode_tokens: int = 0) -> list[int]:
        """Pages per group ``reserve`` would allocate now for ``n_new`` new tokens plus decode growth."""
        req = self.requests[rid]
        return self._pages_needed(req, self._kept_counts(n_new, len(req.token_ids)), decode_tokens)[0].tolist()

    def _kept_counts(self, n: int, start: int) -> np.ndarray:
        """int64 ``[G]``: k_g of an n-token segment at ``start``."""
        return kept_counts(self.layout, n, start, self.sink_tokens, self.recent_window)

    def _pages_needed(self, req: RequestKV, counts: np.ndarray, decode_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``[G]`` (pages to allocate, of them the segment's): the segment's pages, plus decode pages beyond
        the spare ones the request holds."""
        seg = pages_for(counts, self.page_size)
        spare = np.fromiter(map(len, req.spare), dtype=np.int64, count=self.num_groups)
        return seg + np.maximum(0, pages_for(decode_tokens, self.page_size) - spare), seg

    def reserve(self, rid: Hashable, new_token_ids: Sequence[int], decode_tokens: int = 0) -> list[int]:
        """Allocate exactly the pages of the next segment (+ ``decode_tokens`` of decode growth).

        Returns the kept count k_g per group. Raises :class:`AdmissionError` (allocating nothing) when the
        pages cannot be found even after evicting every unlocked tree node.
        """
        req = self.requests[rid]
        if req.pending is not None:
            raise RuntimeError(f"request {rid!r} already has a segment being written")
        if not new_token_ids:
            raise ValueError("a segment needs at least one token")
        start = len(req.token_ids)
        counts = self._kept_counts(len(new_token_ids), start)
        need, seg_pages = self._pages_needed(req, counts, decode_tokens)
        total = int(need.sum())
        self._ensure_free(total, f"request {rid!r} (segment of {len(new_token_ids)} tokens at {start}, "
                                 f"{decode_tokens} decode tokens)")
        pages = self.pool.allocator.alloc_array(total)
        page_list = pages.tolist()
        ends = np.cumsum(need)  # group g's pages: [ends[g] - need[g], ends[g]), the segment's first
        firsts = ends - need
        seg_ends = (firsts + seg_pages).tolist()
        groups = [GroupSlots(page_list[a:b]) for a, b in zip(firsts.tolist(), seg_ends)]
        for g, (a, b) in enumerate(zip(seg_ends, ends.tolist())):
            if b > a:
                req.spare[g] += page_list[a:b]
        if req.decode is not None:  # a new prefill after decoded tokens closes the decode segment
            req.segments.append(req.decode)
            req.decode = None
        table = self._reserved_slot_table(pages, firsts, counts)
        kmax = table.shape[1]
        dev = self.pool.device
        kept = torch.full((self.num_groups, self.layout.heads_per_group, kmax), -1, dtype=torch.int32, device=dev)
        counts_list = counts.tolist()
        req.pending = PendingSegment(start, list(new_token_ids), counts_list, groups, set(), to_device(table, dev),
                                     kept)
        if not req.pending.full:  # the per-layer writes' targets, prepared here: outside the forward
            self._prepare_writes(req.pending)
        req.token_ids += list(new_token_ids)
        return counts_list

    def _reserved_slot_table(self, pages: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> torch.Tensor:
        """int64 [G, max(k_g, 1)]: row g holds the first k_g slots of group g's pages (zeros past them), group g's
        pages starting at ``pages[firsts[g]]``; numpy on the host (a question's table is ~1k cells, where each
        torch call on small CPU tensors cost more than the whole numpy table, ``bench_step_host --host-only``)."""
        ps = self.page_size
        j = np.arange(max(int(counts.max(initial=0)), 1))
        valid = j[None, :] < counts[:, None]
        if not valid.any():
            return torch.zeros(valid.shape, dtype=torch.int64)
        page = pages[np.where(valid, firsts[:, None] + j // ps, 0)]
        return torch.from_numpy(np.where(valid, page * ps + j % ps, 0).astype(np.int64, copy=False))

    def write_segment_layer(self, rid: Hashable, layer: int, k: torch.Tensor, v: torch.Tensor,
                            scores: torch.Tensor) -> None:
        """Keep each kv head's top-k_g tokens of layer ``layer`` and write them into the reserved slots.

        ``k``, ``v``: ``[num_kv_heads, n, head_dim]`` staging K/V of the segment (RoPE applied);
        ``scores``: ``[num_kv_heads, n]`` (its order matters only where a head drops tokens). One request;
        a forward step writes all its rows together (:meth:`compressed_segment_writes`).
        """
        pend = self.requests[rid].pending
        if pend is None:
            raise RuntimeError(f"request {rid!r} has no reserved segment")
        n = len(pend.token_ids)
        if k.shape[1] != n or scores.shape[1] != n:
            raise ValueError(f"segment has {n} tokens, got K {tuple(k.shape)} and scores {tuple(scores.shape)}")
        if pend.writes is None:  # a segment kept whole (reserve prepares only compressed ones)
            self._prepare_writes(pend)
        self.write_compressed_segments_layer(CompressedWrites.single(pend), layer, k.transpose(0, 1),
                                             v.transpose(0, 1), scores[None])

    def compressed_segment_writes(self, rids: Sequence[Hashable], starts: Sequence[int]) -> CompressedWrites:
        """The writes of the pending segments of ``rids`` whose tokens are staging rows ``[starts[i],
        starts[i] + n_i)`` (:meth:`write_compressed_segments_layer` runs them per layer, all rows at once)."""
        pends = []
        for rid in rids:
            pend = self.requests[rid].pending
            if pend is None:
                raise ValueError(f"request {rid!r} has no reserved segment")
            if pend.writes is None:
                self._prepare_writes(pend)
            pends.append(pend)
        return CompressedWrites.build(pends, starts, self.layout.num_layers, self.pool.device)

    def write_compressed_segments_layer(self, plan: CompressedWrites, layer: int, k: torch.Tensor, v: torch.Tensor,
                                        scores: torch.Tensor) -> None:
        """Layer ``layer`` of ``plan``'s segments: each head keeps its protected and top-scored tokens
        (``scores`` ``[R, H_kv, >= max n_r]``, ``-inf`` past each row's length: see ``pad_scores``), written
        from the step's staging ``k``, ``v`` ``[T, H_kv, D]``. Device work only, one batch for all rows."""
        dev = self.pool.device
        e = slice(plan.bounds[layer], plan.bounds[layer + 1])
        row, head, rank, column = plan.row[e], plan.head[e], plan.rank[e], plan.column[e]
        n_max = plan.protected.shape[1]
        kept = select_kept_padded(scores[..., :n_max].to(dev), plan.counts[:, layer], plan.protected,
                                  plan.kept.shape[-1])
        pos = kept[row, head, rank]
        tok = plan.offsets[row] + pos
        self.pool.scatter(plan.slot[e], column, tok, head, k.to(dev), v.to(dev))
        plan.kept[row, plan.group[e], column, rank] = pos.to(torch.int32)
        for pend in plan.pendings:
            pend.layers_written.add(layer)

    def _prepare_writes(self, pend: PendingSegment) -> None:
        """Every layer's write targets of ``pend`` and the positions all its heads keep (host-to-device copies
        that synchronise, once per segment)."""
        pend.writes = SegmentWrites.build(pend.kept_counts, [layer.group for layer in self.layout.layers],
                                          self._head_group, self._head_column, pend.slot_table)
        pend.protected = protected_mask(len(pend.token_ids), pend.start, self.sink_tokens, self.recent_window,
                                        self.pool.device)

    def full_segment_writes(self, rids: Sequence[Hashable], starts: Sequence[int]) -> FullSegmentWrites:
        """The writes of the pending segments of ``rids`` — each kept whole by every group — whose tokens are
        staging rows ``[starts[i], starts[i] + n_i)`` (:meth:`write_full_segments_layer` runs them per layer:
        one batch of device work for all these requests instead of one per request)."""
        tables, lengths = [], []
        for rid in rids:
            pend = self.requests[rid].pending
            if pend is None or not pend.full:
                raise ValueError(f"request {rid!r} has no pending segment kept whole by every group")
            lengths.append(len(pend.token_ids))
            tables.append(pend.slot_table[:, :lengths[-1]])  # [G, n]: group g's slot of each token
        # a few device operations for all rows (one gather by the [L, H] head -> group map), not a few per row
        tokens = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
        return FullSegmentWrites.build(rids, torch.cat(tables, 1)[self._head_group], self._head_column,
                                       to_device(torch.from_numpy(tokens), self.pool.device))

    def write_full_segments_layer(self, plan: FullSegmentWrites, layer: int, k: torch.Tensor,
                                  v: torch.Tensor) -> None:
        """Layer ``layer`` of ``plan``'s segments from the step's staging ``k``, ``v`` ``[T, H_kv, D]``."""
        self.pool.scatter(plan.slot[layer], plan.column[layer], plan.token, plan.head, k, v)
        for rid in plan.rids:
            self.requests[rid].pending.layers_written.add(layer)

    def commit_segment(self, rid: Hashable) -> Segment:
        """Turn the fully written pending segment into a segment the request owns."""
        return self.commit_segments([rid])[0]

    def commit_segments(self, rids: Sequence[Hashable]) -> list[Segment]:
        """:meth:`commit_segment` of several requests; the kept positions of those that dropped tokens come to
        the host in one device copy that the host does not wait for (``Segment.kept_on_host`` waits at the first
        read; serving never reads them)."""
        reqs = [self.requests[rid] for rid in rids]
        for req in reqs:
            if req.pending is None:
                raise RuntimeError(f"request {req.rid!r} has no reserved segment")
        dropped = [req.pending for req in reqs if not req.pending.full]
        host, ready = {}, None
        if dropped:
            flat, ready = to_host(torch.cat([p.kept_table.reshape(-1) for p in dropped]))
            parts = flat.split([p.kept_table.numel() for p in dropped])
            host = {id(p): t.view(p.kept_table.shape) for p, t in zip(dropped, parts)}
        members = [len(m) for m in self.layout.members]
        segs = []
        for req in reqs:
            seg = req.pending.to_segment(self.layout.num_layers, members, host.get(id(req.pending)))
            if not seg.full:
                seg.kept_ready = ready
            req.segments.append(seg)
            req.pending = None
            req.version += 1
            segs.append(seg)
        return segs

    def commit_if_written(self, rid: Hashable) -> bool:
        """Commit the pending segment if every layer has been written; True if one was committed."""
        pend = self.requests[rid].pending
        if pend is None or len(pend.layers_written) < self.layout.num_layers:
            return False
        self.commit_segment(rid)
        return True

    # ------------------------------------------------------------------ decode
    def append_decode(self, rid: Hashable, token_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decoded token (kept by every group); ``k``, ``v``: ``[num_layers, num_kv_heads, D]``.

        Uses reserved decode pages first, then free (or evicted) pages; raises :class:`AdmissionError` when
        none can be found — the caller retracts a request (``abort``) and retries.
        """
        slots = self.open_decode_slots([rid], [token_id])
        for layer in range(self.layout.num_layers):
            self.write_token_layer(slots, layer, k[layer][None], v[layer][None])

    def open_decode_slots(self, rids: Sequence[Hashable], token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Give each request's next decoded token one slot in every group; int64 ``[R, G]`` slot ids.

        The token counts as appended at once (``slot_lists`` includes its slots); its K/V is written layer
        by layer with :meth:`write_token_layer`. Pages come from the reserved decode pages, then the free
        list (evicting unlocked tree nodes); if the whole batch cannot be served, :class:`AdmissionError`
        is raised before any request changes. Without ``token_ids`` (a server step: the ids may still be on
        the GPU) the tokens are recorded as ``UNRESOLVED`` until :meth:`resolve_tokens`; slots depend only on
        positions.
        """
        reqs = [self.requests[rid] for rid in rids]
        for req in reqs:
            if req.pending is not None:
                raise RuntimeError(f"request {req.rid!r} is still writing a segment")
        # a group needs a page when its decode pages are full (all groups hold every decoded token)
        short = [(req, g) for req in reqs if req.decoded_tokens % self.page_size == 0
                 for g, sp in enumerate(req.spare) if not sp]
        if short:
            self._ensure_free(len(short), f"decode step of {len(reqs)} request(s) {list(rids)[:4]!r}")
            for (req, g), p in zip(short, self.pool.allocator.alloc(len(short))):
                req.spare[g].append(p)
        ps = self.page_size
        rows, offs = [], np.empty(len(reqs), dtype=np.int64)
        if token_ids is None:
            token_ids = [UNRESOLVED] * len(reqs)
            for req in reqs:
                if req.unresolved_from is None:
                    req.unresolved_from = len(req.token_ids)
        for r, (req, token_id) in enumerate(zip(reqs, token_ids)):
            if req.decode is None:
                req.decode = Segment(len(req.token_ids), [], True, [GroupSlots() for _ in range(self.num_groups)])
            n = req.decode.n  # every group keeps every decoded token: one length for all groups
            offs[r] = n % ps
            if offs[r] == 0:  # a new page per group (a new decode segment starts here too, at n = 0)
                for g, gs in enumerate(req.decode.groups):
                    gs.pages.append(req.spare[g].pop(0))
                req.decode_page_row = np.fromiter((gs.pages[-1] for gs in req.decode.groups), np.int64,
                                                  self.num_groups) * ps
            rows.append(req.decode_page_row)
            for gs in req.decode.groups:
                gs.length = n + 1
            req.decode.token_ids.append(int(token_id))
            req.token_ids.append(int(token_id))
        if not rows:
            return torch.empty((0, self.num_groups), dtype=torch.int64)
        return torch.from_numpy(np.stack(rows) + offs[:, None])

    def resolve_tokens(self, rid: Hashable, token_ids: Sequence[int], offset: int = 0) -> None:
        """Record the ids of ``rid``'s decoded tokens opened without one: ``token_ids[i]`` is the id at position
        ``offset + i`` of the request's sequence as the scheduler knows it (SGLang's ``origin_input_ids +
        output_ids``); positions it does not reach stay unresolved. A known position that disagrees raises:
        the sequence is not this request's."""
        req = self.requests[rid]
        if req.unresolved_from is None:
            return
        start, end = req.unresolved_from, min(len(req.token_ids), offset + len(token_ids))
        if start < offset:
            raise ValueError(f"request {rid!r}: ids from position {start} are unresolved, the sequence starts at "
                             f"{offset}")
        if end <= start:
            return
        for p in range(start, end):
            if req.token_ids[p] not in (UNRESOLVED, token_ids[p - offset]):
                raise ValueError(f"request {rid!r}: token {p} is {req.token_ids[p]} here but "
                                 f"{token_ids[p - offset]} in the sequence given to resolve_tokens")
        for seg in req.segments + ([req.decode] if req.decode is not None else []):
            for p in range(max(start, seg.start), min(end, seg.end)):
                seg.token_ids[p - seg.start] = int(token_ids[p - offset])
        for p in range(start, end):
            req.token_ids[p] = int(token_ids[p - offset])
        req.unresolved_from = end if end < len(req.token_ids) else None

    def _decode_groups(self, req: RequestKV) -> list[GroupSlots]:
        return req.decode.groups if req.decode is not None else [GroupSlots()] * self.num_groups

    def write_token_layer(self, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write layer ``layer``'s K/V of R tokens that every group keeps (``slots``: ``[R, G]`` from
        :meth:`open_decode_slots`; ``k``, ``v``: ``[R, num_kv_heads, D]``)."""
        self.pool.write_tokens(slots.to(self.pool.device), self._head_group[layer], self._head_column[layer], k, v)

    # ------------------------------------------------------------------ what attention reads
    def request_segments(self, rid: Hashable) -> list[Segment]:
        """The segments a request sees, in order: its tree path, its own segments, its decode tokens."""
        req = self.requests[rid]
        segs = [n.segment for n in SegmentTree.path(req.node)] + req.segments
        return segs + ([req.decode] if req.decode is not None and req.decode.n else [])

    def _list_parts(self, rid: Hashable, device: torch.device | None = None) -> list[list[torch.Tensor]]:
        """Per group, the (cached) int32 slot tensors on ``device`` (default: the host) whose concatenation
        is ``rid``'s list (committed tokens only; a segment being prefilled is read from its staging K/V)."""
        segs = self.request_segments(rid)
        return [[s.groups[g].slots(self.page_size, device=device) for s in segs if s.groups[g].length]
                for g in range(self.num_groups)]

    def request_lists(self, rid: Hashable, device: torch.device | None = None) -> list[torch.Tensor]:
        """int32 slots of each group's list of ``rid``, on ``device`` (default: the host), concatenated per
        group from the segments' per-group lists: the reference :meth:`slot_lists` is checked against."""
        return [torch.cat(p) if p else torch.empty(0, dtype=torch.int32, device=device)
                for p in self._list_parts(rid, device)]

    def slot_lists(self, rids: Sequence[Hashable],
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """CSR ``(kv_indptr [R*G+1] on the host, kv_indices on device)`` int32: slots of (request r, group g)
        at ``kv_indices[kv_indptr[r*G+g]:kv_indptr[r*G+g+1]]`` (the :meth:`request_lists`), built by
        :func:`~tangram_sgl.pool.segment.csr_slot_lists` from the requests' cached segment slot tables."""
        return csr_slot_lists([self.request_segments(rid) for rid in rids], self.num_groups, self.page_size, device)

    def _decode_room(self, req: RequestKV) -> list[int]:
        """Per group: the decode slots already reserved for ``req`` (spare pages, rest of its decode page),
        plus one page."""
        return [(len(sp) + 1) * self.page_size + len(gs.pages) * self.page_size - gs.length
                for sp, gs in zip(req.spare, self._decode_groups(req))]

    def device_slot_ranges(self, rids: Sequence[Hashable],
                           token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After :meth:`open_decode_slots` of ``rids`` (``token_slots``: its ``[R, G]`` slots, on the pool's
        device): host int32 ``(starts [R*G], lens [R*G])`` of their lists in ``device_lists.arena``. A row
        whose mirror only lacks this token gets it appended on the device; others are uploaded whole. None
        when the arena cannot hold the batch's lists (the caller then uses :meth:`slot_lists`)."""
        dl = self.device_lists
        reqs = [self.requests[rid] for rid in rids]
        versions = [req.version for req in reqs]
        tokens = [len(req.token_ids) for req in reqs]
        for _ in range(2):  # an upload may clear a fragmented arena: a second pass restores the lost rows
            stale = np.flatnonzero(~dl.ready_for_step(rids, versions, tokens))
            if stale.size:  # all of them in one slot_lists call and one upload
                sub = [reqs[r] for r in stale]
                sub_rids = [req.rid for req in sub]
                indptr, slots = self.slot_lists(sub_rids, self.pool.device)
                if not dl.upload(sub_rids, indptr.diff().numpy(), slots,
                                 np.array([self._decode_room(req) for req in sub]), [req.version for req in sub],
                                 [tokens[r] for r in stale]):
                    return None
            if all(rid in dl.mirrors for rid in rids):
                break
        else:
            return None
        fast = np.flatnonzero([dl.mirrors[rid].tokens == n - 1 for rid, n in zip(rids, tokens)])
        if len(fast) == len(rids):
            dl.append(rids, token_slots)
        elif len(fast):  # a device index: ``token_slots[list]`` would copy the list from the host and wait
            dl.append([rids[r] for r in fast],
                      token_slots.index_select(0, to_device(torch.from_numpy(fast), token_slots.device)))
        return dl.ranges_of(rids)

    def gather(self, rid: Hashable, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K ``[T, D]``, V ``[T, D]``, absolute positions ``[T]``) that (layer, kv head) of ``rid`` sees
        (K/V on the pool's device, positions on the host)."""
        g, c = self.layout.layers[layer].group[head], self.layout.layers[layer].column[head]
        segs = self.request_segments(rid)
        if not segs:
            empty = torch.empty(0, self.pool.head_dim, dtype=self.pool.k_buffer.dtype)
            return empty, empty.clone(), torch.empty(0, dtype=torch.long)
        slots = torch.cat([s.groups[g].slots(self.page_size) for s in segs])
        pos = torch.cat([s.start + s.kept_positions(g, c).long() for s in segs])
        k, v = self.pool.read(slots, c)
        return k, v, pos

    # ------------------------------------------------------------------ publish / release
    def _merged_own_segments(self, req: RequestKV, with_decode: bool) -> list[Segment]:
        """The request's committed segments (+ decode when ``with_decode``), adjacent full page-aligned ones
        merged; the caller publishes them."""
        segs = list(req.segments)
        if with_decode and req.decode is not None and req.decode.n:
            segs.append(req.decode)
        if req.unresolved_from is not None and segs and segs[-1].end > req.unresolved_from:
            raise RuntimeError(f"request {req.rid!r}: decoded tokens from position {req.unresolved_from} have no "
                               f"token id yet (resolve_tokens) and cannot become tree keys")
        merged: list[Segment] = []
        for seg in segs:
            if merged and merged[-1].can_append(seg, self.page_size):
                merged[-1].append(seg, self.page_size)
            else:
                merged.append(seg)
        req.segments = []
        if with_decode:
            req.decode = None
        return merged

    def _insert_own(self, req: RequestKV, with_decode: bool = True) -> SegmentNode:
        node = req.node
        for seg in self._merged_own_segments(req, with_decode):
            node, _ = self.tree.insert(node, seg)
        return node

    def checkpoint(self, rid: Hashable) -> PrefixMatch:
        """Publish the request's committed segments (chunk boundary) and move its lock to the new leaf; an open
        decode segment stays the request's (under overlap scheduling the last chunk's checkpoint comes after the
        first decode step)."""
        req = self.requests[rid]
        node = self._insert_own(req, with_decode=False)
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node
        req.version += 1  # deduplicated tokens now read the tree's copy: other slots
        return PrefixMatch(node, node.end)

    def finish(self, rid: Hashable) -> PrefixMatch:
        """Insert everything the request computed into the tree, unlock, and forget the request."""
        req = self.requests[rid]
        if req.pending is not None:
            raise RuntimeError(f"request {rid!r} finished while a segment was still being written")
        node = self._insert_own(req)
        self.tree.unlock(req.node)
        self.pool.allocator.free(p for pages in req.spare for p in pages)
        del self.requests[rid]
        self.device_lists.drop(rid)
        return PrefixMatch(node, node.end)

    def abort(self, rid: Hashable) -> None:
        """Retract: free every page the request owns (nothing is inserted), unlock its prefix."""
        req = self.requests.pop(rid)
        self.pool.allocator.free(list(req.owned_pages()))
        self.tree.unlock(req.node)
        self.device_lists.drop(rid)
