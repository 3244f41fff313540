"""CPU reference of what every request must see, built independently of the pool's pages and slots.

The store receives the same staging K/V and scores the manager does, keeps them as plain torch tensors,
applies the budget rule itself, and answers "which K/V, at which positions, must (layer, kv head) of this
request see, in order". Segments a request did not compute (its matched prefix) are looked up in the
store's registry of *published* segments (compressed: by start, end and a hash of the tokens up to the
end; full tokens: one by one), so a tree that serves a prefix nobody published is caught too.
:func:`check_request` compares the manager against the store token by token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.invariants import InvariantViolation
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.reservation import segment_kept_counts
from tangram_sgl.selection import kept_positions_reference

_HASH_MOD = (1 << 61) - 1
_HASH_BASE = 1_000_003


def prefix_hashes(token_ids: Sequence[int]) -> list[int]:
    """``h[i]`` = rolling hash of ``token_ids[:i]`` (``len(token_ids) + 1`` values)."""
    out = [0]
    for t in token_ids:
        out.append((out[-1] * _HASH_BASE + int(t) + 1) % _HASH_MOD)
    return out


@dataclass
class RefPiece:
    """Consecutive tokens [start, start+n) as a request sees them: per (layer, head) kept K/V and positions."""

    start: int
    n: int
    full: bool
    k: list[list[torch.Tensor]]      # [layer][head] -> [kept, D]
    v: list[list[torch.Tensor]]
    pos: list[list[torch.Tensor]]    # [layer][head] -> absolute positions, ascending


class ReferenceKVStore:
    """Per request: the ordered pieces it must see; plus the registry of published segments."""

    def __init__(self, layout: HeadGroupLayout, sink_tokens: int, recent_window: int):
        self.layout = layout
        self.sink = sink_tokens
        self.window = recent_window
        self._views: dict[Hashable, list[RefPiece]] = {}
        self._tokens: dict[Hashable, list[int]] = {}
        self._compressed: dict[tuple[int, int, int], RefPiece] = {}
        self._full: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ building views
    def begin(self, rid: Hashable, prefix_ids: Sequence[int], boundaries: Sequence[tuple[int, int, bool]]) -> None:
        """Start request ``rid`` on a matched prefix split into (start, end, full) segments."""
        h = prefix_hashes(prefix_ids)
        pieces = []
        for start, end, full in boundaries:
            if full:
                for p in range(start, end):
                    if (p, h[p + 1]) not in self._full:
                        raise InvariantViolation(f"request {rid!r}: the tree served full token {p} that no "
                                                 f"request published")
                    k, v = self._full[(p, h[p + 1])]
                    pieces.append(self._full_piece(p, k[:, :, None], v[:, :, None]))
            else:
                key = (start, end, h[end])
                if key not in self._compressed:
                    raise InvariantViolation(f"request {rid!r}: the tree served compressed segment "
                                             f"[{start}, {end}) that no request published")
                pieces.append(self._compressed[key])
        self._views[rid] = pieces
        self._tokens[rid] = list(prefix_ids)

    def _full_piece(self, start: int, k: torch.Tensor, v: torch.Tensor) -> RefPiece:
        L, H, n = k.shape[:3]
        pos = torch.arange(start, start + n)
        return RefPiece(start, n, True, [[k[l, h] for h in range(H)] for l in range(L)],
                        [[v[l, h] for h in range(H)] for l in range(L)], [[pos] * H for _ in range(L)])

    def add_segment(self, rid: Hashable, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor,
                    scores: torch.Tensor) -> None:
        """A segment the request computed: ``k``, ``v`` ``[L, H, n, D]``, ``scores`` ``[L, H, n]``."""
        start, n = len(self._tokens[rid]), len(token_ids)
        counts = segment_kept_counts(self.layout, n, start, self.sink, self.window)
        if all(c == n for c in counts):
            piece = self._full_piece(start, k, v)
        else:
            ks, vs, ps = [], [], []
            for l, slots in enumerate(self.layout.layers):
                kl, vl, pl = [], [], []
                for h, g in enumerate(slots.group):
                    kept = torch.tensor(kept_positions_reference(scores[l, h].tolist(), counts[g], start, self.sink,
                                                                 self.window), dtype=torch.long)
                    kl.append(k[l, h, kept])
                    vl.append(v[l, h, kept])
                    pl.append(kept + start)
                ks.append(kl)
                vs.append(vl)
                ps.append(pl)
            piece = RefPiece(start, n, False, ks, vs, ps)
        self._views[rid].append(piece)
        self._tokens[rid] += list(token_ids)

    def add_decode(self, rid: Hashable, token_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One decoded token, ``k``, ``v`` ``[L, H, D]`` (kept by every head)."""
        self._views[rid].append(self._full_piece(len(self._tokens[rid]), k[:, :, None], v[:, :, None]))
        self._tokens[rid].append(int(token_id))

    def publish(self, rid: Hashable) -> None:
        """The request's pieces are now in the tree (checkpoint / finish): register them for later matches."""
        toks = self._tokens[rid]
        h = prefix_hashes(toks)
        for piece in self._views[rid]:
            if piece.full:
                k = torch.stack([torch.stack(row) for row in piece.k])  # [L, H, n, D]
                v = torch.stack([torch.stack(row) for row in piece.v])
                for i in range(piece.n):
                    self._full[(piece.start + i, h[piece.start + i + 1])] = (k[:, :, i], v[:, :, i])
            else:
                self._compressed[(piece.start, piece.start + piece.n, h[piece.start + piece.n])] = piece

    def drop(self, rid: Hashable) -> None:
        del self._views[rid], self._tokens[rid]

    # ------------------------------------------------------------------ answers
    def expected(self, rid: Hashable, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K [T, D], V [T, D], absolute positions [T]) that (layer, head) of ``rid`` must see."""
        pieces = self._views[rid]
        return (torch.cat([p.k[layer][head] for p in pieces]), torch.cat([p.v[layer][head] for p in pieces]),
                torch.cat([p.pos[layer][head] for p in pieces]))

    def token_ids(self, rid: Hashable) -> list[int]:
        return list(self._tokens[rid])


def check_request(mgr: TangramKVManager, ref: ReferenceKVStore, rid: Hashable) -> None:
    """Token-by-token: every (layer, kv head) of ``rid`` sees exactly the reference's kept K/V, in order."""
    if mgr.requests[rid].token_ids != ref.token_ids(rid):
        raise InvariantViolation(f"request {rid!r}: token ids differ from the reference")
    for layer in range(mgr.layout.num_layers):
        for head in range(mgr.layout.num_kv_heads):
            k, v, pos = mgr.gather(rid, layer, head)
            k, v = k.cpu(), v.cpu()
            rk, rv, rpos = ref.expected(rid, layer, head)
            if not torch.equal(pos, rpos.long()):
                raise InvariantViolation(f"request {rid!r} layer {layer} head {head}: positions differ "
                                         f"({len(pos)} vs {len(rpos)} tokens)")
            if not (torch.equal(k, rk.to(k.dtype)) and torch.equal(v, rv.to(v.dtype))):
                bad = int(((k != rk.to(k.dtype)).any(-1) | (v != rv.to(v.dtype)).any(-1)).nonzero()[0])
                raise InvariantViolation(f"request {rid!r} layer {layer} head {head}: K/V differ at slot {bad} "
                                         f"(position {int(pos[bad])})")
