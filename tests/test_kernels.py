"""Triton kernels vs their torch references (CPU, TRITON_INTERPRET=1, small shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest
import torch

from tangram_sgl.kernels.decode import paged_decode, paged_decode_torch


def make_pool(lengths, hkv_map, *, page_size, heads_per_group, head_dim, dtype=torch.float32, seed=0):
    """Random pool + CSR slot lists. lengths[r][g]: kept tokens of (request r, group g); each list is two
    owner segments (each starting on a fresh page, the first one's last page possibly partial) on
    shuffled pages, page 0 never used."""
    gen = torch.Generator().manual_seed(seed)
    B, G = len(lengths), len(lengths[0])
    segs = []
    for r in range(B):
        for g in range(G):
            n = lengths[r][g]
            a = n // 3
            segs.append((a, n - a))
    pages_needed = sum(math.ceil(a / page_size) + math.ceil(b / page_size) for a, b in segs)
    num_pages = pages_needed + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    indptr, indices = [0], []
    for a, b in segs:
        for seg in (a, b):
            for j in range(math.ceil(seg / page_size)):
                p = perm.pop()
                take = min(page_size, seg - j * page_size)
                indices.extend(p * page_size + o for o in range(take))
        indptr.append(len(indices))
    shape = (num_pages, heads_per_group, page_size, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v, torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32)


def layer_map(hkv, num_groups, heads_per_group):
    """kv head h -> (group, column): heads spread round-robin over groups (a layer uses several groups)."""
    group = [h % num_groups for h in range(hkv)]
    column = [(h // num_groups) % heads_per_group for h in range(hkv)]
    return torch.tensor(group, dtype=torch.int32), torch.tensor(column, dtype=torch.int32)


DECODE_CASES = [
    # (gqa, hkv, page_size, splits per group, min_split, lengths[r][g])
    (4, 4, 16, (3, 1), 8, [[40, 7], [0, 16], [24, 24], [5, 0]]),  # empty group, < page, split boundary
    (1, 2, 1, (2, 2), 4, [[8, 3], [9, 1]]),  # gqa 1, page 1, n = 2 * min_split
    (3, 2, 16, (4, 2), 4, [[64, 17], [33, 0]]),  # gqa 3, 4 splits of 16, a page boundary
    (6, 2, 16, (2, 1), 16, [[32, 15], [31, 48]]),  # gqa 6, n = 2 * chunk exactly
    (8, 1, 1, (5,), 2, [[50], [11], [0]]),  # gqa 8, many splits
]


@pytest.mark.parametrize("gqa,hkv,page,splits,min_split,lengths", DECODE_CASES)
def test_paged_decode_matches_reference(gqa, hkv, page, splits, min_split, lengths):
    G, hp, D = len(splits), 2, 32
    k, v, indptr, indices = make_pool(lengths, None, page_size=page, heads_per_group=hp, head_dim=D)
    hg, hc = layer_map(hkv, G, hp)
    q = torch.randn(len(lengths), gqa * hkv, D)
    scale = D**-0.5
    out = paged_decode(q, k, v, indptr, indices, hg, hc, torch.tensor(splits, dtype=torch.int32),
                       max_splits=max(splits), min_split_tokens=min_split, sm_scale=scale, block_n=16)
    ref = paged_decode_torch(q, k, v, indptr, indices, hg, hc, sm_scale=scale)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for r, row in enumerate(lengths):  # empty groups give zeros, others do not
        for h in range(hkv):
            empty = row[int(hg[h])] == 0
            assert bool((out[r, h * gqa : (h + 1) * gqa] == 0).all()) == empty


def test_paged_decode_half_precision():
    """fp16 storage (the interpreter's bf16 tl.dot is broken in triton 3.8; bf16 is covered on the GPU)."""
    lengths = [[70, 20], [3, 33]]
    k, v, indptr, indices = make_pool(lengths, None, page_size=16, heads_per_group=4, head_dim=32, dtype=torch.float16)
    hg, hc = layer_map(4, 2, 4)
    q = torch.randn(2, 16, 32).half()
    out = paged_decode(q, k, v, indptr, indices, hg, hc, torch.tensor([3, 1], dtype=torch.int32),
                       max_splits=3, min_split_tokens=16, sm_scale=0.2, block_n=16)
    ref = paged_decode_torch(q, k, v, indptr, indices, hg, hc, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
