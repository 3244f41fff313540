"""The one page pool of a model: K and V buffers ``[num_pages, H_p, page_size, head_dim]`` plus its allocator.

A slot is ``page * page_size + offset``; column ``c`` of a page of group ``g`` holds member ``c`` of ``g``
(a (layer, kv_head) from :class:`~tangram_sgl.layout.HeadGroupLayout`). Which owner holds which page is
tracked by the owners themselves (:mod:`tangram_sgl.pool.segment`); the pool only stores data.
"""

from __future__ import annotations

import torch

from tangram_sgl.kernels.pool_write import scatter_kv, scatter_kv_torch, write_token_kv, write_token_kv_torch
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.page_allocator import PageAllocator


class GroupPagePool:
    """K/V storage shared by all layers and head groups, and the allocator of its pages."""

    def __init__(
        self,
        layout: HeadGroupLayout,
        num_pages: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ):
        self.layout = layout
        self.page_size = layout.page_size
        self.heads_per_group = layout.heads_per_group
        self.head_dim = head_dim
        self.num_pages = num_pages
        shape = (num_pages, layout.heads_per_group, layout.page_size, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @property
    def device(self) -> torch.device:
        return self.k_buffer.device

    def page_bytes(self) -> int:
        """Bytes of one page, K and V together."""
        return 2 * self.k_buffer[0].numel() * self.k_buffer.element_size()

    def scatter(self, slots: torch.Tensor, columns: torch.Tensor, tokens: torch.Tensor, heads: torch.Tensor,
                k_src: torch.Tensor, v_src: torch.Tensor) -> None:
        """Store ``k_src[tokens[i], heads[i]]``, ``v_src[...]`` (staging ``[T, H_kv, head_dim]``) at (slot
        ``slots[i]``, column ``columns[i]``): one Triton launch on CUDA (``kernels/pool_write.py``), its torch
        reference elsewhere; the index tensors on the pool's device."""
        scatter = scatter_kv if self.device.type == "cuda" else scatter_kv_torch
        scatter(slots, columns, tokens, heads, k_src, v_src, self.k_buffer, self.v_buffer)

    def write_tokens(self, slots: torch.Tensor, head_group: torch.Tensor, head_column: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Store one token per row kept by every group: ``k[r, h]``, ``v[r, h]`` (``[R, H_kv, head_dim]``) at slot
        ``slots[r, head_group[h]]`` (``slots``: ``[R, G]``), column ``head_column[h]``; one Triton launch on CUDA
        (``kernels/pool_write.py``), its torch reference elsewhere; all tensors on the pool's device."""
        write = write_token_kv if self.device.type == "cuda" else write_token_kv_torch
        write(slots, head_group, head_column, k, v, self.k_buffer, self.v_buffer)

    def read(self, slots: torch.Tensor, column: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[m, head_dim]`` of column ``column`` at the given slots."""
        slots = slots.to(self.device, torch.long)
        pages, offs = slots // self.page_size, slots % self.page_size
        return self.k_buffer[pages, column, offs], self.v_buffer[pages, column, offs]
