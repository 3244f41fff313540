"""Workloads: the embedded default, ShareGPT from the packaged file, generated long-context sessions."""

from __future__ import annotations

import re

import pytest

from tangram_sgl.replay.conversation import Conversation, Turn, conversation_from_dict, conversation_to_dict
from tangram_sgl.replay.workloads import (
    default_workload,
    essay_paragraphs,
    long_context_workload,
    sharegpt_user_turns,
    sharegpt_workload,
)


def test_default_workload_shape():
    w = default_workload()
    assert len(w.conversations) >= 3
    for c in w.conversations:
        assert 3 <= len(c.turns) <= 4
        assert all(t.user and t.expected for t in c.turns)
    assert len({c.id for c in w.conversations}) == len(w.conversations)


def test_messages_for_turn_resends_history():
    c = Conversation(id="x", system="S", turns=(Turn("u0"), Turn("u1"), Turn("u2")))
    msgs = c.messages_for_turn(2, ["a0", "a1"])
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("system", "S"), ("user", "u0"), ("assistant", "a0"), ("user", "u1"), ("assistant", "a1"), ("user", "u2")]
    with pytest.raises(ValueError):
        c.messages_for_turn(2, ["a0"])
    assert conversation_from_dict(conversation_to_dict(c)) == c


def test_sharegpt_turn_filter():
    ok = {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a"},
                            {"from": "human", "value": "q2"}]}
    assert sharegpt_user_turns(ok) == ["q1", "q2"]
    starts_with_gpt = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]}
    assert sharegpt_user_turns(starts_with_gpt) is None
    two_users = {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q"}]}
    assert sharegpt_user_turns(two_users) is None


def test_sharegpt_workload_from_package():
    w = sharegpt_workload(8, min_turns=3, max_turns=4, max_turn_chars=1000, seed=3)
    assert len(w.conversations) == 8 and len({c.id for c in w.conversations}) == 8
    assert all(3 <= len(c.turns) <= 4 and all(len(t.user) <= 1000 for t in c.turns) for c in w.conversations)
    assert w.meta["records_read"] > 10_000 and w.meta["eligible"] > 1000
    assert sharegpt_workload(8, min_turns=3, max_turns=4, max_turn_chars=1000, seed=3).conversations == w.conversations
    with pytest.raises(ValueError, match="only"):
        sharegpt_workload(10, min_turns=200)


def test_long_context_sessions():
    words = lambda s: len(s.split())
    w = long_context_workload(2, doc_tokens=3000, num_questions=6, count_tokens=words, seed=1)
    assert len(w.conversations) == 2
    for c, n in zip(w.conversations, w.meta["doc_tokens"]):
        assert len(c.turns) == 6
        assert 2500 <= n <= 3100
        doc = c.turns[0].user
        for t in c.turns:
            assert re.fullmatch(r"\d{6}", t.expected)
            name = re.search(r"the (\w+ \w+) vault", t.user).group(1)
            assert f"The access code of the {name} vault is {t.expected}." in doc
    assert w.conversations[0].turns[0].user != w.conversations[1].turns[0].user


def _word_level_tokenizer():
    """A dummy-weight model's kind of tokenizer: 253 words t3..t255, everything else <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_long_context_documents_differ_in_tokens_for_a_word_level_tokenizer():
    """Essays through a word-level tokenizer are all <unk> (every document the same tokens): refused;
    ``--doc-text vocab`` documents are the tokenizer's own words and differ from the first token."""
    from tangram_sgl.replay.cli import _check_essays_tokenize, _plain_words
    from tangram_sgl.replay.workloads import vocab_paragraphs

    tok = _word_level_tokenizer()
    with pytest.raises(SystemExit, match="--doc-text vocab"):
        _check_essays_tokenize(tok, essay_paragraphs())
    words = _plain_words(tok)
    assert len(words) == 253 and "<unk>" not in words
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])
    w = long_context_workload(4, doc_tokens=2000, num_questions=2, count_tokens=count, seed=3,
                              paragraphs=vocab_paragraphs(words, seed=3))
    heads = [tok(c.turns[0].user, add_special_tokens=False)["input_ids"][10:60] for c in w.conversations]
    assert all(heads[i] != heads[j] for i in range(4) for j in range(i))
    unk = sum(t == tok.unk_token_id for h in heads for t in h)
    assert unk < len(heads) * 50 * 0.2
