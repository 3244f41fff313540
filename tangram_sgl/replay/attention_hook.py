"""Route a transformers model's attention through tangram's KV cache.

The model runs unchanged (embeddings, norms, projections, RoPE, MLPs are transformers' own); only the
attention call is replaced: :func:`install` registers the ``tangram_reference`` implementation with
transformers' ``AttentionInterface`` and switches the model to it. Each forward passes a
:class:`KVStep` as the ``tangram_step`` keyword; the decoder layers hand it through to every attention
call, which returns ``step.attend(layer, q, k, v, scaling)``. No attention mask is built: the step knows
the causal structure of what it is computing (a new segment over a cached prefix, or one decode token).
"""

from __future__ import annotations

from typing import Protocol

import torch

ATTN_IMPLEMENTATION = "tangram_reference"


class KVStep(Protocol):
    """One forward pass of one request through the cache (a prefill segment or a decode token)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """q ``[Hq, T, D]``, k/v ``[Hkv, T, D]`` (RoPE applied) of the T new tokens -> output ``[T, Hq, D]``."""


def _tangram_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    step: KVStep | None = kwargs.get("tangram_step")
    if step is None:
        raise RuntimeError("the tangram_reference attention needs a tangram_step keyword in the forward call")
    if query.shape[0] != 1:
        raise ValueError(f"the reference engine runs one request per forward, got batch {query.shape[0]}")
    for name in ("softcap", "sliding_window"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"layer {module.layer_idx} uses attention {name}={kwargs[name]!r}, which the "
                                      f"tangram reference attention does not implement")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.attend(module.layer_idx, query[0], key[0], value[0], scale)
    return out[None], None


def install(model: torch.nn.Module) -> None:
    """Make ``model`` (a Llama/Qwen2-style transformers causal LM) call tangram's attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _tangram_attention)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
