"""FlashInfer extend path (``kernels/flashinfer_extend.py``): index construction on the CPU, the two-pass
plumbing against a torch stand-in with FlashInfer's documented semantics, and on a GPU the real FlashInfer
0.6.15 against the torch reference (``TANGRAM_KERNEL_TEST_DEVICE=cuda``)."""

import os

DEV = os.environ.get("TANGRAM_KERNEL_TEST_DEVICE", "cpu")
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads: later modules run Triton kernels on CPU

import itertools
import sys
import types

import numpy as np
import pytest
import torch
from tangram_sgl.kernels.decode import gather_head_kv
from tangram_sgl.kernels.extend import extend_attention_torch
from tangram_sgl.kernels.flashinfer_extend import FlashInferExtend, pseudo_request_order, pseudo_token_indices
from test_kernels import layer_map, make_pool

# (gqa, hkv, page, new tokens per row, prefix lengths[r][g]): partial pages (two segments per list), empty
# groups, a row with no prefix beside rows with one, page size 1, gqa 1/3/8
CASES = [
    (4, 4, 16, [5, 1, 20], [[40, 7], [3, 0], [0, 16]]),
    (1, 2, 1, [17, 3], [[8, 3], [9, 1]]),
    (3, 2, 16, [11, 6], [[33, 0], [16, 17]]),
    (8, 2, 16, [4, 13], [[0, 0], [5, 2]]),
]


def test_pseudo_token_indices_address_each_heads_list():
    lengths, page, hp, hkv = [[40, 7], [0, 33]], 16, 2, 4
    k, _, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=8)
    k, indices = k.cpu(), indices.cpu()
    hg, hc = layer_map(hkv, 2, hp)
    row_ptr, pseudo = pseudo_token_indices(indptr.numpy(), indices, hg.tolist(), hc.tolist(), batch=2,
                                           page_size=page, heads_per_group=hp)
    flat = k.view(-1, 8)  # the page-size-1 view: one token of one column per row
    for r, h in itertools.product(range(2), range(hkv)):
        g, n = int(hg[h]), lengths[r][int(hg[h])]
        lo = int(indptr[r * 2 + g])
        got = flat[pseudo[row_ptr[r * hkv + h]:row_ptr[r * hkv + h + 1]].long()]
        assert torch.equal(got, gather_head_kv(k, indices[lo:lo + n], int(hc[h])))
    empty = pseudo_token_indices(np.zeros(5, dtype=np.int32), indices[:0], hg.tolist(), hc.tolist(), batch=2,
                                 page_size=page, heads_per_group=hp)
    assert empty[0].tolist() == [0] * 9 and empty[1].numel() == 0


def test_pseudo_request_order_is_request_head_token():
    fwd, inv, qo = pseudo_request_order([0, 2, 5], 2)
    assert fwd.tolist() == [0, 2, 1, 3, 4, 6, 8, 5, 7, 9]  # (r0,h0: t0 t1) (r0,h1) (r1,h0: t2 t3 t4) (r1,h1)
    assert qo.tolist() == [0, 2, 4, 7, 10]
    assert np.array_equal(fwd[inv], np.arange(10))


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


class _Paged(_Ragged):
    """Torch stand-in: FlashInfer's paged prefill (kv_len from indptr and last_page_len, as get_seq_lens)."""

    def plan(self, qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, *, causal, sm_scale, q_data_type,
             kv_data_type, max_token_per_sequence):
        assert qo_indptr.device.type == "cpu" and kv_indptr.device.type == "cpu"  # plan() reads them on the host
        _check_max_qo(qo_indptr, max_token_per_sequence)
        self.qo, self.ptr, self.indices, self.last, self.ps = qo_indptr, kv_indptr, indices, last, page_size
        self.hq, self.hkv, self.causal, self.scale = hq, hkv, causal, sm_scale

    def run(self, q, kv, return_lse=False):
        k_pages, v_pages = kv
        out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device=q.device)
        for r in range(len(self.qo) - 1):
            pages = self.indices[int(self.ptr[r]):int(self.ptr[r + 1])].long()
            n = max(len(pages) - 1, 0) * self.ps + int(self.last[r])
            k = k_pages[pages].reshape(-1, self.hkv, k_pages.shape[-1])[:n, 0]
            v = v_pages[pages].reshape(-1, self.hkv, v_pages.shape[-1])[:n, 0]
            qs = slice(int(self.qo[r]), int(self.qo[r + 1]))
            out[qs], lse[qs] = _attend(q[qs], k, v, self.causal, self.scale)
        return (out, lse) if return_lse else out


def _merge_state(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    return v_a * torch.exp(s_a - s)[..., None] + v_b * torch.exp(s_b - s)[..., None], s


def flashinfer_standin() -> types.SimpleNamespace:
    """A ``flashinfer`` module of torch stand-ins for what ``kernels/flashinfer_extend.py`` calls."""
    return types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_Ragged,
                                 BatchPrefillWithPagedKVCacheWrapper=_Paged, merge_state=_merge_state)


def _run_case(gqa, hkv, page, n_new, lengths, dev, layers=2):
    G, hp, D = len(lengths[0]), 2, 64  # FlashInfer's prefill kernels: head dim 64/128/256
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    k, v, indptr, indices = make_pool(lengths, page_size=page, heads_per_group=hp, head_dim=D, seed=3)
    k, v, indices = k.to(dev, dtype), v.to(dev, dtype), indices.to(dev)
    offsets = [0, *itertools.accumulate(n_new)]
    fi = FlashInferExtend(dev, workspace_bytes=1 << 20)
    step = fi.step(offsets, indptr.numpy(), indices, num_kv_heads=hkv, page_size=page, heads_per_group=hp)
    gen = torch.Generator(device="cpu").manual_seed(4)
    for layer in range(layers):  # layers map their heads to other (group, column)s: one prefix plan each
        hg, hc = layer_map(hkv, G, hp)
        hg, hc = hg.roll(layer), hc.roll(layer)
        q = torch.randn(offsets[-1], gqa * hkv, D, generator=gen).to(dev, dtype)
        kn, vn = (torch.randn(offsets[-1], hkv, D, generator=gen).to(dev, dtype) for _ in range(2))
        out = step.attend(q, kn, vn, k, v, hg.tolist(), hc.tolist(), 0.3)
        ref = extend_attention_torch(q.float(), kn.float(), vn.float(), torch.tensor(offsets, dtype=torch.int32,
                                     device=dev), k.float(), v.float(), indptr.to(dev), indices, hg.to(dev),
                                     hc.to(dev), sm_scale=0.3)
        tol = {"atol": 2e-5, "rtol": 1e-4} if dev == "cpu" else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(out.float(), ref, **tol)


@pytest.mark.parametrize("gqa,hkv,page,n_new,lengths", CASES)
def test_two_pass_plumbing_matches_reference(monkeypatch, gqa, hkv, page, n_new, lengths):
    """Permutations, page-size-1 view, per-layer plans and the merge, with FlashInfer replaced by torch."""
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    _run_case(gqa, hkv, page, n_new, lengths, "cpu")


@pytest.mark.skipif(DEV != "cuda", reason="FlashInfer runs on the GPU (TANGRAM_KERNEL_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("gqa,hkv,page,n_new,lengths", CASES + [(4, 8, 16, [300, 64], [[900, 40, 0, 333],
                                                                                        [17, 1024, 5, 64]])])
def test_flashinfer_extend_matches_reference(gqa, hkv, page, n_new, lengths):
    _run_case(gqa, hkv, page, n_new, lengths, "cuda", layers=3)


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
        FlashInferExtend("cpu")
