"""``TangramAttnBackend``: metadata, 2-turn / chunked / mixed forwards through SGLang's ``RadixAttention`` and
``ForwardBatch``, and the factory through SGLang's attention registry.

CPU by default (torch reference kernels; the Triton variant under TRITON_INTERPRET=1). On a GPU machine:
``TANGRAM_ATTN_TEST_DEVICE=cuda pytest tests/test_attention_backend.py`` runs the same tests with the pool
on CUDA (Triton kernels selected by default; fp32 ``tl.dot`` there is TF32, hence the looser tolerance).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys

DEV = os.environ.get("TANGRAM_ATTN_TEST_DEVICE", "cpu")  # on CPU, Triton runs interpreted (tests/conftest.py)
TOL = 1e-4 if DEV == "cpu" else 1e-2
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
    set_tc_piecewise_forward_context,
)
from tangram_sgl.patches.cuda_graph import can_run_graph_around
from tangram_sgl.patches.prefill_graph import capture_around
from transformers import LlamaConfig, LlamaForCausalLM

from tangram_sgl.attention.backend import TangramAttnBackend
from tangram_sgl.attention.forward_step import AttentionContext, StepError, StepRow, layout_flashinfer_extend
from tangram_sgl.attention.servable import TangramNotServable
from tangram_sgl.budget import kept_tokens
from tangram_sgl.pool.invariants import check_invariants
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.request_kv import UNRESOLVED
from tangram_sgl.pool.sglang_kv_cache import TangramKVCache
from tangram_sgl.profile import ModelIdentity, TangramProfile
from tangram_sgl.profile_builder import build_profile, uniform_profile
from tangram_sgl.replay.attention_hook import install
from tangram_sgl.replay.reference_engine import ReferenceEngine

VOCAB = 256
LAYERS, HEADS, KV_HEADS = 2, 4, 2
HEAD_DIM = 64 if os.environ.get("TANGRAM_ATTN_TEST_DEVICE") == "cuda" else 16  # FlashInfer: 64/128/256 only


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(seed: int = 0, arch: str = "llama") -> LlamaForCausalLM:
    """A 2-layer GQA model of Llama or Qwen2 architecture (Qwen2: q/k/v biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = config_cls(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024)
    return model_cls(cfg).eval().to(DEV)


def server_args(**changes) -> SimpleNamespace:
    off = PhaseConfig(backend=Backend.DISABLED)
    sa = SimpleNamespace(cuda_graph_config=CudaGraphConfig(decode=off, prefill=copy.deepcopy(off)),
                         disable_overlap_schedule=True, tp_size=1, pp_size=1, dp_size=1, enable_dp_attention=False,
                         enable_two_batch_overlap=False, enable_pdmux=False, speculative_algorithm=None)
    for k, v in changes.items():
        setattr(sa, k, v)
    return sa


def fake_runner(kv: TangramKVManager, config, **sa_changes) -> SimpleNamespace:
    """The attributes of SGLang's ModelRunner the backend reads."""
    return SimpleNamespace(server_args=server_args(**sa_changes), token_to_kv_pool=TangramKVCache(kv, 4096, DEV),
                           req_to_token_pool=None, model_config=SimpleNamespace(hf_config=config), device=DEV,
                           dtype=kv.pool.k_buffer.dtype)


def mixed_profile(config, page_size: int, heads_per_group: int, seed: int, scorer: str = "snapkv",
                  **aot) -> TangramProfile:
    """Non-uniform budgets (0.1 .. 0.6); groups of ``heads_per_group`` across layers."""
    ident = ModelIdentity.from_config(config)
    g = torch.Generator().manual_seed(seed)
    mean = (torch.rand(ident.num_layers, ident.num_kv_heads, generator=g) * 0.5 + 0.1).tolist()
    return build_profile(ident, mean, [[0.0] * ident.num_kv_heads] * ident.num_layers, scorer=scorer,
                         target_ratio=0.3, alpha=0.0, page_size=page_size, heads_per_group=heads_per_group,
                         sink_tokens=2, recent_window=6, **aot)


def forward_batch(mode: ForwardMode, rows: list[tuple[str, int, list[int]]]) -> ForwardBatch:
    """A batch as SGLang builds it: rows of (rid, first position, new token ids)."""
    ids = [t for _, _, toks in rows for t in toks]
    pos = [p for _, s, toks in rows for p in range(s, s + len(toks))]
    seq = [s + len(toks) for _, s, toks in rows]
    fb = ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=torch.tensor(ids, device=DEV),
                      req_pool_indices=torch.arange(len(rows), device=DEV), seq_lens=torch.tensor(seq, device=DEV),
                      out_cache_loc=torch.zeros(len(ids), dtype=torch.int64, device=DEV), seq_lens_sum=sum(seq),
                      seq_lens_cpu=torch.tensor(seq), positions=torch.tensor(pos, device=DEV),
                      rids=[r for r, _, _ in rows])
    if mode != ForwardMode.DECODE:
        fb.extend_prefix_lens_cpu = [s for _, s, _ in rows]
        fb.extend_seq_lens_cpu = [len(t) for _, _, t in rows]
        fb.extend_prefix_lens = torch.tensor(fb.extend_prefix_lens_cpu, device=DEV)
        fb.extend_seq_lens = torch.tensor(fb.extend_seq_lens_cpu, device=DEV)
        fb.extend_num_tokens = len(ids)
    return fb


# ---------------------------------------------------------------------------------------------- (a) metadata
def _write_segment(kv: TangramKVManager, rid: str, n: int, start: int, seed: int) -> None:
    """Write every layer of the pending segment with K[..., 0] = absolute position and random scores."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(kv.layout.num_layers):
        k = torch.zeros(kv.layout.num_kv_heads, n, HEAD_DIM, device=DEV)
        k[..., 0] = torch.arange(start, start + n, dtype=torch.float32)
        k[..., 1] = layer
        kv.write_segment_layer(rid, layer, k, k.clone(), torch.rand(kv.layout.num_kv_heads, n, generator=g).to(DEV))
    kv.commit_segment(rid)


def _decode_kv(kv: TangramKVManager, position: int) -> torch.Tensor:
    k = torch.zeros(kv.layout.num_layers, kv.layout.num_kv_heads, HEAD_DIM, device=DEV)
    k[..., 0] = position
    return k


def _step_slots(step, row: int, g: int) -> torch.Tensor:
    """The slots (row, group g) of a step attends to: a CSR list (extend) or an arena range (decode)."""
    i = row * step.ctx.kv.num_groups + g
    if step.decode_only:
        lo = int(step.kv_starts[i])
        return step.kv_indices[lo:lo + int(step.kv_lens[i])]
    return step.kv_indices[int(step.kv_indptr[i]):int(step.kv_indptr[i + 1])]


def _csr_positions(step, kv: TangramKVManager, row: int, layer: int, head: int) -> list[int]:
    """Absolute positions (K[..., 0]) stored at the step's slot list of (row, head's group), head's column."""
    g, c = kv.layout.layers[layer].group[head], kv.layout.layers[layer].column[head]
    slots = _step_slots(step, row, g).long()
    ps = kv.page_size
    return kv.pool.k_buffer[slots // ps, c, slots % ps, 0].long().tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_metadata_for_ragged_extend_decode_and_mixed_batches(page_size):
    cfg = tiny_llama().config
    cfg.num_key_value_heads = 4  # 2 layers x 4 kv heads in groups of 3: three groups, two spanning layers
    profile = mixed_profile(cfg, page_size, 3, seed=5)
    kv = TangramKVManager.from_profile(profile, 2000 // page_size + 100, head_dim=HEAD_DIM, dtype=torch.float32,
                                       device=DEV)
    assert kv.num_groups == 3
    backend = TangramAttnBackend(fake_runner(kv, cfg), profile)
    sink, win = profile.sink_tokens, profile.recent_window

    # history: "old" prefilled 40 tokens, decoded 3, finished -> the tree holds [40 compressed ; 3 full]
    old = list(range(1, 41))
    kv.admit("old", old)
    kv.reserve("old", old, decode_tokens=3)
    _write_segment(kv, "old", 40, 0, seed=1)
    for p, t in zip(range(40, 43), (41, 42, 43)):
        kv.append_decode("old", t, _decode_kv(kv, p), _decode_kv(kv, p))
    kv.finish("old")
    # a: turn 2 of "old" (prefix hit of 43, 10 new); b: fresh 7 tokens; c: prefilled 20, decoded 2
    a_ids = old + [41, 42, 43] + list(range(100, 110))
    assert kv.admit("a", a_ids).length == 43
    kv.reserve("a", a_ids[43:], decode_tokens=4)
    kv.admit("b", list(range(7)))
    kv.reserve("b", list(range(7)))
    kv.admit("c", list(range(200, 220)))
    kv.reserve("c", list(range(200, 220)), decode_tokens=4)
    _write_segment(kv, "c", 20, 0, seed=2)
    for p in (20, 21):
        kv.append_decode("c", 7, _decode_kv(kv, p), _decode_kv(kv, p))

    # EXTEND [a, b]: a sees its compressed prefix, b nothing; new tokens are read from staging
    backend.init_forward_metadata(forward_batch(ForwardMode.EXTEND, [("a", 43, a_ids[43:]), ("b", 0, list(range(7)))]))
    step = backend.step
    assert step.qo_indptr.tolist() == [0, 10, 17] and not step.decode_only
    assert step.compress == {0: True, 1: any(kept_tokens(b, 7, 0, sink, win) < 7 for b in kv.layout.group_budget)}
    G = kv.num_groups
    for g in range(G):
        expect = kept_tokens(kv.layout.group_budget[g], 40, 0, sink, win) + 3
        assert int(step.kv_indptr[g + 1] - step.kv_indptr[g]) == expect
        assert int(step.kv_indptr[G + g + 1] - step.kv_indptr[G + g]) == 0
    for layer in range(LAYERS):
        for h in range(4):
            seen = _csr_positions(step, kv, 0, layer, h)
            assert seen == kv.gather("a", layer, h)[2].tolist()  # each column reads its own head's kept tokens
            assert seen[-3:] == [40, 41, 42] and seen == sorted(seen)
    kept_sets = {tuple(_csr_positions(step, kv, 0, layer, h)) for layer in range(LAYERS) for h in range(4)}
    assert len(kept_sets) > 1  # heads keep different tokens

    # DECODE [c]: the new token's slot is opened in every group and is the last entry of each list
    fb = forward_batch(ForwardMode.DECODE, [("c", 22, [9])])
    fb.input_ids = None  # never read: under overlap scheduling it is still being gathered on the GPU
    backend.init_forward_metadata(fb)
    step = backend.step
    assert step.decode_only and step.token_slots.shape == (1, G)
    assert step.on_arena
    for g in range(G):
        slots = _step_slots(step, 0, g)
        assert len(slots) == kept_tokens(kv.layout.group_budget[g], 20, 0, sink, win) + 3
        assert int(slots[-1]) == int(step.token_slots[0, g])
        assert slots.tolist() == torch.cat([kv.request_lists("c")[g]]).tolist()
    assert step.splits.tolist() == list(profile.aot_split.splits_for(1))
    assert step.max_splits == max(profile.aot_split.splits_for(1))
    assert kv.requests["c"].token_ids[-1] == UNRESOLVED  # the id comes from SGLang's req, at the cache hooks
    kv.resolve_tokens("c", kv.requests["c"].token_ids[:-1] + [9])
    assert kv.requests["c"].token_ids[-1] == 9 and kv.requests["c"].decode.token_ids[-1] == 9
    check_invariants(kv, deep=True)

    # MIXED [a extend, c decode]: c's list excludes its new token (read from staging), its slots are opened
    committed_c = len(kv.requests["c"].token_ids)
    backend.init_forward_metadata(forward_batch(ForwardMode.MIXED, [("a", 43, a_ids[43:]), ("c", committed_c, [5])]))
    step = backend.step
    assert not step.decode_only and step.extend_rows == [0] and step.decode_index.tolist() == [10]
    for g in range(G):
        assert int(step.kv_indptr[G + g + 1] - step.kv_indptr[G + g]) == kept_tokens(
            kv.layout.group_budget[g], 20, 0, sink, win) + 3
    assert step.token_slots.shape == (1, G) and len(kv.requests["c"].token_ids) == committed_c + 1

    # rows that do not match the cache, and unsupported modes, fail loudly
    with pytest.raises(StepError, match="covers"):
        backend.init_forward_metadata(forward_batch(ForwardMode.EXTEND, [("a", 42, a_ids[42:])]))
    with pytest.raises(StepError, match="sequence length"):
        backend.init_forward_metadata(forward_batch(ForwardMode.DECODE, [("c", 5, [1])]))
    with pytest.raises(StepError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(forward_batch(ForwardMode.TARGET_VERIFY, [("b", 0, list(range(7)))]))
    with pytest.raises(StepError, match="not running"):
        backend.init_forward_metadata(forward_batch(ForwardMode.DECODE, [("nobody", 0, [1])]))


# ---------------------------------------------------------------------------------------------- (b) end to end
class _RadixStep:
    """transformers' attention call -> SGLang's RadixAttention layer -> the active attention backend."""

    def __init__(self, layers: list[RadixAttention], fb: ForwardBatch):
        self.layers, self.fb = layers, fb

    def attend(self, layer, q, k, v, scaling):
        t = q.shape[1]
        flat = [x.transpose(0, 1).reshape(t, -1) for x in (q, k, v)]
        return self.layers[layer](*flat, self.fb).view(t, q.shape[0], q.shape[-1])


class _DenseCacheStep:
    """Independent dense reference: a full per-(layer, kv head) K/V cache of every token a conversation has
    computed (K/V as they were computed, so compressed history shows in later tokens); new tokens at
    [start, start+n) see, per (layer, kv head), only the given cached positions, and each other causally."""

    def __init__(self, cache: dict[int, tuple[torch.Tensor, torch.Tensor]], start: int,
                 visible: dict[tuple[int, int], torch.Tensor]):
        self.cache, self.start, self.visible = cache, start, visible

    def attend(self, layer, q, k, v, scaling):
        hq, t, d = q.shape
        gq = hq // k.shape[0]
        old_k, old_v = self.cache.get(layer, (k[:, :0], v[:, :0]))
        keys, vals = torch.cat([old_k[:, :self.start], k], 1), torch.cat([old_v[:, :self.start], v], 1)
        self.cache[layer] = (keys, vals)
        out = torch.empty(t, hq, d, device=q.device)
        for h in range(k.shape[0]):
            mask = torch.zeros(t, self.start + t, dtype=torch.bool, device=q.device)
            mask[:, self.visible[(layer, h)].to(q.device)] = True
            mask[:, self.start:] = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            logits = torch.einsum("gtd,sd->gts", q[h * gq:(h + 1) * gq], keys[h]) * scaling
            p = logits.masked_fill(~mask, float("-inf")).softmax(-1)
            out[:, h * gq:(h + 1) * gq] = torch.einsum("gts,sd->tgd", p, vals[h])
        return out


class Harness:
    """SGLang's side of a server, by hand: scheduling (admit / reserve / finish as the hooks do), batches,
    and a forward whose attention layers are SGLang RadixAttention modules running the tangram backend."""

    def __init__(self, model: LlamaForCausalLM, profile: TangramProfile, pages: int, kernels: str | None = None,
                 kv: TangramKVManager | None = None, graph_buckets: tuple[int, ...] = (),
                 prefill_buckets: tuple[int, ...] = (), decode_kernel: str | None = None):
        self.model = model
        install(model)
        self.kv = kv or TangramKVManager.from_profile(profile, pages, dtype=torch.float32, device=DEV)
        sa = {"cuda_graph_config": CudaGraphConfig(decode=PhaseConfig(backend=Backend.DISABLED),
                                                   prefill=PhaseConfig(backend=Backend.BREAKABLE))} \
            if prefill_buckets else {}
        self.backend = TangramAttnBackend(fake_runner(self.kv, model.config, **sa), profile, kernels=kernels,
                                          decode_kernel=decode_kernel)
        self.layers = [RadixAttention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS, layer_id=i) for i in range(LAYERS)]
        self.dense_cache: dict[str, dict] = {}  # conversation (first letter of the rid) -> _DenseCacheStep cache
        self.checked_rows = 0
        self.graph_buckets, self.graph_replays = graph_buckets, 0
        self.captured: dict[int, tuple[int, ...]] = {}
        if graph_buckets:
            self.capture_graphs()
        self.prefill_buckets, self.prefill_replays = prefill_buckets, 0
        if prefill_buckets:
            self.capture_prefill_graphs()

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.backend)):
            return self.model(input_ids=fb.input_ids[None], position_ids=fb.positions[None], use_cache=False,
                              tangram_step=_RadixStep(self.layers, fb)).logits[0]

    @staticmethod
    def _addresses(step) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (step.token_slots, step.kv_starts, step.kv_lens, step.kv_indices,
                                            step.splits))

    def capture_graphs(self) -> None:
        """What SGLang's decode graph runner does at start: static state, then each bucket (largest first)
        run once on padding rows only; records the addresses each bucket's graph would read."""
        self.backend.init_cuda_graph_state(max(self.graph_buckets), max(self.graph_buckets))
        free = self.kv.free_pages()
        for bs in sorted(self.graph_buckets, reverse=True):
            fb = forward_batch(ForwardMode.DECODE, [(f"pad{i}", 0, [0]) for i in range(bs)])
            fb.rids = None  # the runner's capture batch carries no request ids
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
            self.captured[bs] = self._addresses(self.backend.step)
            self._forward(fb)
        assert self.kv.free_pages() == free  # capture touches no request state

    def capture_prefill_graphs(self) -> None:
        """What SGLang's breakable prefill graph runner does at start, through the capture hook: per token bucket,
        a request-less EXTEND batch's metadata, then two warm-up forwards and the captured one."""
        free = self.kv.free_pages()

        def capture(runner) -> None:
            for n in sorted(self.prefill_buckets, reverse=True):
                fb = forward_batch(ForwardMode.EXTEND, [("pad", 0, [0] * n)])
                fb.rids = None  # capture_prepare's batch carries no request ids
                self.backend.init_forward_metadata(fb)
                for _ in range(3):
                    assert not self._forward(fb).isnan().any()

        capture_around(capture, SimpleNamespace(model_runner=SimpleNamespace(attn_backend=self.backend)))
        assert self.kv.free_pages() == free and not self.kv.requests  # capture touches no request state

    def prefill_graph_forward(self, fb: ForwardBatch) -> torch.Tensor:
        """An extend / mixed batch replayed in the smallest captured token bucket: metadata from the live batch,
        then the forward on the padded static batch, every attention layer through SGLang's breakable-graph
        attention op (``unified_attention_with_output``: the backend sees the real tokens only)."""
        raw = len(fb.input_ids)
        n = min(b for b in self.prefill_buckets if b >= raw)
        self.backend.init_forward_metadata(fb)
        static = copy.copy(fb)
        static.forward_mode = ForwardMode.EXTEND  # load_batch normalises MIXED
        static.input_ids = torch.cat([fb.input_ids, fb.input_ids.new_zeros(n - raw)])
        static.positions = torch.cat([fb.positions, fb.positions.new_zeros(n - raw)])
        static.out_cache_loc = torch.cat([fb.out_cache_loc, fb.out_cache_loc.new_zeros(n - raw)])
        static.num_token_non_padded_cpu = raw
        self.prefill_replays += 1
        with set_tc_piecewise_forward_context(static, self.layers, None, [], [], num_tokens=n, raw_num_tokens=raw):
            return self._forward(static)[:raw]

    def graph_forward(self, fb: ForwardBatch) -> torch.Tensor:
        """A decode batch replayed in the smallest captured bucket: the can_run_graph hook prepares the step,
        the runner pads the batch and calls out_graph with its replay view (no request ids)."""
        raw = fb.batch_size
        bs = min(b for b in self.graph_buckets if b >= raw)
        runner = SimpleNamespace(attn_backend=self.backend)
        assert can_run_graph_around(lambda _runner, _fb: True, runner, fb)  # the seam, around SGLang's check
        pad = bs - raw
        view = SimpleNamespace(batch_size=bs, num_padding=pad, forward_mode=ForwardMode.DECODE)
        self.backend.init_forward_metadata_out_graph(view)
        assert self._addresses(self.backend.step) == self.captured[bs]  # what the captured graph reads
        padded = copy.copy(fb)
        padded.input_ids = torch.cat([fb.input_ids, fb.input_ids.new_zeros(pad)])
        padded.positions = torch.cat([fb.positions, fb.positions.new_zeros(pad)])
        self.graph_replays += 1
        return self._forward(padded)[:raw]

    def admit(self, rid: str, ids: list[int], max_new: int) -> int:
        hit = self.kv.admit(rid, ids, max_prefix_len=len(ids) - 1).length
        self.kv.reserve(rid, ids[hit:], decode_tokens=max_new - 1)
        return hit

    def step(self, mode: ForwardMode, rows: list[tuple[str, int, list[int]]]) -> list[int]:
        """Run one batch; check every row against a dense forward over each head's kept tokens; return the
        greedy next token of every row."""
        visible = {rid: {(l, h): self.kv.gather(rid, l, h)[2] for l in range(LAYERS) for h in range(KV_HEADS)}
                   for rid, _, _ in rows}
        fb = forward_batch(mode, rows)
        if self.graph_buckets and mode == ForwardMode.DECODE:
            logits = self.graph_forward(fb)
        elif self.prefill_buckets and mode != ForwardMode.DECODE:
            logits = self.prefill_graph_forward(fb)
        else:
            self.backend.init_forward_metadata(fb)
            logits = self._forward(fb)
        nxt, at = [], 0
        for rid, start, toks in rows:
            n = len(toks)
            step = _DenseCacheStep(self.dense_cache.setdefault(rid[0], {}), start, visible[rid])
            with torch.no_grad():
                dense = self.model(input_ids=torch.tensor([toks], device=DEV),
                                   position_ids=torch.arange(start, start + n, device=DEV)[None], use_cache=False,
                                   tangram_step=step).logits[0]
            torch.testing.assert_close(logits[at:at + n], dense, rtol=TOL, atol=TOL)
            self.checked_rows += 1
            nxt.append(int(logits[at + n - 1].argmax()))
            at += n
        return nxt

    def finish(self, rid: str, seq: list[int]):
        """What the radix cache's ``cache_finished_req`` does: the decoded tokens' ids (the backend opened them
        without reading them) from the request's sequence, then the insertion."""
        self.kv.resolve_tokens(rid, seq)
        return self.kv.finish(rid)

    def decode_rows(self, rids: list[str], last: dict[str, int]) -> list[tuple[str, int, list[int]]]:
        """Decode rows as SGLang schedules them: each request's last sampled token at its next position."""
        return [(rid, len(self.kv.requests[rid].token_ids), [last[rid]]) for rid in rids]


def run_conversations(h: Harness, seed: int) -> dict[str, list[int]]:
    """Two conversations: EXTEND [A1, B1], 3 DECODE steps, A1 finishes, MIXED [A2 (tree hit) + B1 decode],
    3 DECODE steps, both finish, EXTEND [B2 (tree hit)], 2 DECODE steps. Returns each turn's output ids."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    out: dict[str, list[int]] = {}
    a1, b1 = rand(37), rand(23)
    h.admit("A1", a1, 4)
    h.admit("B1", b1, 8)
    nxt = h.step(ForwardMode.EXTEND, [("A1", 0, a1), ("B1", 0, b1)])
    out["A1"], out["B1"] = [nxt[0]], [nxt[1]]
    for _ in range(3):
        nxt = h.step(ForwardMode.DECODE, h.decode_rows(["A1", "B1"], {"A1": out["A1"][-1], "B1": out["B1"][-1]}))
        out["A1"].append(nxt[0])
        out["B1"].append(nxt[1])
    h.finish("A1", a1 + out["A1"])
    a2 = a1 + out["A1"] + rand(11)
    hit = h.admit("A2", a2, 4)
    assert hit == len(a1) + 3  # prompt + decoded tokens whose K/V exist
    b_row = h.decode_rows(["B1"], {"B1": out["B1"][-1]})[0]
    nxt = h.step(ForwardMode.MIXED, [("A2", hit, a2[hit:]), b_row])
    out["A2"] = [nxt[0]]
    out["B1"].append(nxt[1])
    for _ in range(3):
        nxt = h.step(ForwardMode.DECODE, h.decode_rows(["A2", "B1"], {"A2": out["A2"][-1], "B1": out["B1"][-1]}))
        out["A2"].append(nxt[0])
        out["B1"].append(nxt[1])
    h.finish("A2", a2 + out["A2"])
    h.finish("B1", b1 + out["B1"])
    b2 = b1 + out["B1"] + rand(9)
    hit = h.admit("B2", b2, 3)
    assert hit == len(b1) + len(out["B1"]) - 1
    out["B2"] = h.step(ForwardMode.EXTEND, [("B2", hit, b2[hit:])])
    for _ in range(2):
        out["B2"] += h.step(ForwardMode.DECODE, h.decode_rows(["B2"], {"B2": out["B2"][-1]}))
    h.finish("B2", b2 + out["B2"])
    return out


@pytest.mark.parametrize("page_size,arch", [(1, "llama"), (16, "llama"), (16, "qwen2")])
def test_two_turns_exact_at_budget_one(page_size, arch):
    """Budget 1.0: every head keeps every token; the answers equal transformers' own greedy decoding (full
    forwards without a cache, the plainest reference: for the tiny Qwen2, HF's cached ``generate`` picks a
    different third token than its own cache-free forward, whose top two logits are 0.006 apart)."""
    model = tiny_llama(1, arch)
    profile = uniform_profile(model.config, 1.0, page_size=page_size, heads_per_group=3, sink_tokens=2,
                              recent_window=6)
    h = Harness(model, profile, pages=400)
    dense_model = copy.deepcopy(model)
    dense_model.set_attn_implementation("eager")
    out = run_conversations(h, seed=7)
    assert h.checked_rows == 2 + 6 + 2 + 6 + 1 + 2
    # at budget 1.0 the kept sets are all positions: the backend's greedy answers equal transformers' own
    g = torch.Generator().manual_seed(7)
    a1 = torch.randint(0, VOCAB, (37,), generator=g).tolist()
    seq = list(a1)
    with torch.no_grad():
        for _ in range(4):
            seq.append(int(dense_model(torch.tensor([seq], device=DEV)).logits[0, -1].argmax()))
    assert out["A1"] == seq[37:]
    assert h.kv.free_pages() + h.kv.evictable_pages() == 399 and not h.kv.requests


@pytest.mark.parametrize("page_size, scorer", [(1, "snapkv"), (16, "snapkv"), (16, "expected_attention")])
def test_two_turns_compressed_match_kept_tokens_and_reference_engine(page_size, scorer):
    """Non-uniform budgets < 1: every row equals dense attention over each head's kept tokens (checked inside
    the harness), and conversation A's answers and kept sets equal the CPU reference engine's (also with a
    scorer of pre-RoPE queries, whose RoPE the backend rebuilds from the model config)."""
    model = tiny_llama(2)
    profile = mixed_profile(model.config, page_size, 3, seed=11, scorer=scorer)
    h = Harness(model, profile, pages=400)
    out = run_conversations(h, seed=3)

    ref = ReferenceEngine(copy.deepcopy(model).cpu(), profile, kv_pages=400)
    g = torch.Generator().manual_seed(3)
    a1 = torch.randint(0, VOCAB, (37,), generator=g).tolist()
    torch.randint(0, VOCAB, (23,), generator=g)
    assert ref.generate("A1", a1, 4).output_ids == out["A1"]
    a2 = a1 + out["A1"] + torch.randint(0, VOCAB, (11,), generator=g).tolist()
    assert ref.generate("A2", a2, 4).output_ids == out["A2"]
    probe = a2 + out["A2"]
    for kv in (h.kv, ref.kv):
        kv.admit("probe", probe)
    kept = [(l, hh) for l in range(LAYERS) for hh in range(KV_HEADS)]
    for l, hh in kept:
        mine, theirs = h.kv.gather("probe", l, hh), ref.kv.gather("probe", l, hh)
        assert torch.equal(mine[2], theirs[2])
        torch.testing.assert_close(mine[0].cpu(), theirs[0], rtol=TOL, atol=TOL)
    sizes = {len(h.kv.gather("probe", l, hh)[2]) for l, hh in kept}
    assert max(sizes) < len(probe) - 1 and len(sizes) > 1  # compressed, non-uniformly


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_chunked_prefill_publishes_each_chunk_then_decodes(budget):
    """Chunked prefill (what cache_unfinished_req does between chunks: ``checkpoint``): each chunk is one
    segment; later chunks attend to the earlier, compressed chunks; every row checked as above."""
    model = tiny_llama(4)
    profile = (uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2, sink_tokens=2, recent_window=6)
               if budget == 1.0 else mixed_profile(model.config, 4, 2, seed=13))
    h = Harness(model, profile, pages=600)
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    assert h.kv.admit("C", ids, max_prefix_len=69).length == 0
    for lo, hi in ((0, 30), (30, 60), (60, 70)):
        h.kv.reserve("C", ids[lo:hi], decode_tokens=3 if hi == 70 else 0)
        nxt = h.step(ForwardMode.EXTEND, [("C", lo, ids[lo:hi])])
        if hi < 70:
            assert h.kv.checkpoint("C").length == hi  # the chunk is published in the tree
    decoded = []
    for _ in range(3):
        decoded.append(nxt[0])
        nxt = h.step(ForwardMode.DECODE, h.decode_rows(["C"], {"C": nxt[0]}))
    assert h.checked_rows == 6
    done = h.finish("C", ids + decoded)
    assert [seg.n for seg in done.segments()] == [30, 30, 10, 3]  # chunk boundaries are segment boundaries


class SglangScheduler:
    """SGLang 0.5.17's request path around the backend: ``TangramRadixCache`` (match, lock,
    ``cache_unfinished_req`` at chunk boundaries, ``cache_finished_req``), the BEFORE-``alloc_for_extend``
    reservation hook, ``ReqToTokenPool`` and the logical-id allocator; requests are duck-typed ``Req``s."""

    def __init__(self, h: Harness):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from tangram_sgl.pool.sglang_allocator import TangramTokenAllocator
        from tangram_sgl.radix.sglang_cache import TangramRadixCache

        self.h = h
        rtt = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
        max_tokens = h.kv.pool.allocator.usable_pages * h.kv.page_size // h.kv.num_groups
        alloc = TangramTokenAllocator(h.kv, max_tokens, 4 * max_tokens, torch.float32, "cpu")
        self.cache = TangramRadixCache(CacheInitParams(disable=False, req_to_token_pool=rtt,
                                                       token_to_kv_pool_allocator=alloc, page_size=1), h.kv)

    def admit(self, rid: str, prompt: list[int], max_new: int) -> SimpleNamespace:
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]))))
        req = SimpleNamespace(
            rid=rid, origin_input_ids=array("q", prompt), output_ids=array("q"), extra_key=None, req_pool_idx=None,
            prefix_indices=m.device_indices, last_node=m.last_device_node, cache_protected_len=len(m.device_indices),
            extend_range=None, full_untruncated_fill_ids=array("q", prompt), inflight_middle_chunks=0,
            kv_committed_len=0, sampling_params=SimpleNamespace(max_new_tokens=max_new))
        req.get_fill_ids = lambda r=req: (r.origin_input_ids + r.output_ids)[: r.extend_range.end]
        self.cache.inc_lock_ref(req.last_node)
        self.cache.req_to_token_pool.alloc([req])
        return req

    def run_chunk(self, req: SimpleNamespace, n: int) -> int:
        """The next ``n`` prompt tokens of ``req``: reservation hook, logical ids, EXTEND step; its sampled token."""
        from sglang.srt.mem_cache.allocation import alloc_token_slots
        from tangram_sgl.patches.memory_pool import reserve_for_extend

        start = len(req.prefix_indices)
        req.extend_range = SimpleNamespace(start=start, end=start + n)
        reserve_for_extend(SimpleNamespace(tree_cache=self.cache, reqs=[req]))
        row = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[start:start + n] = alloc_token_slots(self.cache, n).to(torch.int32)
        req.prefix_indices = row[:start + n].to(torch.int64).clone()
        return self.h.step(ForwardMode.EXTEND, [(req.rid, start, list(req.origin_input_ids[start:start + n]))])[0]

    def prefill_chunk(self, req: SimpleNamespace, n: int) -> int:
        """One chunk of ``n`` prompt tokens (EXTEND); a non-final chunk is cached as SGLang does."""
        nxt = self.run_chunk(req, n)
        if len(req.prefix_indices) < len(req.origin_input_ids):
            self.cache.cache_unfinished_req(req, chunked=True)
        else:
            req.output_ids.append(nxt)
        return nxt

    def run_decode(self, req: SimpleNamespace, pos: int, token: int) -> int:
        """A DECODE step of ``req``'s token ``token`` at position ``pos`` (its logical id allocated)."""
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        self.cache.req_to_token_pool.req_to_token[req.req_pool_idx, pos] = alloc_token_slots(self.cache, 1).to(
            torch.int32)
        return self.h.step(ForwardMode.DECODE, [(req.rid, pos, [token])])[0]

    def decode(self, req: SimpleNamespace) -> int:
        nxt = self.run_decode(req, len(req.origin_input_ids) + len(req.output_ids) - 1, req.output_ids[-1])
        req.output_ids.append(nxt)
        return nxt

    def finish(self, req: SimpleNamespace) -> list[int]:
        self.cache.cache_finished_req(req, is_insert=True,
                                      kv_len_to_handle=len(req.origin_input_ids) + len(req.output_ids) - 1)
        self.cache.req_to_token_pool.free(req)
        return list(req.output_ids)


def _checked_cache_path(budget: float, seed: int, monkeypatch) -> tuple[LlamaForCausalLM, TangramProfile]:
    """(tiny model, profile at ``budget``: uniform 1.0 or a mixed one) for a test through SGLang's cache path,
    with the pool invariants checked after every cache operation (the server's debug flag)."""
    from tangram_sgl.radix.sglang_cache import DEBUG_ENV

    monkeypatch.setenv(DEBUG_ENV, "1")
    model = tiny_llama(seed)
    return model, (uniform_profile(model.config, 1.0, page_size=4, heads_per_group=3, sink_tokens=2, recent_window=6)
                   if budget == 1.0 else mixed_profile(model.config, 4, 3, seed=17))


def _logical_ids_free(sched: SglangScheduler) -> int:
    alloc = sched.cache.token_to_kv_pool_allocator
    return alloc.free_pages.numel() + alloc.release_pages.numel()


def _overlap_turn(sched: SglangScheduler, req: SimpleNamespace, chunks: tuple[int, ...], max_new: int) -> list[int]:
    """One request in SGLang 0.5.17's overlap order: each batch is built and run before the previous batch's
    result is processed, so a decode row's input token is not yet in ``req.output_ids`` while its step is
    built; the last chunk's ``cache_unfinished_req`` comes after the first decode step; the finishing token is
    a row of one more batch, whose KV counts in ``kv_len_to_handle``."""
    for n in chunks[:-1]:
        sched.prefill_chunk(req, n)
    on_gpu = sched.run_chunk(req, chunks[-1])
    first = True
    while True:
        # output_ids lags: on_gpu is not in it yet
        nxt = sched.run_decode(req, len(req.origin_input_ids) + len(req.output_ids), on_gpu)
        req.output_ids.append(on_gpu)  # the previous batch's result, processed after this batch was launched
        if first:  # the last chunk's maybe_cache_unfinished_req, with the first decode slot already open
            sched.cache.cache_unfinished_req(req)
            first = False
        if len(req.output_ids) == max_new:  # finished; the batch just run wrote this token's KV
            break
        on_gpu = nxt
    sched.cache.cache_finished_req(req, is_insert=True,
                                   kv_len_to_handle=len(req.origin_input_ids) + len(req.output_ids))
    sched.cache.req_to_token_pool.free(req)
    return list(req.output_ids)


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_overlap_scheduling_order_through_sglang_radix_cache(budget, monkeypatch):
    """The same two-turn conversation in the overlap scheduler's order and in the plain one: the same answers,
    the decoded ids resolved from SGLang's ``req`` (the backend never reads ``input_ids``), the tree one token
    longer under overlap (the finishing token's KV was computed), the invariants after every cache operation,
    and every logical id back after each turn."""
    model, profile = _checked_cache_path(budget, 6, monkeypatch)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    question = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    answers, hits = {}, {}
    for overlap in (False, True):
        h = Harness(copy.deepcopy(model), profile, pages=900)
        sched = SglangScheduler(h)
        free_ids = _logical_ids_free(sched)
        req = sched.admit("t1", prompt, max_new=4)
        if overlap:
            answer = _overlap_turn(sched, req, (24, 26), 4)
        else:
            for n in (24, 26):
                sched.prefill_chunk(req, n)
            for _ in range(3):
                sched.decode(req)
            answer = sched.finish(req)
        assert not h.kv.requests and _logical_ids_free(sched) == free_ids
        keys = [t for node in h.kv.tree.nodes() for t in node.segment.token_ids]
        assert UNRESOLVED not in keys
        # another conversation with the same first prompt (session 15's one differing first turn on the H200):
        # at 1.0 matched inside the first turn's node, which splits at a page boundary (49 tokens at most, one is
        # left to compute, in whole pages of 4); compressed, only the first chunk's node (a compressed node is
        # matched whole or not at all)
        rep = sched.admit("t1-again", prompt, max_new=4)  # "t": the reference's dense cache of this prompt
        hit = len(rep.prefix_indices)
        assert hit == (48 if budget == 1.0 else 24)
        if overlap:
            repeated = _overlap_turn(sched, rep, (50 - hit,), 4)
        else:
            sched.prefill_chunk(rep, 50 - hit)
            for _ in range(3):
                sched.decode(rep)
            repeated = sched.finish(rep)
        req2 = sched.admit("t2", prompt + answer + question, max_new=2)
        hits[overlap] = len(req2.prefix_indices)
        answers[overlap] = answer, repeated
    assert answers[True] == answers[False]
    assert hits == {False: 50 + 3, True: 50 + 4}  # + the decoded tokens whose K/V exist


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_through_sglang_radix_cache_and_reservation_hook(budget, monkeypatch):
    """Two turns of a chunked conversation through SGLang's cache interfaces and the reservation hook; the
    second turn's match covers the first turn (its chunks and answer); every row checked as above; the pool
    invariants hold after every cache operation (the server's debug flag)."""
    model, profile = _checked_cache_path(budget, 6, monkeypatch)
    h = Harness(model, profile, pages=900)
    sched = SglangScheduler(h)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    req = sched.admit("t1", prompt, max_new=4)
    assert len(req.prefix_indices) == 0
    for n in (24, 26):  # chunked prefill: the first chunk is published in the tree at its boundary
        sched.prefill_chunk(req, n)
    for _ in range(3):
        sched.decode(req)
    answer = sched.finish(req)
    assert not h.kv.requests and not h.kv.external_locks
    turn2 = prompt + answer + torch.randint(0, VOCAB, (9,), generator=g).tolist()
    req2 = sched.admit("t2", turn2, max_new=2)
    assert len(req2.prefix_indices) == 50 + 3  # prompt chunks + the decoded tokens whose K/V exist
    sched.prefill_chunk(req2, len(turn2) - 53)
    sched.decode(req2)
    sched.finish(req2)
    assert h.checked_rows == 2 + 3 + 1 + 1
    assert h.kv.free_pages() + h.kv.evictable_pages() == 899
    check_invariants(h.kv, deep=True)


def test_triton_kernels_match_the_torch_path(monkeypatch):
    """The kernels the backend selects on CUDA (Triton; here under TRITON_INTERPRET=1), with an AOT table whose
    small min_split_tokens makes decode split and merge, and the token-balanced decode (--tangram-decode-kernel
    balanced; 5 programs, so that sequences cross programs, and the interpreter runs few): the same answers, every
    row checked as above."""
    monkeypatch.setattr("tangram_sgl.attention.kernel_set.BALANCED_PROGRAMS", 5)
    model = tiny_llama(2)
    profile = mixed_profile(model.config, 16, 3, seed=11, min_split_tokens=4)
    runs = []
    for kernels, decode in (("torch", None), ("triton", None), ("triton", "balanced")):
        h = Harness(copy.deepcopy(model), profile, pages=400, kernels=kernels, decode_kernel=decode)
        assert (h.backend.context.kernels.name, h.backend.context.kernels.decode_variant) == (kernels, decode or "aot")
        runs.append(run_conversations(h, seed=3))
    assert runs[0] == runs[1] == runs[2]
    assert max(profile.aot_split.splits_for(2)) > 1


def test_the_balanced_decode_needs_the_triton_kernels():
    """No silent fallback: the torch references have no token-balanced variant, so asking for it on them fails."""
    model = tiny_llama(2)
    profile = mixed_profile(model.config, 16, 3, seed=11)
    with pytest.raises(ValueError, match="needs the pool on a CUDA device"):
        Harness(copy.deepcopy(model), profile, pages=100, kernels="torch", decode_kernel="balanced")
    with pytest.raises(ValueError, match="unknown decode kernel 'splitk'"):
        Harness(copy.deepcopy(model), profile, pages=100, kernels="triton", decode_kernel="splitk")


# ---------------------------------------------------------------------------------------------- (c) factory
@pytest.fixture(scope="module")
def registry():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return ATTENTION_BACKENDS


def test_factory_builds_the_backend_from_the_runner(registry, tmp_path, monkeypatch):
    model = tiny_llama()
    profile = uniform_profile(model.config, 0.5, page_size=16, heads_per_group=2)
    path = tmp_path / "profile.json"
    profile.save(path)
    monkeypatch.setenv("TANGRAM_PROFILE", str(path))  # what --tangram-profile exports to the scheduler
    kv = TangramKVManager.from_profile(profile, 64, device=DEV)
    backend = registry["tangram"](fake_runner(kv, model.config))
    assert isinstance(backend, TangramAttnBackend) and backend.manager is kv
    assert backend.context.kernels.name == ("torch" if DEV == "cpu" else "triton")  # chosen by the pool's device
    assert backend.token_to_kv_pool.manager is kv
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    assert backend.context.flashinfer_extend is None
    monkeypatch.setenv("TANGRAM_EXTEND_KERNEL", "cutlass")  # what --tangram-extend-kernel exports reaches it
    with pytest.raises(ValueError, match="unknown extend kernel 'cutlass'"):
        registry["tangram"](fake_runner(kv, model.config))


@pytest.mark.skipif(DEV != "cuda", reason="FlashInfer extend needs the pool on CUDA (TANGRAM_ATTN_TEST_DEVICE=cuda)")
def test_flashinfer_extend_kernels_are_warmed_up_when_the_backend_starts(registry, tmp_path, monkeypatch):
    """Under ``mixed`` SGLang's warm-up prompt takes the Triton kernel: the backend itself must run FlashInfer's
    passes once, or their JIT compile stalls the scheduler inside the first long prompt (session 15)."""
    model = tiny_llama()
    profile = uniform_profile(model.config, 0.5, page_size=16, heads_per_group=2)
    profile.save(tmp_path / "profile.json")
    monkeypatch.setenv("TANGRAM_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.setenv("TANGRAM_EXTEND_KERNEL", "mixed")
    kv = TangramKVManager.from_profile(profile, 64, device=DEV)
    fi = registry["tangram"](fake_runner(kv, model.config)).context.flashinfer_extend
    assert fi is not None and fi.chunk.event is not None and fi.prefix.event is not None  # both passes planned


@pytest.mark.parametrize("changes, message", [
    ({"cuda_graph_config": CudaGraphConfig(prefill=PhaseConfig(backend=Backend.FULL))},
     "not 'full'; pass --cuda-graph-backend-prefill breakable or disabled"),
    ({"disable_overlap_schedule": False, "enable_mixed_chunk": True},
     "--enable-mixed-chunk.*--disable-overlap-schedule"),
    ({"disable_overlap_schedule": False, "strip_thinking_cache": True}, "--strip-thinking-cache"),
    ({"tp_size": 2}, "--tp 2"),
    ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
])
def test_factory_refuses_what_it_cannot_serve(registry, changes, message):
    model = tiny_llama()
    profile = uniform_profile(model.config, 0.5, page_size=16, heads_per_group=2)
    kv = TangramKVManager.from_profile(profile, 64)
    with pytest.raises(TangramNotServable, match=message):
        registry["tangram"](fake_runner(kv, model.config, **changes))


def test_pre_rope_scorer_is_refused_for_a_model_whose_rope_is_not_undone():
    model = tiny_llama()
    profile = uniform_profile(model.config, 0.5, page_size=16, heads_per_group=2, scorer="expected_attention")
    config = copy.deepcopy(model.config)
    config.model_type = "phi3"
    with pytest.raises(TangramNotServable, match="reads pre-RoPE queries.*not 'phi3'"):
        TangramAttnBackend(fake_runner(TangramKVManager.from_profile(profile, 64, device=DEV), config), profile)


def test_pre_rope_unrotates_on_the_rotary_device_and_inverts_rope():
    """``unrotate`` inverts transformers' RoPE, and computes on the rotary's device: transformers moves inv_freq
    to its probe tensor's device, so a CPU probe beside a CUDA rotary failed on the GPU. The ``meta`` device
    stands in for CUDA here (a copy from it to the CPU raises)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from tangram_sgl.attention.segment_scoring import config_pre_rope, rotary_pre_rope

    config = tiny_llama().config
    pre = config_pre_rope(config)
    q = torch.randn(1, HEADS, 5, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(7, 12)[None])
    rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(pre.unrotate(rotated[0], 7), q[0], atol=1e-5, rtol=1e-5)
    rotary = LlamaRotaryEmbedding(config)
    elsewhere = rotary_pre_rope(rotary)
    rotary.to("meta")
    assert elsewhere.unrotate(torch.empty(HEADS, 5, HEAD_DIM, device="meta"), 7).device.type == "meta"


def test_factory_needs_the_tangram_pool(registry):
    runner = fake_runner(TangramKVManager.from_profile(uniform_profile(tiny_llama().config, 1.0), 8), None)
    runner.token_to_kv_pool = object()
    with pytest.raises(TangramNotServable, match="needs the tangram KV pool"):
        registry["tangram"](runner)


def test_synthetic_profile_serves_with_snapkv_selection():
    """A synthetic profile (budgets for throughput work, ``scorer: synthetic``) picks tokens with SnapKV."""
    from importlib import resources

    from tangram_sgl.attention.forward_step import AttentionContext
    from tangram_sgl.profile import load_profile

    profile = load_profile(str(resources.files("tangram_sgl") / "profiles" / "llama-3.1-8b.synthetic.r0.25.json"))
    assert profile.scorer == "synthetic" and profile.runtime_scorer == "snapkv"
    kv = TangramKVManager.from_profile(profile, 4, dtype=torch.float32, device=DEV)
    ctx = AttentionContext.create(kv, profile)
    assert type(ctx.scorer.scorer).__name__ == "SnapKVScorer"


def _graph_conversations_match_eager(budget: float, **graphs) -> Harness:
    """The two-turn conversations through a harness with ``graphs`` (its graph buckets) give the eager answers,
    every row checked against dense attention on the way; the harness, after the final invariant check."""
    model = tiny_llama(5)
    profile = (uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2, sink_tokens=2, recent_window=6)
               if budget == 1.0 else mixed_profile(model.config, 4, 2, seed=17))
    eager = run_conversations(Harness(model, profile, pages=400), seed=9)
    h = Harness(model, profile, pages=400, **graphs)
    assert run_conversations(h, seed=9) == eager
    assert h.kv.free_pages() + h.kv.evictable_pages() == 399 and not h.kv.requests
    check_invariants(h.kv, deep=True)
    return h


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_decode_cuda_graph_path_matches_eager(budget):
    """Decode through the CUDA-graph protocol (capture on padding rows, can_run_graph hook, replay view with
    padding): every row still equals dense attention over its kept tokens, the answers equal the eager
    backend's, and every replay reads the tensors its bucket captured."""
    h = _graph_conversations_match_eager(budget, graph_buckets=(1, 4))
    assert h.graph_replays == 3 + 3 + 2  # the decode-only steps (mixed batches stay eager)
    assert h.kv.pool.k_buffer[0].any()  # padding rows wrote the null page, which no list reads


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_breakable_prefill_graph_path_matches_eager(budget, monkeypatch):
    """Extend and mixed batches through the breakable prefill-graph protocol (capture on request-less batches
    inside the capture hook; replays padded to a token bucket, attention through SGLang's graph-break op on the
    real tokens): every row still equals dense attention over its kept tokens and the answers equal eager."""
    if DEV == "cpu":  # SGLang registers its attention op for CUDA only: its Python body, called directly
        from sglang.srt.layers import radix_attention as ra

        def op(query, key, value, output, save_kv_cache, layer_id, *, use_mha_companion=False, **kwargs):
            ra._unified_attention_with_output_impl(query, key, value, output, save_kv_cache, layer_id,
                                                   use_mha_companion, False, **kwargs)

        monkeypatch.setattr(ra, "unified_attention_with_output", op)
    h = _graph_conversations_match_eager(budget, prefill_buckets=(16, 64))
    assert h.prefill_replays == 3  # EXTEND [A1, B1], MIXED [A2 + B1], EXTEND [B2]


def test_request_less_batches_are_served_only_inside_the_prefill_capture():
    model = tiny_llama(5)
    h = Harness(model, uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2), pages=40)
    fb = forward_batch(ForwardMode.EXTEND, [("pad", 0, [0] * 8)])
    fb.rids = None
    with pytest.raises(StepError, match="ForwardBatch.rids, which is missing"):
        h.backend.init_forward_metadata(fb)
    with h.backend.prefill_capture():
        h.backend.init_forward_metadata(fb)
        assert not h._forward(fb).isnan().any()
    with pytest.raises(StepError, match="ForwardBatch.rids, which is missing"):
        h.backend.init_forward_metadata(fb)


def test_the_prefill_capture_hook_wraps_sglangs_runner(registry):
    """After ``load_plugins()`` SGLang's ``PrefillCudaGraphRunner.capture`` runs inside the hook, which holds the
    tangram backend's capture context (and leaves other backends alone)."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    assert PrefillCudaGraphRunner.capture.__wrapped__ is not None
    model = tiny_llama(5)
    h = Harness(model, uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2), pages=40)
    seen = []
    runner = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=h.backend))
    capture_around(lambda r: seen.append(r.model_runner.attn_backend._capturing_prefill), runner)
    other = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=object()))
    capture_around(lambda r: seen.append("other"), other)
    assert seen == [True, "other"] and not h.backend._capturing_prefill


def test_graph_declines_a_step_beyond_the_arena_and_eager_reuses_it():
    """A decode step whose slot lists do not fit the device arena is built on the host and declined by the
    can_run_graph hook; the eager forward then runs that same prepared step (its decode slots opened once)."""
    model = tiny_llama(6)
    profile = uniform_profile(model.config, 1.0, page_size=4, heads_per_group=2, sink_tokens=2, recent_window=6)
    kv = TangramKVManager.from_profile(profile, 200, dtype=torch.float32, device=DEV, slot_arena_entries=8)
    h = Harness(model, profile, pages=200, kv=kv)
    h.backend.init_cuda_graph_state(4, 4)
    ids = list(range(1, 21))
    h.admit("A", ids, 4)
    nxt = h.step(ForwardMode.EXTEND, [("A", 0, ids)])
    fb = forward_batch(ForwardMode.DECODE, h.decode_rows(["A"], {"A": nxt[0]}))
    assert not can_run_graph_around(lambda _runner, _fb: False, SimpleNamespace(attn_backend=h.backend), fb)
    assert h.backend._prepared is None  # SGLang's own refusal: nothing is built
    assert not can_run_graph_around(lambda _runner, _fb: True, SimpleNamespace(attn_backend=h.backend), fb)
    prepared = h.backend._prepared[1]
    h.backend.init_forward_metadata(fb)
    assert h.backend.step is prepared and len(h.kv.requests["A"].token_ids) == 21
    view = SimpleNamespace(batch_size=1, num_padding=0, forward_mode=ForwardMode.DECODE)
    with pytest.raises(RuntimeError, match="without a prepared step"):
        h.backend.init_forward_metadata_out_graph(view)


def _decode_together(sched: SglangScheduler, reqs: list[SimpleNamespace]) -> None:
    """One DECODE batch of every request in ``reqs`` (logical ids as SGLang allocates them)."""
    from sglang.srt.mem_cache.allocation import alloc_token_slots

    rows = []
    for req in reqs:
        pos = len(req.origin_input_ids) + len(req.output_ids) - 1
        sched.cache.req_to_token_pool.req_to_token[req.req_pool_idx, pos] = alloc_token_slots(sched.cache, 1).to(
            torch.int32)
        rows.append((req.rid, pos, [req.output_ids[-1]]))
    for req, nxt in zip(reqs, sched.h.step(ForwardMode.DECODE, rows)):
        req.output_ids.append(nxt)


@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_retraction_and_readmission_keep_requests_isolated(budget, monkeypatch):
    """A and B share a prefix and decode in the same batches; B is retracted mid-decode as SGLang retracts
    (``cache_finished_req(is_insert=False)``) while A decodes on over the freed pages and arena block; B is
    re-admitted on its prompt + answer so far and finishes. Every row equals dense attention over its own
    kept tokens, the invariants (deep) hold after every cache operation, nothing leaks, and at budget 1.0
    B's answer equals an uninterrupted run's."""
    model, profile = _checked_cache_path(budget, 7, monkeypatch)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    a_prompt = shared + torch.randint(0, VOCAB, (7,), generator=g).tolist()
    b_prompt = shared + torch.randint(0, VOCAB, (5,), generator=g).tolist()

    alone = SglangScheduler(Harness(copy.deepcopy(model), profile, pages=900))
    ref = alone.admit("Bref", b_prompt, max_new=6)
    alone.prefill_chunk(ref, len(b_prompt))
    for _ in range(5):
        alone.decode(ref)
    uninterrupted = alone.finish(ref)

    h = Harness(model, profile, pages=900)
    sched = SglangScheduler(h)
    a, b = sched.admit("A", a_prompt, max_new=8), sched.admit("B", b_prompt, max_new=6)
    sched.prefill_chunk(a, len(a_prompt))
    sched.prefill_chunk(b, len(b_prompt))
    for _ in range(3):
        _decode_together(sched, [a, b])
    so_far = list(b.output_ids)
    sched.cache.cache_finished_req(b, is_insert=False, kv_len_to_handle=len(b_prompt) + len(so_far) - 1)
    sched.cache.req_to_token_pool.free(b)
    assert "B" not in h.kv.requests and "B" not in h.kv.device_lists.mirrors
    for _ in range(3):
        _decode_together(sched, [a])
    sched.finish(a)
    b2 = sched.admit("B2", b_prompt + so_far[:-1], max_new=3)  # SGLang re-admits prompt + output so far
    b2.output_ids.append(so_far[-1])
    # the shared prefix comes from A's tree nodes: page-aligned part of a full segment, none of a compressed one
    assert len(b2.prefix_indices) == (40 if budget == 1.0 else 0)
    sched.prefill_chunk(b2, len(b_prompt) + len(so_far) - 1 - len(b2.prefix_indices))
    repredicted = b2.output_ids.pop()  # B already has its next token; decoding goes on from it
    for _ in range(2):
        sched.decode(b2)
    answer = so_far + list(b2.output_ids[1:])
    sched.finish(b2)
    assert h.checked_rows == 2 + 3 * 2 + 3 + 1 + 2
    assert not h.kv.requests and not h.kv.device_lists.mirrors
    assert h.kv.free_pages() + h.kv.evictable_pages() == 899
    check_invariants(h.kv, deep=True)
    if budget == 1.0:
        assert repredicted == so_far[-1] and answer == uninterrupted


def _two_row_extend_step(decode_tokens: int = 0):
    """(manager, context, extend step of two compressed fp16 rows "a" and "b", its q / k / v staging)."""
    model = tiny_llama(3)
    profile = mixed_profile(model.config, 4, 2, seed=11)
    kv = TangramKVManager.from_profile(profile, 400, dtype=torch.float16, device=DEV)
    ctx = AttentionContext.create(kv, profile)
    rows = []
    for rid, n in (("a", 40), ("b", 25)):
        toks = list(range(1, n + 1))
        kv.admit(rid, toks)
        kv.reserve(rid, toks, decode_tokens=decode_tokens)
        rows.append(StepRow(rid, 0, n, False))
    q = torch.randn(65, HEADS, HEAD_DIM, device=DEV, dtype=torch.float16)
    k, v = (torch.randn(65, KV_HEADS, HEAD_DIM, device=DEV, dtype=torch.float16) for _ in range(2))
    return kv, ctx, ctx.step(rows), (q, k, v)


def test_every_bucket_reads_its_aot_row_from_the_table_uploaded_with_the_context():
    """A decode step's AOT split row is a view of ``AttentionContext.split_rows``, uploaded once: until session 26
    each bucket's first step uploaded its row from a Python list, a host wait that the GPU sync-debug test caught."""
    kv, ctx, _, _ = _two_row_extend_step()
    for b, size in enumerate(ctx.aot.batch_buckets):
        splits, top = ctx.decode_splits(size)
        assert splits.untyped_storage().data_ptr() == ctx.split_rows.untyped_storage().data_ptr()
        assert splits.tolist() == list(ctx.aot.splits[b]) and top == max(ctx.aot.splits[b])
        assert splits.device == kv.pool.device and splits.dtype == torch.int32


@pytest.mark.skipif(DEV != "cuda", reason="host-GPU synchronisation exists only on a CUDA device (GPU test stage)")
def test_decode_step_build_never_synchronises_the_host():
    """What overlap scheduling needs beyond the CPU-tested order: building a decode step (rows without token ids,
    slots opened, device lists uploaded or appended) only queues GPU work — its host-to-device copies page-locked
    and non-blocking (``pool/device_copy.py``); CUDA's sync debug mode raises on any host wait. The first step
    mixes both kinds of row ("b" uploaded, "a" appended): until session 25 its zero-fill and its choice of the
    appended rows each copied a host value and waited (the session's 8-session trace: ~3 ms a question round)."""
    kv, ctx, step, (q, k, v) = _two_row_extend_step(decode_tokens=4)
    for layer in range(LAYERS):
        step.attend(layer, q, k, v, HEAD_DIM ** -0.5)
    step.commit()
    ctx.step([StepRow("a", len(kv.requests["a"].token_ids), 1, True)])  # a's lists uploaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # b uploaded and a appended, then both appended
            ctx.step([StepRow(rid, len(kv.requests[rid].token_ids), 1, True) for rid in ("a", "b")])
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(DEV != "cuda", reason="host-GPU synchronisation exists only on a CUDA device (GPU test stage)")
def test_admission_and_extend_step_build_never_synchronise_the_host():
    """Reservation runs inside SGLang's ``get_next_batch_to_run``, which under overlap scheduling admits batch k while
    batch k-1 still runs on the GPU: reserving segments (compressed and kept whole) and building their extend step
    only queue GPU work. Session 16's trace caught a blocking copy of each reserved slot table there: the host
    waited ~140 ms per request for the previous 8k-token prefill chunk, and the GPU then idled while it caught up."""
    model = tiny_llama(3)
    profile = mixed_profile(model.config, 4, 2, seed=11)
    kv = TangramKVManager.from_profile(profile, 400, dtype=torch.float16, device=DEV)
    ctx = AttentionContext.create(kv, profile)
    turns = {"a": list(range(1, 41)), "b": list(range(1, 26)), "c": [7, 8]}
    for rid, toks in turns.items():
        kv.admit(rid, toks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rid, toks in turns.items():
            kv.reserve(rid, toks, decode_tokens=4)
        step = ctx.step([StepRow(rid, 0, len(toks), False) for rid, toks in turns.items()])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.compressed and len(step.compressed) < len(turns)  # both kinds of segment were reserved


@pytest.mark.skipif(DEV != "cuda", reason="host-GPU synchronisation exists only on a CUDA device (GPU test stage)")
def test_extend_layers_never_synchronise_the_host():
    """Once a step's metadata is built, its per-layer work for compressed segments (extend kernel, SnapKV
    scores, selection, segment writes) and its commit only queue GPU work: CUDA's sync debug mode raises on any
    host wait (a device copy of per-layer kept counts was one, per row and layer, until the counts lived on the
    GPU; the commit's copy of the kept positions another, until it went to page-locked memory behind an event)."""
    kv, _, step, (q, k, v) = _two_row_extend_step()
    assert all(step.compress.values())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(LAYERS):
            step.attend(layer, q, k, v, HEAD_DIM ** -0.5)
        step.commit()  # the kept positions come to the host without a wait, read later (kept_on_host)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    check_invariants(kv, deep=True)


def test_extend_kernel_choice_is_checked():
    model = tiny_llama(3)
    profile = mixed_profile(model.config, 4, 2, seed=11)
    kv = TangramKVManager.from_profile(profile, 50, device="cpu")
    for name in ("flashinfer", "mixed"):
        with pytest.raises(ValueError, match="needs the pool on a CUDA device"):
            AttentionContext.create(kv, profile, extend_kernel=name)
    with pytest.raises(ValueError, match="unknown extend kernel 'cutlass'"):
        AttentionContext.create(kv, profile, extend_kernel="cutlass")


def _extend_steps_agree(make_flashinfer_ctx, dtype: torch.dtype, tol: float) -> None:
    """A second chunk of two rows over their committed, compressed first chunks (multi-segment lists with
    partial pages): every layer of the FlashInfer-extend step against the kernel set's step."""
    model = tiny_llama(3)
    profile = mixed_profile(model.config, 4, 2, seed=11)
    kv = TangramKVManager.from_profile(profile, 400, dtype=dtype, device=DEV)
    base = AttentionContext.create(kv, profile)
    fi = make_flashinfer_ctx(base, kv, profile)
    gen = torch.Generator(device=DEV).manual_seed(5)

    def qkv(n):
        return (torch.randn(n, HEADS, HEAD_DIM, device=DEV, dtype=dtype, generator=gen),
                *(torch.randn(n, KV_HEADS, HEAD_DIM, device=DEV, dtype=dtype, generator=gen) for _ in range(2)))

    lens = {"a": (40, 23), "b": (25, 9)}
    for rid, (first, _) in lens.items():
        toks = list(range(1, first + 1))
        kv.admit(rid, toks)
        kv.reserve(rid, toks)
    step = base.step([StepRow(rid, 0, first, False) for rid, (first, _) in lens.items()])
    q, k, v = qkv(65)
    for layer in range(LAYERS):
        step.attend(layer, q, k, v, HEAD_DIM ** -0.5)
    step.commit()
    rows = []
    for rid, (first, second) in lens.items():
        kv.reserve(rid, list(range(100, 100 + second)))
        rows.append(StepRow(rid, first, second, False))
    steps = base.step(rows), fi.step(rows)
    assert steps[1].fi_step is not None and steps[1].fi_step.has_prefix
    for layer in range(LAYERS):
        q, k, v = qkv(32)
        want, got = (s.attend(layer, q, k, v, HEAD_DIM ** -0.5) for s in steps)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    steps[0].commit()
    check_invariants(kv, deep=True)


def test_flashinfer_extend_step_wiring_matches_the_kernel_step(monkeypatch):
    """ForwardStep with a FlashInfer extend (FlashInfer's API stood in by torch, see
    tests/test_flashinfer_extend.py): head maps and orders, host indptr and staging reach it correctly."""
    from test_flashinfer_extend import flashinfer_standin

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    _extend_steps_agree(lambda base, kv, profile: dataclasses.replace(
        base, flashinfer_extend=layout_flashinfer_extend(kv.layout, base.head_order.tolist(), DEV)), torch.float32, TOL)


def test_mixed_extend_kernel_uses_flashinfer_only_past_the_threshold(monkeypatch):
    """--tangram-extend-kernel mixed: a question-sized step runs the kernel set's extend, a step with a row
    adding more than the threshold runs FlashInfer (stood in by torch); both agree with the kernel step."""
    from test_flashinfer_extend import flashinfer_standin

    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer_standin())
    model = tiny_llama(3)
    profile = mixed_profile(model.config, 4, 2, seed=11)
    kv = TangramKVManager.from_profile(profile, 400, device=DEV)
    base = AttentionContext.create(kv, profile)
    mixed = dataclasses.replace(base, flashinfer_extend=layout_flashinfer_extend(kv.layout, base.head_order.tolist(),
                                                                                 DEV), flashinfer_min_new=24)
    gen = torch.Generator(device=DEV).manual_seed(3)
    for rid, n in (("short", 24), ("long", 25)):
        toks = list(range(1, n + 1))
        kv.admit(rid, toks)
        kv.reserve(rid, toks)
        steps = base.step([StepRow(rid, 0, n, False)]), mixed.step([StepRow(rid, 0, n, False)])
        assert (steps[1].fi_step is None) == (n <= 24)
        for layer in range(LAYERS):
            q = torch.randn(n, HEADS, HEAD_DIM, device=DEV, generator=gen)
            k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, device=DEV, generator=gen) for _ in range(2))
            want, got = (s.attend(layer, q, k, v, HEAD_DIM ** -0.5) for s in steps)
            torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
        steps[0].commit()


@pytest.mark.skipif(DEV != "cuda", reason="FlashInfer runs on CUDA only (GPU test stage)")
def test_flashinfer_extend_step_matches_the_triton_step():
    """--tangram-extend-kernel flashinfer through ForwardStep with the real FlashInfer, against Triton."""
    _extend_steps_agree(lambda base, kv, profile: AttentionContext.create(kv, profile, extend_kernel="flashinfer"),
                        torch.float16, 2e-2)
