"""The plugin through SGLang 0.5.17's real argument parsing, Engine-style construction, and a spawned child."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tangram_sgl.profile_builder import uniform_profile

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
    "vocab_size": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def sglang_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt import server_args

    return server_args


@pytest.fixture
def model_dir(tmp_path):
    import json

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return d


@pytest.fixture
def profile_path(tmp_path, model_dir):
    p = tmp_path / "profile.json"
    uniform_profile(model_dir, 0.5, page_size=16).save(p)
    return p


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The exported policy starts unset and is unset again after the test (set-then-delete makes monkeypatch
    restore the variable's absence, so what a test's parse exports cannot leak into later modules)."""
    for name in ("TANGRAM_KV_POLICY", "TANGRAM_PROFILE", "TANGRAM_EXTEND_KERNEL", "TANGRAM_DECODE_KERNEL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _parse(sglang_loaded, *argv: str):
    return sglang_loaded.prepare_server_args(["--device", "cpu", "--random-seed", "1", *argv])


def test_kv_policy_reaches_resolved_server_args(sglang_loaded, model_dir, profile_path):
    sa = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram",
                "--tangram-profile", str(profile_path))
    assert (sa.attention_backend, sa.radix_cache_backend, sa.page_size) == ("tangram", "tangram", 16)
    assert os.environ["TANGRAM_KV_POLICY"] == "tangram"
    assert os.environ["TANGRAM_PROFILE"] == str(profile_path.resolve())
    assert (os.environ["TANGRAM_EXTEND_KERNEL"], os.environ["TANGRAM_DECODE_KERNEL"]) == ("mixed", "aot")
    _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile",
           str(profile_path), "--tangram-extend-kernel", "triton", "--tangram-decode-kernel", "balanced")
    assert (os.environ["TANGRAM_EXTEND_KERNEL"], os.environ["TANGRAM_DECODE_KERNEL"]) == ("triton", "balanced")


def test_default_policy_leaves_sglang_untouched(sglang_loaded, model_dir):
    plain = _parse(sglang_loaded, "--model-path", str(model_dir))
    default = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "default")
    assert plain == default
    assert plain.radix_cache_backend is None and plain.attention_backend != "tangram"
    assert "TANGRAM_KV_POLICY" not in os.environ


def test_engine_keywords(sglang_loaded, model_dir, profile_path):
    # sglang.Engine(**kwargs) builds ServerArgs(**kwargs) after load_plugins(): the same path.
    sa = sglang_loaded.ServerArgs(model_path=str(model_dir), device="cpu", kv_policy="tangram",
                                  tangram_profile=str(profile_path))
    assert (sa.attention_backend, sa.radix_cache_backend) == ("tangram", "tangram")


@pytest.mark.parametrize("extra,message", [
    ((), r"--kv-policy tangram needs --tangram-profile PATH"),
    (("--attention-backend", "triton"), r"--attention-backend triton is not supported with it"),
    (("--page-size", "1"), r"--page-size 1 differs from the profile's page_size 16"),
    (("--enable-hierarchical-cache",), r"does not support --enable-hierarchical-cache"),
    (("--kv-cache-dtype", "fp8_e4m3"), r"not 'fp8_e4m3' \(quantised KV is not implemented\)"),
    (("--cuda-graph-backend-prefill", "full"), r"only as breakable graphs; --cuda-graph-backend-prefill full"),
    (("--cuda-graph-backend-prefill", "tc_piecewise"), r"--cuda-graph-backend-prefill tc_piecewise is not supported"),
])
def test_incompatible_flags_fail_clearly(sglang_loaded, model_dir, profile_path, extra, message):
    from tangram_sgl.patches.server_args import KvPolicyError

    argv = ["--model-path", str(model_dir), "--kv-policy", "tangram", *extra]
    if extra:
        argv += ["--tangram-profile", str(profile_path)]
    with pytest.raises(KvPolicyError, match=message):
        _parse(sglang_loaded, *argv)


@pytest.mark.parametrize("flag,value", [("--tangram-extend-kernel", "flashinfer"), ("--tangram-decode-kernel", "aot")])
def test_kernel_choices_need_the_tangram_policy(sglang_loaded, model_dir, flag, value):
    from tangram_sgl.patches.server_args import KvPolicyError

    with pytest.raises(KvPolicyError, match=f"{flag} was given without --kv-policy tangram"):
        _parse(sglang_loaded, "--model-path", str(model_dir), flag, value)


def test_engine_keywords_choose_the_kernels(sglang_loaded, model_dir, profile_path):
    """``sglang.Engine(tangram_decode_kernel=...)``: the keyword reaches the scheduler's environment; a bad one is
    refused by its flag's name."""
    from tangram_sgl.patches.server_args import KvPolicyError

    sglang_loaded.ServerArgs(model_path=str(model_dir), device="cpu", kv_policy="tangram",
                             tangram_profile=str(profile_path), tangram_decode_kernel="balanced")
    assert (os.environ["TANGRAM_EXTEND_KERNEL"], os.environ["TANGRAM_DECODE_KERNEL"]) == ("mixed", "balanced")
    with pytest.raises(KvPolicyError, match=r"--tangram-decode-kernel: expected one of \('aot', 'balanced'\)"):
        sglang_loaded.ServerArgs(model_path=str(model_dir), device="cpu", kv_policy="tangram",
                                 tangram_profile=str(profile_path), tangram_decode_kernel="splitk")


def test_bad_profile_fails_at_parse_time(sglang_loaded, model_dir, tmp_path):
    from tangram_sgl.profile import ProfileError

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "tangram-profile", "version": 1, "model"')
    with pytest.raises(ProfileError, match="not valid JSON"):
        _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile", str(bad))


def _scheduler_child(server_args, queue) -> None:
    """What SGLang's run_scheduler_process does first in a spawned child: load_plugins()."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from tangram_sgl.patches import radix_cache
    from tangram_sgl.patches.attention_backend import create_tangram_backend

    queue.put({
        "attention_backend": server_args.attention_backend,
        "radix_cache_backend": server_args.radix_cache_backend,
        "page_size": server_args.page_size,
        "env_policy": os.environ.get("TANGRAM_KV_POLICY"),
        "env_profile": os.environ.get("TANGRAM_PROFILE"),
        "attn_registered": ATTENTION_BACKENDS.get("tangram") is create_tangram_backend,
        "radix_registered": get_radix_cache_factory("tangram") is radix_cache.create_tangram_tree_cache,
    })


def test_policy_carries_into_spawned_scheduler_process(sglang_loaded, model_dir, profile_path):
    sa = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram",
                "--tangram-profile", str(profile_path))
    ctx = mp.get_context("spawn")  # SGLang starts schedulers with spawn
    queue = ctx.Queue()
    proc = ctx.Process(target=_scheduler_child, args=(sa, queue))
    proc.start()
    seen = queue.get(timeout=120)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert seen == {
        "attention_backend": "tangram", "radix_cache_backend": "tangram", "page_size": 16,
        "env_policy": "tangram", "env_profile": str(profile_path.resolve()),
        "attn_registered": True, "radix_registered": True,
    }


def test_launch_server_help_lists_the_options():
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, check=False,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--kv-policy" in out.stdout and "--tangram-profile" in out.stdout
    assert "{default,tangram}" in out.stdout
    assert "--tangram-extend-kernel {triton,flashinfer,mixed}" in out.stdout
    assert "--tangram-decode-kernel {aot,balanced}" in out.stdout


def test_selecting_the_backend_builds_it_or_names_the_flag(sglang_loaded, model_dir, profile_path, monkeypatch):
    """The registry's ``tangram`` factory on SGLang's resolved ServerArgs: the policy keeps decode CUDA graphs
    (SGLang's default, full graphs) and SGLang's overlap scheduler (on by default) as given; where SGLang's own
    prefill default is breakable graphs (CUDA) it keeps them for steps of at most 1024 tokens (or the
    --cuda-graph-max-bs-prefill given), elsewhere (torch.compile graphs here on the CPU) prefill runs eagerly; the
    factory builds TangramAttnBackend on the tangram pool, and settings the backend cannot
    serve are still refused by name if they reach it another way."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.model_executor import cuda_graph_config as sglang_graph_config
    from tangram_sgl.patches.server_args import DEFAULT_PREFILL_GRAPH_MAX_TOKENS, KvPolicyError

    from tangram_sgl.attention.backend import TangramAttnBackend
    from tangram_sgl.attention.servable import TangramNotServable
    from tangram_sgl.pool.kv_manager import TangramKVManager
    from tangram_sgl.pool.sglang_kv_cache import TangramKVCache
    from tangram_sgl.profile import load_profile

    kv = TangramKVManager.from_profile(load_profile(profile_path), 32, dtype=torch.float32)

    def runner(sa):
        return SimpleNamespace(server_args=sa, token_to_kv_pool=TangramKVCache(kv, 512, "cpu"), device="cpu",
                               model_config=SimpleNamespace(hf_config=MODEL_CONFIG))

    sa = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram",
                "--tangram-profile", str(profile_path))
    assert sa.cuda_graph_config.decode.backend == "full" and sa.cuda_graph_config.prefill.backend == "disabled"
    with pytest.raises(ValueError, match="--tangram-extend-kernel triton"):  # the FlashInfer default needs CUDA
        ATTENTION_BACKENDS["tangram"](runner(sa))
    sa = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram",
                "--tangram-profile", str(profile_path), "--tangram-extend-kernel", "triton")
    backend = ATTENTION_BACKENDS["tangram"](runner(sa))
    assert isinstance(backend, TangramAttnBackend) and backend.manager is kv
    bcg = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile",
                 str(profile_path), "--cuda-graph-backend-prefill", "breakable", "--tangram-extend-kernel", "triton")
    assert bcg.cuda_graph_config.prefill.backend == "breakable"  # asked for: kept, and the backend serves it
    assert isinstance(ATTENTION_BACKENDS["tangram"](runner(bcg)), TangramAttnBackend)
    small = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile",
                   str(profile_path), "--cuda-graph-backend-prefill", "breakable", "--cuda-graph-max-bs-prefill", "1024",
                   "--tangram-extend-kernel", "triton")  # graphs for question-sized steps only (eval's tangram-bcg1024)
    prefill = small.cuda_graph_config.prefill
    assert prefill.backend == "breakable" and prefill.max_bs == 1024 and max(prefill.bs) == 1024
    with monkeypatch.context() as m:  # SGLang's default on CUDA is breakable graphs: tangram's, for small steps only
        m.setattr(sglang_graph_config, "default_prefill_backend", lambda: "breakable")
        tangram = ("--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile", str(profile_path),
                   "--tangram-extend-kernel", "triton")
        cuda = _parse(sglang_loaded, *tangram).cuda_graph_config.prefill
        capped = _parse(sglang_loaded, *tangram, "--cuda-graph-max-bs-prefill", "512").cuda_graph_config.prefill
        eager = _parse(sglang_loaded, *tangram, "--cuda-graph-backend-prefill", "disabled").cuda_graph_config.prefill
        no_graphs = [_parse(sglang_loaded, *tangram, flag).cuda_graph_config
                     for flag in ("--disable-cuda-graph", "--disable-prefill-cuda-graph")]
        stock = _parse(sglang_loaded, "--model-path", str(model_dir)).cuda_graph_config.prefill
    assert cuda.backend == "breakable" and cuda.max_bs == max(cuda.bs) == DEFAULT_PREFILL_GRAPH_MAX_TOKENS
    assert capped.backend == "breakable" and capped.max_bs == max(capped.bs) == 512
    assert eager.backend == "disabled" and stock.backend == "breakable" and stock.max_bs > cuda.max_bs
    assert [(c.prefill.backend, c.decode.backend) for c in no_graphs] == [("disabled", "disabled"), ("disabled", "full")]
    # SGLang's overlap scheduler stays on (its default), and --disable-overlap-schedule still turns it off
    assert not sa.disable_overlap_schedule
    nov = _parse(sglang_loaded, "--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile",
                 str(profile_path), "--tangram-extend-kernel", "triton", "--disable-overlap-schedule")
    assert nov.disable_overlap_schedule and isinstance(ATTENTION_BACKENDS["tangram"](runner(nov)), TangramAttnBackend)
    mixed = SimpleNamespace(**{**vars(sa), "enable_mixed_chunk": True})  # reached the backend another way
    with pytest.raises(TangramNotServable, match="--enable-mixed-chunk.*--disable-overlap-schedule"):
        ATTENTION_BACKENDS["tangram"](runner(mixed))
    with pytest.raises(KvPolicyError, match="without --kv-policy tangram"):
        _parse(sglang_loaded, "--model-path", str(model_dir), "--tangram-extend-kernel", "triton")


def test_overlap_schedule_refuses_what_breaks_its_order(sglang_loaded, model_dir, profile_path, monkeypatch):
    """With SGLang's overlap scheduler (the default), its consecutive-prefill overlap switch (read as SGLang reads
    it, so "y" counts), --strip-thinking-cache or --enable-mixed-chunk is refused by name, pointing at
    --disable-overlap-schedule; with that flag they are served."""
    from tangram_sgl.patches.server_args import KvPolicyError

    args = ("--model-path", str(model_dir), "--kv-policy", "tangram", "--tangram-profile", str(profile_path))
    monkeypatch.setenv("SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP", "y")
    with pytest.raises(KvPolicyError, match="SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP.*--disable-overlap-schedule"):
        _parse(sglang_loaded, *args)
    _parse(sglang_loaded, *args, "--disable-overlap-schedule")
    monkeypatch.delenv("SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP")
    for flag in ("--strip-thinking-cache", "--enable-mixed-chunk"):
        with pytest.raises(KvPolicyError, match=f"{flag}.*--disable-overlap-schedule"):
            _parse(sglang_loaded, *args, flag)
        _parse(sglang_loaded, *args, flag, "--disable-overlap-schedule")  # without overlap: served


def test_console_script_help():
    out = subprocess.run([str(Path(sys.executable).parent / "tangram-sgl"), "--help"], capture_output=True, check=False,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for sub in ("profile", "synth", "validate", "replay"):
        assert sub in out.stdout
