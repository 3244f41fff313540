"""Static decode metadata for CUDA-graph capture and replay of the tangram decode step.

SGLang 0.5.17 captures one decode graph per batch-size bucket ``bs`` and replays it after calling the
backend's ``init_forward_metadata_out_graph`` (host work, outside the graph). A captured graph reads
fixed addresses, so every tensor the decode layers read lives in :class:`DecodeGraphBuffers`, allocated
once for the largest bucket and viewed per bucket, or is the manager's slot-list arena (allocated once):

- ``starts``, ``lens`` int32 ``[max_bs*G]``: the (row, group) ranges of ``kv.device_lists.arena``; rows
  past the live batch (SGLang's padding) have length 0;
- ``token_slots`` int64 ``[max_bs, G]``: each row's decode-token slot per group; padding rows write to
  slot 0, the pool's null page, which no list reads.

The AOT split row of a bucket is a row of ``AttentionContext.split_rows`` (uploaded once, with the context),
the same memory at capture and replay. Per step, the host builds the :class:`ForwardStep` as in eager mode (rows ->
requests, decode slots, the new token appended to the device lists) and :meth:`DecodeGraphBuffers.load`
copies its O(rows x groups) metadata in; a step whose lists did not fit the arena (host-built lists) runs
eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram_sgl.attention.forward_step import AttentionContext, ForwardStep, decode_attend


@dataclass
class GraphDecodeStep:
    """The decode step a captured graph runs: views of the static buffers for bucket ``bs``."""

    ctx: AttentionContext
    token_slots: torch.Tensor
    kv_starts: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor
    splits: torch.Tensor
    max_splits: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return decode_attend(self.ctx, layer, q, k, v, scale, self.token_slots, self.kv_starts, self.kv_lens,
                             self.kv_indices, self.splits, self.max_splits)

    def commit(self) -> None:
        """Nothing to publish: decode tokens were recorded when the host step was built."""


class DecodeGraphBuffers:
    """Static decode metadata for buckets up to ``max_bs`` rows (see module docstring)."""

    def __init__(self, ctx: AttentionContext, max_bs: int):
        dev, g = ctx.kv.pool.device, ctx.kv.num_groups
        self.ctx, self.max_bs = ctx, max_bs
        self.starts = torch.zeros(max_bs * g, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(max_bs * g, dtype=torch.int32, device=dev)
        self.token_slots = torch.zeros(max_bs, g, dtype=torch.long, device=dev)
        ctx.kv.null_page_is_padding_sink = True  # capture and padded replays write page 0 from now on

    def fits(self, step: ForwardStep) -> bool:
        """Whether ``step`` can run in a graph: decode only, its lists in the arena, at most ``max_bs`` rows."""
        return step.decode_only and step.on_arena and len(step.rows) <= self.max_bs

    def view(self, bs: int) -> GraphDecodeStep:
        """The bucket-``bs`` step over the static buffers (what a graph captures and replays)."""
        if not 0 < bs <= self.max_bs:
            raise ValueError(f"decode graph bucket {bs} outside 1..{self.max_bs}")
        g = self.ctx.kv.num_groups
        splits, max_splits = self.ctx.decode_splits(bs)
        return GraphDecodeStep(self.ctx, self.token_slots[:bs], self.starts[:bs * g], self.lens[:bs * g],
                               self.ctx.kv.device_lists.arena, splits, max_splits)

    def capture(self, bs: int) -> GraphDecodeStep:
        """Bucket ``bs`` with every row padding (empty lists, null decode slots): what capture runs."""
        g = self.ctx.kv.num_groups
        self.starts[:bs * g].zero_()
        self.lens[:bs * g].zero_()
        self.token_slots[:bs].zero_()
        return self.view(bs)

    def load(self, step: ForwardStep, bs: int) -> GraphDecodeStep:
        """Copy ``step``'s metadata into the bucket-``bs`` buffers (rows past the step padded) and return the
        view the captured graph reads."""
        if not self.fits(step):
            raise ValueError("this step cannot run in a decode graph (not decode-only, its lists not in the "
                             f"arena, or more than {self.max_bs} rows)")
        g, raw = self.ctx.kv.num_groups, len(step.rows)
        if raw > bs:
            raise ValueError(f"a step of {raw} rows does not fit decode graph bucket {bs}")
        self.starts[:raw * g].copy_(step.kv_starts, non_blocking=True)
        self.lens[:raw * g].copy_(step.kv_lens, non_blocking=True)
        self.lens[raw * g:bs * g].zero_()
        self.token_slots[:raw].copy_(step.token_slots, non_blocking=True)
        self.token_slots[raw:bs].zero_()
        return self.view(bs)
