"""Microbenchmark of one decode attention layer on the head-group pool (issue 8).

Llama-3.1-8B shapes (32 q / 8 kv heads, d 128, bf16, page 16, H_p 4). Synthetic 32-layer profiles at mean
budget 1.0 / 0.5 / 0.25 (the same head-budget pattern in every layer, cross-layer grouping, so a group's
budget equals its members'); layer 0 is measured. Each request holds one segment of ``context`` tokens,
of which group g keeps k_g(context) (``tangram_sgl.budget.kept_tokens``).

Paths timed per (batch, context, budget):
- ``triton``: ``tangram_sgl.kernels.decode.paged_decode`` (AOT splits of the batch bucket, no planning),
  captured in a CUDA graph;
- ``fi_plan``: FlashInfer 0.6.15 on the same cache, each (request, kv head) a pseudo-request,
  ``plan()`` every step (its host time measured separately) + ``run()``;
- ``fi_stored``: FlashInfer fa2 wrapper planned once for the bucket and reused (``StoredPlanDecode``):
  ``fi_stored_run_ms`` is run() alone, ``fi_stored_step_ms`` adds the on-GPU page-table build;
- ``fi_full``: FlashInfer on the uncompressed cache (all heads at full context, SGLang's decode call).
Roofline: bytes the layer must read (kept K and V of every (request, kv head), plus q and out) at the GPU's peak
HBM bandwidth (``results_io.peak_hbm_bytes_per_s``: 4.8 TB/s on the H200, 3.35 on the H100).

GPU:  python eval/bench_kernels.py --out eval/results/bench_kernels.json
CPU smoke test (interpreter, tiny shapes, no FlashInfer):  TRITON_INTERPRET=1 python eval/bench_kernels.py --tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.testing
from results_io import device_name, peak_hbm_bytes_per_s, save_figure, summary_row
from tangram_sgl.kernels.decode import (
    DECODE_CONFIG,
    csr_ranges,
    launch_order,
    paged_decode,
    paged_decode_torch,
)
from tangram_sgl.kernels.decode_balanced import BALANCED_PROGRAMS, balanced_paged_decode
from tangram_sgl.kernels.flashinfer_decode import (
    StoredPlanDecode,
    pool_as_single_head_pages,
    pseudo_request_pages,
)
from tqdm import tqdm

from tangram_sgl.aot_table import TARGET_CANDIDATES
from tangram_sgl.budget import kept_tokens
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.profile import ModelIdentity, TangramProfile
from tangram_sgl.profile_builder import build_profile

HBM_BYTES_PER_S = peak_hbm_bytes_per_s(device_name())
ROOFLINE_UNIT = f"of {HBM_BYTES_PER_S / 1e12:g} TB/s"
# Per-layer head-budget patterns (kv heads of one layer); the 0.25 one is the anchor
# (one kv head of 8 at 1.0, the rest at 0.14).
BUDGET_PATTERNS = {
    1.0: (1.0,) * 8,
    0.5: (1.0, 1.0, 0.5, 0.5, 0.3, 0.3, 0.2, 0.2),
    0.25: (1.0,) + (0.14,) * 7,
}
ANCHOR = (32, 32768, 0.25)
FULL_BUDGET_TUNE_POINT = (64, 32768, 1.0)
TUNE_CONFIGS = ((128, 4, 2), (128, 4, 3), (64, 4, 3), (64, 4, 4), (32, 4, 6), (128, 8, 3))


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hq: int
    hkv: int
    head_dim: int
    page_size: int
    heads_per_group: int


LLAMA_8B = Shape(num_layers=32, hq=32, hkv=8, head_dim=128, page_size=16, heads_per_group=4)
TINY = Shape(num_layers=2, hq=8, hkv=4, head_dim=32, page_size=16, heads_per_group=2)


def synthetic_profile(shape: Shape, mean_budget: float, target_ctas: int | None = None) -> TangramProfile:
    """The benchmark's head pattern at ``mean_budget``; its AOT table at ``target_ctas`` for every bucket, or (None)
    the table's own per-bucket choice, as served."""
    pattern = BUDGET_PATTERNS[mean_budget][: shape.hkv]
    model = ModelIdentity("LlamaForCausalLM", "llama", shape.num_layers, shape.hkv, shape.hq, shape.head_dim, "synthetic")
    return build_profile(
        model, [list(pattern)] * shape.num_layers, [[0.0] * shape.hkv] * shape.num_layers,
        scorer="snapkv", target_ratio=mean_budget, alpha=0.0, page_size=shape.page_size,
        heads_per_group=shape.heads_per_group, grouping="cross_layer", synthetic=True, created_by="eval/bench_kernels.py",
        target_ctas=target_ctas,
    )


@dataclass
class Cache:
    k: torch.Tensor
    v: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    head_group: torch.Tensor
    head_column: torch.Tensor
    head_len: list[int]  # kept tokens per kv head of the layer (same for every request)
    head_order: torch.Tensor  # launch order of the kv heads (descending group budget)


def build_cache(shape: Shape, profile: TangramProfile, batch: int, context: int, dev: str, gen: torch.Generator) -> Cache:
    """Layer 0's groups filled with whole pages (shuffled page order); other groups empty."""
    layout = HeadGroupLayout.from_profile(profile)
    hg, hc = layout.layers[0].group, layout.layers[0].column
    G = layout.num_groups
    glen = {g: kept_tokens(layout.group_budget[g], context, 0, profile.sink_tokens, profile.recent_window) for g in set(hg)}
    ps = shape.page_size
    pages = {g: math.ceil(n / ps) for g, n in glen.items()}
    num_pages = 1 + batch * sum(pages.values())
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).to(dev)
    lens = torch.zeros(batch, G, dtype=torch.long)
    for g, n in glen.items():
        lens[:, g] = n
    page_cnt = (lens + ps - 1) // ps
    indptr = torch.zeros(batch * G + 1, dtype=torch.long)
    indptr[1:] = torch.cumsum(lens.flatten(), 0)
    # slot j of list (r, g) = page_of_list[j // ps] * ps + j % ps, pages drawn consecutively from perm
    page_start = torch.cumsum(page_cnt.flatten(), 0) - page_cnt.flatten()
    seg = torch.repeat_interleave(torch.arange(batch * G), lens.flatten()).to(dev)
    j = torch.arange(int(indptr[-1]), device=dev) - indptr.to(dev)[seg]
    indices = perm[page_start.to(dev)[seg] + j // ps] * ps + j % ps
    shape4 = (num_pages, shape.heads_per_group, ps, shape.head_dim)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    k = torch.randn(shape4, device=dev, dtype=dtype)
    v = torch.randn(shape4, device=dev, dtype=dtype)
    return Cache(k, v, indptr.int().to(dev), indices.int(), torch.tensor(hg, dtype=torch.int32, device=dev),
                 torch.tensor(hc, dtype=torch.int32, device=dev), [glen[g] for g in hg],
                 torch.tensor(launch_order([layout.group_budget[g] for g in hg]), dtype=torch.int32, device=dev))


def gpu_time_ms(fn: Callable[[], object], events_if_uncapturable: bool = False) -> tuple[float, str]:
    """Median time of fn: CUDA-graph replay on the GPU, wall clock on the CPU.

    With ``events_if_uncapturable`` a function that cannot be captured is timed with CUDA events
    (L2 flushed) instead, and the returned method string says so and why.
    """
    if torch.cuda.is_available():
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"), "cuda_graph"
        except RuntimeError as e:
            if not events_if_uncapturable:
                raise
            torch.cuda.synchronize()
            return triton.testing.do_bench(fn, rep=100, return_mode="median"), f"events (capture failed: {str(e)[:120]})"
    t = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t), "cpu_wall"


def host_time_ms(fn: Callable[[], object], reps: int = 15) -> float:
    """Median host wall time of fn (returns when the call returns; GPU work it queued is not waited for)."""
    fn()
    t = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def run_config(shape: Shape, profile: TangramProfile, batch: int, context: int, dev: str, tune: tuple[int, int, int],
               with_flashinfer: bool, gen: torch.Generator, extra_tc: bool, ours_cache: bool = True,
               launch_splits: int = 0, balanced_programs: int = 0, balanced_maxnreg: int | None = None) -> dict:
    """One (batch, context, budget) case: our kernel, and with ``with_flashinfer`` FlashInfer on the uncompressed
    cache, plus (``ours_cache``) FlashInfer plan()+run and stored plans on the same compressed cache.
    ``launch_splits``: the launch's split dimension at least this (the extra programs exit at once);
    ``balanced_programs``: also time the token-balanced decode with that many programs (0: not), its split kernel's
    registers capped at ``balanced_maxnreg`` if given."""
    c = build_cache(shape, profile, batch, context, dev, gen)
    D = shape.head_dim
    q = torch.randn(batch, shape.hq, D, device=dev, dtype=c.k.dtype)
    scale = D**-0.5
    table = profile.aot_split
    splits_row = table.splits_for(batch)
    splits = torch.tensor(splits_row, dtype=torch.int32, device=dev)
    max_splits = max(*splits_row, launch_splits)
    block_n, warps, stages = tune
    starts, lens = csr_ranges(c.kv_indptr)

    def ours() -> torch.Tensor:
        return paged_decode(q, c.k, c.v, starts, lens, c.kv_indices, c.head_group, c.head_column, splits,
                            head_order=c.head_order, max_splits=max_splits, min_split_tokens=table.min_split_tokens, sm_scale=scale,
                            block_n=block_n, num_warps=warps, num_stages=stages)

    kept = sum(c.head_len)
    bytes_read = batch * (kept * D * 2 * c.k.element_size() + 2 * shape.hq * D * q.element_size())
    res = {
        "batch": batch, "context": context, "mean_budget": profile.target_ratio,
        "kept_tokens_per_head": c.head_len, "kept_fraction": kept / (shape.hkv * context),
        "bytes_read": bytes_read, "roofline_ms": bytes_read / HBM_BYTES_PER_S * 1e3,
        "splits": list(splits_row), "max_splits": max_splits,
    }
    out = ours()
    res["triton_ms"], res["timing"] = gpu_time_ms(ours)
    res["triton_roofline_frac"] = res["roofline_ms"] / res["triton_ms"]
    res["triton_host_plan_ms"] = 0.0
    if balanced_programs:
        def balanced() -> torch.Tensor:
            return balanced_paged_decode(q, c.k, c.v, starts, lens, c.kv_indices, c.head_group, c.head_column,
                                         sm_scale=scale, num_programs=balanced_programs, block_n=block_n,
                                         num_warps=warps, num_stages=stages, maxnreg=balanced_maxnreg)

        res["balanced_programs"], res["balanced_maxnreg"] = balanced_programs, balanced_maxnreg
        res["balanced_max_abs_diff_vs_triton"] = float((balanced().float() - out.float()).abs().max())
        res["balanced_ms"], res["balanced_timing"] = gpu_time_ms(balanced)
        res["balanced_roofline_frac"] = res["roofline_ms"] / res["balanced_ms"]
    if batch * context <= 4096:
        ref = paged_decode_torch(q, c.k, c.v, *csr_ranges(c.kv_indptr), c.kv_indices, c.head_group, c.head_column, sm_scale=scale)
        res["max_abs_err_vs_torch"] = float((out.float() - ref.float()).abs().max())
    if with_flashinfer:
        if ours_cache:
            try:
                res.update(flashinfer_baselines(shape, c, q, out, splits, splits_row, table, scale, extra_tc))
            except Exception as e:  # noqa: BLE001 - recorded in the results, the sweep goes on
                res["flashinfer_error"] = f"{type(e).__name__}: {e}"[:500]
        del c
        torch.cuda.empty_cache()
        try:
            res.update(full_cache_flashinfer(shape, batch, context, q, scale))
        except Exception as e:  # noqa: BLE001 - recorded in the results
            res["flashinfer_full_error"] = f"{type(e).__name__}: {e}"[:500]
    return res


def flashinfer_baselines(shape: Shape, c: Cache, q: torch.Tensor, out: torch.Tensor, splits: torch.Tensor,
                         splits_row: tuple[int, ...], table, scale: float, extra_tc: bool) -> dict:
    """FlashInfer plan()+run and stored-plan run on the same non-uniform cache."""
    import flashinfer

    batch, dev = q.shape[0], q.device
    gq, D, ps = shape.hq // shape.hkv, shape.head_dim, shape.page_size
    res: dict = {}
    rows_indptr, rows_pages, rows_last = pseudo_request_pages(
        c.kv_indptr, c.kv_indices, c.head_group, c.head_column, batch=batch, page_size=ps,
        heads_per_group=shape.heads_per_group)
    kp, vp = pool_as_single_head_pages(c.k), pool_as_single_head_pages(c.v)
    q_rows = q.view(batch * shape.hkv, gq, D)
    ip_cpu, last_cpu = rows_indptr.cpu(), rows_last.cpu()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    for tc in ((False, True) if extra_tc else (False,)):
        tag = "fi_plan_tc" if tc else "fi_plan"
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)

        def plan(w=w) -> None:
            w.plan(ip_cpu, rows_pages, last_cpu, gq, 1, D, ps, q_data_type=q.dtype, kv_data_type=q.dtype, sm_scale=scale)

        res[f"{tag}_host_plan_ms"] = host_time_ms(plan)
        o_fi = w.run(q_rows, (kp, vp))
        res[f"{tag}_max_abs_diff_vs_triton"] = float((o_fi.view_as(out).float() - out.float()).abs().max())
        res[f"{tag}_run_ms"], res[f"{tag}_timing"] = gpu_time_ms(lambda w=w: w.run(q_rows, (kp, vp)), True)
        res[f"{tag}_total_ms"] = res[f"{tag}_run_ms"] + res[f"{tag}_host_plan_ms"]
    counts = (rows_indptr[1:] - rows_indptr[:-1]).cpu()
    stored = StoredPlanDecode(counts, num_qo_heads=gq, head_dim=D, page_size=ps, dtype=q.dtype, device=dev, sm_scale=scale)
    # the plan is made for the bucket's full lengths; check it is exact on a shorter step (last token of
    # every row dropped) against the Triton kernel on the same shortened lists
    short_ip, short_pages, short_last = shorten_by_one(rows_indptr, rows_pages, rows_last, ps)
    stored.load_page_table(short_ip, short_pages, short_last)
    o_short = stored.run(q_rows, kp, vp).view_as(out)
    s_indptr, s_indices = shorten_slot_lists(c.kv_indptr, c.kv_indices)
    o_short_ref = paged_decode(q, c.k, c.v, *csr_ranges(s_indptr), s_indices, c.head_group, c.head_column, splits,
                               max_splits=max(splits_row), min_split_tokens=table.min_split_tokens, sm_scale=scale)
    res["fi_stored_shorter_step_max_abs_diff"] = float((o_short.float() - o_short_ref.float()).abs().max())
    stored.load_page_table(rows_indptr, rows_pages, rows_last)
    res["fi_stored_max_abs_diff_vs_triton"] = float((stored.run(q_rows, kp, vp).view_as(out).float() - out.float()).abs().max())
    res["fi_stored_run_ms"], res["fi_stored_timing"] = gpu_time_ms(lambda: stored.run(q_rows, kp, vp), True)
    res["fi_stored_host_plan_ms"] = 0.0

    def stored_step() -> torch.Tensor:  # the whole plan-free step: page table built on the GPU, then run
        stored.load_slot_lists(c.kv_indptr, c.kv_indices, c.head_group, c.head_column, page_size=ps,
                               heads_per_group=shape.heads_per_group)
        return stored.run(q_rows, kp, vp)

    res["fi_stored_step_max_abs_diff_vs_triton"] = float((stored_step().view_as(out).float() - out.float()).abs().max())
    res["fi_stored_step_ms"], res["fi_stored_step_timing"] = gpu_time_ms(stored_step, True)
    return res


def shorten_by_one(indptr: torch.Tensor, pages: torch.Tensor, last: torch.Tensor, ps: int):
    """The same page table with one token fewer in every non-empty row."""
    cnt = (indptr[1:] - indptr[:-1]).long()
    new_last = last.long() - 1
    drop = (new_last == 0) & (cnt > 0)
    new_cnt = cnt - drop.long()
    new_last = torch.where(drop, torch.full_like(new_last, ps), new_last)
    new_last = torch.where(new_cnt == 0, torch.zeros_like(new_last), new_last)
    keep = torch.repeat_interleave(torch.arange(cnt.numel(), device=cnt.device), cnt)
    pos = torch.arange(pages.numel(), device=pages.device) - indptr.long()[keep]
    sel = pos < new_cnt[keep]
    new_ip = torch.zeros_like(indptr)
    new_ip[1:] = torch.cumsum(new_cnt, 0).to(indptr.dtype)
    return new_ip, pages[sel].contiguous(), new_last.int()


def shorten_slot_lists(indptr: torch.Tensor, indices: torch.Tensor):
    """Slot lists with each non-empty list's last slot dropped."""
    lens = (indptr[1:] - indptr[:-1]).long()
    last = torch.zeros(indices.numel(), dtype=torch.bool, device=indices.device)
    last[(indptr[1:].long() - 1)[lens > 0]] = True
    new_lens = (lens - (lens > 0).long())
    new_ip = torch.zeros_like(indptr)
    new_ip[1:] = torch.cumsum(new_lens, 0).to(indptr.dtype)
    return new_ip, indices[~last].contiguous()


def full_cache_flashinfer(shape: Shape, batch: int, context: int, q: torch.Tensor, scale: float) -> dict:
    """FlashInfer decode on the uncompressed cache (SGLang's layout: [pages, page, Hkv, D]), both kernels."""
    import flashinfer

    ps, D = shape.page_size, shape.head_dim
    per = math.ceil(context / ps)
    k = torch.randn(batch * per + 1, ps, shape.hkv, D, device=q.device, dtype=q.dtype)
    v = torch.randn_like(k)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * per
    indices = (torch.randperm(batch * per, device=q.device) + 1).int()
    last = torch.full((batch,), context - (per - 1) * ps, dtype=torch.int32)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    res = {"full_bytes_read": batch * context * shape.hkv * D * 2 * q.element_size()}
    res["full_roofline_ms"] = res["full_bytes_read"] / HBM_BYTES_PER_S * 1e3
    for tc in (False, True):
        tag = "fi_full_tc" if tc else "fi_full"
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, shape.hq, shape.hkv, D, ps, q_data_type=q.dtype, kv_data_type=q.dtype, sm_scale=scale)
        res[f"{tag}_run_ms"], res[f"{tag}_timing"] = gpu_time_ms(lambda w=w: w.run(q, (k, v)), True)
    return res


def tune_triton(shape: Shape, dev: str, gen: torch.Generator) -> dict:
    """Pick (block_n, num_warps, num_stages) at the anchor and at a full-budget shape (sum of both times)."""
    shapes = (ANCHOR, FULL_BUDGET_TUNE_POINT)
    times: dict[str, list[float]] = {}
    for cfg in tqdm(TUNE_CONFIGS, desc="tune"):
        try:
            times[str(cfg)] = [run_config(shape, synthetic_profile(shape, m), b, n, dev, cfg, False, gen, False)["triton_ms"]
                               for b, n, m in shapes]
        except Exception as e:  # noqa: BLE001 - e.g. a config needing more shared memory than an SM has
            times[str(cfg)] = [f"{type(e).__name__}: {str(e)[:100]}"]
    ok = [cfg for cfg in TUNE_CONFIGS if all(isinstance(t, float) for t in times[str(cfg)])]
    best = min(ok, key=lambda cfg: sum(times[str(cfg)]))
    return {"shapes": [list(x) for x in shapes], "times_ms": times, "best": list(best)}


# where the CTA target is studied: the tune points, plus batch 16 / 32 / 64 at both ends of the budget range
# (the first study found 528 best at the anchor and 1056 at batch 64, budget 1.0: ~16.5 CTAs per request)
STUDY_POINTS = (ANCHOR, FULL_BUDGET_TUNE_POINT, (16, 32768, 0.25), (16, 32768, 1.0), (32, 32768, 1.0),
                (64, 32768, 0.25))


def target_ctas_study(shape: Shape, dev: str, tune: tuple[int, int, int], gen: torch.Generator,
                      targets: list[int]) -> list[dict]:
    """Triton decode at the study points with AOT tables built for other CTA targets (the table's one knob)."""
    rows = []
    for batch, context, budget in STUDY_POINTS:
        for t in targets:
            r = run_config(shape, synthetic_profile(shape, budget, t), batch, context, dev, tune, False, gen, False)
            rows.append({"batch": batch, "context": context, "mean_budget": budget, "target_ctas": t,
                         "splits": sorted(set(r["splits"])), "triton_ms": r["triton_ms"],
                         "roofline_frac": r["triton_roofline_frac"]})
            print(rows[-1], flush=True)
    return rows


def best_target_ctas(study: list[dict]) -> int:
    """The CTA target whose worst roofline share over the study points is highest."""
    worst: dict[int, float] = {}
    for row in study:
        worst[row["target_ctas"]] = min(worst.get(row["target_ctas"], 1.0), row["roofline_frac"])
    return max(worst, key=worst.__getitem__)


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import flashinfer

        v["flashinfer"] = flashinfer.__version__
    except ImportError:
        v["flashinfer"] = None
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["cuda"] = torch.version.cuda
    return v


def plot(results: list[dict], path: Path, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["mean_budget"] for r in results}, reverse=True)
    contexts = sorted({r["context"] for r in results})
    fig, axes = plt.subplots(len(budgets), len(contexts), figsize=(4.2 * len(contexts), 3.4 * len(budgets)), squeeze=False)
    series = [("triton_ms", "Triton AOT split-KV", "o-"), ("balanced_ms", "Triton token-balanced", "d-"),
              ("fi_plan_total_ms", "FlashInfer plan()+run", "s--"),
              ("fi_plan_run_ms", "FlashInfer run (plan excluded)", "s:"), ("fi_stored_run_ms", "FlashInfer stored plan", "^-"),
              ("fi_full_tc_run_ms", "FlashInfer uncompressed", "x-"), ("roofline_ms", "roofline of kept bytes", "k-")]
    for i, b in enumerate(budgets):
        for j, n in enumerate(contexts):
            ax = axes[i][j]
            rows = sorted((r for r in results if r["mean_budget"] == b and r["context"] == n), key=lambda r: r["batch"])
            for key, label, style in series:
                pts = [(r["batch"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts), style, label=label, markersize=4)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"mean budget {b}, context {n // 1024}k", fontsize=9)
            ax.set_xlabel("batch")
            ax.set_ylabel("ms per layer")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"One Llama-3.1-8B decode layer\non {gpu} (bf16, page 16, H_p 4)", fontsize=10)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,16,32,64")
    ap.add_argument("--contexts", default="8192,32768,65536")
    ap.add_argument("--budgets", default="1.0,0.5,0.25")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, interpreter, no FlashInfer")
    ap.add_argument("--no-tune", action="store_true",
                    help="skip tuning; use --triton-config")
    ap.add_argument("--triton-config", default=",".join(map(str, DECODE_CONFIG)),
                    help="block_n,num_warps,num_stages with --no-tune (default: the kernel's own, as serving runs it)")
    ap.add_argument("--no-flashinfer", action="store_true", help="time the Triton kernel only")
    ap.add_argument("--fi-baselines", choices=("all", "uncompressed"), default="all",
                    help="FlashInfer comparisons: all (plan()+run and stored plans on our cache, and the uncompressed "
                         "cache) or only the uncompressed cache (stock SGLang's decode; each FlashInfer kernel variant "
                         "is a JIT compile of minutes on a fresh machine)")
    ap.add_argument("--no-anchor", action="store_true", help="do not measure the anchor first (when not in the grid)")
    ap.add_argument("--study-targets", default=",".join(map(str, TARGET_CANDIDATES)),
                    help="CTA targets of the AOT-table study at the study points ('' skips the study)")
    ap.add_argument("--target-ctas", default="table",
                    help="the AOT table's CTA target for the main configs: 'table' (each bucket's simulated best, as "
                         "served), 'best' (the study's best worst case) or a number")
    ap.add_argument("--launch-splits", type=int, default=0,
                    help="launch the main configs with at least this many programs per (request, kv head), the extra "
                         "ones exiting at once: what early exits cost (a table with per-context rows would launch the "
                         "largest row's grid at every context)")
    ap.add_argument("--fi-from", metavar="JSON",
                    help="with --no-flashinfer: copy the FlashInfer columns (fi_*) of the same (batch, context, "
                         "budget) from this earlier run (they do not depend on our kernel or AOT table); only when it "
                         "ran on the same GPU")
    ap.add_argument("--balanced-programs", type=int, default=BALANCED_PROGRAMS,
                    help="programs of the token-balanced decode timed beside the AOT-split one (0: not timed)")
    ap.add_argument("--balanced-maxnreg", type=int, default=None,
                    help="cap on the token-balanced split kernel's registers a thread (Triton's maxnreg)")
    ap.add_argument("--out", default="eval/results/bench_kernels.json")
    ap.add_argument("--plot-from", nargs="+", metavar="JSON",
                    help="only plot: merge the results of these runs (later files' keys win) into --out's PNG")
    args = ap.parse_args()
    if args.plot_from:
        merged: dict[tuple, dict] = {}
        gpus: dict[str, None] = {}
        for f in args.plot_from:
            doc = json.loads(Path(f).read_text())
            gpus[doc["versions"].get("gpu", "the CPU")] = None
            for r in doc["results"]:
                merged.setdefault((r["batch"], r["context"], r["mean_budget"]), {}).update(r)
        plot(list(merged.values()), Path(args.out).with_suffix(".png"), " / ".join(gpus))
        return
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.tiny else LLAMA_8B
    if args.tiny:
        batches, contexts = [2, 3], [40, 70]
    else:
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    with_fi = not (args.tiny or args.no_flashinfer)
    gen = torch.Generator().manual_seed(0)
    if args.tiny:
        tune = {"best": [64, 4, 2], "times_ms": {}}
    elif args.no_tune:
        tune = {"best": [int(x) for x in args.triton_config.split(",")], "times_ms": {}, "source": "--triton-config"}
    else:
        tune = tune_triton(shape, dev, gen)
    print("triton config (block_n, num_warps, num_stages):", tune, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    targets = [int(x) for x in args.study_targets.split(",") if x]
    study = [] if args.tiny or not targets else target_ctas_study(shape, dev, tuple(tune["best"]), gen, targets)
    if args.target_ctas == "best":
        if not study:
            ap.error("--target-ctas best needs the study (--study-targets)")
        target_ctas = best_target_ctas(study)
    else:
        target_ctas = None if args.target_ctas == "table" else int(args.target_ctas)
    print("AOT table CTA target of the main configs:", target_ctas or "each bucket's simulated best", flush=True)
    write_results(out, shape, {}, tune, study, target_ctas, [])  # a run cut short keeps the study
    configs = [(b, n, m) for m in budgets for n in contexts for b in batches]
    if not (args.tiny or args.no_anchor):  # the anchor first, so a run cut short still has it
        configs = [ANCHOR] + [cfg for cfg in configs if cfg != ANCHOR]
    gpu = versions().get("gpu", "the CPU")
    fi_columns = copied_fi_columns(args.fi_from, gpu) if args.fi_from else {}
    results: list[dict] = []
    profiles = {m: synthetic_profile(shape, m, target_ctas) for m in {c[2] for c in configs}}
    for b, n, m in tqdm(configs, desc="configs"):
        r = run_config(shape, profiles[m], b, n, dev, tuple(tune["best"]), with_fi, gen, extra_tc=(b, n, m) == ANCHOR,
                       ours_cache=args.fi_baselines == "all", launch_splits=args.launch_splits,
                       balanced_programs=args.balanced_programs, balanced_maxnreg=args.balanced_maxnreg)
        r.update(fi_columns.get((b, n, m), {}))
        results.append(r)
        print(json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.items() if k != "kept_tokens_per_head"}), flush=True)
        write_results(out, shape, profiles, tune, study, target_ctas, results)
    plot(results, out.with_suffix(".png"), gpu)
    print("wrote", out, out.with_suffix(".png"))


def copied_fi_columns(path: str, our_gpu: str) -> dict[tuple, dict]:
    """The FlashInfer columns (``fi_*``) of an earlier run by (batch, context, budget), for ``--fi-from``; none, said
    on stdout, when that run was on another GPU than ``our_gpu`` (its times are no baseline for ours)."""
    earlier = json.loads(Path(path).read_text())
    their_gpu = earlier["versions"].get("gpu", "the CPU")
    if their_gpu != our_gpu:
        print(f"FlashInfer columns NOT copied: {path} was measured on {their_gpu}, this run is on {our_gpu}", flush=True)
        return {}
    return {(r["batch"], r["context"], r["mean_budget"]): {k: x for k, x in r.items() if k.startswith("fi_")}
            | {"fi_columns_from": path} for r in earlier["results"]}


def write_results(out: Path, shape: Shape, profiles: dict, tune: dict, study: list[dict], target_ctas: int,
                  results: list[dict]) -> None:
    doc = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "shape": shape.__dict__,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "budget_patterns": {str(k): v for k, v in BUDGET_PATTERNS.items()},
        "aot_split": {m: profiles[m].aot_split.__dict__ for m in profiles},
        "triton_tune": tune,
        "anchor_target_ctas_study": study,
        "target_ctas": target_ctas,
        "anchor": {"batch": ANCHOR[0], "context": ANCHOR[1], "mean_budget": ANCHOR[2], "target_ms": 0.26},
        "results": results,
        "summary": summary(results),
    }
    out.write_text(json.dumps(doc, indent=1))


def cases(results: list[dict]) -> str:
    """What a worst-of row covers: the batches, contexts and budgets of the cases it was taken over."""
    def values(key: str, fmt) -> str:
        return "/".join(fmt(v) for v in sorted({r[key] for r in results}))
    return (f"{len(results)} case{'s' * (len(results) > 1)}: batch {values('batch', str)}, context "
            f"{values('context', lambda c: f'{c // 1024}k')}, budget {values('mean_budget', lambda b: f'{b:g}')}")


def summary(results: list[dict]) -> list[dict]:
    """The README rows: anchor time, roofline share at batch >= 16, budget-1.0 ratio, host planning."""
    rows = []
    for r in results:
        if (r["batch"], r["context"], r["mean_budget"]) == ANCHOR and "triton_ms" in r:
            rows.append(summary_row("decode ms/layer, B32 x 32k, mean budget 0.25 (Triton, AOT splits)",
                                    r["triton_ms"], "ms", "<= 0.26", r["triton_ms"] <= 0.26))
            if "fi_plan_total_ms" in r:
                x = r["fi_plan_total_ms"] / r["triton_ms"]
                rows.append(summary_row("speed-up vs FlashInfer plan()+run, same cache (anchor)", x, "x", ">= 2.7", x >= 2.7))
            if "fi_full_tc_run_ms" in r:
                x = r["fi_full_tc_run_ms"] / r["triton_ms"]
                rows.append(summary_row("speed-up vs FlashInfer uncompressed decode (anchor)", x, "x", ">= 3.6", x >= 3.6))
            if "balanced_ms" in r:
                cap = f", maxnreg {r['balanced_maxnreg']}" if r["balanced_maxnreg"] else ""
                rows.append(summary_row("decode ms/layer, B32 x 32k, mean budget 0.25 (Triton, token-balanced, "
                                        f"{r['balanced_programs']} programs{cap})", r["balanced_ms"], "ms", "<= 0.26",
                                        r["balanced_ms"] <= 0.26))
    big = [r for r in results if r["batch"] >= 16 and "triton_roofline_frac" in r]
    if big:
        worst = min(r["triton_roofline_frac"] for r in big)
        rows.append(summary_row(f"worst roofline share at batch >= 16 ({cases(big)})", worst, ROOFLINE_UNIT,
                                ">= 0.85", worst >= 0.85))
    balanced = [r for r in big if "balanced_roofline_frac" in r]
    if balanced:
        worst = min(r["balanced_roofline_frac"] for r in balanced)
        rows.append(summary_row(f"token-balanced decode: worst roofline share at batch >= 16 ({cases(balanced)})",
                                worst, ROOFLINE_UNIT, ">= 0.85", worst >= 0.85))
    full = [r for r in results if r["mean_budget"] == 1.0 and "fi_full_tc_run_ms" in r and "triton_ms" in r]
    if full:
        worst = max(r["triton_ms"] / r["fi_full_tc_run_ms"] for r in full)
        rows.append(summary_row(f"budget 1.0: worst Triton time / FlashInfer uncompressed ({cases(full)})", worst,
                                "x", "<= 1.10", worst <= 1.10))
    plans = [r.get("triton_host_plan_ms", 0.0) for r in results]
    if plans:
        rows.append(summary_row("host planning per decode step (ours)", max(plans), "ms", "0", max(plans) == 0.0))
    return rows


if __name__ == "__main__":
    main()
