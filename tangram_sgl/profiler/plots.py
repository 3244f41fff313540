"""PNG summary of a profile: per-head budget heatmap (kv heads x layers) and group-budget histogram."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tangram_sgl.profile import TangramProfile


def plot_profile(profile: TangramProfile, path: str | Path) -> None:
    """Write the two-panel figure for ``profile`` to ``path``."""
    budget = np.asarray(profile.budget)  # [L, H]
    fig, (ax_map, ax_hist) = plt.subplots(
        1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2.2, 1]}, constrained_layout=True
    )
    im = ax_map.imshow(budget.T, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax_map.set_xlabel("layer")
    ax_map.set_ylabel("kv head")
    ax_map.set_yticks(range(budget.shape[1]))
    kind = "generated" if profile.synthetic else f"{profile.num_samples} samples"
    ax_map.set_title(f"{profile.model.model_type} head budgets ({profile.scorer}, target {profile.target_ratio}, "
                     f"alpha {profile.alpha}, {kind}); mean {profile.mean_budget():.3f}")
    fig.colorbar(im, ax=ax_map, label="budget (kept fraction)")

    bins = np.linspace(0.0, 1.0, 21)
    ax_hist.hist(budget.ravel(), bins=bins, alpha=0.45, label="heads")
    ax_hist.hist([g.budget for g in profile.groups], bins=bins, alpha=0.75,
                 label=f"groups (H_p={profile.heads_per_group}, {profile.grouping})")
    ax_hist.set_xlabel("budget")
    ax_hist.set_ylabel("count")
    ax_hist.set_title(f"reserved {profile.allocated_fraction():.3f} of full KV")
    ax_hist.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
