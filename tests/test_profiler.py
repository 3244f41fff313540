"""The offline profiler on a tiny random Llama: budgets, groups, local heads, determinism, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tangram_sgl.profile import ModelIdentity, load_profile, profile_from_dict, validate_for_model
from tangram_sgl.profiler.calibration import TASKS, calibration_set
from tangram_sgl.profiler.cli import add_profile_args, run_profile
from tangram_sgl.profiler.pipeline import ProfileSettings, collect_scores, profile_from_scores
from tangram_sgl.profiler.retention import segment_kept, segment_scores
from tangram_sgl.profiler.segments import TokenizedSample, tokenize_conversation
from tangram_sgl.scorers import make_scorer

LOCAL_KV_HEAD = 0


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, attention_bias=True,
        architectures=["LlamaForCausalLM"],
    )


def tiny_model(local: bool) -> LlamaForCausalLM:
    """A random tiny Llama; with ``local`` kv head 0 of every layer attends only to its nearest tokens.

    Its queries and keys are constant (zero weights, large equal biases), so q.k depends only on the RoPE
    distance and peaks sharply at distance 0.
    """
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    model.set_attn_implementation("sdpa")
    if local:
        d, g = 16, 2  # head_dim, query heads per kv head
        with torch.no_grad():
            for layer in model.model.layers:
                att = layer.self_attn
                q_rows = slice(LOCAL_KV_HEAD * g * d, (LOCAL_KV_HEAD + 1) * g * d)
                k_rows = slice(LOCAL_KV_HEAD * d, (LOCAL_KV_HEAD + 1) * d)
                att.q_proj.weight[q_rows] = 0.0
                att.q_proj.bias[q_rows] = 6.0
                att.k_proj.weight[k_rows] = 0.0
                att.k_proj.bias[k_rows] = 6.0
    return model


def random_samples(count: int, seed: int = 0) -> list[TokenizedSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 300, (330,), generator=gen)
        out.append(TokenizedSample(task="random", ids=ids, segments=((0, 180), (200, 320))))
    return out


SETTINGS = ProfileSettings(scorer="snapkv", sink_tokens=4, recent_window=8, heads_per_group=4)


@pytest.fixture(scope="module")
def local_profile():
    model = tiny_model(local=True)
    scores = collect_scores(model, random_samples(6), SETTINGS, progress=False)
    return profile_from_scores(ModelIdentity.from_config(model.config), scores, 0.3, SETTINGS, created_by="test")


def test_budgets_in_unit_interval_groups_partition_and_file_validates(local_profile):
    prof = local_profile
    flat = [b for row in prof.budget for b in row]
    assert len(flat) == 3 * 2
    assert all(0.0 < b <= 1.0 for b in flat)
    assert all(b == round(b, 6) for b in flat)
    members = [m for g in prof.groups for m in g.members]
    assert sorted(members) == [(li, hi) for li in range(3) for hi in range(2)]
    assert all(len(g.members) <= 4 for g in prof.groups)
    # budget-sorted packing: groups are in non-increasing budget order
    assert [g.budget for g in prof.groups] == sorted((g.budget for g in prof.groups), reverse=True)
    again = profile_from_dict(json.loads(json.dumps(prof.to_dict())))
    validate_for_model(again, tiny_config())
    oa = prof.notes["over_allocation"]
    # 2 kv heads per layer and H_p = 4: per-layer groups are half padding, cross-layer groups are full
    assert oa["per_layer"] > 0.25 > oa["cross_layer"] >= 0.0


def test_matched_mode_lands_on_the_target(local_profile):
    assert local_profile.mean_budget() == pytest.approx(0.3, abs=2e-3)
    assert local_profile.mean_budget() <= 0.3 + 1e-9
    assert 0.0 < local_profile.notes["threshold_ratio"] < 0.3


def test_local_heads_get_visibly_lower_budgets(local_profile):
    for li, row in enumerate(local_profile.budget):
        local, other = row[LOCAL_KV_HEAD], row[1 - LOCAL_KV_HEAD]
        assert local < 0.5 * other, f"layer {li}: local head {local} vs other head {other}"


def test_without_the_construction_head_0_is_not_singled_out():
    model = tiny_model(local=False)
    scores = collect_scores(model, random_samples(6), SETTINGS, progress=False)
    prof = profile_from_scores(ModelIdentity.from_config(model.config), scores, 0.3, SETTINGS, created_by="t")
    assert not any(row[LOCAL_KV_HEAD] < 0.5 * row[1 - LOCAL_KV_HEAD] for row in prof.budget)


def test_segment_retention_definition():
    gen = torch.Generator().manual_seed(1)
    per_layer = [torch.rand(1, 3, 100, generator=gen) for _ in range(2)]  # one window, 3 heads, 100 tokens
    seg = segment_scores(per_layer, start=0, sink=4, window=10)
    assert seg.scores.shape == (1, 2, 3, 86) and seg.n == 100
    kept = segment_kept(seg, 0.25, "layer")
    assert kept.sum(dim=1).tolist() == pytest.approx([75.0, 75.0])  # round(0.25 * 3 heads * 100)
    assert float(segment_kept(seg, 0.25, "global").sum()) == pytest.approx(150.0)
    # identical scores in every head: ties are shared, every head keeps the same
    tied = segment_scores([torch.ones(1, 3, 100)] * 2, start=50, sink=4, window=10)
    assert segment_kept(tied, 0.3, "global").flatten().tolist() == pytest.approx([30.0] * 6)
    # the cap: at ratio 1 every candidate is kept
    assert segment_kept(seg, 1.0, "layer").flatten().tolist() == pytest.approx([86.0] * 6)


def test_conversation_retention_is_the_union_over_windows():
    """A head whose top tokens stay put keeps the same count under two windows; one whose top tokens move keeps
    the union of both windows' survivors."""
    n, top = 100, 10
    stable, moving_a, moving_b = (torch.zeros(n) for _ in range(3))
    stable[:top] = 1.0
    moving_a[20:20 + top] = 1.0
    moving_b[50:50 + top] = 1.0
    own = segment_scores([torch.stack([stable, moving_a])[None]], start=10, sink=0, window=0)
    both = segment_scores([torch.stack([torch.stack([stable, moving_a]), torch.stack([stable, moving_b])])],
                          start=10, sink=0, window=0)
    assert both.scores.shape == (2, 1, 2, n)
    ratio = top / n  # 20 slots over 2 heads: exactly the tokens scored 1
    assert segment_kept(own, ratio, "layer").flatten().tolist() == pytest.approx([10.0, 10.0])
    assert segment_kept(both, ratio, "layer").flatten().tolist() == pytest.approx([10.0, 20.0])
    # tied survivors combine as independent draws: 1 - (1 - p_a)(1 - p_b) per token
    flat = segment_scores([torch.ones(2, 2, n)], start=10, sink=0, window=0)
    assert segment_kept(flat, 0.25, "layer").flatten().tolist() == pytest.approx([n * (1 - 0.75**2)] * 2)


def test_streaming_scorer_gives_uniform_budgets():
    model = tiny_model(local=True)
    st = ProfileSettings(scorer="streaming", sink_tokens=4, recent_window=8)
    scores = collect_scores(model, random_samples(3), st, progress=False)
    prof = profile_from_scores(ModelIdentity.from_config(model.config), scores, 0.4, st, created_by="t")
    assert len({b for row in prof.budget for b in row}) == 1


def _byte_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in ("<s>", "<|im_start|>", "<|im_end|>"):
        vocab[tok] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_conversation_segments_cover_prompts_not_answers():
    tok = _byte_tokenizer()
    conv = calibration_set(1, seed=3, target_tokens=40, turns=3, tasks=("kv_retrieval",))[0]
    s = tokenize_conversation(tok, conv)
    assert len(s.segments) == 3
    text = [tok.decode(s.ids[a:b]) for a, b in s.segments]
    assert text[0].startswith("<|im_start|>user") and text[0].endswith("<|im_start|>assistant\n")
    assert text[1].startswith("\n<|im_start|>user") or text[1].startswith("<|im_start|>user")
    answer = tok.decode(s.ids[s.segments[0][1] : s.segments[1][0]])
    assert conv.turns[0][1] in answer


def test_calibration_is_deterministic_and_seeded():
    a = calibration_set(8, seed=5, target_tokens=300)
    assert a == calibration_set(8, seed=5, target_tokens=300)
    assert a != calibration_set(8, seed=6, target_tokens=300)
    assert [c.task for c in a] == list(TASKS) * 2
    even = calibration_set(4, seed=5, target_tokens=300, source_split="even")
    odd = calibration_set(4, seed=5, target_tokens=300, source_split="odd")
    # tasks with source documents draw them from disjoint halves (kv_retrieval has none: it is seeded only)
    assert all(e.turns[0][0] != o.turns[0][0] for e, o in zip(even, odd) if e.task != "kv_retrieval")


def test_cli_same_seed_same_file(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model(local=True).save_pretrained(model_dir)
    _byte_tokenizer().save_pretrained(model_dir)
    parser = argparse.ArgumentParser()
    add_profile_args(parser)

    def run(out: str, seed: int, *more: str) -> bytes:
        args = parser.parse_args(["--model", str(model_dir), "--ratio", "0.5", "0.25", "--out", out,
                                  "--samples", "4", "--tokens", "60", "--window", "8", "--seed", str(seed),
                                  "--device", "cpu", *more])
        assert run_profile(args) == 0
        return (tmp_path / out.replace("{ratio}", "0.25")).read_bytes()

    first = run(str(tmp_path / "a-{ratio}.json"), 0)
    assert first == run(str(tmp_path / "b-{ratio}.json"), 0)
    assert first != run(str(tmp_path / "c-{ratio}.json"), 1)
    # a scorer spec with parameters is recorded as given, and the runtime builds that scorer from the file
    run(str(tmp_path / "p-{ratio}.json"), 0, "--scorer", "snapkv:pool_kernel=31")
    wide = load_profile(tmp_path / "p-0.5.json", model_dir)
    assert wide.runtime_scorer == "snapkv:pool_kernel=31" and make_scorer(wide.runtime_scorer).pool_kernel == 31
    # conversation retention: recorded in the file, and later turns' windows change the budgets
    conv = run(str(tmp_path / "v-{ratio}.json"), 0, "--retention", "conversation")
    assert json.loads(conv)["notes"]["retention_windows"] == "conversation" and conv != first
    assert json.loads(first)["notes"]["retention_windows"] == "segment"
    with pytest.raises(SystemExit):  # argparse: the spec's error, not a traceback
        parser.parse_args(["--model", "m", "--ratio", "0.5", "--out", "x", "--scorer", "snapkv:pool=3"])
    for r in ("0.5", "0.25"):
        prof = load_profile(tmp_path / f"a-{r}.json", model_dir)
        assert prof.target_ratio == float(r) and not prof.synthetic
        assert (tmp_path / f"a-{r}.png").stat().st_size > 10_000


def test_captured_scores_match_the_models_own_attention():
    """The hook's recomputed q/k (with the module's RoPE) give the attention the model itself computes."""
    from tangram_sgl.profiler.capture import SegmentScoreCapture
    from tangram_sgl.scorers import SnapKVScorer

    model = tiny_model(local=True)
    model.set_attn_implementation("eager")
    ids = random_samples(1)[0].ids[:120]
    w = 8
    with SegmentScoreCapture(model, [SnapKVScorer(pool_kernel=1)], obs_window=w) as cap:
        captured = cap.run(ids, ((0, 120),))[0]
    with torch.inference_mode():
        attn = model(input_ids=ids[None], output_attentions=True).attentions
    for li, probs in enumerate(attn):
        want = probs[0, :, -w:, :].mean(dim=1).view(2, 2, 120).mean(dim=1)  # window mean, then GQA mean
        assert torch.allclose(captured[li][0][0], want, atol=1e-5), f"layer {li}"


def test_later_windows_score_a_segment_by_each_later_question():
    """With later windows, segment [0, 60) is also scored by segment [60, 120)'s window: the model's attention of
    those queries restricted to the segment's keys (renormalised), no causal mask."""
    from tangram_sgl.profiler.capture import SegmentScoreCapture
    from tangram_sgl.scorers import SnapKVScorer

    model = tiny_model(local=True)
    model.set_attn_implementation("eager")
    ids = random_samples(1)[0].ids[:120]
    w = 8
    with SegmentScoreCapture(model, [SnapKVScorer(pool_kernel=1)], obs_window=w, later_windows=True) as cap:
        captured = cap.run(ids, ((0, 60), (60, 120)))[0]
    with torch.inference_mode():
        attn = model(input_ids=ids[None], output_attentions=True).attentions
    for li, probs in enumerate(attn):
        first, second = captured[li]
        assert first.shape == (2, 2, 60) and second.shape == (1, 2, 60)
        own = probs[0, :, 60 - w:60, :60].mean(dim=1).view(2, 2, 60).mean(dim=1)
        later = probs[0, :, -w:, :60]
        later = (later / later.sum(dim=-1, keepdim=True)).mean(dim=1).view(2, 2, 60).mean(dim=1)
        assert torch.allclose(first[0], own, atol=1e-5) and torch.allclose(first[1], later, atol=1e-5), f"layer {li}"
        assert torch.equal(second[0], captured[li][1][0])
