"""The CPU reference engine: a transformers model whose attention reads and writes tangram's KV cache.

Everything about the cache is the server's own code: the head-group page pool, the radix tree and exact
reservation (:class:`tangram_sgl.pool.kv_manager.TangramKVManager`), and the per-layer attention step of the
SGLang backend (:mod:`tangram_sgl.attention.forward_step`: the profile's scorer, ``select_kept`` inside
``write_segment_layer``, the torch reference kernels). The model is transformers' own, with its attention
call routed here (:mod:`tangram_sgl.replay.attention_hook`). One request runs at a time.

One turn (:meth:`ReferenceEngine.generate`):

1. ``admit``: match the prompt against the radix tree (at most ``len - 1`` tokens, so one token is
   left to compute) and lock the matched prefix; ``reserve`` exact pages for the new segment (the prompt
   tokens past the match) plus ``max_new_tokens`` of decode growth.
2. Prefill of the segment, layer by layer: full causal attention of the new tokens over [the cached,
   compressed prefix read from its slot lists ; the segment's own staging K/V]; then the segment's K/V and
   its observation-window queries are scored, and ``write_segment_layer`` keeps each head's top-k_g
   tokens in the reserved slots. The segment is committed after the last layer.
3. Decode, token by token: the token gets a slot in every group (``open_decode_slots``: decoded tokens
   are all kept); each layer writes the token's K/V there and the paged-decode reference attends over the
   request's slot lists (prefix, its own segments, decoded tokens, the token itself).
4. ``finish`` inserts the turn (prompt + answer tokens whose K/V exist) into the radix tree, so the next
   turn, which resends the history, matches it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tangram_sgl.attention.forward_step import AttentionContext, ForwardStep, StepRow
from tangram_sgl.attention.segment_scoring import needs_pre_rope, rotary_pre_rope
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.segment import Segment
from tangram_sgl.profile import TangramProfile, validate_for_model
from tangram_sgl.replay.attention_hook import install


@dataclass(frozen=True)
class KVFootprint:
    """KV bytes of a token sequence as the cache holds it, vs the same tokens uncompressed.

    ``kept_bytes``: K+V of the tokens every (layer, kv head) keeps. ``page_bytes``: whole pages (the memory
    the pool spends: padding columns of partly filled groups and page tails included). ``full_bytes``:
    every token in every (layer, kv head).
    """

    tokens: int
    kept_bytes: int
    page_bytes: int
    full_bytes: int


@dataclass
class Generation:
    """Result of one turn."""

    prompt_ids: list[int]
    output_ids: list[int]
    prefix_hit: int
    ttft_s: float
    decode_s: float
    footprint: KVFootprint

    @property
    def tpot_s(self) -> float | None:
        n = len(self.output_ids)
        return self.decode_s / (n - 1) if n > 1 else None


class _StepAdapter:
    """transformers' attention call (q ``[Hq, T, D]``, k/v ``[Hkv, T, D]``) -> the shared forward step."""

    def __init__(self, step: ForwardStep):
        self.step = step

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        return self.step.attend(layer, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scaling)


class _SegmentStep(_StepAdapter):
    """Prefill of one reserved segment of ``n`` tokens at ``start`` (committed by the caller afterwards)."""

    def __init__(self, engine: ReferenceEngine, rid: Hashable, start: int, n: int):
        super().__init__(engine.attention.step([StepRow(rid, start, n, decode=False)]))


class _DecodeStep(_StepAdapter):
    """One decoded token at ``position``: its slots are opened now, its K/V written layer by layer."""

    def __init__(self, engine: ReferenceEngine, rid: Hashable, position: int, token_id: int):
        super().__init__(engine.attention.step([StepRow(rid, position, 1, decode=True)], [token_id]))


class ReferenceEngine:
    """Runs requests one at a time through ``model`` with tangram's cache (see module docstring)."""

    def __init__(self, model: Any, profile: TangramProfile, *, kv_pages: int, tokenizer: Any = None,
                 page_size: int | None = None, obs_window: int | None = None):
        validate_for_model(profile, model.config)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.profile = profile
        self.dtype = next(model.parameters()).dtype
        self.kv = TangramKVManager.from_profile(profile, kv_pages, page_size=page_size, dtype=self.dtype)
        self.layout = self.kv.layout
        pre_rope = rotary_pre_rope(model.model.rotary_emb) if needs_pre_rope(profile.runtime_scorer) else None
        self.attention = AttentionContext.create(self.kv, profile, kernels="torch", obs_window=obs_window,
                                                 pre_rope=pre_rope)
        install(self.model)

    # ------------------------------------------------------------------ one request
    @torch.inference_mode()
    def generate(self, rid: Hashable, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> Generation:
        """Greedy generation of up to ``max_new_tokens`` tokens (stopping after a token in ``stop_ids``)."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        ids = [int(t) for t in prompt_ids]
        t0 = time.perf_counter()
        match = self.kv.admit(rid, ids, max_prefix_len=len(ids) - 1)
        try:
            start, new = match.length, ids[match.length:]
            # the last sampled token's K/V is never computed, so max_new_tokens - 1 decode slots suffice
            self.kv.reserve(rid, new, decode_tokens=max_new_tokens - 1)
            step = _SegmentStep(self, rid, start, len(new))
            logits = self._forward(new, start, step)
            step.step.commit()
            out = [int(logits.argmax())]
            ttft = time.perf_counter() - t0
            stops = set(stop_ids)
            while len(out) < max_new_tokens and out[-1] not in stops:
                pos = len(self.kv.requests[rid].token_ids)
                logits = self._forward([out[-1]], pos, _DecodeStep(self, rid, pos, out[-1]))
                out.append(int(logits.argmax()))
            decode_s = time.perf_counter() - t0 - ttft
        except BaseException:
            self.kv.abort(rid)
            raise
        done = self.kv.finish(rid)
        return Generation(ids, out, match.length, ttft, decode_s, self.footprint(done.segments()))

    def _forward(self, token_ids: Sequence[int], start: int, step: Any) -> torch.Tensor:
        """Logits of the last of ``token_ids`` placed at positions ``start ..``."""
        n = len(token_ids)
        out = self.model(
            input_ids=torch.tensor([token_ids]), position_ids=torch.arange(start, start + n)[None],
            use_cache=False, logits_to_keep=1, tangram_step=step,
        )
        return out.logits[0, -1]

    # ------------------------------------------------------------------ chat
    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` under the tokenizer's chat template, ready for the assistant's turn."""
        if self.tokenizer is None:
            raise RuntimeError("chat needs the engine's tokenizer")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def stop_ids(self) -> list[int]:
        """End-of-turn token ids: the generation config's EOS ids plus the tokenizer's EOS id."""
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)

    def chat(self, rid: Hashable, messages: Sequence[dict[str, str]], max_new_tokens: int) -> tuple[str, Generation]:
        """One chat turn: the answer text (end-of-turn token stripped) and the generation record."""
        gen = self.generate(rid, self.chat_prompt(messages), max_new_tokens, self.stop_ids())
        stops = set(self.stop_ids())
        text_ids = gen.output_ids[:-1] if gen.output_ids and gen.output_ids[-1] in stops else gen.output_ids
        return self.tokenizer.decode(text_ids, skip_special_tokens=True).strip(), gen

    # ------------------------------------------------------------------ accounting
    def footprint(self, segments: Sequence[Segment]) -> KVFootprint:
        """KV bytes of ``segments`` (e.g. a conversation's radix path) vs the same tokens uncompressed."""
        lay = self.layout
        head_bytes = 2 * self.kv.pool.head_dim * self.kv.pool.k_buffer.element_size()  # K+V of one token, one head
        members = [len(m) for m in lay.members]
        tokens = sum(s.n for s in segments)
        kept = sum(members[g] * gs.length for s in segments for g, gs in enumerate(s.groups))
        pages = sum(s.num_pages() for s in segments)
        return KVFootprint(
            tokens=tokens,
            kept_bytes=kept * head_bytes,
            page_bytes=pages * self.kv.pool.page_bytes(),
            full_bytes=tokens * lay.num_layers * lay.num_kv_heads * head_bytes,
        )
