"""The replay data model: a conversation is an optional system prompt and a list of user turns.

Assistant answers are never part of a workload: the engine under test produces them, and the next turn
resends the whole history (system, user, assistant, ..., new user), as a chat client does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One user message; ``expected`` is the reference answer when the workload knows it."""

    user: str
    expected: str | None = None


@dataclass(frozen=True)
class Conversation:
    """A session to replay turn by turn."""

    id: str
    turns: tuple[Turn, ...]
    system: str | None = None
    source: str = ""

    def messages_for_turn(self, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """Chat messages sent for turn ``turn`` (0-based): the history with ``answers`` of earlier turns."""
        if len(answers) != turn:
            raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t, answer in zip(self.turns[:turn], answers):
            msgs += [{"role": "user", "content": t.user}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": self.turns[turn].user})
        return msgs


@dataclass
class Workload:
    """Conversations plus a description of how they were made (written into the results JSON)."""

    name: str
    conversations: list[Conversation]
    meta: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        turns = [len(c.turns) for c in self.conversations]
        return {"name": self.name, "sessions": len(turns), "turns": sum(turns), **self.meta}


def conversation_from_dict(doc: dict[str, Any]) -> Conversation:
    """Parse ``{"id", "system"?, "turns": [{"user", "expected"?} | str, ...]}``."""
    try:
        turns = tuple(Turn(t) if isinstance(t, str) else Turn(t["user"], t.get("expected")) for t in doc["turns"])
        conv = Conversation(id=str(doc["id"]), turns=turns, system=doc.get("system"), source=doc.get("source", ""))
    except (KeyError, TypeError) as e:
        raise ValueError(f"conversation {doc.get('id', '?')!r}: expected id and turns[].user ({e})") from None
    if not conv.turns:
        raise ValueError(f"conversation {conv.id!r}: no turns")
    return conv


def conversation_to_dict(conv: Conversation) -> dict[str, Any]:
    return {"id": conv.id, "system": conv.system, "source": conv.source, "turns": [asdict(t) for t in conv.turns]}


def load_conversations_json(path: str | Path) -> list[Conversation]:
    """Read a conversations file: a JSON list, or an object with a ``conversations`` list."""
    doc = json.loads(Path(path).read_text())
    items = doc["conversations"] if isinstance(doc, dict) else doc
    return [conversation_from_dict(d) for d in items]
