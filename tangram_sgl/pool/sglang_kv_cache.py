"""``TangramKVCache``: the ``KVCache`` object SGLang's model runner holds when the tangram pool is active.

It exposes the one shared :class:`GroupPagePool` (``k_buffer``/``v_buffer``
``[num_pages, H_p, page_size, head_dim]``, the same tensors for every layer) and the
:class:`TangramKVManager` the tangram attention backend writes through (``write_segment_layer`` /
``commit_segment`` / ``append_decode``). SGLang's per-token ``set_kv_buffer`` has no meaning here —
a token's K/V goes to per-head kept slots chosen after scoring — so it refuses loudly.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from tangram_sgl.pool.kv_manager import TangramKVManager


class TangramKVCache(KVCache):
    """SGLang ``KVCache`` view of the tangram pool (see module docstring)."""

    def __init__(self, manager: TangramKVManager, logical_size: int, device: str):
        pool = manager.pool
        super().__init__(logical_size, 1, pool.k_buffer.dtype, manager.layout.num_layers, device,
                         enable_memory_saver=False, allocation_label="tangram head-group")
        self.manager = manager
        self.mem_usage = 2 * pool.k_buffer.numel() * pool.k_buffer.element_size() / (1 << 30)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.manager.pool.k_buffer

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.manager.pool.v_buffer

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.manager.pool.k_buffer, self.manager.pool.v_buffer

    def get_kv_size_bytes(self) -> tuple[int, int]:
        b = self.manager.pool.k_buffer
        return b.numel() * b.element_size(), b.numel() * b.element_size()

    def set_kv_buffer(self, layer: Any, loc: Any, cache_k: torch.Tensor, cache_v: torch.Tensor, *args: Any,
                      **kwargs: Any) -> None:
        raise RuntimeError("the tangram pool is written by the tangram attention backend through "
                           "TangramKVManager.write_segment_layer / append_decode, not per token; an attention "
                           "backend other than 'tangram' is running on the tangram pool")
