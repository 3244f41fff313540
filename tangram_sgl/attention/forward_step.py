"""One forward of a batch through ``TangramKVManager``: what every attention layer computes and writes.

Shared by SGLang's ``TangramAttnBackend`` and the CPU reference engine, so both produce the same numbers.
A batch is a list of :class:`StepRow`: an *extend* row prefills the segment its request has reserved
(``TangramKVManager.reserve``); a *decode* row appends one decoded token (kept by every group).

Per layer (:meth:`ForwardStep.attend`):

- **decode-only batch**: each token's K/V is written into the slot it got in every group
  (``open_decode_slots`` at step construction), then the split-KV paged decode kernel reads the
  (request, group) slot lists, the new token included, split by the AOT table row of the batch bucket.
  The lists are the device-resident ones (``device_slot_ranges``: the new token appended in place), or,
  when the arena cannot hold them, host-built CSR lists (logged).
- **extend or mixed batch**: the extend kernel attends each row's new tokens over [its committed slot
  lists ; its own staging K/V, causal] (the Triton/torch kernel, or, with ``extend_kernel="flashinfer"``,
  FlashInfer's chunk + prefix passes, each planned once per step: ``kernels/flashinfer_extend.py``; with
  ``"mixed"``, FlashInfer only for steps adding more than ``MIXED_FLASHINFER_MIN_NEW`` tokens to a row, where
  its per-layer host work pays off); then each
  extend row's segment is scored (the profile's scorer on the segment's observation window) and each head
  keeps its protected and top-scored tokens in the reserved slots, all compressed rows in one batch per
  layer (``compressed_segment_writes``); rows every group keeps whole (short turns, budget 1.0) are written
  together without selection (``full_segment_writes``); decode rows (mixed batches) write their token's
  K/V into their decode slots.

After the last layer the caller runs :meth:`ForwardStep.commit` (extend rows' segments become committed).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tangram_sgl.attention.kernel_set import KernelSet
from tangram_sgl.attention.segment_scoring import PreRope, ScoredRows, SegmentScorer
from tangram_sgl.kernels.decode import csr_ranges, launch_order
from tangram_sgl.kernels.flashinfer_extend import FlashInferExtend
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.device_copy import to_device
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.profile import AotSplitTable, TangramProfile

logger = logging.getLogger(__name__)
# --tangram-extend-kernel mixed: steps whose rows each add at most this many tokens (questions, decode rows)
# run the Triton extend kernel, one launch per layer, instead of FlashInfer's passes (~10 launches and their
# Python per layer: host-bound at question size on the H200, bench_step_host_r128's cProfile)
MIXED_FLASHINFER_MIN_NEW = 256


class StepError(RuntimeError):
    """A batch row does not match what the tangram cache holds for its request."""


@dataclass(frozen=True)
class StepRow:
    """One batch row: request ``rid``'s ``n`` new tokens at absolute positions ``[start, start + n)``;
    ``decode``: one decoded token (kept by every group) instead of a reserved prefill segment."""

    rid: Hashable
    start: int
    n: int
    decode: bool


@dataclass
class AttentionContext:
    """What every forward step of one model shares: the manager, kernels, scorer, head maps, AOT table."""

    kv: TangramKVManager
    kernels: KernelSet
    scorer: SegmentScorer
    aot: AotSplitTable
    head_group: torch.Tensor  # int32 [L, H] on the pool's device
    head_column: torch.Tensor
    head_order: torch.Tensor  # int32 [L, H]: each layer's kv heads by descending group budget (decode launch)
    flashinfer_extend: FlashInferExtend | None = None  # extend attention through FlashInfer instead of kernels
    flashinfer_min_new: int = 0  # ... for steps whose longest row adds more new tokens than this
    split_rows: torch.Tensor = field(init=False)  # int32 [buckets, G] on the pool's device: the AOT table
    split_max: tuple[int, ...] = field(init=False)  # each bucket's largest split count

    def __post_init__(self) -> None:
        # Uploaded whole, once: a bucket's first decode step (eager or under capture) copies nothing from the host.
        self.split_rows = torch.tensor(self.aot.splits, dtype=torch.int32, device=self.kv.pool.device)
        self.split_max = tuple(max(row) for row in self.aot.splits)

    @classmethod
    def create(cls, kv: TangramKVManager, profile: TangramProfile, *, kernels: str | None = None,
               obs_window: int | None = None, pre_rope: PreRope | None = None,
               extend_kernel: str | None = None, decode_kernel: str | None = None) -> AttentionContext:
        """Context for ``kv`` (built from ``profile``); ``kernels``: ``"torch"``/``"triton"``/None (by device);
        ``decode_kernel``: the Triton decode, ``"aot"`` (None) or ``"balanced"`` (see ``KernelSet``);
        ``extend_kernel``: ``"flashinfer"`` runs extend attention through FlashInfer (CUDA only), ``"mixed"``
        only steps adding more than ``MIXED_FLASHINFER_MIN_NEW`` tokens to a row; None, ``"triton"`` (the server
        flag's name for our kernels) or the kernel set's name keeps it in the kernel set (Triton on CUDA, the
        torch references elsewhere)."""
        lay = kv.layout
        if (profile.model.num_layers, profile.model.num_kv_heads, profile.num_groups) != (
                lay.num_layers, lay.num_kv_heads, lay.num_groups):
            raise ValueError("the profile does not describe this manager's layout (layers, kv heads, groups)")
        if any(len(row) != lay.num_groups for row in profile.aot_split.splits):
            raise ValueError(f"the profile's AOT split table rows do not have {lay.num_groups} groups")
        ks = KernelSet.for_device(kv.pool.device, kernels, decode_kernel)
        scorer = SegmentScorer(profile.runtime_scorer, ks, obs_window or max(1, profile.recent_window), pre_rope)
        dev = kv.pool.device
        order = [launch_order([lay.group_budget[g] for g in layer.group]) for layer in lay.layers]
        fi = None
        if extend_kernel in ("flashinfer", "mixed"):
            if torch.device(dev).type != "cuda":
                raise ValueError(f"extend_kernel={extend_kernel!r} (--tangram-extend-kernel) needs the pool on a CUDA "
                                 "device; elsewhere choose the Triton kernel (--tangram-extend-kernel triton)")
            fi = layout_flashinfer_extend(lay, order, dev)
        elif extend_kernel not in (None, "triton", ks.name):
            raise ValueError(f"unknown extend kernel {extend_kernel!r}; choose 'flashinfer', 'mixed', 'triton' or "
                             f"the kernel set {ks.name!r}")
        return cls(kv, ks, scorer, profile.aot_split, lay.head_group_tensor(dev), lay.head_column_tensor(dev),
                   torch.tensor(order, dtype=torch.int32, device=dev), fi,
                   MIXED_FLASHINFER_MIN_NEW if extend_kernel == "mixed" else 0)

    @property
    def triton_extend(self) -> bool:
        """Whether steps may run the Triton extend kernel (alone, or for question-sized steps under ``mixed``)."""
        return self.kernels.name == "triton" and (self.flashinfer_extend is None or self.flashinfer_min_new > 0)

    def decode_splits(self, batch_size: int) -> tuple[torch.Tensor, int]:
        """(int32 ``[G]`` splits on the device, the bucket's max) of the AOT row for ``batch_size``."""
        b = self.aot.bucket_index(batch_size)
        return self.split_rows[b], self.split_max[b]

    def step(self, rows: Sequence[StepRow], decode_token_ids: Sequence[int] | None = None) -> ForwardStep:
        return ForwardStep(self, rows, decode_token_ids)


def layout_flashinfer_extend(layout: HeadGroupLayout, head_order: Sequence[Sequence[int]],
                             device: torch.device | str) -> FlashInferExtend:
    """FlashInfer's extend passes for ``layout``'s head maps (``head_order``: each layer's launch order)."""
    return FlashInferExtend(device, layout.head_group_tensor().numpy(), layout.head_column_tensor().numpy(),
                            np.asarray(head_order), page_size=layout.page_size, heads_per_group=layout.heads_per_group)


def decode_attend(ctx: AttentionContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  token_slots: torch.Tensor, kv_starts: torch.Tensor, kv_lens: torch.Tensor, kv_indices: torch.Tensor,
                  splits: torch.Tensor, max_splits: int) -> torch.Tensor:
    """One decode layer: write each row's token K/V into its slots, then split-KV paged decode over the lists
    (which include those slots). Device work only, fixed shapes per batch size: CUDA-graph capturable."""
    pool = ctx.kv.pool
    ctx.kv.write_token_layer(token_slots, layer, k, v)
    return ctx.kernels.decode(q, pool.k_buffer, pool.v_buffer, kv_starts, kv_lens, kv_indices, ctx.head_group[layer],
                              ctx.head_column[layer], ctx.head_order[layer], splits, max_splits,
                              ctx.aot.min_split_tokens, scale)


class ForwardStep:
    """Metadata and per-layer work of one forward (see module docstring)."""

    def __init__(self, ctx: AttentionContext, rows: Sequence[StepRow], decode_token_ids: Sequence[int] | None = None):
        """``decode_token_ids``: the decode rows' token ids in row order, or None (a server step: recorded as
        unresolved, see ``TangramKVManager.resolve_tokens``)."""
        kv = ctx.kv
        self.ctx, self.rows = ctx, list(rows)
        if not self.rows:
            raise StepError("a forward step needs at least one row")
        self.rids = [r.rid for r in self.rows]
        self._check_rows()
        self.extend_rows = [i for i, r in enumerate(self.rows) if not r.decode]
        decode_rows = [i for i, r in enumerate(self.rows) if r.decode]
        if decode_token_ids is not None and len(decode_token_ids) != len(decode_rows):
            raise StepError(f"{len(decode_rows)} decode rows but {len(decode_token_ids)} decode token ids")
        self.decode_only = not self.extend_rows
        dev = kv.pool.device
        if dev.type == "cuda":  # the reservations' device tensors, made on the scheduler's stream (overlap)
            stream = torch.cuda.current_stream(dev)
            for i in self.extend_rows:
                for t in kv.requests[self.rids[i]].pending.device_tensors():
                    t.record_stream(stream)
        decode_rids = [self.rids[i] for i in decode_rows]
        self.on_arena = False  # decode lists read from kv.device_lists.arena (else host-built CSR lists)
        if self.decode_only:  # the token's slots are part of the lists; its K/V is written before attention
            self.token_slots = to_device(kv.open_decode_slots(decode_rids, decode_token_ids), dev)
            self._decode_lists()
            self.splits, self.max_splits = ctx.decode_splits(len(self.rows))
        else:  # committed tokens only; new tokens are read from staging
            indptr, self.kv_indices = kv.slot_lists(self.rids, dev)
            self.token_slots = to_device(kv.open_decode_slots(decode_rids, decode_token_ids), dev) \
                if decode_rows else None
            self.kv_indptr = to_device(indptr, dev)
            self.max_prefix = int(indptr.diff().max()) if indptr.numel() > 1 else 0  # host CSR: no sync
        lens = torch.tensor([r.n for r in self.rows], dtype=torch.int32)
        offsets = torch.zeros(len(self.rows) + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(lens, 0)
        self.offsets = offsets.tolist()
        self.qo_indptr = to_device(offsets, dev)
        self.max_new = int(lens.max())
        self.fi_step = None
        if ctx.flashinfer_extend is not None and not self.decode_only and self.max_new > ctx.flashinfer_min_new:
            # indptr: the host CSR built above
            self.fi_step = ctx.flashinfer_extend.step(self.offsets, indptr.numpy(), self.kv_indices)
        self.decode_index = to_device(torch.tensor([self.offsets[i] for i in decode_rows], dtype=torch.long), dev)
        self.compress = {i: not kv.requests[self.rids[i]].pending.full for i in self.extend_rows}
        whole = [i for i in self.extend_rows if not self.compress[i]]  # each kind written in one batch per layer
        self.compressed = [i for i in self.extend_rows if self.compress[i]]
        self.whole_writes = kv.full_segment_writes([self.rids[i] for i in whole],
                                                   [self.offsets[i] for i in whole]) if whole else None
        self.compressed_writes = self.scored_rows = None
        if self.compressed:
            offs = [self.offsets[i] for i in self.compressed]
            self.compressed_writes = kv.compressed_segment_writes([self.rids[i] for i in self.compressed], offs)
            self.scored_rows = ScoredRows.build(offs, [self.rows[i].n for i in self.compressed],
                                                [self.rows[i].start for i in self.compressed],
                                                ctx.scorer.obs_window, dev)

    def _decode_lists(self) -> None:
        """Decode-only step: (start, length) ranges of the lists in the device arena, the new token appended
        there; when the arena cannot hold the batch, host-built CSR lists (logged, counted)."""
        kv, dev = self.ctx.kv, self.ctx.kv.pool.device
        ranges = kv.device_slot_ranges(self.rids, self.token_slots)
        if ranges is None:
            kv.arena_fallback_steps += 1
            if kv.arena_fallback_steps & (kv.arena_fallback_steps - 1) == 0:  # 1, 2, 4, ...: not every step
                logger.warning("tangram: the device slot-list arena (%d entries) cannot hold this decode batch's "
                               "lists; they are built on the host (slow path, %d steps so far)",
                               kv.device_lists.capacity, kv.arena_fallback_steps)
            indptr, self.kv_indices = kv.slot_lists(self.rids, dev)
            ranges = csr_ranges(indptr)
        else:
            self.on_arena, self.kv_indices = True, kv.device_lists.arena
        self.kv_starts, self.kv_lens = (to_device(x, dev) for x in ranges)

    def _check_rows(self) -> None:
        kv = self.ctx.kv
        if len(set(self.rids)) != len(self.rids):
            raise StepError(f"a request appears twice in one batch: {self.rids}")
        for r in self.rows:
            req = kv.requests.get(r.rid)
            if req is None:
                raise StepError(f"request {r.rid!r} is not running in the tangram cache (no reservation was made "
                                f"for it: did the alloc_for_extend hook run?)")
            if r.decode:
                if r.n != 1 or req.pending is not None or len(req.token_ids) != r.start:
                    raise StepError(f"decode row of {r.rid!r} at position {r.start} (n={r.n}) does not follow its "
                                    f"cached {len(req.token_ids)} tokens"
                                    f"{' (a segment is still being written)' if req.pending is not None else ''}")
            else:
                pend = req.pending
                if pend is None or pend.start != r.start or len(pend.token_ids) != r.n:
                    have = "none" if pend is None else f"[{pend.start}, {pend.start + len(pend.token_ids)})"
                    raise StepError(f"extend row of {r.rid!r} covers [{r.start}, {r.start + r.n}) but its reserved "
                                    f"segment is {have}")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (RoPE applied; rows ragged by the step's offsets) -> ``[T, Hq, D]``."""
        ctx, kv = self.ctx, self.ctx.kv
        pool = kv.pool
        hg, hc = ctx.head_group[layer], ctx.head_column[layer]
        if self.decode_only:
            return decode_attend(ctx, layer, q, k, v, scale, self.token_slots, self.kv_starts, self.kv_lens,
                                 self.kv_indices, self.splits, self.max_splits)
        if self.fi_step is not None:
            out = self.fi_step.attend(layer, q, k, v, pool.k_buffer, pool.v_buffer, scale)
        else:
            out = ctx.kernels.extend(q, k, v, self.qo_indptr, self.max_new, pool.k_buffer, pool.v_buffer,
                                     self.kv_indptr, self.kv_indices, hg, hc, scale, self.max_prefix)
        if self.whole_writes is not None:
            kv.write_full_segments_layer(self.whole_writes, layer, k, v)
        if self.compressed_writes is not None:
            scores = ctx.scorer.scores_rows(q, k, v, scale, self.scored_rows)
            kv.write_compressed_segments_layer(self.compressed_writes, layer, k, v, scores)
        if self.token_slots is not None:
            kv.write_token_layer(self.token_slots, layer, k[self.decode_index], v[self.decode_index])
        return out

    def commit(self) -> None:
        """After the last layer: the extend rows' segments become committed (visible to later steps)."""
        self.ctx.kv.commit_segments([self.rids[i] for i in self.extend_rows])
