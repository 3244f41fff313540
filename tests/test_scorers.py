"""Scorers: shapes, GQA aggregation, RoPE averaging, and what each one ranks first."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tangram_sgl.scorers import SCORERS, SegmentTensors, averaged_rope_matrix, make_scorer


def _segment(hq: int = 6, hkv: int = 2, n: int = 40, w: int = 8, d: int = 16, seed: int = 0) -> SegmentTensors:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, w, d, generator=g)
    return SegmentTensors(q_obs=q, q_obs_pre=q, k=torch.randn(hkv, n, d, generator=g),
                          v=torch.randn(hkv, n, d, generator=g), scale=d**-0.5, start=10,
                          inv_freq=1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_scorer_returns_one_finite_row_per_kv_head(name):
    s = make_scorer(name).score(_segment())
    assert s.shape == (2, 40) and s.dtype == torch.float32 and torch.isfinite(s).all()
    assert make_scorer(name).default_scope in ("layer", "global")


def test_unknown_scorer_is_rejected():
    with pytest.raises(ValueError, match="unknown scorer"):
        make_scorer("h2o")


def test_scorer_specs_set_parameters_and_reject_bad_ones():
    assert make_scorer("snapkv").pool_kernel == 7 and make_scorer("snapkv:pool_kernel=31").pool_kernel == 31
    assert make_scorer("expected_attention:n_future=64,epsilon=0.5").epsilon == 0.5
    for bad, why in (("snapkv:pool=3", "param in"), ("snapkv:pool_kernel", "param in"),
                     ("snapkv:pool_kernel=4", "positive odd"), ("snapkv:pool_kernel=x", "needs a number")):
        with pytest.raises(ValueError, match=why):
            make_scorer(bad)


def test_a_wider_snapkv_pool_spreads_each_peak_further():
    seg = _segment(n=64)
    narrow, wide = make_scorer("snapkv").score(seg), make_scorer("snapkv:pool_kernel=31").score(seg)
    assert (wide >= narrow).all() and (wide > narrow).any()
    raw = make_scorer("snapkv:pool_kernel=1").score(seg)
    peak = int(raw[0, :40].argmax())  # away from the window's own high scores
    assert (wide[0, max(0, peak - 15):peak + 16] >= raw[0, peak]).all()
    assert not (narrow[0, max(0, peak - 15):peak + 16] >= raw[0, peak]).all()


def test_averaged_rope_over_one_position_is_that_rotation():
    d, pos = 16, 37
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    x = torch.randn(1, 1, 1, d)
    ang = pos * inv_freq
    emb = torch.cat([ang, ang])
    rotated, _ = apply_rotary_pos_emb(x, x, emb.cos()[None, None], emb.sin()[None, None])
    r = averaged_rope_matrix(inv_freq, pos, 1)
    assert torch.allclose(x[0, 0, 0] @ r.T, rotated[0, 0, 0], atol=1e-5)
    # averaging over many positions shrinks the fast-rotating pairs towards zero, keeps the slow ones
    r_many = averaged_rope_matrix(inv_freq, 0, 512)
    assert r_many[0, 0].abs() < 0.05 and r_many[d // 2 - 1, d // 2 - 1] > 0.9


def test_expected_attention_prefers_keys_aligned_with_future_queries():
    seg = _segment(hq=2, hkv=1, n=30)
    mu = torch.zeros(16)
    mu[-1] = 3.0  # the slowest RoPE pair barely rotates, so alignment survives the averaging
    q = mu + 0.01 * torch.randn(2, 8, 16)
    k = 0.01 * torch.randn(1, 30, 16)
    k[0, 5] = mu
    seg = SegmentTensors(q_obs=q, q_obs_pre=q, k=k, v=torch.ones(1, 30, 16), scale=0.25, start=0,
                         inv_freq=seg.inv_freq)
    s = make_scorer("expected_attention").score(seg)
    assert int(s[0].argmax()) == 5


def test_keydiff_ranks_the_odd_key_first():
    k = torch.ones(1, 20, 8) + 0.01 * torch.randn(1, 20, 8)
    k[0, 7] = -1.0
    seg = SegmentTensors(q_obs=torch.zeros(1, 4, 8), q_obs_pre=torch.zeros(1, 4, 8), k=k, v=k, scale=1.0,
                         start=0, inv_freq=torch.ones(4))
    s = make_scorer("keydiff").score(seg)
    assert int(s[0].argmax()) == 7


def test_snapkv_averages_the_query_group():
    seg = _segment(hq=4, hkv=2)
    full = make_scorer("snapkv").score(seg)
    # kv head 1 only depends on query heads 2 and 3
    seg2 = SegmentTensors(q_obs=torch.cat([torch.zeros_like(seg.q_obs[:2]), seg.q_obs[2:]]),
                          q_obs_pre=seg.q_obs_pre, k=seg.k, v=seg.v, scale=seg.scale, start=seg.start,
                          inv_freq=seg.inv_freq)
    assert torch.allclose(make_scorer("snapkv").score(seg2)[1], full[1])
    assert not torch.allclose(make_scorer("snapkv").score(seg2)[0], full[0])


def test_streaming_is_recency_and_equal_across_heads():
    s = make_scorer("streaming").score(_segment())
    assert torch.equal(s[0], s[1]) and bool((s[0][1:] > s[0][:-1]).all())


def test_a_later_window_sees_the_whole_segment():
    seg = _segment(n=40, w=8)
    later = SegmentTensors(q_obs=seg.q_obs, q_obs_pre=seg.q_obs_pre, k=seg.k, v=seg.v, scale=seg.scale,
                           start=seg.start, inv_freq=seg.inv_freq, query_end=seg.start + 200)
    assert seg.window_in_segment and not later.window_in_segment and later.window_end == 210
    raw = make_scorer("snapkv:pool_kernel=1")
    # inside the segment the window's first query cannot see the last keys; after it every query sees them all
    kk = seg.k.repeat_interleave(3, dim=0)
    want = (torch.einsum("hwd,hnd->hwn", seg.q_obs, kk) * seg.scale).softmax(-1).mean(1).view(2, 3, 40).mean(1)
    assert torch.allclose(raw.score(later), want, atol=1e-6) and not torch.allclose(raw.score(seg), want, atol=1e-3)
    # expected_attention averages RoPE over the positions after the window, wherever it lies
    ea = make_scorer("expected_attention")
    assert not torch.allclose(ea.score(later), ea.score(seg))
    with pytest.raises(ValueError, match="inside the segment"):
        SegmentTensors(q_obs=seg.q_obs, q_obs_pre=seg.q_obs_pre, k=seg.k, v=seg.v, scale=seg.scale, start=seg.start,
                       inv_freq=seg.inv_freq, query_end=seg.start + 39)
