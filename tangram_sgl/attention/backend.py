"""``TangramAttnBackend``: SGLang's attention backend over the tangram head-group pool.

Built by the ``tangram`` factory (``tangram_sgl.patches.attention_backend``) from the model runner: the
:class:`TangramKVManager` comes from the runner's KV cache (:class:`TangramKVCache`, built by the pool
hook), the profile from ``--tangram-profile``. Per forward, :meth:`init_forward_metadata` maps the batch
rows to the manager's requests (:mod:`tangram_sgl.attention.batch_rows`) and builds a
:class:`ForwardStep` (CSR slot lists per (request, group), decode slots, the AOT split row of the batch
bucket); every ``RadixAttention`` layer then calls :meth:`ForwardStep.attend`, and the last layer commits
the prefilled segments. The kernels are the Triton ones on CUDA and the torch references on CPU.

Not supported yet, each refused at construction with the flag to use: CUDA graphs (decode and prefill),
overlap scheduling, tensor / pipeline / data-parallel attention, two-batch overlap, PD multiplexing,
speculative decoding; per layer: sliding windows, logit capping, cross attention, a model that writes its
own KV (``save_kv_cache=False``).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from tangram_sgl.attention.batch_rows import batch_rows
from tangram_sgl.attention.forward_step import AttentionContext, ForwardStep
from tangram_sgl.patches.attention_backend import TangramNotServable
from tangram_sgl.pool.sglang_kv_cache import TangramKVCache
from tangram_sgl.profile import TangramProfile

CUDA_GRAPH_FLAGS = "--disable-cuda-graph (i.e. --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled)"


def cuda_graph_error() -> TangramNotServable:
    return TangramNotServable(
        f"--kv-policy tangram: the tangram attention backend does not support CUDA graphs yet "
        f"(decode metadata is built on the host per step); pass {CUDA_GRAPH_FLAGS}")


def check_server_args(sa: Any) -> None:
    """Raise :class:`TangramNotServable` naming the flag for every setting this backend cannot serve."""
    graphs = sa.cuda_graph_config
    if graphs is not None and (graphs.decode.backend != "disabled" or graphs.prefill.backend != "disabled"):
        raise cuda_graph_error()
    if not sa.disable_overlap_schedule:
        raise TangramNotServable("--kv-policy tangram: the tangram attention backend needs the decoded token ids "
                                 "on the host when a step starts; pass --disable-overlap-schedule")
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


class TangramAttnBackend(AttentionBackend):
    """Attention over per-(request, head group) slot lists, writing K/V through the tangram manager."""

    def __init__(self, model_runner: Any, profile: TangramProfile | None = None, kernels: str | None = None):
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
        self.context = AttentionContext.create(self.manager, profile, kernels=kernels)
        self.num_layers = self.manager.layout.num_layers
        self.step: ForwardStep | None = None
        self._checked_layers: set[int] = set()

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Rows -> requests, then the step's slot lists, decode slots and AOT split row."""
        if forward_batch.forward_mode.is_idle():
            self.step = None
            return
        rows, decode_ids = batch_rows(forward_batch, self.manager)
        self.step = self.context.step(rows, decode_ids)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise cuda_graph_error()

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: Any) -> None:
        raise cuda_graph_error()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        raise cuda_graph_error()

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
