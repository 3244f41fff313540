"""Which attention kernels run: the Triton kernels (CUDA) or their torch references (CPU), one choice per step.

Both sets take the same arguments (the pool contract of ``docs/arch/kernels.md``); the choice is explicit
(``"triton"`` or ``"torch"``) or follows the pool's device (CUDA -> Triton, else torch). Nothing falls back
from one set to the other at run time. The Triton set decodes with the AOT split table
(``decode_variant="aot"``) or the token-balanced kernel (``decode_variant="balanced"``, which the torch set
refuses: it has no such variant to run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tangram_sgl.kernels.decode import paged_decode, paged_decode_torch
from tangram_sgl.kernels.decode_balanced import BALANCED_PROGRAMS, balanced_paged_decode
from tangram_sgl.kernels.extend import extend_attention, extend_attention_torch
from tangram_sgl.kernels.scoring import snapkv_scores_ragged, snapkv_scores_ragged_torch

KERNEL_SETS = ("torch", "triton")
DECODE_VARIANTS = ("aot", "balanced")


@dataclass(frozen=True)
class KernelSet:
    """Extend, decode and SnapKV-scoring kernels of one implementation (``name``); ``decode_variant``: which
    Triton decode kernel runs."""

    name: str
    decode_variant: str = "aot"

    def __post_init__(self) -> None:
        if self.name not in KERNEL_SETS:
            raise ValueError(f"unknown kernel set {self.name!r}; choose from {KERNEL_SETS}")
        if self.decode_variant not in DECODE_VARIANTS:
            raise ValueError(f"unknown decode kernel {self.decode_variant!r}; choose from {DECODE_VARIANTS}")
        if self.decode_variant != "aot" and self.name != "triton":
            raise ValueError(f"decode kernel {self.decode_variant!r} (--tangram-decode-kernel) is a Triton kernel: it "
                             f"needs the pool on a CUDA device (here the {self.name} kernels run)")

    @classmethod
    def for_device(cls, device: torch.device | str, name: str | None = None,
                   decode_variant: str | None = None) -> KernelSet:
        """``name`` if given, else Triton on CUDA and the torch references elsewhere; ``decode_variant`` or "aot"."""
        if name is None:
            name = "triton" if torch.device(device).type == "cuda" else "torch"
        return cls(name, decode_variant or "aot")

    def extend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
               max_new: int, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
               kv_indices: torch.Tensor, head_group: torch.Tensor, head_column: torch.Tensor,
               sm_scale: float, max_prefix: int | None = None) -> torch.Tensor:
        """New tokens over [(request, group) slot list ; their own staging K/V, causal] -> ``[T, Hq, D]``
        (``max_prefix``: the longest list, a host int that lets the Triton kernel split long prefixes)."""
        if self.name == "torch":
            return extend_attention_torch(q, k_new, v_new, qo_indptr, k_buffer, v_buffer, kv_indptr, kv_indices,
                                          head_group, head_column, sm_scale=sm_scale)
        return extend_attention(q, k_new, v_new, qo_indptr, max_new, k_buffer, v_buffer, kv_indptr, kv_indices,
                                head_group, head_column, sm_scale=sm_scale, max_prefix=max_prefix)

    def decode(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_starts: torch.Tensor,
               kv_lens: torch.Tensor, kv_indices: torch.Tensor, head_group: torch.Tensor, head_column: torch.Tensor,
               head_order: torch.Tensor, splits: torch.Tensor, max_splits: int, min_split_tokens: int,
               sm_scale: float) -> torch.Tensor:
        """One query token per request over its (request, group) slot range -> ``[B, Hq, D]`` (``head_order``:
        the layer's kv heads longest-first, the Triton launch order; ``head_order``, ``splits``, ``max_splits`` and
        ``min_split_tokens`` steer the AOT-split kernel only)."""
        if self.name == "torch":
            return paged_decode_torch(q, k_buffer, v_buffer, kv_starts, kv_lens, kv_indices, head_group,
                                      head_column, sm_scale=sm_scale)
        if self.decode_variant == "balanced":
            return balanced_paged_decode(q, k_buffer, v_buffer, kv_starts, kv_lens, kv_indices, head_group,
                                         head_column, sm_scale=sm_scale, num_programs=BALANCED_PROGRAMS)
        return paged_decode(q, k_buffer, v_buffer, kv_starts, kv_lens, kv_indices, head_group, head_column,
                            splits, head_order=head_order, max_splits=max_splits,
                            min_split_tokens=min_split_tokens, sm_scale=sm_scale)

    def snapkv_ragged(self, q: torch.Tensor, k: torch.Tensor, q_start: torch.Tensor, k_start: torch.Tensor,
                      lens: torch.Tensor, n_max: int, obs_window: int, scale: float, pool_kernel: int) -> torch.Tensor:
        """SnapKV scores ``[R, Hkv, n_max]`` of several segments of a step's staging (see
        ``tangram_sgl.kernels.scoring.snapkv_scores_ragged``)."""
        fn = snapkv_scores_ragged_torch if self.name == "torch" else snapkv_scores_ragged
        return fn(q, k, q_start, k_start, lens, n_max, obs_window=obs_window, scale=scale, pool_kernel=pool_kernel)
