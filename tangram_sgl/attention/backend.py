"""``TangramAttnBackend``: SGLang's attention backend over the tangram head-group pool.

Built by the ``tangram`` factory (``tangram_sgl.patches.attention_backend``) from the model runner: the
:class:`TangramKVManager` comes from the runner's KV cache (:class:`TangramKVCache`, built by the pool
hook), the profile from ``--tangram-profile``. Per forward, :meth:`init_forward_metadata` maps the batch
rows to the manager's requests (:mod:`tangram_sgl.attention.batch_rows`) and builds a
:class:`ForwardStep` (CSR slot lists per (request, group), decode slots, the AOT split row of the batch
bucket); every ``RadixAttention`` layer then calls :meth:`ForwardStep.attend`, and the last layer commits
the prefilled segments. The kernels are the Triton ones on CUDA and the torch references on CPU.

Decode CUDA graphs (SGLang's decode graph runner, any bucket list): :meth:`init_cuda_graph_state` allocates
:class:`DecodeGraphBuffers`; capture runs every bucket with padding rows only; before a replay the
``can_run_graph`` hook (``tangram_sgl.patches.cuda_graph``) hands the live ``ForwardBatch`` to
:meth:`prepare_graph_step`, which builds the host step (the view SGLang passes at replay carries no request
ids), and :meth:`init_forward_metadata_out_graph` copies it into the static buffers. A batch the graph
cannot take runs eagerly on the same prepared step.

Prefill CUDA graphs, breakable only (SGLang's default on CUDA, kept by the server-args hook): SGLang captures the
transformer body as graph segments split at every attention call, which runs eagerly at replay. So an extend
step's metadata is the eager one (SGLang calls :meth:`init_forward_metadata` with the live batch before each
replay) and each layer's attention is the eager :meth:`ForwardStep.attend` on the real tokens. SGLang's capture
and warm-up forwards carry no requests: while the ``PrefillCudaGraphRunner.capture`` hook
(``tangram_sgl.patches.prefill_graph``) holds :meth:`prefill_capture`, such a batch gets a
:class:`CaptureExtendStep` (zeros, no cache access); anywhere else a batch without request ids is refused.

SGLang's overlap scheduler (its default) is served: rows never read ``input_ids``, the decoded ids are resolved by
the radix cache from SGLang's ``req``; the settings that break its order are refused with it. Not supported yet,
each refused at construction with the flag to use: full / torch.compile prefill CUDA graphs, tensor / pipeline /
data-parallel attention, two-batch overlap, PD multiplexing, speculative decoding; per layer: sliding windows,
logit capping, cross attention, a model that writes its own KV (``save_kv_cache=False``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from tangram_sgl.attention.batch_rows import batch_rows
from tangram_sgl.attention.decode_graph import DecodeGraphBuffers, GraphDecodeStep
from tangram_sgl.attention.forward_step import AttentionContext, ForwardStep
from tangram_sgl.attention.segment_scoring import PreRope, config_pre_rope, needs_pre_rope
from tangram_sgl.attention.servable import PREFILL_GRAPH_BACKENDS, TangramNotServable, overlap_conflict
from tangram_sgl.kernels.extend import warm_up_extend
from tangram_sgl.pool.sglang_kv_cache import TangramKVCache
from tangram_sgl.profile import TangramProfile

logger = logging.getLogger(__name__)


def check_server_args(sa: Any) -> None:
    """Raise :class:`TangramNotServable` naming the flag for every setting this backend cannot serve."""
    graphs = sa.cuda_graph_config
    if graphs is not None and graphs.prefill.backend not in PREFILL_GRAPH_BACKENDS:
        raise TangramNotServable(f"--kv-policy tangram: prefill CUDA graphs run only as breakable graphs (attention "
                                 f"eager between captured segments), not {graphs.prefill.backend!r}; pass "
                                 f"--cuda-graph-backend-prefill breakable or disabled")
    if not sa.disable_overlap_schedule and (refusal := overlap_conflict(lambda name: getattr(sa, name, False))):
        raise TangramNotServable(refusal)
    for name, flag in (("tp_size", "--tp"), ("pp_size", "--pp"), ("dp_size", "--dp")):
        if getattr(sa, name, 1) != 1:
            raise TangramNotServable(f"--kv-policy tangram runs on one GPU for now; {flag} {getattr(sa, name)} "
                                     f"is not supported")
    for name, flag in (("enable_dp_attention", "--enable-dp-attention"),
                       ("enable_two_batch_overlap", "--enable-two-batch-overlap"),
                       ("enable_pdmux", "--enable-pdmux")):
        if getattr(sa, name, False):
            raise TangramNotServable(f"--kv-policy tangram does not support {flag}")
    if getattr(sa, "speculative_algorithm", None) is not None:
        raise TangramNotServable("--kv-policy tangram does not support speculative decoding")


class CaptureExtendStep:
    """The step of a forward without requests (SGLang's prefill-graph capture and warm-up): attention gives
    zeros of the query's shape and nothing is read from or written to the cache."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.zeros_like(q)

    def commit(self) -> None:
        pass


def _pre_rope(profile: TangramProfile, model_runner: Any, device: torch.device) -> PreRope | None:
    """The model's RoPE when the profile's scorer reads pre-RoPE queries (SGLang hands attention rotated ones)."""
    if not needs_pre_rope(profile.runtime_scorer):
        return None
    try:
        return config_pre_rope(model_runner.model_config.hf_config, device)
    except ValueError as e:
        raise TangramNotServable(f"the profile's scorer {profile.runtime_scorer!r} reads pre-RoPE queries: {e}") from e


class TangramAttnBackend(AttentionBackend):
    """Attention over per-(request, head group) slot lists, writing K/V through the tangram manager."""

    def __init__(self, model_runner: Any, profile: TangramProfile | None = None, kernels: str | None = None,
                 extend_kernel: str | None = None, decode_kernel: str | None = None):
        super().__init__()
        check_server_args(model_runner.server_args)
        cache = model_runner.token_to_kv_pool
        if not isinstance(cache, TangramKVCache):
            raise TangramNotServable(f"the tangram attention backend needs the tangram KV pool, but the runner "
                                     f"holds {type(cache).__name__} (is --kv-policy tangram set, so that the pool "
                                     f"hook builds it?)")
        if profile is None:
            from tangram_sgl.patches.memory_pool import served_profile

            profile = served_profile(model_runner.model_config)
        self.token_to_kv_pool = cache  # SGLang reads the pools through the active backend
        self.req_to_token_pool = getattr(model_runner, "req_to_token_pool", None)
        self.manager = cache.manager
        self.context = AttentionContext.create(self.manager, profile, kernels=kernels, extend_kernel=extend_kernel,
                                               decode_kernel=decode_kernel,
                                               pre_rope=_pre_rope(profile, model_runner, self.manager.pool.device))
        if self.context.flashinfer_extend is not None:
            logger.info("tangram: extend attention runs through FlashInfer (--tangram-extend-kernel %s%s)",
                        extend_kernel, f": steps adding more than {self.context.flashinfer_min_new} tokens to a row"
                        if self.context.flashinfer_min_new else "")
            t0 = time.perf_counter()
            self.context.flashinfer_extend.warm_up(profile.model.num_attention_heads, profile.model.head_dim,
                                                   model_runner.dtype, self.manager.pool.k_buffer.dtype)
            logger.info("tangram: FlashInfer extend kernels warmed up (JIT-compiled if new) in %.1f s",
                        time.perf_counter() - t0)
        if self.context.triton_extend:
            t0 = time.perf_counter()
            pool, lay = self.manager.pool, self.manager.layout
            n = warm_up_extend(profile.model.num_attention_heads, pool.k_buffer, pool.v_buffer,
                               self.context.head_group[0], self.context.head_column[0], lay.num_groups,
                               model_runner.dtype)
            logger.info("tangram: %d variants of the Triton extend kernel warmed up (compiled if new) in %.1f s", n,
                        time.perf_counter() - t0)
        self.num_layers = self.manager.layout.num_layers
        self.step: ForwardStep | GraphDecodeStep | CaptureExtendStep | None = None
        self._capturing_prefill = False  # inside SGLang's prefill-graph capture (see prefill_capture)
        self.graph: DecodeGraphBuffers | None = None
        self._prepared: tuple[Any, ForwardStep] | None = None  # (live batch, its step) from prepare_graph_step
        self._checked_layers: set[int] = set()

    # ------------------------------------------------------------------ metadata
    def _host_step(self, forward_batch: Any) -> ForwardStep:
        return self.context.step(batch_rows(forward_batch, self.manager))

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager forward: rows -> requests, then the step's slot lists, decode slots and AOT split row (the step
        :meth:`prepare_graph_step` built for this very batch, when the graph then declined it)."""
        prepared, self._prepared = self._prepared, None
        if forward_batch.forward_mode.is_idle():
            self.step = None
        elif self._capturing_prefill and forward_batch.rids is None and forward_batch.forward_mode.is_extend():
            self.step = CaptureExtendStep()
        elif prepared is not None and prepared[0] is forward_batch:
            self.step = prepared[1]
        else:
            self.step = self._host_step(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph = DecodeGraphBuffers(self.context, max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def prepare_graph_step(self, forward_batch: Any) -> bool:
        """Before a decode graph replay (``can_run_graph`` hook): build the live batch's host step; whether its
        metadata fits the static buffers (if not, SGLang runs the batch eagerly, on this same step)."""
        self._prepared = None
        if self.graph is None or not forward_batch.forward_mode.is_decode():
            return False
        step = self._host_step(forward_batch)
        self._prepared = (forward_batch, step)
        return self.graph.fits(step)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Decode graphs: padding-only rows at capture; at replay the prepared step copied into the buffers
        (``forward_batch`` is then SGLang's replay view: padded bucket size, no request ids)."""
        if self.graph is None:
            raise RuntimeError("the tangram backend got a CUDA-graph call before init_cuda_graph_state")
        bs = forward_batch.batch_size
        if in_capture:
            self.step = self.graph.capture(bs)
            return
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            raise RuntimeError("decode graph replay without a prepared step: the can_run_graph hook "
                               "(tangram_sgl.patches.cuda_graph) did not run for this batch")
        live = bs - getattr(forward_batch, "num_padding", 0)
        if len(prepared[1].rows) != live:
            raise RuntimeError(f"decode graph replay of {live} rows, but the prepared step has "
                               f"{len(prepared[1].rows)}")
        self.step = self.graph.load(prepared[1], bs)

    @contextmanager
    def prefill_capture(self) -> Iterator[None]:
        """While SGLang captures prefill graphs: its request-less extend batches get a :class:`CaptureExtendStep`."""
        self._capturing_prefill = True
        try:
            yield
        finally:
            self._capturing_prefill = False

    # ------------------------------------------------------------------ per layer
    def _check_layer(self, layer: Any, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            raise TangramNotServable(f"layer {layer.layer_id} asked the tangram backend not to store its K/V "
                                     f"(save_kv_cache=False: the model writes K/V itself), which it cannot honour")
        if layer.layer_id in self._checked_layers:
            return
        lay, pool = self.manager.layout, self.manager.pool
        if layer.tp_k_head_num != lay.num_kv_heads or layer.tp_q_head_num % lay.num_kv_heads:
            raise TangramNotServable(f"layer {layer.layer_id} has {layer.tp_q_head_num} q / {layer.tp_k_head_num} kv "
                                     f"heads; the profile has {lay.num_kv_heads} kv heads per layer")
        if not layer.qk_head_dim == layer.v_head_dim == pool.head_dim:
            raise TangramNotServable(f"layer {layer.layer_id}: head dims q/k {layer.qk_head_dim}, v {layer.v_head_dim} "
                                     f"differ from the pool's {pool.head_dim}")
        if layer.sliding_window_size not in (None, -1) or layer.logit_cap or layer.is_cross_attention:
            raise TangramNotServable(f"layer {layer.layer_id}: sliding windows, logit capping and cross attention "
                                     f"are not supported by the tangram backend")
        self._checked_layers.add(layer.layer_id)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any,
                save_kv_cache: bool) -> torch.Tensor:
        self._check_layer(layer, save_kv_cache)
        if self.step is None:
            raise RuntimeError("the tangram backend ran a layer without init_forward_metadata for this batch")
        hq, d = layer.tp_q_head_num, layer.qk_head_dim
        out = self.step.attend(layer.layer_id, q.view(-1, hq, d), k.view(-1, layer.tp_k_head_num, d),
                               v.view(-1, layer.tp_v_head_num, d), layer.scaling)
        if layer.layer_id == self.num_layers - 1:
            self.step.commit()
        return out.view(-1, hq * d)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, save_kv_cache)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, save_kv_cache)
