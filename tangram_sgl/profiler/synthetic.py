"""Synthetic profiles for dummy-weight models (throughput work), labelled ``synthetic: true``.

Real profiles (SnapKV, global threshold; see ``tangram_sgl/profiles/smollm2-*``) show: the first layers
keep much more than the rest, layers differ from each other, heads within a layer differ, a few heads
sit near 1.0 and the bulk is skewed below the mean. The generator draws a logit per head

    z[l, h] = early[l] + N(0, layer_sd)[l] + N(0, head_sd)[l, h] + hot[l, h]

with ``early`` = +``early_boost`` on the first ``early_layers`` layers, and ``hot`` = +``hot_boost`` on a
``hot_fraction`` of heads (retrieval-like heads). Mean retention is sigmoid(z + c) and its spread over
samples std = ``std_scale`` * m * (1 - m) (largest for mid-range heads, as in real profiles). The shift c
is found by bisection so that the mean head budget min(1, m + alpha*std) equals the target ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tangram_sgl.profile import ModelIdentity, TangramProfile
from tangram_sgl.profile_builder import build_profile, head_budgets

_BISECT_STEPS = 60


@dataclass(frozen=True)
class SyntheticShape:
    """Defaults fitted by eye to the shipped SmolLM2 SnapKV profiles: budget median / p10 / p90 of
    0.47 / 0.26 / 0.79 at target 0.5 (real: 0.47 / 0.21 / 0.84) and 0.19 / 0.09 / 0.48 at 0.25 (real:
    0.20 / 0.10 / 0.44); real std / (m(1-m)) has median 0.25; real first two layers keep ~2x the rest."""

    layer_sd: float = 0.5
    head_sd: float = 0.5
    early_layers: int = 2
    early_boost: float = 2.0
    hot_fraction: float = 0.03
    hot_boost: float = 3.5
    std_scale: float = 0.25


def _budgets(z: np.ndarray, c: float, shape: SyntheticShape, alpha: float) -> tuple[list, list, list]:
    m = 1.0 / (1.0 + np.exp(-(z + c)))
    s = shape.std_scale * m * (1.0 - m)
    mean = np.round(m, 6).tolist()
    std = np.round(s, 6).tolist()
    return mean, std, head_budgets(mean, std, alpha)


def synthetic_profile(config: Any, target_ratio: float, *, seed: int = 0, alpha: float = 2.0,
                      shape: SyntheticShape = SyntheticShape(), **build_kwargs: Any) -> TangramProfile:
    """A synthetic profile for the model ``config`` whose mean head budget is ``target_ratio``."""
    if not 0.0 < target_ratio < 1.0:
        raise ValueError(f"target ratio must lie in (0, 1) for a synthetic profile, got {target_ratio}")
    model = ModelIdentity.from_config(config)
    L, H = model.num_layers, model.num_kv_heads
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, shape.layer_sd, size=(L, 1)) + rng.normal(0.0, shape.head_sd, size=(L, H))
    z[: shape.early_layers] += shape.early_boost
    hot = rng.permutation(L * H)[: max(1, round(shape.hot_fraction * L * H))]
    z.reshape(-1)[hot] += shape.hot_boost

    def mean_budget(c: float) -> float:
        return float(np.mean(_budgets(z, c, shape, alpha)[2]))

    lo, hi = -30.0, 30.0
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if mean_budget(mid) <= target_ratio:
            lo = mid
        else:
            hi = mid
    mean, std, _ = _budgets(z, lo, shape, alpha)
    notes = {
        "synthetic_generator": "tangram_sgl.profiler.synthetic",
        "synthetic_seed": seed,
        "synthetic_shape": shape.__dict__,
        "synthetic_shift": round(lo, 6),
    }
    build_kwargs.setdefault("created_by", "tangram-sgl synth")
    return build_profile(model, mean, std, scorer="synthetic", target_ratio=target_ratio, alpha=alpha,
                         num_samples=0, synthetic=True, notes=notes, **build_kwargs)
