"""Shipped profiles, the synthetic generator, and the SmolLM2 model helper."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tangram_sgl.models import resolve_model_dir, smollm2_gguf_path
from tangram_sgl.profile import ProfileError, load_profile, validate_for_model
from tangram_sgl.profiler.synthetic import synthetic_profile

PROFILES = Path(__file__).resolve().parents[1] / "tangram_sgl" / "profiles"
LLAMA_CONFIG = PROFILES / "llama-3.1-8b.config.json"
SMOLLM2_CONFIG = PROFILES / "smollm2-135m-instruct.config.json"


@pytest.mark.parametrize("ratio", ["0.5", "0.25"])
@pytest.mark.parametrize(("slug", "scorer"), [("snapkv", "snapkv"), ("snapkv-p31", "snapkv:pool_kernel=31")])
def test_shipped_smollm2_profiles_are_real_and_valid(ratio, slug, scorer):
    prof = load_profile(PROFILES / f"smollm2-135m-instruct.{slug}.r{ratio}.json", SMOLLM2_CONFIG)
    assert not prof.synthetic and prof.scorer == scorer and prof.num_samples == 50
    assert (prof.model.num_layers, prof.model.num_kv_heads) == (30, 3)
    assert prof.mean_budget() == pytest.approx(float(ratio), abs=2e-3)
    b = np.asarray(prof.budget)
    assert b.std() > 0.05  # heads differ
    with pytest.raises(ProfileError, match="another model"):
        validate_for_model(prof, LLAMA_CONFIG)


@pytest.mark.parametrize("ratio", ["0.5", "0.25"])
def test_shipped_llama_synthetic_profiles_are_labelled_and_valid(ratio):
    prof = load_profile(PROFILES / f"llama-3.1-8b.synthetic.r{ratio}.json", LLAMA_CONFIG)
    assert prof.synthetic and prof.scorer == "synthetic"
    assert (prof.model.num_layers, prof.model.num_kv_heads) == (32, 8)
    assert prof.mean_budget() == pytest.approx(float(ratio), abs=1e-3)


def test_synthetic_budgets_are_skewed_with_a_few_full_heads():
    prof = synthetic_profile(LLAMA_CONFIG, 0.25, seed=3)
    b = np.asarray(prof.budget).ravel()
    assert prof.mean_budget() == pytest.approx(0.25, abs=1e-3)
    assert np.median(b) < b.mean()  # right-skewed
    assert 1 <= int((b > 0.9).sum()) <= int(0.1 * b.size)
    assert json.dumps(prof.to_dict()) == json.dumps(synthetic_profile(LLAMA_CONFIG, 0.25, seed=3).to_dict())
    assert prof.to_dict() != synthetic_profile(LLAMA_CONFIG, 0.25, seed=4).to_dict()


def test_smollm2_gguf_ships_with_the_package():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000


def test_model_spec_must_be_a_model():
    with pytest.raises(FileNotFoundError, match="expected 'smollm2'"):
        resolve_model_dir("/nonexistent/model")
