"""Triton kernels vs their torch references (CPU, TRITON_INTERPRET=1, small shapes).

On a GPU machine the same tests run compiled with
``TRITON_INTERPRET=0 TANGRAM_KERNEL_TEST_DEVICE=cuda pytest tests/test_kernels.py``.
"""

import os

DEV = os.environ.get("TANGRAM_KERNEL_TEST_DEVICE", "cpu")  # on CPU, Triton runs interpreted (tests/conftest.py)

import itertools
import math

import pytest
import torch
from tangram_sgl.kernels.compaction import compact_kept_kv, compact_kept_kv_torch
from tangram_sgl.kernels.decode import (
    csr_ranges,
    gather_head_kv,
    launch_order,
    paged_decode,
    paged_decode_torch,
)
from tangram_sgl.kernels.decode_balanced import balanced_paged_decode
from tangram_sgl.kernels.extend import (
    _extend_kernel,
    _extend_merge_kernel,
    extend_attention,
    extend_attention_torch,
    extend_splits,
    warm_up_extend,
)
from tangram_sgl.kernels.flashinfer_decode import (
    build_pseudo_page_table,
    pool_as_single_head_pages,
    pseudo_request_pages,
)
from tangram_sgl.kernels.pool_write import scatter_kv, scatter_kv_torch, write_token_kv, write_token_kv_torch
from tangram_sgl.kernels.scoring import snapkv_scores_ragged, snapkv_scores_ragged_torch, snapkv_scores_torch


@pytest.fixture(autouse=True)
def default_device():
    """Tensors made by these tests live on DEV; restored after each test (other modules share the process)."""
    before = torch.get_default_device()
    torch.set_default_device(DEV)
    yield
    torch.set_default_device(before)

# fp32 tolerances: exact-ish under the interpreter; on a GPU, tl.dot multiplies fp32 in TF32 (10-bit
# mantissa), seen on the H200 as ~2e-3 absolute error against the fp32 torch reference.
F32_TOL = {"atol": 2e-5, "rtol": 1e-4} if DEV == "cpu" else {"atol": 5e-3, "rtol": 5e-3}
# SnapKV scores are pooled softmax probabilities (<= 1), used only to rank tokens
SCORE_TOL = {"atol": 1e-6, "rtol": 1e-4} if DEV == "cpu" else {"atol": 2e-3, "rtol": 2e-2}


def make_pool(lengths, *, page_size, heads_per_group, head_dim, dtype=torch.float32, seed=0):
    """Random pool + CSR slot lists. lengths[r][g]: kept tokens of (request r, group g); each list is two
    owner segments (each starting on a fresh page, the first one's last page possibly partial) on
    shuffled pages, page 0 never used."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    B, G = len(lengths), len(lengths[0])
    segs = []
    for r in range(B):
        for g in range(G):
            n = lengths[r][g]
            a = n // 3
            segs.append((a, n - a))
    pages_needed = sum(math.ceil(a / page_size) + math.ceil(b / page_size) for a, b in segs)
    num_pages = pages_needed + 3
    perm = (torch.randperm(num_pages - 1, generator=gen, device="cpu") + 1).tolist()
    indptr, indices = [0], []
    for a, b in segs:
        for seg in (a, b):
            for j in range(math.ceil(seg / page_size)):
                p = perm.pop()
                take = min(page_size, seg - j * page_size)
                indices.extend(p * page_size + o for o in range(take))
        indptr.append(len(indices))
    shape = (num_pages, heads_per_group, page_size, head_dim)
    k = torch.randn(shape, generator=gen, device="cpu").to(DEV, dtype)
    v = torch.randn(shape, generator=gen, device="cpu").to(DEV, dtype)
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
    (4, 2, 16, (1, 1), 8, [[40, 0], [0, 5]]),  # one split everywhere: no merge launch, empty groups
]


@pytest.mark.parametrize("gqa,hkv,page,splits,min_split,lengths", DECODE_CASES)
def test_paged_decode_matches_reference(gqa, hkv, page, splits, min_split, lengths):
    G, hp, D = len(splits), 2, 32
    k, v, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=D)
    hg, hc = layer_map(hkv, G, hp)
    q = torch.randn(len(lengths), gqa * hkv, D)
    scale = D**-0.5
    order = torch.tensor(launch_order([float(h % 3) for h in range(hkv)]), dtype=torch.int32)  # a permutation
    out = paged_decode(q, k, v, *csr_ranges(indptr), indices, hg, hc, torch.tensor(splits, dtype=torch.int32),
                       head_order=order, max_splits=max(splits), min_split_tokens=min_split, sm_scale=scale, block_n=16)
    ref = paged_decode_torch(q, k, v, *csr_ranges(indptr), indices, hg, hc, sm_scale=scale)
    torch.testing.assert_close(out, ref, **F32_TOL)
    for r, row in enumerate(lengths):  # empty groups give zeros, others do not
        for h in range(hkv):
            empty = row[int(hg[h])] == 0
            assert bool((out[r, h * gqa : (h + 1) * gqa] == 0).all()) == empty


def test_launch_order_is_longest_first():
    assert launch_order([0.14, 1.0, 0.5, 1.0, 0.14]) == [1, 3, 2, 0, 4]


def test_paged_decode_half_precision():
    """fp16 storage (the interpreter's bf16 tl.dot is broken in triton 3.8; bf16 is covered on the GPU)."""
    lengths = [[70, 20], [3, 33]]
    k, v, indptr, indices = make_pool(lengths, page_size=16, heads_per_group=4, head_dim=32, dtype=torch.float16)
    hg, hc = layer_map(4, 2, 4)
    q = torch.randn(2, 16, 32).half()
    out = paged_decode(q, k, v, *csr_ranges(indptr), indices, hg, hc, torch.tensor([3, 1], dtype=torch.int32),
                       max_splits=3, min_split_tokens=16, sm_scale=0.2, block_n=16)
    ref = paged_decode_torch(q, k, v, *csr_ranges(indptr), indices, hg, hc, sm_scale=0.2)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


EXTEND_CASES = [
    # (gqa, hkv, page_size, new tokens per request, prefix lengths[r][g], block_m)
    (4, 4, 16, [5, 0, 20], [[40, 7], [3, 0], [0, 16]], 16),  # no new tokens, empty prefix, < page
    (1, 2, 1, [17, 3], [[8, 3], [9, 1]], 16),
    (3, 2, 16, [11, 6], [[33, 0], [16, 17]], 32),  # gqa 3: rows past 10 tokens * 3 heads are padding
    (6, 1, 16, [9], [[20]], 16),  # gqa 6: two tokens per block
    (8, 2, 1, [4, 13], [[0, 0], [5, 2]], 16),
]


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("gqa,hkv,page,n_new,lengths,block_m", EXTEND_CASES)
def test_extend_matches_reference(gqa, hkv, page, n_new, lengths, block_m, splits):
    """Unsplit, and with prefix lists cut into S chunks (some empty: prefixes of 0-3 tokens, a request with no new
    tokens) merged by log-sum-exp: equal to the reference."""
    G, hp, D = len(lengths[0]), 2, 32
    k, v, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=D, seed=1)
    hg, hc = layer_map(hkv, G, hp)
    total = sum(n_new)
    qo = torch.tensor([0] + list(itertools.accumulate(n_new)), dtype=torch.int32)
    q = torch.randn(total, gqa * hkv, D)
    kn, vn = torch.randn(total, hkv, D), torch.randn(total, hkv, D)
    out = extend_attention(q, kn, vn, qo, max(n_new), k, v, indptr, indices, hg, hc,
                           sm_scale=0.3, num_splits=splits, block_m=block_m, block_n=16)
    ref = extend_attention_torch(q, kn, vn, qo, k, v, indptr, indices, hg, hc, sm_scale=0.3)
    torch.testing.assert_close(out, ref, **F32_TOL)


def test_extend_splits_fill_the_gpu_only_for_small_grids():
    assert extend_splits(1, 8, 1, 4096) == 16  # a question over 4k tokens: 256-token chunks
    assert extend_splits(1, 8, 1, 32768) == 32  # capped, and 264 programs reached
    assert extend_splits(1, 8, 1, 100) == 1  # a short prefix is not worth a split
    assert extend_splits(3, 8, 86, 4096) == 1  # an 8k-token chunk already fills the GPU
    assert extend_splits(4, 8, 2, 8192) == 5  # 64 programs -> 320


def _compiled_variants() -> int:
    """Kernels Triton holds compiled for the extend and its merge, over all devices (GPU only)."""
    return sum(len(cache[0]) for fn in (_extend_kernel, _extend_merge_kernel) for cache in fn.device_caches.values())


def test_extend_warm_up_leaves_nothing_to_compile_mid_serving():
    """After ``warm_up_extend`` no extend step compiles: any split count (hence merge width), token total or
    request count reuses a warmed variant (on the GPU Triton's caches do not grow; the interpreter compiles
    nothing, so there the warm-up's launches must only leave the pool untouched)."""
    lengths = [[300, 40], [0, 9]]
    k, v, indptr, indices = make_pool(lengths, page_size=16, heads_per_group=2, head_dim=32, seed=5)
    hg, hc = layer_map(4, 2, 2)
    k0, v0 = k.clone(), v.clone()
    assert warm_up_extend(16, k, v, hg, hc, 2, torch.float32) == 6
    assert torch.equal(k, k0) and torch.equal(v, v0)
    before = _compiled_variants() if DEV == "cuda" else 0
    for n_new, splits in (([1, 16], 3), ([17, 15], 5), ([2, 1], 32), ([64, 33], 1), ([1], 12)):
        B = len(n_new)
        qo = torch.tensor([0] + list(itertools.accumulate(n_new)), dtype=torch.int32)
        q = torch.randn(sum(n_new), 16, 32)
        kn, vn = torch.randn(sum(n_new), 4, 32), torch.randn(sum(n_new), 4, 32)
        out = extend_attention(q, kn, vn, qo, max(n_new), k, v, indptr[: 2 * B + 1], indices, hg, hc,
                               sm_scale=0.3, num_splits=splits)
        ref = extend_attention_torch(q, kn, vn, qo, k, v, indptr[: 2 * B + 1], indices, hg, hc, sm_scale=0.3)
        torch.testing.assert_close(out, ref, **F32_TOL)
    if DEV == "cuda":
        assert _compiled_variants() == before


@pytest.mark.parametrize("block_m,block_n", [(128, 64), (128, 32), (128, 128), (64, 32)])
def test_extend_long_chunk_block_configs_match_reference(block_m, block_n):
    """The block configurations eval/bench_extend.py times for long chunks (a causal run past one block,
    prefixes longer and shorter than a key block) agree with the reference."""
    lengths, n_new = [[150, 40], [0, 9]], [140, 33]
    k, v, indptr, indices = make_pool(lengths, page_size=16, heads_per_group=2, head_dim=32, seed=4)
    hg, hc = layer_map(4, 2, 2)
    qo = torch.tensor([0] + list(itertools.accumulate(n_new)), dtype=torch.int32)
    q = torch.randn(sum(n_new), 16, 32)
    kn, vn = torch.randn(sum(n_new), 4, 32), torch.randn(sum(n_new), 4, 32)
    out = extend_attention(q, kn, vn, qo, max(n_new), k, v, indptr, indices, hg, hc, sm_scale=0.3,
                           block_m=block_m, block_n=block_n, num_warps=8)
    ref = extend_attention_torch(q, kn, vn, qo, k, v, indptr, indices, hg, hc, sm_scale=0.3)
    torch.testing.assert_close(out, ref, **F32_TOL)


@pytest.mark.parametrize("gqa,hkv,obs,lens,pool", [(4, 2, 8, [5, 40, 17], 7), (1, 3, 16, [16, 3], 1),
                                                     (6, 1, 4, [9, 1, 30], 3)])
def test_snapkv_scores_ragged_matches_reference(gqa, hkv, obs, lens, pool):
    """Several segments of one step's staging scored in one launch pair: each row equals the one-segment
    reference on its own tokens (a row shorter than the window uses all its tokens), -inf past its length."""
    D = 32
    offsets = [0, *itertools.accumulate(lens)]
    q, k = torch.randn(offsets[-1], gqa * hkv, D), torch.randn(offsets[-1], hkv, D)
    q_start = torch.tensor([o + n - min(obs, n) for o, n in zip(offsets, lens)], dtype=torch.int32)
    k_start = torch.tensor(offsets[:-1], dtype=torch.int32)
    n = torch.tensor(lens, dtype=torch.int32)
    out = snapkv_scores_ragged(q, k, q_start, k_start, n, max(lens) + 3, obs_window=obs, scale=D**-0.5,
                               pool_kernel=pool, block_n=16)
    ref = snapkv_scores_ragged_torch(q, k, q_start, k_start, n, max(lens) + 3, obs_window=obs, scale=D**-0.5,
                                     pool_kernel=pool)
    assert out.shape == (len(lens), hkv, max(lens) + 3) and torch.isinf(out[0, :, lens[0]:]).all()
    torch.testing.assert_close(out, ref, **SCORE_TOL)


@pytest.mark.parametrize("gqa,hkv,w,n,pool", [(4, 2, 8, 50, 7), (1, 3, 16, 16, 1), (3, 1, 5, 70, 3), (6, 1, 20, 33, 7), (8, 1, 1, 9, 1)])
def test_snapkv_scores_matches_reference(gqa, hkv, w, n, pool):
    D = 32
    q = torch.randn(gqa * hkv, w, D)
    k = torch.randn(hkv, n, D)
    zero, length = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
    out = snapkv_scores_ragged(q.transpose(0, 1), k.transpose(0, 1), zero, zero, length, n, obs_window=w,
                               scale=D**-0.5, pool_kernel=pool, block_n=16)[0]  # one segment, read through strides
    ref = snapkv_scores_torch(q, k, scale=D**-0.5, pool_kernel=pool)
    torch.testing.assert_close(out, ref, **SCORE_TOL)


@pytest.mark.parametrize("page,seg_lens,kept_counts", [
    (16, [40, 9, 0], [[17, 5], [9, 0], [0, 0]]),  # group keeps all of a short segment, an empty one
    (1, [12, 30], [[3, 12], [30, 1]]),
])
def test_compaction_matches_reference(page, seg_lens, kept_counts):
    gen = torch.Generator(device="cpu").manual_seed(2)
    hkv, hp, D, G = 4, 2, 32, 2
    hg, hc = layer_map(hkv, G, hp)
    k, v, dst_indptr, dst_slots = make_pool(kept_counts, page_size=page, heads_per_group=hp, head_dim=D)
    stage_indptr = torch.tensor([0] + list(itertools.accumulate(seg_lens)), dtype=torch.int32)
    ks, vs = torch.randn(sum(seg_lens), hkv, D), torch.randn(sum(seg_lens), hkv, D)
    kept, indptr = [], [0]
    for r, n in enumerate(seg_lens):
        for h in range(hkv):
            cnt = kept_counts[r][int(hg[h])]
            kept.extend(sorted(torch.randperm(n, generator=gen, device="cpu")[:cnt].tolist()))
            indptr.append(len(kept))
    args = (ks, vs, stage_indptr, torch.tensor(indptr, dtype=torch.int32), torch.tensor(kept, dtype=torch.int32),
            dst_indptr, dst_slots, hg, hc)
    k_ref, v_ref = k.clone(), v.clone()
    compact_kept_kv(*args, k, v, max_kept=max(max(row) for row in kept_counts), block=16)
    compact_kept_kv_torch(*args, k_ref, v_ref)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # the written columns hold exactly the staging rows of the kept positions
    r, h = 0, 0
    g, c = int(hg[h]), int(hc[h])
    slots = dst_slots[int(dst_indptr[r * G + g]) : int(dst_indptr[r * G + g + 1])].long()
    pos = torch.tensor(kept[indptr[r * hkv + h] : indptr[r * hkv + h + 1]])
    assert torch.equal(k[slots // page, c, slots % page], ks[pos, h])


@pytest.mark.parametrize("page,m", [(16, 37), (1, 5), (16, 0)])
def test_pool_scatter_matches_reference(page, m):
    """Staging rows (fp32) into a half-precision pool at distinct (slot, column) places: the Triton kernel
    and its reference write the same pool, and nothing else of it."""
    gen, cpu = torch.Generator(device="cpu").manual_seed(7), "cpu"  # host draws (the default device may be CUDA)
    pages, hp, t, hkv, d = 8, 2, 11, 3, 32
    place = torch.randperm(pages * page * hp, generator=gen, device=cpu)[:m]  # distinct (slot, column)
    slot, column = place // hp, place % hp
    token = torch.randint(0, t, (m,), generator=gen, device=cpu)
    head = torch.randint(0, hkv, (m,), generator=gen, device=cpu)
    ks, vs = (torch.randn(t, hkv, d, generator=gen, device=cpu) for _ in range(2))
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    pool = [torch.randn(pages, hp, page, d, generator=gen, device=cpu).to(DEV, dt) for _ in range(2)]
    ref = [x.clone() for x in pool]
    idx = [x.to(DEV) for x in (slot, column, token, head)]
    scatter_kv(*idx, ks.to(DEV), vs.to(DEV), *pool, block=16)
    scatter_kv_torch(*idx, ks.to(DEV), vs.to(DEV), *ref)
    assert all(torch.equal(a, b) for a, b in zip(pool, ref))
    if m:
        assert torch.equal(pool[0][slot[0] // page, column[0], slot[0] % page].cpu(), ks[token[0], head[0]].to(dt))


@pytest.mark.parametrize("page,rows", [(16, 5), (1, 3), (16, 0)])
def test_token_write_matches_reference(page, rows):
    """A decode step's tokens (fp32 rows, 5 kv heads in 3 groups of 2, one padding column) into a half-precision
    pool: the Triton kernel and its reference write the same pool; each head lands at its group's slot of its
    row, in its column, and nothing else of the pool changes."""
    gen, cpu = torch.Generator(device="cpu").manual_seed(5), "cpu"  # host draws (the default device may be CUDA)
    pages, hp, hkv, d = 12, 2, 5, 32
    head_group, head_column = torch.tensor([2, 0, 1, 0, 2]), torch.tensor([1, 0, 1, 1, 0])
    groups = 3
    place = torch.randperm(pages * page, generator=gen, device=cpu)[: rows * groups]  # distinct slots
    slots = place.reshape(rows, groups)
    k, v = (torch.randn(rows, hkv, d, generator=gen, device=cpu) for _ in range(2))
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    pool = [torch.randn(pages, hp, page, d, generator=gen, device=cpu).to(DEV, dt) for _ in range(2)]
    before, ref = [x.clone() for x in pool], [x.clone() for x in pool]
    args = [x.to(DEV) for x in (slots, head_group, head_column, k, v)]
    write_token_kv(*args, *pool)
    write_token_kv_torch(*args, *ref)
    assert all(torch.equal(a, b) for a, b in zip(pool, ref))
    written = torch.zeros(pages, hp, page, dtype=torch.bool, device=cpu)
    for r, h in itertools.product(range(rows), range(hkv)):
        s, c = int(slots[r, head_group[h]]), int(head_column[h])
        assert torch.equal(pool[0][s // page, c, s % page].cpu(), k[r, h].to(dt))
        assert torch.equal(pool[1][s // page, c, s % page].cpu(), v[r, h].to(dt))
        written[s // page, c, s % page] = True
    assert all(torch.equal(a.cpu()[~written], b.cpu()[~written]) for a, b in zip(pool, before))


def test_pseudo_request_pages_address_the_same_tokens():
    lengths = [[40, 16], [0, 33]]
    page, hp, hkv, G = 16, 2, 4, 2
    k, _, indptr, indices = whole_page_pool(lengths, page_size=page, heads_per_group=hp, head_dim=8)
    hg, hc = layer_map(hkv, G, hp)
    row_indptr, pages, last = pseudo_request_pages(indptr, indices, hg, hc, batch=2, page_size=page, heads_per_group=hp)
    view = pool_as_single_head_pages(k)
    for r in range(2):
        for h in range(hkv):
            row = r * hkv + h
            pp = pages[row_indptr[row] : row_indptr[row + 1]].long()
            n = lengths[r][int(hg[h])]
            got = view[pp, :, 0].reshape(-1, 8)[:n] if n else view[:0, :, 0].reshape(-1, 8)
            lo = int(indptr[r * G + int(hg[h])])
            assert torch.equal(got, gather_head_kv(k, indices[lo : lo + n], int(hc[h])))
            assert int(last[row]) == (n - (len(pp) - 1) * page if n else 0)
    with pytest.raises(ValueError, match="whole pages"):
        _, _, ip, ix = make_pool([[40, 7]], page_size=page, heads_per_group=hp, head_dim=8)
        pseudo_request_pages(ip, ix, hg, hc, batch=1, page_size=page, heads_per_group=hp)


def whole_page_pool(lengths, *, page_size, heads_per_group, head_dim):
    """Pool whose (request, group) slot lists are whole pages in order (one owner segment each)."""
    k, v, _, _ = make_pool(lengths, page_size=page_size, heads_per_group=heads_per_group, head_dim=head_dim)
    indptr, indices, next_page = [0], [], 1
    for row in lengths:
        for n in row:
            for j in range(math.ceil(n / page_size)):
                indices.extend(next_page * page_size + o for o in range(min(page_size, n - j * page_size)))
                next_page += 1
            indptr.append(len(indices))
    assert next_page <= k.shape[0]
    return k, v, torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32)


@pytest.mark.parametrize("page", [16, 1])
def test_pseudo_page_table_kernel_matches_torch(page):
    lengths = [[40, 16, 0], [0, 33, 5], [70, 1, 2]]
    hp, hkv, G = 2, 5, 3
    _, _, indptr, indices = whole_page_pool(lengths, page_size=page, heads_per_group=hp, head_dim=8)
    hg, hc = layer_map(hkv, G, hp)
    ref = pseudo_request_pages(indptr, indices, hg, hc, batch=3, page_size=page, heads_per_group=hp)
    row_indptr = torch.full((3 * hkv + 1,), -1, dtype=torch.int32)
    pages = torch.full((int(ref[1].numel()) + 7,), -1, dtype=torch.int32)
    last = torch.full((3 * hkv,), -1, dtype=torch.int32)
    max_pages = max(math.ceil(n / page) for row in lengths for n in row)
    build_pseudo_page_table(indptr, indices, hg, hc, row_indptr, pages, last, batch=3, page_size=page,
                            heads_per_group=hp, max_pages_per_row=max_pages, block=4)
    assert torch.equal(row_indptr, ref[0])
    assert torch.equal(pages[: ref[1].numel()], ref[1])
    assert bool((pages[ref[1].numel() :] == -1).all())
    assert torch.equal(last, ref[2])


@pytest.mark.parametrize("programs", [1, 3, 7, 64])
@pytest.mark.parametrize("gqa,hkv,page,splits,min_split,lengths", DECODE_CASES)
def test_balanced_decode_matches_reference(gqa, hkv, page, splits, min_split, lengths, programs):
    """Every program count: ranges that start or end inside, at, or past a sequence; programs with no tokens."""
    G, hp, D = len(splits), 2, 32
    k, v, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=D)
    hg, hc = layer_map(hkv, G, hp)
    q = torch.randn(len(lengths), gqa * hkv, D)
    out = balanced_paged_decode(q, k, v, *csr_ranges(indptr), indices, hg, hc, sm_scale=D**-0.5,
                                num_programs=programs, block_n=16)
    ref = paged_decode_torch(q, k, v, *csr_ranges(indptr), indices, hg, hc, sm_scale=D**-0.5)
    torch.testing.assert_close(out, ref, **F32_TOL)
    for r, row in enumerate(lengths):
        for h in range(hkv):
            assert bool((out[r, h * gqa : (h + 1) * gqa] == 0).all()) == (row[int(hg[h])] == 0)
