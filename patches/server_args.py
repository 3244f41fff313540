"""Seam: ``sglang.srt.server_args.ServerArgs`` — the ``--kv-policy`` / ``--tangram-profile`` /
``--tangram-extend-kernel`` / ``--tangram-decode-kernel`` options.

SGLang's ServerArgs is a dataclass with no plugin fields, so the policy is *mapped* onto existing fields:
``--kv-policy tangram`` sets ``attention_backend="tangram"``, ``radix_cache_backend="tangram"`` and the
profile's page size, and exports ``TANGRAM_KV_POLICY`` / ``TANGRAM_PROFILE`` / ``TANGRAM_EXTEND_KERNEL`` /
``TANGRAM_DECODE_KERNEL`` into ``os.environ`` so the scheduler processes SGLang spawns (they inherit the
environment) know the policy and the profile.

Hooks: AFTER ``ServerArgs.add_cli_args`` (adds the options to the parser), AROUND
``ServerArgs.from_cli_args`` (CLI path) and AROUND ``ServerArgs.__init__`` (``sglang.Engine(kv_policy=...)``
and ``ServerArgs(kv_policy=...)``). Conflicting settings fail with a message naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.model_executor import cuda_graph_config as sglang_graph_config
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from tangram_sgl.attention.kernel_set import DECODE_VARIANTS
from tangram_sgl.attention.servable import PREFILL_GRAPH_BACKENDS, overlap_conflict
from tangram_sgl.profile import load_profile

KV_POLICIES = ("default", "tangram")
logger = logging.getLogger(__name__)
ENV_POLICY = "TANGRAM_KV_POLICY"
ENV_PROFILE = "TANGRAM_PROFILE"
ENV_EXTEND_KERNEL = "TANGRAM_EXTEND_KERNEL"
EXTEND_KERNELS = ("triton", "flashinfer", "mixed")
# FlashInfer for prefill chunks (faster on the H200 there, eval/results/bench_extend.json), the Triton kernel for
# question-sized steps (fewer host launches per layer: 0.64/0.73/0.77 -> 0.76/0.84/0.81x stock, bench_serving_grid)
DEFAULT_EXTEND_KERNEL = "mixed"
ENV_DECODE_KERNEL = "TANGRAM_DECODE_KERNEL"
# the split-KV decode with the profile's AOT split table, measured on the H200; the token-balanced one is not yet
DEFAULT_DECODE_KERNEL = "aot"
# ServerArgs-style field of each kernel choice -> (its environment variable, choices, default)
KERNEL_CHOICES = {"tangram_extend_kernel": (ENV_EXTEND_KERNEL, EXTEND_KERNELS, DEFAULT_EXTEND_KERNEL),
                  "tangram_decode_kernel": (ENV_DECODE_KERNEL, DECODE_VARIANTS, DEFAULT_DECODE_KERNEL)}
# On CUDA, breakable prefill CUDA graphs for steps of at most this many tokens (question turns replay graphs, document
# chunks run eagerly): 0.97 / 0.99 / 0.99x stock against eager prefill's 0.96 / 0.98 / 0.98x on an H100, short class
# at 8 / 32 / 64 sessions (session 27, bench_serving_grid_h100)
DEFAULT_PREFILL_GRAPH_MAX_TOKENS = 1024
_SA = "sglang.srt.server_args.ServerArgs"

# Features whose KV handling tangram_sgl does not implement: (ServerArgs field, its "off" value, flag).
_UNSUPPORTED = (
    ("enable_hierarchical_cache", False, "--enable-hierarchical-cache"),
    ("disable_radix_cache", False, "--disable-radix-cache"),
    ("enable_lmcache", False, "--enable-lmcache"),
    ("speculative_algorithm", None, "--speculative-algorithm"),
    ("disaggregation_mode", "null", "--disaggregation-mode"),
)
_SUPPORTED_KV_DTYPES = ("auto", "bf16", "bfloat16", "float16")


class KvPolicyError(ValueError):
    """``--kv-policy tangram`` was combined with settings it cannot honour."""


def add_cli_args_after(result: Any, parser: argparse.ArgumentParser) -> None:
    """AFTER ServerArgs.add_cli_args: add the tangram options."""
    group = parser.add_argument_group("tangram_sgl (per-head KV compression)")
    group.add_argument("--kv-policy", choices=KV_POLICIES, default="default",
                       help="KV-cache policy. 'tangram' keeps a per-head budget of each turn's tokens "
                            "(needs --tangram-profile).")
    group.add_argument("--tangram-profile", type=str, default=None,
                       help="Budget profile JSON made by `tangram-sgl profile` (or `tangram-sgl synth`).")
    group.add_argument("--tangram-extend-kernel", choices=EXTEND_KERNELS, default=None,
                       help="Prefill attention of the tangram backend: 'mixed' (default: 'flashinfer' for steps adding "
                            "more than 256 tokens to a row, 'triton' for question-sized steps), 'flashinfer' "
                            "(FlashInfer's chunk + per-(request, kv head) prefix passes, planned once per step) or "
                            "'triton' (our Triton extend kernel, one launch per layer; 2.4-2.9x slower than "
                            "FlashInfer on 8k-token chunks, eval/results/bench_extend.json).")
    group.add_argument("--tangram-decode-kernel", choices=DECODE_VARIANTS, default=None,
                       help="Decode attention of the tangram backend: 'aot' (default: split-KV with the profile's "
                            "AOT split table) or 'balanced' (every program an equal share of the batch's kept "
                            "tokens; kernels/decode_balanced.py, not yet measured on a GPU).")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def apply_kv_policy(fields: MutableMapping[str, Any], policy: str | None, profile_path: str | None,
                    kernels: Mapping[str, str | None] | None = None) -> None:
    """Rewrite ServerArgs field values in place for ``policy``; export the policy for child processes.

    ``fields`` maps ServerArgs field names to the values the user gave (absent or None = unset); ``kernels`` maps
    :data:`KERNEL_CHOICES` fields (``tangram_extend_kernel``, ...) to the values given.
    """
    policy = policy or "default"
    if policy not in KV_POLICIES:
        raise KvPolicyError(f"--kv-policy: expected one of {KV_POLICIES}, got {policy!r}")
    kernels = {name: value for name, value in (kernels or {}).items() if value is not None}
    for name, value in kernels.items():
        if value not in (choices := KERNEL_CHOICES[name][1]):
            raise KvPolicyError(f"{_flag(name)}: expected one of {choices}, got {value!r}")
    if policy == "default":
        if profile_path or kernels:
            given = "--tangram-profile" if profile_path else _flag(next(iter(kernels)))
            raise KvPolicyError(f"{given} was given without --kv-policy tangram")
        for name in (ENV_POLICY, ENV_PROFILE, *(env for env, _, _ in KERNEL_CHOICES.values())):
            os.environ.pop(name, None)
        return
    if not profile_path:
        raise KvPolicyError("--kv-policy tangram needs --tangram-profile PATH (see `tangram-sgl profile --help`)")
    profile = load_profile(profile_path)  # the model check runs in the scheduler, where the config is loaded
    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        given = fields.get(name)
        if given not in (None, "tangram"):
            raise KvPolicyError(f"--kv-policy tangram runs its own attention backend; "
                                f"--{name.replace('_', '-')} {given} is not supported with it")
    given = fields.get("radix_cache_backend")
    if given not in (None, "tangram"):
        raise KvPolicyError(f"--kv-policy tangram needs the tangram radix cache; "
                            f"--radix-cache-backend {given} is not supported with it")
    page_size = fields.get("page_size")
    if page_size not in (None, profile.page_size):
        raise KvPolicyError(f"--page-size {page_size} differs from the profile's page_size {profile.page_size}; "
                            f"omit --page-size or use a profile made for it")
    kv_dtype = fields.get("kv_cache_dtype")
    if kv_dtype not in (None, *_SUPPORTED_KV_DTYPES):
        raise KvPolicyError(f"--kv-policy tangram supports --kv-cache-dtype {'/'.join(_SUPPORTED_KV_DTYPES)}, "
                            f"not {kv_dtype!r} (quantised KV is not implemented)")
    for name, off, flag in _UNSUPPORTED:
        if name in fields and fields[name] not in (off, None):
            raise KvPolicyError(f"--kv-policy tangram does not support {flag} (got {fields[name]!r})")
    _disable_unsupported_defaults(fields)
    fields["attention_backend"] = "tangram"
    fields["radix_cache_backend"] = "tangram"
    fields["page_size"] = profile.page_size
    os.environ[ENV_POLICY] = "tangram"
    os.environ[ENV_PROFILE] = str(Path(profile_path).resolve())
    for name, (env, _, default) in KERNEL_CHOICES.items():
        os.environ[env] = kernels.get(name, default)


def _disable_unsupported_defaults(fields: MutableMapping[str, Any]) -> None:
    """Turn off, loudly, the defaults the tangram backend cannot run with yet; refuse explicit requests.

    Decode CUDA graphs stay as the user set them (SGLang's default: on). Prefill graphs, where SGLang's own default
    is breakable graphs (CUDA: the model body replays as captured segments, attention with its scoring and compaction
    runs eagerly between them), default to breakable graphs for steps of at most
    :data:`DEFAULT_PREFILL_GRAPH_MAX_TOKENS` tokens unless ``--cuda-graph-max-bs-prefill`` says otherwise: graphs cut
    a question step's host time, eager prefill runs long chunks faster (graphs for every size measured slower than
    eager prefill, H200 session 20: 0.68 / 0.91 / 0.85x stock against 0.96 / 0.94 / 0.84x). Elsewhere prefill runs
    eagerly. ``--cuda-graph-backend-prefill disabled`` / ``breakable`` are kept as asked, ``--disable-cuda-graph``
    and ``--disable-prefill-cuda-graph`` work as in stock SGLang; full and torch.compile prefill graphs are refused.
    SGLang's overlap scheduler stays as the user set it (SGLang's default: on; ``--disable-overlap-schedule`` turns
    it off); with it, the settings that change the order or the lengths the radix hooks rely on are refused
    (docs/arch/attention.md).
    """
    prefill = fields.get("cuda_graph_backend_prefill")
    if prefill not in (None, *PREFILL_GRAPH_BACKENDS):
        raise KvPolicyError(f"--kv-policy tangram runs prefill CUDA graphs only as breakable graphs; "
                            f"--cuda-graph-backend-prefill {prefill} is not supported with it (use breakable or "
                            f"disabled)")
    if fields.get("cuda_graph_config") is not None:
        raise KvPolicyError("--kv-policy tangram sets the CUDA-graph phases itself; omit --cuda-graph-config "
                            "(use --cuda-graph-backend-decode / --cuda-graph-max-bs-decode)")
    if not fields.get("disable_overlap_schedule"):
        if envs.SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP.get():  # SGLang's own reading of the variable
            raise KvPolicyError("--kv-policy tangram with SGLang's overlap scheduler does not support "
                                "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP (it processes a batch's results between "
                                "building the next batch and its metadata); add --disable-overlap-schedule")
        if (refusal := overlap_conflict(fields.get)) is not None:
            raise KvPolicyError(refusal)
    if prefill is not None:
        return
    if sglang_graph_config.default_prefill_backend() != "breakable":
        fields["cuda_graph_backend_prefill"] = "disabled"
        return
    # only the size limit: SGLang still resolves the backend (--disable-cuda-graph, --disable-prefill-cuda-graph and
    # its auto-disable rules keep working; a backend the tangram one cannot serve is refused at its start)
    if fields.get("cuda_graph_max_bs_prefill") is None:
        fields["cuda_graph_max_bs_prefill"] = DEFAULT_PREFILL_GRAPH_MAX_TOKENS
    logger.info("--kv-policy tangram: breakable prefill CUDA graphs (SGLang's default here) for steps of at most %d "
                "tokens, longer steps eager (--cuda-graph-backend-prefill disabled: all eager)",
                fields["cuda_graph_max_bs_prefill"])


def from_cli_args_around(original: Callable, cls: type, args: argparse.Namespace) -> Any:
    """AROUND ServerArgs.from_cli_args: map --kv-policy onto the namespace before SGLang reads it."""
    fields = vars(args)
    apply_kv_policy(fields, fields.pop("kv_policy", None), fields.pop("tangram_profile", None),
                    {name: fields.pop(name, None) for name in KERNEL_CHOICES})
    return original(cls, args)


def init_around(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ServerArgs.__init__: accept ``kv_policy=`` / ``tangram_profile=`` / ``tangram_*_kernel=`` keywords
    (Engine API)."""
    policy = kwargs.pop("kv_policy", None)
    profile = kwargs.pop("tangram_profile", None)
    kernels = {name: kwargs.pop(name, None) for name in KERNEL_CHOICES}
    if policy is not None or profile is not None or any(v is not None for v in kernels.values()):
        apply_kv_policy(kwargs, policy, profile, kernels)
    original(self, *args, **kwargs)


def register() -> None:
    HookRegistry.register(f"{_SA}.add_cli_args", add_cli_args_after, HookType.AFTER)
    HookRegistry.register(f"{_SA}.from_cli_args", from_cli_args_around, HookType.AROUND)
    HookRegistry.register(f"{_SA}.__init__", init_around, HookType.AROUND)
