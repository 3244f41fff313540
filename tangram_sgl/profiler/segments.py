"""Token ids of a conversation and its compression segments.

In multi-turn serving, turn t's prefill covers the tokens after the cached prefix: the chat template's
tokens closing the previous answer, the new user message and the assistant header. That span is the
turn's *segment* (what Tangram compresses); assistant answers are decoded tokens, kept by every head and
never in a segment. The text of segment t is ``prompt_t[len(full_{t-1}):]`` where ``prompt_t`` is the
chat template rendered up to turn t's generation prompt and ``full_{t-1}`` the rendering through answer
t-1; each piece is tokenized on its own, so segment boundaries are exact token boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tangram_sgl.profiler.calibration import Conversation


@dataclass(frozen=True)
class TokenizedSample:
    """``ids`` [T] int64 and the half-open token ranges of its segments, in order."""

    task: str
    ids: torch.Tensor
    segments: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())


def tokenize_conversation(tokenizer: Any, conv: Conversation) -> TokenizedSample:
    """Render ``conv`` with the tokenizer's chat template and cut it into per-turn segments."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; calibration needs one to build turn segments")
    msgs = conv.messages()
    pieces: list[tuple[str, bool]] = []  # (text, is_segment)
    done = ""
    for t in range(len(conv.turns)):
        prompt = tokenizer.apply_chat_template(msgs[: 2 * t + 1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(msgs[: 2 * t + 2], tokenize=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError("the chat template does not render turns as prefixes of each other")
        pieces.append((prompt[len(done):], True))
        pieces.append((full[len(prompt):], False))
        done = full
    ids: list[int] = []
    segments = []
    for text, is_segment in pieces:
        tok = tokenizer(text, add_special_tokens=False)["input_ids"]
        if is_segment:
            segments.append((len(ids), len(ids) + len(tok)))
        ids.extend(tok)
    return TokenizedSample(task=conv.task, ids=torch.tensor(ids, dtype=torch.long), segments=tuple(segments))
