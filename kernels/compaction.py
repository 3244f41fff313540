"""Compaction: gather each kv head's kept tokens from staging into its column of its group's slots.

For request r and kv head h of the layer (group g = ``head_group[h]``, column c = ``head_column[h]``), the
j-th kept position ``kept_pos[kept_indptr[r*Hkv + h] + j]`` (segment-relative, ascending) is copied from
staging row ``stage_indptr[r] + pos`` to slot ``dst_slots[dst_indptr[r*G + g] + j]`` of the pool, column c,
for K and V. Heads of one group keep the same count k_g, which must equal the (r, g) slot count.
One launch covers all requests and heads of a layer; the pool is written in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compact_kernel(
    KStage, VStage, K, V,
    StageIndptr, KeptIndptr, KeptPos, DstIndptr, DstSlots, HeadGroup, HeadColumn,
    num_groups,
    stride_st, stride_sh, stride_vst, stride_vsh,
    stride_kp, stride_kc, stride_kt, stride_vp, stride_vc, stride_vt,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    kept_start = tl.load(KeptIndptr + r * num_kv_heads + h)
    n_kept = tl.load(KeptIndptr + r * num_kv_heads + h + 1) - kept_start
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_kept
    g = tl.load(HeadGroup + h)
    c = tl.load(HeadColumn + h).to(tl.int64)
    dst_start = tl.load(DstIndptr + r * num_groups + g)
    pos = tl.load(KeptPos + kept_start + offs, mask=mask, other=0)
    src = (tl.load(StageIndptr + r) + pos).to(tl.int64)
    slot = tl.load(DstSlots + dst_start + offs, mask=mask, other=0).to(tl.int64)
    page = slot // PAGE
    tok = slot % PAGE
    offs_d = tl.arange(0, D)
    k = tl.load(KStage + (src * stride_st + h * stride_sh)[:, None] + offs_d[None, :], mask=mask[:, None])
    tl.store(K + (page * stride_kp + c * stride_kc + tok * stride_kt)[:, None] + offs_d[None, :], k, mask=mask[:, None])
    v = tl.load(VStage + (src * stride_vst + h * stride_vsh)[:, None] + offs_d[None, :], mask=mask[:, None])
    tl.store(V + (page * stride_vp + c * stride_vc + tok * stride_vt)[:, None] + offs_d[None, :], v, mask=mask[:, None])


def compact_kept_kv(
    k_stage: torch.Tensor,
    v_stage: torch.Tensor,
    stage_indptr: torch.Tensor,
    kept_indptr: torch.Tensor,
    kept_pos: torch.Tensor,
    dst_indptr: torch.Tensor,
    dst_slots: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    *,
    max_kept: int,
    block: int = 64,
) -> None:
    """Copy kept K/V of one layer from staging into the pool (in place).

    k_stage, v_stage: [total_tokens, Hkv, D] ragged by stage_indptr (int32 [R + 1]); kept_indptr: int32
    [R*Hkv + 1] into kept_pos (int32); dst_indptr: int32 [R*G + 1] into dst_slots (int32 slots);
    max_kept: a host bound on any (r, h) kept count (sets the grid).
    """
    R = stage_indptr.shape[0] - 1
    hkv = head_group.shape[0]
    D = k_stage.shape[-1]
    if kept_indptr.shape[0] != R * hkv + 1:
        raise ValueError(f"kept_indptr has {kept_indptr.shape[0]} entries, expected R*Hkv+1 = {R * hkv + 1}")
    if (dst_indptr.shape[0] - 1) % R:
        raise ValueError(f"dst_indptr has {dst_indptr.shape[0]} entries, not R*G+1 for R={R}")
    if k_stage.stride(-1) != 1 or v_stage.stride(-1) != 1 or k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("staging and pool tensors must be contiguous along head_dim")
    num_groups = (dst_indptr.shape[0] - 1) // R
    grid = (R, hkv, max(1, triton.cdiv(max_kept, block)))
    _compact_kernel[grid](
        k_stage, v_stage, k_buffer, v_buffer,
        stage_indptr, kept_indptr, kept_pos, dst_indptr, dst_slots, head_group, head_column,
        num_groups,
        k_stage.stride(0), k_stage.stride(1), v_stage.stride(0), v_stage.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        v_buffer.stride(0), v_buffer.stride(1), v_buffer.stride(2),
        PAGE=k_buffer.shape[2], D=D, BLOCK=block,
    )


def compact_kept_kv_torch(
    k_stage: torch.Tensor,
    v_stage: torch.Tensor,
    stage_indptr: torch.Tensor,
    kept_indptr: torch.Tensor,
    kept_pos: torch.Tensor,
    dst_indptr: torch.Tensor,
    dst_slots: torch.Tensor,
    head_group: torch.Tensor,
    head_column: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
) -> None:
    """Reference of :func:`compact_kept_kv` (same arguments but ``max_kept``; in place)."""
    R = stage_indptr.shape[0] - 1
    hkv = head_group.shape[0]
    num_groups = (dst_indptr.shape[0] - 1) // R
    page_size = k_buffer.shape[2]
    for r in range(R):
        for h in range(hkv):
            a, b = int(kept_indptr[r * hkv + h]), int(kept_indptr[r * hkv + h + 1])
            g, c = int(head_group[h]), int(head_column[h])
            d0 = int(dst_indptr[r * num_groups + g])
            src = int(stage_indptr[r]) + kept_pos[a:b].long()
            slots = dst_slots[d0 : d0 + b - a].long()
            k_buffer[slots // page_size, c, slots % page_size] = k_stage[src, h]
            v_buffer[slots // page_size, c, slots % page_size] = v_stage[src, h]
