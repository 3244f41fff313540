"""FlashInfer 0.6.15 decode over the head-group pool, each (request, kv head) a pseudo-request.

View: the pool ``[num_pages, H_p, page_size, D]`` is read as single-head pages
``[num_pages * H_p, page_size, 1, D]`` (NHD), so column c of page p is pseudo-page ``p * H_p + c``, and
query row ``r * Hkv + h`` of ``q.view(B * Hkv, G_q, D)`` is the pseudo-request of (request r, kv head h).
FlashInfer needs every page of a row full except the last, so with page_size > 1 each (request, group)
slot list must be whole pages in order (``pseudo_request_pages`` checks it).

``StoredPlanDecode`` is the plan-free path: a tensor-core (fa2) wrapper in CUDA-graph mode, planned once
per (batch bucket, length bucket) with the bucket's maximum page count per row and then reused; each step
only rewrites the device-side page table and calls ``run()``. That is exact for rows no longer than
planned because the fa2 kernel recomputes kv_len from indptr/last_page_len at run time and clamps chunk
starts (the CUDA-core decode kernel does not, so it is not used here); a row longer than planned fails a
device-side assert instead of being truncated. ``StoredPlanDecode.load_slot_lists`` builds the step's page
table on the GPU with fixed shapes (``build_pseudo_page_table``: no host sync, graph-capturable);
``pseudo_request_pages`` is its torch reference (and checks the whole-page condition).
flashinfer is imported lazily (GPU machines only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pool_as_single_head_pages(buffer: torch.Tensor) -> torch.Tensor:
    """``[P, H_p, page_size, D]`` -> ``[P * H_p, page_size, 1, D]`` (a view, FlashInfer NHD, one kv head)."""
    p, hp, ps, d = buffer.shape
    return buffer.view(p * hp, ps, 1, d)


def pseudo_request_pages(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    *,
    batch: int,
    page_size: int,
    heads_per_group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer page table (indptr [B*Hkv+1], pseudo-page ids, last_page_len [B*Hkv]), all int32.

    Row r*Hkv + h lists the pages of (r, head_group[h]) as pseudo-pages of column head_column[h].
    Raises if a slot list is not whole pages in order. Uses data-dependent shapes (host syncs): this is
    per-step setup work of the FlashInfer baselines, not of the Triton decode.
    """
    dev = kv_indices.device
    hkv = head_group.shape[0]
    num_groups = (kv_indptr.shape[0] - 1) // batch
    indptr = kv_indptr.long()
    lens = indptr[1:] - indptr[:-1]  # [B*G]
    seg = torch.repeat_interleave(torch.arange(batch * num_groups, device=dev), lens)
    pos = torch.arange(kv_indices.numel(), device=dev) - indptr[seg]
    slots = kv_indices.long()
    off = pos % page_size
    base = slots[torch.arange(slots.numel(), device=dev) - off]  # the slot opening each list entry's page
    if not bool(((slots == base + off) & (base % page_size == 0)).all()):
        raise ValueError("a (request, group) slot list is not whole pages in order; use page_size 1 for FlashInfer")
    head = off == 0
    page_of_head = slots[head] // page_size
    page_cnt = (lens + page_size - 1) // page_size  # [B*G]
    page_start = torch.cumsum(page_cnt, 0) - page_cnt
    row_seg = (torch.arange(batch, device=dev)[:, None] * num_groups + head_group.to(dev).long()[None, :]).flatten()
    row_cnt = page_cnt[row_seg]
    row_indptr = torch.zeros(batch * hkv + 1, dtype=torch.long, device=dev)
    row_indptr[1:] = torch.cumsum(row_cnt, 0)
    total = int(row_indptr[-1])
    within = torch.arange(total, device=dev) - torch.repeat_interleave(row_indptr[:-1], row_cnt)
    src = torch.repeat_interleave(page_start[row_seg], row_cnt) + within
    col = torch.repeat_interleave(head_column.to(dev).long().repeat(batch), row_cnt)
    pages = page_of_head[src] * heads_per_group + col
    row_len = lens[row_seg]
    last = torch.where(row_len > 0, row_len - (row_cnt - 1) * page_size, torch.zeros_like(row_len))
    return row_indptr.int(), pages.int(), last.int()


@triton.jit
def _pseudo_page_table_kernel(
    KvIndptr, KvIndices, HeadGroup, HeadColumn, RowIndptr, Pages, LastLen,
    num_groups,
    PAGE: tl.constexpr, HP: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    row = r * tl.num_programs(1) + h
    g = tl.load(HeadGroup + h)
    c = tl.load(HeadColumn + h)
    start = tl.load(KvIndptr + r * num_groups + g)
    n = tl.load(KvIndptr + r * num_groups + g + 1) - start
    n_pages = tl.cdiv(n, PAGE)
    j = blk * BLOCK + tl.arange(0, BLOCK)
    mask = j < n_pages
    slot = tl.load(KvIndices + start + j * PAGE, mask=mask, other=0)
    tl.store(Pages + tl.load(RowIndptr + row) + j, (slot // PAGE) * HP + c, mask=mask)
    if blk == 0:
        tl.store(LastLen + row, tl.where(n > 0, n - (n_pages - 1) * PAGE, 0))


def build_pseudo_page_table(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    row_indptr: torch.Tensor,
    pages: torch.Tensor,
    last_page_len: torch.Tensor,
    *,
    batch: int,
    page_size: int,
    heads_per_group: int,
    max_pages_per_row: int,
    block: int = 128,
) -> None:
    """Fill (row_indptr, pages, last_page_len) in place, as ``pseudo_request_pages`` returns them.

    Fixed shapes only (``pages`` is a buffer of the planned capacity; ``max_pages_per_row`` a host bound
    that sets the grid): no host sync, so it can run inside a CUDA graph. Assumes whole-page slot lists.
    """
    hkv = head_group.shape[0]
    num_groups = (kv_indptr.shape[0] - 1) // batch
    lens = (kv_indptr[1:] - kv_indptr[:-1]).view(batch, num_groups)[:, head_group.long()]  # [B, Hkv]
    row_indptr[0] = 0
    torch.cumsum(((lens + page_size - 1) // page_size).flatten(), 0, dtype=row_indptr.dtype, out=row_indptr[1:])
    grid = (batch, hkv, max(1, triton.cdiv(max_pages_per_row, block)))
    _pseudo_page_table_kernel[grid](
        kv_indptr, kv_indices, head_group, head_column, row_indptr, pages, last_page_len,
        num_groups, PAGE=page_size, HP=heads_per_group, BLOCK=block,
    )


class StoredPlanDecode:
    """FlashInfer fa2 decode planned once for a (batch bucket, length bucket) and reused every step.

    rows = B * Hkv pseudo-requests; ``max_pages_per_row`` (host int tensor [rows]) is the bucket's largest
    page count of each row, which the plan is made for. Per step, ``load_slot_lists`` (or
    ``load_page_table`` with a ready table) writes the page table into the wrapper's CUDA-graph buffers
    (device work only: no host sync, no plan), then ``run``.
    """

    def __init__(
        self,
        max_pages_per_row: torch.Tensor,
        *,
        num_qo_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_scale: float,
        workspace_bytes: int = 256 << 20,
    ) -> None:
        import flashinfer

        rows = int(max_pages_per_row.numel())
        counts = max_pages_per_row.to(torch.int64).cpu()
        self.planned_pages = counts.to(device=device, dtype=torch.int32)
        self.max_planned_pages = int(counts.max()) if rows else 0
        indptr = torch.zeros(rows + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
        self.indptr = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max(1, int(indptr[-1])), dtype=torch.int32, device=device)
        self.last_page_len = torch.full((rows,), page_size, dtype=torch.int32, device=device)
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )
        self.wrapper.plan(
            indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32), torch.full((rows,), page_size, dtype=torch.int32),
            num_qo_heads, 1, head_dim, page_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=sm_scale,
        )

    def load_page_table(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """Write one step's page table into the planned buffers (device-side assert: no row longer than planned)."""
        torch._assert_async(((indptr[1:] - indptr[:-1]) <= self.planned_pages).all())
        self.indptr.copy_(indptr)
        self.indices[: indices.numel()].copy_(indices)
        self.last_page_len.copy_(last_page_len)

    def load_slot_lists(
        self,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        head_group: torch.Tensor,
        head_column: torch.Tensor,
        *,
        page_size: int,
        heads_per_group: int,
    ) -> None:
        """Build the step's page table on the GPU straight into the planned buffers (no host sync)."""
        batch = (self.indptr.numel() - 1) // head_group.shape[0]
        build_pseudo_page_table(
            kv_indptr, kv_indices, head_group, head_column, self.indptr, self.indices, self.last_page_len,
            batch=batch, page_size=page_size, heads_per_group=heads_per_group,
            max_pages_per_row=int(self.max_planned_pages),
        )
        torch._assert_async(((self.indptr[1:] - self.indptr[:-1]) <= self.planned_pages).all())

    def run(self, q_rows: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q_rows: [rows, G_q, D]; k_pages, v_pages: single-head page views. Returns [rows, G_q, D]."""
        return self.wrapper.run(q_rows, (k_pages, v_pages))
