"""Shared support for the pool / radix / stress tests (no tests here): toy layout, deterministic K/V."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.reference_store import prefix_hashes
from tangram_sgl.profile import ModelIdentity, TangramProfile
from tangram_sgl.profile_builder import build_profile, uniform_profile

L, H, D = 2, 4, 2
TOY_MEAN = [[0.2, 0.5, 0.9, 0.3], [0.1, 0.6, 0.25, 1.0]]
TOY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": L,
              "num_attention_heads": 8, "num_key_value_heads": H, "head_dim": D, "hidden_size": 16}


def toy_profile(page_size: int = 4, heads_per_group: int = 2, sink: int = 2, window: int = 3,
                budget: float | None = None) -> TangramProfile:
    """2 layers x 4 kv heads, budgets 0.1..1.0 (or all ``budget``), groups of ``heads_per_group``."""
    kw = {"sink_tokens": sink, "recent_window": window, "page_size": page_size, "heads_per_group": heads_per_group}
    if budget is not None:
        return uniform_profile(TOY_CONFIG, budget, **kw)
    model = ModelIdentity.from_config(TOY_CONFIG)
    return build_profile(model, TOY_MEAN, [[0.0] * H for _ in range(L)], scorer="snapkv", target_ratio=0.5,
                         alpha=0.0, **kw)


def toy_manager(num_pages: int = 64, slot_arena_entries: int | None = None, **kw) -> TangramKVManager:
    return TangramKVManager.from_profile(toy_profile(**kw), num_pages, dtype=torch.float32,
                                         slot_arena_entries=slot_arena_entries)


def token_kv(token_ids: Sequence[int], start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[L, H, n, D]`` of tokens [start, start+n): a function of the tokens up to each position, so
    equal prefixes give equal K/V (as a real model does); every (layer, head, position) is distinct."""
    h = prefix_hashes(token_ids[: start + n])[start + 1: start + n + 1]
    base = torch.tensor([x % 65521 for x in h], dtype=torch.float32)
    lh = torch.arange(L * H, dtype=torch.float32).reshape(L, H, 1, 1) * 65536
    k = base.reshape(1, 1, n, 1) + lh + torch.arange(D, dtype=torch.float32) * 0.5
    return k, k + 0.25


def token_scores(token_ids: Sequence[int], start: int, n: int) -> torch.Tensor:
    """Scores ``[L, H, n]``: pseudo-random in the token prefix and in the segment's end (like SnapKV)."""
    h = prefix_hashes(token_ids[: start + n])
    end = h[start + n]
    vals = [[[((h[start + p + 1] * 2654435761 + (l * H + hh) * 97 + end) % 1009) / 1009 for p in range(n)]
             for hh in range(H)] for l in range(L)]
    return torch.tensor(vals, dtype=torch.float32)


def prefill(mgr: TangramKVManager, rid, token_ids: Sequence[int], decode_tokens: int = 0, ref=None) -> None:
    """Reserve, write every layer, and commit the request's next segment ``token_ids``."""
    start = len(mgr.requests[rid].token_ids)
    mgr.reserve(rid, token_ids, decode_tokens)
    full = mgr.requests[rid].token_ids
    k, v = token_kv(full, start, len(token_ids))
    s = token_scores(full, start, len(token_ids))
    for layer in range(L):
        mgr.write_segment_layer(rid, layer, k[layer], v[layer], s[layer])
    mgr.commit_segment(rid)
    if ref is not None:
        ref.add_segment(rid, token_ids, k, v, s)


def decode(mgr: TangramKVManager, rid, token_id: int, ref=None) -> None:
    """Append one decoded token: odd ids as the CPU engine does (``append_decode``), even ids as the attention
    backend's decode step does (slots opened, K/V written per layer, the device slot lists synced)."""
    toks = mgr.requests[rid].token_ids + [token_id]
    k, v = token_kv(toks, len(toks) - 1, 1)
    if token_id % 2:
        mgr.append_decode(rid, token_id, k[:, :, 0], v[:, :, 0])
    else:
        slots = mgr.open_decode_slots([rid], [token_id])
        for layer in range(L):
            mgr.write_token_layer(slots, layer, k[layer, :, 0][None], v[layer, :, 0][None])
        mgr.device_slot_ranges([rid], slots)
    if ref is not None:
        ref.add_decode(rid, token_id, k[:, :, 0], v[:, :, 0])


class StepClock:
    """Deterministic stand-in for the ``time`` module in SGLang's radix cache (real clocks can tie)."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        self.t += 1.0
        return self.t

    def perf_counter(self):
        return 0.0
