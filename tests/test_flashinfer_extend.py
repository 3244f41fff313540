"""FlashInfer extend path (``kernels/flashinfer_extend.py``): index construction on the CPU, the two-pass
plumbing against a torch stand-in with FlashInfer's documented semantics, and on a GPU the real FlashInfer
0.6.15 against the torch reference (``TANGRAM_KERNEL_TEST_DEVICE=cuda``)."""

import os

DEV = os.environ.get("TANGRAM_KERNEL_TEST_DEVICE", "cpu")  # on CPU, Triton runs interpreted (tests/conftest.py)

import itertools
import sys
import types

import numpy as np
import pytest
import torch
from tangram_sgl.kernels.decode import gather_head_kv
from tangram_sgl.kernels.extend import extend_attention_torch
from tangram_sgl.kernels.flashinfer_extend import (
    FlashInferExtend,
    prefix_chunking,
    pseudo_lists,
    pseudo_request_order,
)
from tangram_sgl.kernels.pseudo_pages import write_pseudo_pages, write_pseudo_pages_torch
from test_kernels import layer_map, make_pool

# (gqa, hkv, page, new tokens per row, prefix lengths[r][g]): partial pages (two segments per list), empty
# groups, a row with no prefix beside rows with one, page size 1, gqa 1/3/8
CASES = [
    (4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]]),
    (1, 2, 1, [17, 3], [[8, 3], [9, 1]]),
    (3, 2, 16, [11, 6], [[33, 0], [16, 17]]),
    (8, 2, 16, [4, 13], [[0, 0], [5, 2]]),
]


def _layer_pages(kv_indptr, indices, hg, hc, write=write_pseudo_pages_torch, **kw):
    """(indptr [L, P+1], the pseudo-page ids of each layer, on the host) of a step, through ``pseudo_lists``
    and ``write`` on ``indices``' device."""
    src, indptr, col = pseudo_lists(kv_indptr, hg, hc, **kw)
    dev, pages = indices.device, []
    for li in range(hg.shape[0]):
        out = torch.full((int(indptr[li, -1]) + 3,), -1, dtype=torch.int32, device=dev)  # room past the end
        args = [torch.from_numpy(x[li]).to(dev) for x in (src, indptr[:, :-1], np.diff(indptr, axis=1), col)]
        extra = {"total": int(indptr[li, -1])} if write is write_pseudo_pages_torch else {}
        write(indices, *args, out, page_size=16, heads_per_group=2, **extra)
        out = out.cpu()
        assert out[int(indptr[li, -1]):].tolist() == [-1] * 3  # stays untouched
        pages.append(out[:int(indptr[li, -1])])
    return indptr, pages


def test_pseudo_lists_address_each_heads_list():
    lengths, page, hp, hkv = [[40, 7], [0, 33]], 16, 2, 4
    k, _, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=8)
    k, indices = k.cpu(), indices.cpu()
    hg, hc = (np.stack([x.numpy(), np.roll(x.numpy(), 1)]) for x in layer_map(hkv, 2, hp))  # two layers
    row_ptr, pages = _layer_pages(indptr.numpy(), indices, hg, hc, batch=2)
    flat = k.view(-1, 8)  # the page-size-1 view: one token of one column per row
    for li, r, h in itertools.product(range(2), range(2), range(hkv)):
        g, n = int(hg[li, h]), lengths[r][int(hg[li, h])]
        lo = int(indptr[r * 2 + g])
        got = flat[pages[li][row_ptr[li, r * hkv + h] - row_ptr[li, 0]:row_ptr[li, r * hkv + h + 1]].long()]
        assert torch.equal(got, gather_head_kv(k, indices[lo:lo + n], int(hc[li, h])))
    empty_ptr, _ = _layer_pages(np.zeros(5, dtype=np.int64), indices[:0], hg, hc, batch=2)
    assert empty_ptr.tolist() == [[0] * 9] * 2
    # in pieces of 16 slots: each list's pieces, in order, are the list; a piece past its end is empty
    ptr3, pages3 = _layer_pages(indptr.numpy(), indices, hg, hc, batch=2, chunk=16, chunks=3)
    for li, row in itertools.product(range(2), range(2 * hkv)):
        pieces = [pages3[li][ptr3[li, row * 3 + j]:ptr3[li, row * 3 + j + 1]] for j in range(3)]
        assert all(p.numel() <= 16 for p in pieces)
        assert torch.equal(torch.cat(pieces), pages[li][row_ptr[li, row]:row_ptr[li, row + 1]])
    assert np.diff(ptr3[0]).reshape(2 * hkv, 3)[0].tolist() == [16, 16, 8]  # r0, head 0: group 0's 40 slots


@pytest.mark.parametrize("chunks", [1, 3])
def test_pseudo_pages_kernel_matches_reference(chunks):
    """The Triton kernel (interpreted on CPU, compiled on CUDA) against its torch reference, pieces of every
    length up to 40."""
    lengths = [[40, 7, 0], [1, 33, 16]]
    _, _, indptr, indices = make_pool(lengths, page_size=16, heads_per_group=2, head_dim=8)
    hg = np.array([[0, 1, 2, 0], [2, 2, 1, 0]])
    hc = np.array([[0, 0, 0, 1], [0, 1, 1, 1]])
    kw = {"batch": 2, "chunk": 16, "chunks": chunks}
    want = _layer_pages(indptr.numpy(), indices.cpu(), hg, hc, **kw)
    got = _layer_pages(indptr.numpy(), indices.to(DEV), hg, hc, write=write_pseudo_pages, **kw)
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))


def test_pseudo_request_order_is_request_head_chunk_token():
    fwd, inv, qo = pseudo_request_order([0, 2, 5], 2)
    assert fwd.tolist() == [0, 2, 1, 3, 4, 6, 8, 5, 7, 9]  # (r0,h0: t0 t1) (r0,h1) (r1,h0: t2 t3 t4) (r1,h1)
    assert qo.tolist() == [0, 2, 4, 7, 10]
    assert np.array_equal(fwd[inv[:, 0]], np.arange(10))
    fwd, inv, qo = pseudo_request_order([0, 2, 5], 2, chunks=2)
    assert fwd.tolist()[:8] == [0, 2, 0, 2, 1, 3, 1, 3]  # (r0,h0,j0) (r0,h0,j1) (r0,h1,j0) (r0,h1,j1)
    assert qo.tolist() == [0, 2, 4, 6, 8, 11, 14, 17, 20]
    assert inv.shape == (10, 2) and all(np.array_equal(fwd[inv[:, j]], np.arange(10)) for j in range(2))


def test_prefix_chunking_spreads_few_long_prefixes_over_the_gpu():
    gq, slots = 4, 264
    # 128 questions of 32 tokens over 4k prefixes (8 kv heads): 1024 CTAs already, one piece per list
    assert prefix_chunking(np.full(1024, 4096), np.full(1024, 32), gq, cta_slots=slots, min_chunk=512) == (4096, 1)
    # one question over a 64k prefix: 8 CTAs would each stream 64k slots; cut so all slots work
    chunk, chunks = prefix_chunking(np.full(8, 65536), np.full(8, 32), gq, cta_slots=slots, min_chunk=512)
    assert chunks * chunk >= 65536 and 8 * chunks >= slots // 2 and chunk >= 512
    # never below min_chunk, and one piece when nothing is long
    assert prefix_chunking(np.array([600, 0]), np.array([4, 4]), gq, cta_slots=slots, min_chunk=512) == (300, 2)
    assert prefix_chunking(np.array([500, 3]), np.array([4, 4]), gq, cta_slots=slots, min_chunk=512) == (500, 1)


def _attend(q, k, v, causal, scale):
    """[n, gq, d] queries over [m, d] keys -> (out [n, gq, d], natural-log lse [n, gq]); empty kv -> 0, -inf."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), device=q.device)
    s = torch.einsum("ngd,md->ngm", q.float(), k.float()) * scale
    if causal:
        n, m, dev = q.shape[0], k.shape[0], q.device
        future = torch.arange(m, device=dev)[None, None, :] > torch.arange(n, device=dev)[:, None, None] + (m - n)
        s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("ngm,md->ngd", torch.softmax(s, -1), v.float()).to(q.dtype), lse


class _Ragged:
    """Torch stand-in: FlashInfer's ragged prefill (GQA, causal aligned bottom-right, natural-log lse)."""

    def __init__(self, workspace, layout):
        assert layout == "NHD"

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, *, causal, sm_scale, q_data_type, kv_data_type):
        self.qo, self.kv, self.hq, self.hkv, self.causal, self.scale = qo_indptr, kv_indptr, hq, hkv, causal, sm_scale

    def run(self, q, k, v, return_lse=False):
        out, lse, gq = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device), self.hq // self.hkv
        for r in range(len(self.qo) - 1):
            qs, ks = slice(int(self.qo[r]), int(self.qo[r + 1])), slice(int(self.kv[r]), int(self.kv[r + 1]))
            for h in range(self.hkv):
                hs = slice(h * gq, (h + 1) * gq)
                out[qs, hs], lse[qs, hs] = _attend(q[qs, hs], k[ks, h], v[ks, h], self.causal, self.scale)
        return (out, lse) if return_lse else out


def _check_max_qo(qo_indptr: torch.Tensor, given: int) -> None:
    """FlashInfer trusts ``max_token_per_sequence`` instead of computing it: it must be the exact maximum."""
    assert given == int((qo_indptr[1:] - qo_indptr[:-1]).max()), (given, qo_indptr)


def _seq_lens(indptr: torch.Tensor, last: torch.Tensor, page_size: int) -> torch.Tensor:
    """FlashInfer's get_seq_lens: pages before the last are full."""
    return (indptr[1:] - indptr[:-1] - 1).clamp(min=0) * page_size + last


class _Paged(_Ragged):
    """Torch stand-in: FlashInfer 0.6.15's paged prefill outside CUDA-graph mode (plan() keeps device copies of
    its index arguments as ``_paged_kv_*_buf``, run() reads them; kv_len from indptr and last_page_len). The fa2
    kernel reads each kv length at run time; with split-KV it lays partial outputs out by the run-time length's
    chunk count and merges by the planned one, so a plan holds for other lengths only with split-KV disabled
    (then while each is at most the planned one, the indices' room): checked at every run()."""

    def __init__(self, workspace, layout, backend="auto"):
        assert layout == "NHD" and backend == "fa2"

    def plan(self, qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, *, causal, sm_scale, q_data_type,
             kv_data_type, max_token_per_sequence, disable_split_kv=False):
        assert all(x.device.type == "cpu" for x in (qo_indptr, kv_indptr, last))  # plan() reads them on the host
        _check_max_qo(qo_indptr, max_token_per_sequence)
        dev = indices.device
        self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr.to(dev), kv_indptr.to(dev)
        self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = indices.to(dev), last.to(dev)
        self.planned, self.split = _seq_lens(kv_indptr, last, page_size), not disable_split_kv
        self.hq, self.hkv, self.ps, self.causal, self.scale = hq, hkv, page_size, causal, sm_scale

    def run(self, q, kv, return_lse=False):
        k_pages, v_pages = kv
        ptr, last = self._paged_kv_indptr_buf.cpu(), self._paged_kv_last_page_len_buf.cpu()
        lens = _seq_lens(ptr, last, self.ps)
        assert bool((lens <= self.planned).all()), "a run-time kv length exceeds the one the plan was made for"
        assert not self.split or torch.equal(lens, self.planned), "split-KV plan run on other kv lengths"
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
        for r in range(len(ptr) - 1):
            pages = self._paged_kv_indices_buf[int(ptr[r]):int(ptr[r + 1])].long()
            k = k_pages[pages].reshape(-1, self.hkv, k_pages.shape[-1])[:int(lens[r]), 0]
            v = v_pages[pages].reshape(-1, self.hkv, v_pages.shape[-1])[:int(lens[r]), 0]
            qs = slice(int(self._qo_indptr_buf[r]), int(self._qo_indptr_buf[r + 1]))
            out[qs], lse[qs] = _attend(q[qs], k, v, self.causal, self.scale)
        return (out, lse) if return_lse else out


def _merge_state(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    return v_a * torch.exp(s_a - s)[..., None] + v_b * torch.exp(s_b - s)[..., None], s


def _merge_states(v, s):
    """[N, states, H, D], [N, states, H] -> the merged (v, s); an empty state has lse -inf."""
    total = torch.logsumexp(s, dim=1)
    return (v * torch.exp(s - total[:, None])[..., None]).sum(1), total


def flashinfer_standin() -> types.SimpleNamespace:
    """A ``flashinfer`` module of torch stand-ins for what ``kernels/flashinfer_extend.py`` calls."""
    return types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_Ragged,
                                 BatchPrefillWithPagedKVCacheWrapper=_Paged, merge_state=_merge_state,
                                 merge_states=_merge_states)


def layer_maps(hkv: int, num_groups: int, hp: int, layers: int, seed: int = 5):
    """[L, Hkv] group, column and order arrays: layer l rolls the round-robin map by l (other groups per layer);
    orders are random permutations (the launch order is a budget sort; any order must give the same result)."""
    hg, hc = (x.numpy() for x in layer_map(hkv, num_groups, hp))
    rng = np.random.default_rng(seed)
    return (np.stack([np.roll(hg, li) for li in range(layers)]), np.stack([np.roll(hc, li) for li in range(layers)]),
            np.stack([rng.permutation(hkv) for _ in range(layers)]))


def _run_case(gqa, hkv, page, n_new, lengths, dev, layers=2, planned_lens=None, **chunking):
    G, hp, D = len(lengths[0]), 2, 64  # FlashInfer's prefill kernels: head dim 64/128/256
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    k, v, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=D, seed=3)
    k, v, indices = k.to(dev, dtype), v.to(dev, dtype), indices.to(dev)
    offsets = [0, *itertools.accumulate(n_new)]
    hg, hc, order = layer_maps(hkv, G, hp, layers)
    fi = FlashInferExtend(dev, hg, hc, order, page_size=page, heads_per_group=hp, workspace_bytes=32 << 20,
                          **chunking)
    step = fi.step(offsets, indptr.numpy(), indices)
    if planned_lens is not None:
        step.planned_lens = planned_lens(step)
    gen = torch.Generator(device="cpu").manual_seed(4)
    for layer in range(layers):  # one prefix plan for all layers, though their lengths differ
        q = torch.randn(offsets[-1], gqa * hkv, D, generator=gen).to(dev, dtype)
        kn, vn = (torch.randn(offsets[-1], hkv, D, generator=gen).to(dev, dtype) for _ in range(2))
        out = step.attend(layer, q, kn, vn, k, v, 0.3)
        ref = extend_attention_torch(q.float(), kn.float(), vn.float(), torch.tensor(offsets, dtype=torch.int32,
                                     device=dev), k.float(), v.float(), indptr.to(dev), indices,
                                     torch.from_numpy(hg[layer]).to(dev), torch.from_numpy(hc[layer]).to(dev),
                                     sm_scale=0.3)
        tol = {"atol": 2e-5, "rtol": 1e-4} if dev == "cpu" else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(out.float(), ref, **tol)


# one piece per list (a CPU device counts one CTA slot), and lists cut into pieces of 4 slots
CHUNKINGS = [{}, {"cta_slots": 10_000, "min_chunk": 4}]


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=["whole", "pieces"])
@pytest.mark.parametrize("gqa,hkv,page,n_new,lengths", CASES)
def test_two_pass_plumbing_matches_reference(monkeypatch, gqa, hkv, page, n_new, lengths, chunking):
    """Head orders, page-size-1 view, the per-step prefix plan with per-layer indices, the prefix pieces and
    the merges, with FlashInfer replaced by torch."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    _run_case(gqa, hkv, page, n_new, lengths, "cpu", layers=3, **chunking)


def test_a_split_kv_plan_is_not_reused_across_layers(monkeypatch):
    """Why the plan disables FlashInfer's split-KV: its partial outputs follow run-time lengths (H200, session
    10), so a split plan holds only for the lengths it was made for."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    plan = _Paged.plan
    monkeypatch.setattr(_Paged, "plan", lambda self, *a, disable_split_kv, **k: plan(self, *a, **k))
    with pytest.raises(AssertionError, match="split-KV plan run on other kv lengths"):
        _run_case(4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]], "cpu", layers=3)


def test_prefix_pass_is_planned_once_per_step(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    planned = []
    plan = _Paged.plan
    monkeypatch.setattr(_Paged, "plan", lambda self, *a, **k: (planned.append(a), plan(self, *a, **k)))
    _run_case(4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]], "cpu", layers=4)
    assert len(planned) == 1


def test_a_plan_for_one_layers_lengths_does_not_cover_the_others(monkeypatch):
    """Why the plan takes each pseudo-request's largest length over the layers: planned with the first
    layer's lengths only, a later layer runs past them (the stand-in's check, FlashInfer's validity rule)."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())

    def first_layer(step):
        return np.diff(step.kv_indptr).reshape(step.batch, -1)[:, step.fi.rank_group[0]].reshape(-1)

    with pytest.raises(AssertionError, match="exceeds the one the plan was made for"):
        _run_case(4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]], "cpu", layers=3, planned_lens=first_layer)


@pytest.mark.skipif(DEV != "cuda", reason="FlashInfer runs on the GPU (TANGRAM_KERNEL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("gqa,hkv,page,n_new,lengths", CASES + [(4, 8, 16, [300, 64], [[900, 40, 0, 333],
                                                                                        [17, 1024, 5, 64]])])
@pytest.mark.parametrize("chunking", CHUNKINGS[:1] + [{"min_chunk": 16}], ids=["default", "pieces16"])
def test_flashinfer_extend_matches_reference(gqa, hkv, page, n_new, lengths, chunking):
    _run_case(gqa, hkv, page, n_new, lengths, "cuda", layers=4, **chunking)


def test_a_flashinfer_keeping_other_buffers_is_refused(monkeypatch):
    """The per-layer writes must reach what run() reads: a wrapper without FlashInfer 0.6.15's buffers fails."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    plan = _Paged.plan
    monkeypatch.setattr(_Paged, "plan", lambda self, *a, **k: (plan(self, *a, **k), delattr(self, "_paged_kv_indptr_buf")))
    with pytest.raises(RuntimeError, match="cannot reuse one plan across layers"):
        _run_case(4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]], "cpu")


def test_no_prefix_step_is_the_chunk_pass(monkeypatch):
    """Every row at position 0: no prefix plan (FlashInfer's paged pass never sees an all-empty batch)."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    planned = []
    monkeypatch.setattr(_Paged, "plan", lambda self, *a, **k: planned.append(a))
    _run_case(4, 2, 16, [5, 9], [[0, 0], [0, 0]], "cpu")
    assert planned == []


def test_missing_flashinfer_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(RuntimeError, match="needs the flashinfer package"):
        FlashInferExtend("cpu", *layer_maps(2, 2, 2, 1), page_size=16, heads_per_group=2)



@pytest.mark.parametrize("page", [1, 16])
def test_warm_up_runs_every_flashinfer_kernel_of_a_step(monkeypatch, page):
    """The server's start compiles FlashInfer's JIT kernels (else the first long prompt's forward does, for
    minutes, with the scheduler stuck): both passes and both merges, in the model's head dim and dtypes."""
    calls = []

    def spied(name, fn):
        def call(*a, **k):
            tensor = a[1] if name in ("chunk", "prefix") else a[0]  # run(self, q, ...) / merge(v, ...)
            calls.append((name, tensor.dtype, tensor.shape[-1]))
            return fn(*a, **k)
        return call

    monkeypatch.setattr(_Ragged, "run", spied("chunk", _Ragged.run))
    monkeypatch.setattr(_Paged, "run", spied("prefix", _Paged.run))
    fake = flashinfer_standin()
    fake.merge_state, fake.merge_states = spied("merge_state", _merge_state), spied("merge_states", _merge_states)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    fi = FlashInferExtend("cpu", *layer_maps(4, 2, 2, 3), page_size=page, heads_per_group=2)
    fi.warm_up(8, 64, torch.float64, torch.float64)
    assert sorted({c[0] for c in calls}) == ["chunk", "merge_state", "merge_states", "prefix"]
    assert {(dtype, d) for _, dtype, d in calls} == {(torch.float64, 64)}
