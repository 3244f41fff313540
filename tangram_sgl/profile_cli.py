"""``tangram-sgl validate``: check a profile file, optionally against a model config."""

from __future__ import annotations

import argparse

from tangram_sgl.profile import ProfileError, load_profile


def add_validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("profile", help="profile JSON")
    p.add_argument("--model", default=None, help="model directory (or config.json) the profile must fit")


def run_validate(args: argparse.Namespace) -> int:
    try:
        prof = load_profile(args.profile, args.model)
    except ProfileError as e:
        print(f"invalid: {e}")
        return 1
    kind = "synthetic" if prof.synthetic else "profiled"
    print(f"ok: {kind} {prof.model.model_type} profile, {prof.model.num_layers} layers x "
          f"{prof.model.num_kv_heads} kv heads, {prof.num_groups} groups of <= {prof.heads_per_group}, "
          f"mean head budget {prof.mean_budget():.3f}, reserved {prof.allocated_fraction():.3f} of full KV")
    return 0
