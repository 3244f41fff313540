"""Scores of a prefill segment's tokens, per kv head, with the profile's scorer (what ``select_kept`` ranks).

The observation window is the segment's last ``min(obs_window, n)`` queries, the same window the profiler
used (``obs_window`` defaults to the profile's ``recent_window``). Scorers that model future queries from
pre-RoPE queries (``expected_attention``) need the model's RoPE (:class:`PreRope`); without it they are
refused at construction. SnapKV scores every row of a step at once on the kernel set's ragged SnapKV kernel
(Triton on CUDA); the other scorers run per segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tangram_sgl.attention.kernel_set import KernelSet
from tangram_sgl.pool.device_copy import to_device
from tangram_sgl.scorers import SegmentTensors, SnapKVScorer, make_scorer
from tangram_sgl.selection import pad_scores

PRE_ROPE_SCORERS = frozenset({"expected_attention"})


@dataclass(frozen=True)
class ScoredRows:
    """The rows of one step whose segments are scored: staging offsets, lengths and absolute starts (host),
    and the ragged SnapKV kernel's row tensors on the device (``q_start``: each row's first window query),
    built once per step so that no layer copies them."""

    offsets: list[int]
    lengths: list[int]
    starts: list[int]
    q_start: torch.Tensor
    k_start: torch.Tensor
    lens: torch.Tensor

    @classmethod
    def build(cls, offsets: list[int], lengths: list[int], starts: list[int], obs_window: int,
              device: torch.device) -> ScoredRows:
        q_start = [a + n - min(obs_window, n) for a, n in zip(offsets, lengths)]
        rows = to_device(torch.tensor([q_start, offsets, lengths], dtype=torch.int32), device)
        return cls(offsets, lengths, starts, rows[0], rows[1], rows[2])


@dataclass(frozen=True)
class PreRope:
    """The model's RoPE, for scorers that read pre-RoPE queries.

    ``unrotate(q_obs [Hq, w, D], first_position) -> q_obs before RoPE``; ``inv_freq`` ``[D/2]`` (float32, CPU).
    """

    inv_freq: torch.Tensor
    unrotate: Callable[[torch.Tensor, int], torch.Tensor]


# model types whose RoPE rotates the two halves of each head (transformers' ``rotate_half``), which
# :func:`config_pre_rope` undoes; another model type with a pre-RoPE scorer is refused
HALF_ROTATION_MODEL_TYPES = frozenset({"llama", "qwen2"})


def needs_pre_rope(scorer_spec: str) -> bool:
    """Whether the scorer of ``scorer_spec`` reads pre-RoPE queries (its caller must give a :class:`PreRope`)."""
    return make_scorer(scorer_spec).name in PRE_ROPE_SCORERS


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary_pre_rope(rotary: torch.nn.Module) -> PreRope:
    """:class:`PreRope` of a transformers rotary embedding module (``rotary(x, position_ids) -> (cos, sin)``,
    half rotation, no attention scaling); positions are made on its ``inv_freq``'s device."""
    if getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ValueError(f"RoPE with attention scaling {rotary.attention_scaling} cannot be undone on the queries")

    def unrotate(q: torch.Tensor, first_position: int) -> torch.Tensor:
        pos = torch.arange(first_position, first_position + q.shape[1], device=rotary.inv_freq.device)[None]
        # transformers moves inv_freq to the probe tensor's device: the probe lives beside inv_freq and pos
        probe = torch.empty(1, dtype=q.dtype, device=rotary.inv_freq.device)
        cos, sin = (x[0].to(q.device) for x in rotary(probe, pos))
        return q * cos - _rotate_half(q) * sin

    return PreRope(rotary.inv_freq.detach().float().cpu(), unrotate)


def config_pre_rope(hf_config: Any, device: torch.device | str = "cpu") -> PreRope:
    """:class:`PreRope` of a model known only by its transformers config (the SGLang backend's case): the
    rotary embedding transformers builds for Llama-style RoPE, scaled variants (e.g. Llama 3.1's) included."""
    if getattr(hf_config, "model_type", None) not in HALF_ROTATION_MODEL_TYPES:
        raise ValueError(f"pre-RoPE scorers support model types {sorted(HALF_ROTATION_MODEL_TYPES)}, not "
                         f"{getattr(hf_config, 'model_type', None)!r}")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return rotary_pre_rope(LlamaRotaryEmbedding(hf_config, device=device))


class SegmentScorer:
    """``scores(q, k, v, scale, start)`` -> float32 ``[Hkv, n]`` for one segment of one layer."""

    def __init__(self, scorer_name: str, kernels: KernelSet, obs_window: int, pre_rope: PreRope | None = None):
        if obs_window < 1:
            raise ValueError(f"obs_window must be >= 1, got {obs_window}")
        self.scorer = make_scorer(scorer_name)
        if self.scorer.name in PRE_ROPE_SCORERS and pre_rope is None:
            raise ValueError(f"scorer {scorer_name!r} needs the model's RoPE (pre-RoPE queries), which this "
                             f"caller does not provide; use a profile made with snapkv, keydiff or streaming")
        self.kernels = kernels
        self.obs_window = obs_window
        self.pre_rope = pre_rope

    def scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int) -> torch.Tensor:
        """q ``[Hq, n, D]``, k/v ``[Hkv, n, D]`` (RoPE applied) of a segment at absolute ``start``."""
        n = k.shape[1]
        w = min(self.obs_window, n)
        q_obs = q[:, n - w:]
        if self.pre_rope is not None:
            q_pre, inv_freq = self.pre_rope.unrotate(q_obs, start + n - w), self.pre_rope.inv_freq
        else:  # post-RoPE scorers never read q_obs_pre / inv_freq
            q_pre, inv_freq = q_obs, torch.empty(0)
        seg = SegmentTensors(q_obs=q_obs.float(), q_obs_pre=q_pre.float(), k=k.float(), v=v.float(),
                             scale=float(scale), start=start, inv_freq=inv_freq)
        return self.scorer.score(seg)

    def scores_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    rows: ScoredRows) -> torch.Tensor:
        """Scores ``[R, Hkv, max n_r]`` (``-inf`` past each row's length) of several segments of a step's
        staging q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``: SnapKV in one ragged launch pair, other scorers per row."""
        if isinstance(self.scorer, SnapKVScorer):
            return self.kernels.snapkv_ragged(q, k, rows.q_start, rows.k_start, rows.lens, max(rows.lengths),
                                              self.obs_window, scale, self.scorer.pool_kernel)
        return pad_scores([self.scores(q[a:a + n].transpose(0, 1), k[a:a + n].transpose(0, 1),
                                       v[a:a + n].transpose(0, 1), scale, start)
                           for a, n, start in zip(rows.offsets, rows.lengths, rows.starts)])
