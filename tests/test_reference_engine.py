"""The CPU reference engine on a tiny random Llama: exactness at budget 1.0, compression below it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tangram_sgl.profile import ModelIdentity
from tangram_sgl.profile_builder import build_profile, uniform_profile
from tangram_sgl.replay.attention_hook import install
from tangram_sgl.replay.reference_engine import ReferenceEngine

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(model: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def rand_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


@pytest.mark.parametrize("grouping", ["cross_layer", "per_layer"])
def test_budget_one_equals_transformers_generate(grouping):
    model = tiny_llama()
    ref = copy.deepcopy(model)
    profile = uniform_profile(model.config, 1.0, page_size=4, heads_per_group=4 if grouping == "cross_layer" else 2,
                              grouping=grouping, sink_tokens=2, recent_window=8)
    eng = ReferenceEngine(model, profile, kv_pages=300)
    g = torch.Generator().manual_seed(1)
    history = rand_ids(g, 37)
    cached = 0
    for turn in range(3):
        gen = eng.generate(("conv", turn), history, 9)
        assert gen.output_ids == hf_greedy(ref, history, 9), f"turn {turn}"
        # the previous turn (prompt + answer, minus its last token whose K/V was never computed) is cached
        assert gen.prefix_hit == cached
        assert gen.footprint.kept_bytes == gen.footprint.full_bytes
        cached = len(history) + len(gen.output_ids) - 1
        history = history + gen.output_ids + rand_ids(g, 11)


def test_low_budget_keeps_far_less_and_decoded_tokens_all():
    model = tiny_llama()
    profile = uniform_profile(model.config, 0.25, page_size=4, heads_per_group=2, sink_tokens=2, recent_window=8)
    eng = ReferenceEngine(model, profile, kv_pages=300)
    g = torch.Generator().manual_seed(2)
    prompt = rand_ids(g, 200)
    gen = eng.generate("a", prompt, 6)
    fp = gen.footprint
    assert fp.tokens == 205
    # k = ceil(0.25*200) + 2 sink + 8 window = 60 prompt tokens per head, + 5 decoded tokens
    assert fp.kept_bytes == fp.full_bytes * 65 // 205
    assert fp.kept_bytes < 0.35 * fp.full_bytes
    # turn 2 reuses the compressed prefix
    gen2 = eng.generate("b", prompt + gen.output_ids + rand_ids(g, 30), 4)
    assert gen2.prefix_hit == 205
    assert gen2.footprint.kept_bytes < 0.5 * gen2.footprint.full_bytes


class _DenseMaskedStep:
    """Dense attention where new-segment queries see, per kv head, only the given prefix positions."""

    def __init__(self, prefix_len: int, visible_prefix: dict[tuple[int, int], torch.Tensor]):
        self.prefix_len, self.visible_prefix = prefix_len, visible_prefix

    def attend(self, layer, q, k, v, scaling):
        hq, n, _ = q.shape
        hkv = k.shape[0]
        gq = hq // hkv
        out = torch.empty(n, hq, q.shape[-1])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for h in range(hkv):
            mask = causal.clone()
            mask[self.prefix_len:, :self.prefix_len] = False
            mask[self.prefix_len:, self.visible_prefix[(layer, h)]] = True
            logits = torch.einsum("gtd,sd->gts", q[h * gq:(h + 1) * gq], k[h]) * scaling
            p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            out[:, h * gq:(h + 1) * gq] = torch.einsum("gts,sd->tgd", p, v[h])
        return out


def test_compressed_prefix_reads_each_heads_kept_tokens():
    """Turn-2 logits equal a dense forward in which each (layer, kv head) sees only its kept prefix tokens."""
    model = tiny_llama(3)
    dense = copy.deepcopy(model)
    ident = ModelIdentity.from_config(model.config)
    gen = torch.Generator().manual_seed(4)
    mean = (torch.rand(3, 2, generator=gen) * 0.4 + 0.05).tolist()  # non-uniform budgets
    profile = build_profile(ident, mean, [[0.0, 0.0]] * 3, scorer="snapkv", target_ratio=0.25, alpha=0.0,
                            page_size=4, heads_per_group=2, sink_tokens=2, recent_window=6)
    eng = ReferenceEngine(model, profile, kv_pages=300)
    turn1 = rand_ids(gen, 90)
    eng.generate("t1", turn1, 1)  # one token: nothing decoded is cached, the prefix is turn 1's segment
    eng.kv.admit("probe", turn1)
    visible = {}
    for layer in range(3):
        for h in range(2):
            _, _, pos = eng.kv.gather("probe", layer, h)
            visible[(layer, h)] = pos
    eng.kv.abort("probe")
    kept_counts = {len(p) for p in visible.values()}
    assert len(kept_counts) > 1 and max(kept_counts) < 90  # non-uniform, compressed
    assert any(not torch.equal(visible[(l, 0)], visible[(l, 1)]) for l in range(3))  # heads keep their own

    full = turn1 + rand_ids(gen, 20)
    eng_logits = _engine_last_logits(eng, full)
    install(dense)
    with torch.no_grad():
        out = dense(input_ids=torch.tensor([full]), position_ids=torch.arange(len(full))[None], use_cache=False,
                    tangram_step=_DenseMaskedStep(90, visible))
    torch.testing.assert_close(eng_logits, out.logits[0, -1], rtol=1e-4, atol=1e-4)


def _engine_last_logits(eng: ReferenceEngine, ids: list[int]) -> torch.Tensor:
    """Logits of the engine's prefill of ``ids`` (prefix from the cache), via the engine's own steps."""
    from tangram_sgl.replay.reference_engine import _SegmentStep

    m = eng.kv.admit("t2", ids, max_prefix_len=len(ids) - 1)
    assert m.length == 90
    eng.kv.reserve("t2", ids[90:], decode_tokens=0)
    with torch.no_grad():
        logits = eng._forward(ids[90:], 90, _SegmentStep(eng, "t2", 90, len(ids) - 90))
    eng.kv.commit_segment("t2")
    eng.kv.finish("t2")
    return logits


def test_pool_exhaustion_is_a_clear_error():
    from tangram_sgl.pool.reservation import AdmissionError

    model = tiny_llama()
    profile = uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2)
    eng = ReferenceEngine(model, profile, kv_pages=20)
    with pytest.raises(AdmissionError, match="needs"):
        eng.generate("big", list(range(100)), 4)
    assert eng.kv.free_pages() == 19 and not eng.kv.requests  # nothing leaked


@pytest.mark.parametrize("feature", ["softcap", "sliding_window"])
def test_reference_attention_refuses_what_it_does_not_implement(feature):
    from types import SimpleNamespace

    from tangram_sgl.replay.attention_hook import _tangram_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match=feature):
        _tangram_attention(SimpleNamespace(layer_idx=0), q, q, q, None, tangram_step=object(), **{feature: 16})
