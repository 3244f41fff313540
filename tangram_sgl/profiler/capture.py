"""Score every segment of a sample at every layer during one forward pass (transformers models).

A forward pre-hook on each layer's attention module sees the layer input and RoPE (cos, sin); it
recomputes q (window rows only), k and v with the module's own projections, applies the module's RoPE,
and hands each segment to the scorer. The model itself may run any attention implementation (sdpa is
fastest on the CPU); no attention matrix is materialised beyond the window rows.
Supported: Llama-style attention modules (``q_proj``/``k_proj``/``v_proj``, optional ``q_norm``/``k_norm``,
a module-level ``apply_rotary_pos_emb``): Llama, Mistral, Qwen2, Qwen3.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import Self  # typing.Self needs 3.11; torch depends on typing_extensions

from tangram_sgl.scorers import Scorer, SegmentTensors


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    mods = [getattr(layer, "self_attn", None) for layer in layers]
    for i, m in enumerate(mods):
        if m is None or not all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            raise ValueError(f"layer {i}: unsupported attention module {type(m).__name__} (needs q/k/v_proj)")
    return mods


def rope_inv_freq(model: Any) -> torch.Tensor:
    base = getattr(model, "model", model)
    rot = getattr(base, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise ValueError(f"{type(model).__name__}: no rotary embedding with inv_freq found")
    return rot.inv_freq.detach().float().cpu()


class SegmentScoreCapture:
    """Context manager: while active, each forward over one sample fills ``scores[scorer][layer][segment]``.

    ``later_windows``: besides its own window, each segment is also scored by the window of every later
    segment of the sample (the questions of later turns; see ``docs/arch/profiler.md``, conversation retention).
    """

    def __init__(self, model: Any, scorers: Sequence[Scorer], obs_window: int, later_windows: bool = False):
        self.model = model
        self.scorers = tuple(scorers)
        self.obs_window = obs_window
        self.later_windows = later_windows
        self.mods = attention_modules(model)
        self.inv_freq = rope_inv_freq(model)
        cfg = model.config
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.segments: tuple[tuple[int, int], ...] = ()
        self.scores: list[list[list[torch.Tensor]]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Self:
        for li, mod in enumerate(self.mods):
            self._handles.append(mod.register_forward_pre_hook(self._hook(li), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, segments: tuple[tuple[int, int], ...]) -> list[list[list[torch.Tensor]]]:
        """Forward ``ids`` [T] once; returns per scorer, per layer, per segment, float32 scores [W, Hkv, n]:
        W = 1 (the segment's own window) or, with ``later_windows``, own window then each later segment's."""
        self.segments = segments
        self.scores = [[[] for _ in self.mods] for _ in self.scorers]
        base = getattr(self.model, "model", self.model)  # skip the LM head: only attention inputs matter
        device = next(self.model.parameters()).device
        base(input_ids=ids[None].to(device), use_cache=False)
        return self.scores

    def _hook(self, layer: int):
        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            windows = [self._window(mod, h[0], cos[0], sin[0], a, b) for a, b in self.segments]
            for i, (a, b) in enumerate(self.segments):
                k, v = self._keys(mod, h[0], cos[0], sin[0], a, b)
                own_and_later = windows[i:] if self.later_windows else windows[i:i + 1]
                segs = [SegmentTensors(q_obs=q_rot, q_obs_pre=q_pre, k=k, v=v, scale=float(mod.scaling), start=a,
                                       inv_freq=self.inv_freq, query_end=None if end == b else end)
                        for q_rot, q_pre, end in own_and_later]
                for si, scorer in enumerate(self.scorers):
                    self.scores[si][layer].append(torch.stack([scorer.score(seg).float().cpu() for seg in segs]))

        return hook

    def _window(self, mod: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Segment [a, b)'s window queries [Hq, w, D] after and before RoPE, and the window's end b."""
        rope = sys.modules[type(mod).__module__].apply_rotary_pos_emb
        d = mod.head_dim
        w = min(self.obs_window, b - a)
        q = mod.q_proj(h[b - w : b]).view(w, self.num_heads, d).transpose(0, 1)  # [Hq, w, D]
        if hasattr(mod, "q_norm"):
            q = mod.q_norm(q)
        q_rot, _ = rope(q[None], q[None], cos[None, b - w : b], sin[None, b - w : b])
        return q_rot[0].float(), q.float(), b

    def _keys(self, mod: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment [a, b)'s keys (after RoPE) and values, each [Hkv, n, D]."""
        rope = sys.modules[type(mod).__module__].apply_rotary_pos_emb
        d = mod.head_dim
        k = mod.k_proj(h[a:b]).view(b - a, self.num_kv_heads, d).transpose(0, 1)  # [Hkv, n, D]
        v = mod.v_proj(h[a:b]).view(b - a, self.num_kv_heads, d).transpose(0, 1)
        if hasattr(mod, "k_norm"):
            k = mod.k_norm(k)
        _, k_rot = rope(k[None], k[None], cos[None, a:b], sin[None, a:b])
        return k_rot[0].float(), v.float()
