"""Token scorers behind one interface: per kv head, how much each token of a segment deserves to be kept.

A scorer maps the tensors of one segment (:class:`SegmentTensors`) to float32 scores ``[Hkv, n]``; higher
means keep. Tangram fixes budgets and leaves the scorer untouched, so the same scorer ranks tokens offline
(profiling) and at run time (selection). Under GQA every scorer returns one row per kv head; scorers that
look at queries average over the G query heads sharing that kv head (mean, as in SnapKV's kvpress port).

Scores of different heads are compared with each other by the profiler's threshold (see
``docs/arch/profiler.md``), so every scorer puts all heads on one scale:

- ``snapkv``: attention probability mass from the observation window (the segment's last w queries),
  averaged over window queries and the query group, max-pooled along positions (``pool_kernel``, default 7
  as in SnapKV; ``snapkv:pool_kernel=31`` keeps wider spans around each peak, which keeps whole numbers
  that a tokenizer splits into one token per digit).
- ``expected_attention``: the attention a *future* query is expected to pay (kvpress' ExpectedAttention):
  window queries (pre-RoPE) are modelled as a Gaussian N(mu, Sigma); RoPE is averaged over the next
  ``n_future`` positions (R_bar); E[exp(s*q.k)] = exp(s*k.R_bar mu + s^2/2 * k^T R_bar Sigma R_bar^T k),
  normalised over the segment's keys, then weighted by ||v|| (plus ``epsilon``) as in kvpress.
- ``keydiff``: key diversity (KeyDiff, arXiv 2504.15364): 1 - cos(k, mean of the segment's unit keys).
- ``streaming``: recency, (position + 1) / n, identical for all heads (the StreamingLLM baseline: it keeps
  the most recent tokens and yields uniform budgets).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from tangram_sgl.kernels.scoring import snapkv_scores_torch


@dataclass(frozen=True)
class SegmentTensors:
    """One layer's view of one segment of n tokens (absolute positions [start, start + n)).

    q_obs / q_obs_pre: [Hq, w, D] queries of the observation window after / before RoPE: the segment's last w
    tokens, or (profiling a later turn's question, ``query_end`` set) the w tokens before absolute position
    ``query_end`` >= start + n, which see the whole segment. k: [Hkv, n, D] keys after RoPE; v: [Hkv, n, D]
    values. inv_freq: [D/2] RoPE frequencies.
    """

    q_obs: torch.Tensor
    q_obs_pre: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    start: int
    inv_freq: torch.Tensor
    query_end: int | None = None

    def __post_init__(self) -> None:
        if self.query_end is not None and self.query_end < self.start + self.n:
            raise ValueError(f"query_end {self.query_end} lies inside the segment [{self.start}, {self.start + self.n})")

    @property
    def n(self) -> int:
        return int(self.k.shape[1])

    @property
    def window_end(self) -> int:
        """Absolute position after the window's last query."""
        return self.start + self.n if self.query_end is None else self.query_end

    @property
    def window_in_segment(self) -> bool:
        """True when the window is the segment's own last tokens (causal among them)."""
        return self.window_end == self.start + self.n


class Scorer(Protocol):
    name: str
    # "global" when scores of different layers share one scale (attention probabilities), else "layer";
    # the profiler's default threshold scope (see tangram_sgl.profiler.retention).
    default_scope: str

    def score(self, seg: SegmentTensors) -> torch.Tensor:
        """float32 [Hkv, n] scores; higher = keep."""
        ...


@dataclass(frozen=True)
class SnapKVScorer:
    pool_kernel: int = 7
    name: str = "snapkv"
    default_scope: str = "global"

    def score(self, seg: SegmentTensors) -> torch.Tensor:
        return snapkv_scores_torch(seg.q_obs, seg.k, scale=seg.scale, pool_kernel=self.pool_kernel,
                                   causal=seg.window_in_segment)


def averaged_rope_matrix(inv_freq: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """[D, D] mean of the RoPE rotation (HF rotate-half layout) over positions first .. first+count-1."""
    pos = torch.arange(first, first + count, dtype=torch.float64)
    ang = pos[:, None] * inv_freq.double()[None, :]  # [count, D/2]
    c, s = ang.cos().mean(0), ang.sin().mean(0)
    half = inv_freq.numel()
    r = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    idx = torch.arange(half)
    # x1' = c*x1 - s*x2 ; x2' = s*x1 + c*x2  for each pair (i, i + D/2)
    r[idx, idx] = c
    r[idx, idx + half] = -s
    r[idx + half, idx] = s
    r[idx + half, idx + half] = c
    return r.float()


@dataclass(frozen=True)
class ExpectedAttentionScorer:
    n_future: int = 512
    epsilon: float = 0.02
    name: str = "expected_attention"
    default_scope: str = "layer"  # ||v|| differs in scale between layers

    def score(self, seg: SegmentTensors) -> torch.Tensor:
        hq, w, _ = seg.q_obs_pre.shape
        hkv, n, _ = seg.k.shape
        g = hq // hkv
        q = seg.q_obs_pre.float()
        mu = q.mean(dim=1)  # [Hq, D]
        qc = q - mu[:, None, :]
        cov = qc.transpose(1, 2) @ qc / max(1, w - 1)  # [Hq, D, D]
        rot = averaged_rope_matrix(seg.inv_freq, seg.window_end, self.n_future).to(q.device)
        mu_f = mu @ rot.T
        cov_f = rot @ cov @ rot.T
        kk = seg.k.float().repeat_interleave(g, dim=0)  # [Hq, n, D]
        logits = seg.scale * torch.einsum("hnd,hd->hn", kk, mu_f)
        logits = logits + 0.5 * seg.scale**2 * torch.einsum("hnd,hde,hne->hn", kk, cov_f, kk)
        probs = logits.softmax(dim=-1).view(hkv, g, n).mean(dim=1)
        return (probs + self.epsilon) * seg.v.float().norm(dim=-1)


@dataclass(frozen=True)
class KeyDiffScorer:
    name: str = "keydiff"
    default_scope: str = "layer"  # key geometry differs between layers

    def score(self, seg: SegmentTensors) -> torch.Tensor:
        unit = torch.nn.functional.normalize(seg.k.float(), dim=-1)
        anchor = torch.nn.functional.normalize(unit.mean(dim=1, keepdim=True), dim=-1)
        return 1.0 - (unit * anchor).sum(dim=-1)


@dataclass(frozen=True)
class StreamingScorer:
    name: str = "streaming"
    default_scope: str = "layer"

    def score(self, seg: SegmentTensors) -> torch.Tensor:
        hkv, n = seg.k.shape[:2]
        return (torch.arange(1, n + 1, dtype=torch.float32, device=seg.k.device) / n).expand(hkv, n).contiguous()


SCORERS: dict[str, type] = {
    "snapkv": SnapKVScorer,
    "expected_attention": ExpectedAttentionScorer,
    "keydiff": KeyDiffScorer,
    "streaming": StreamingScorer,
}


def make_scorer(spec: str) -> Scorer:
    """The scorer a spec names: ``name`` (its default parameters) or ``name:param=value,...`` with integer or
    float values, e.g. ``snapkv:pool_kernel=31``. Profiles record the spec they were measured with."""
    name, _, params = spec.partition(":")
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose from {sorted(SCORERS)}")
    kwargs: dict[str, int | float] = {}
    fields = {f.name for f in dataclasses.fields(SCORERS[name])} - {"name", "default_scope"}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"scorer spec {spec!r}: expected {name}:param=value with param in {sorted(fields)}")
        try:
            kwargs[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise ValueError(f"scorer spec {spec!r}: {key} needs a number, got {value!r}") from None
    scorer = SCORERS[name](**kwargs)
    pool = getattr(scorer, "pool_kernel", 1)
    if pool < 1 or pool % 2 == 0:
        raise ValueError(f"scorer spec {spec!r}: pool_kernel must be a positive odd number")
    return scorer
