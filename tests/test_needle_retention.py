"""``eval/needle_retention.py``: which heads keep a fact's tokens, read from the cached segment, agrees with the
request-level gather of each head's kept positions; a fact's name and code are found token by token in a chat
prompt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))

from needle_retention import (
    by_outcome,
    conversation_facts,
    fact_token_positions,
    heads_keeping,
    predictive_heads,
)
from test_reference_engine import rand_ids, tiny_llama

from tangram_sgl.profile import ModelIdentity
from tangram_sgl.profile_builder import build_profile
from tangram_sgl.replay.reference_engine import ReferenceEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def test_heads_keeping_matches_each_heads_gathered_positions():
    model = tiny_llama(5)
    gen = torch.Generator().manual_seed(6)
    mean = (torch.rand(3, 2, generator=gen) * 0.4 + 0.05).tolist()  # non-uniform budgets
    profile = build_profile(ModelIdentity.from_config(model.config), mean, [[0.0, 0.0]] * 3, scorer="snapkv",
                            target_ratio=0.25, alpha=0.0, page_size=4, heads_per_group=2, sink_tokens=2,
                            recent_window=6)
    eng = ReferenceEngine(model, profile, kv_pages=300)
    prompt = rand_ids(gen, 120)
    eng.generate("t1", prompt, 1)
    eng.kv.admit("probe", prompt)
    kept = {(li, h): set(eng.kv.gather("probe", li, h)[2].tolist()) for li in range(3) for h in range(2)}
    eng.kv.abort("probe")
    some_kept = some_dropped = False
    for pos in ([0, 1], [118, 119], [40], [50, 51, 52], list(range(20, 30)), [7, 90]):
        keeps = heads_keeping(eng, prompt, pos)
        expect = [[set(pos) <= kept[(li, h)] for h in range(2)] for li in range(3)]
        assert keeps == expect, pos
        some_kept |= any(map(any, keeps[1:]))
        some_dropped |= not all(map(all, keeps))
    assert all(map(all, heads_keeping(eng, prompt, [0, 1]))) and all(map(all, heads_keeping(eng, prompt, [119])))
    assert some_kept and some_dropped  # the cases tell heads apart


def test_fact_token_positions_spell_each_name_and_code():
    from transformers import AutoTokenizer

    from tangram_sgl.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    facts = [("red fox", "004217"), ("blue owl", "938120")]
    doc = "Intro text.\n\n" + "\n\nMore text.\n\n".join(
        f"The access code of the {n} vault is {c}." for n, c in facts) + "\n\nWhat is the access code of the red fox vault?"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": doc}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    for (name, code), pos in zip(facts, fact_token_positions(tok, messages, ids, facts)):
        for part, text in (("name", name), ("code", code)):
            assert pos[part] == list(range(pos[part][0], pos[part][-1] + 1))
            assert tok.decode([ids[p] for p in pos[part]]).strip() == text
        assert pos["name"][-1] < pos["code"][0]  # the fact's own name, not the question's
    with pytest.raises(RuntimeError, match="not found exactly once"):
        fact_token_positions(tok, messages, ids, [("red fox", "555555")])


def test_conversation_facts_reads_each_turns_question():
    from accuracy import FULL_SIZES, needle_task

    conv = needle_task(1, FULL_SIZES, lambda text: len(text) // 4, 1000)[0]
    facts = conversation_facts(conv)
    assert [c for _, c in facts] == [t.expected for t in conv.turns] and len(facts) == 4
    for name, code in facts:
        assert f"The access code of the {name} vault is {code}." in conv.turns[0].user


def test_by_outcome_pairs_the_same_fact_of_both_methods():
    row = lambda conv, fact, deep, ok: {"seed": 1, "conversation": conv, "fact": fact, "code": deep, "correct": ok}
    rows = {"u": [row("a", 0, 9, True), row("a", 1, 10, True), row("b", 1, 20, False), row("c", 2, 30, True)],
            "t": [row("a", 0, 1, False), row("a", 1, 4, False), row("b", 1, 6, False), row("c", 2, 8, False)]}
    assert by_outcome(rows, "code") == [
        {"u correct": False, "t correct": False, "turns": 1, "u deep heads": 20, "t deep heads": 6},
        {"u correct": True, "t correct": False, "turns": 2, "u deep heads": 20, "t deep heads": 6},
    ]


def test_predictive_heads_ranks_the_head_whose_keeping_goes_with_answers():
    row = lambda fact, bits, ok: {"seed": 1, "conversation": "a", "fact": fact, "code_heads": bits, "correct": ok}
    # layer 1's head 0 keeps the code on exactly the answered turns; its head 1 on half of each; fact 0 ignored
    rows = {"u": [row(1, "1110", True), row(1, "1111", True), row(2, "1101", False), row(3, "1100", False),
                  row(0, "0000", True)],
            "t": [row(1, "0010", True), row(2, "0011", True), row(2, "0001", False), row(3, "0000", False)]}
    budgets = {"u": [[0.5, 0.5], [0.5, 0.5]], "t": [[0.9, 0.9], [0.3, 0.1]]}
    best, other = predictive_heads(rows, budgets, skip_layers=1, min_turns=2)
    assert (best["layer"], best["head"], other["layer"], other["head"]) == (1, 0, 1, 1)
    assert best["answered_when_kept"] == 1.0 and best["answered_when_dropped"] == 0.0 and best["difference"] == 1.0
    assert other["difference"] == 0.0 and (other["turns_kept"], other["turns_dropped"]) == (4, 4)
    assert best["u keeps"] == 0.5 and best["t keeps"] == 0.5 and best["t budget"] == 0.3
    assert predictive_heads(rows, budgets, skip_layers=1, min_turns=5) == []  # too few turns either way
