"""Microbenchmark of one extend (prefill) attention layer on the head-group pool: where tangram's prefill time goes.

Llama-3.1-8B shapes (32 q / 8 kv heads, d 128, bf16, page 16, H_p 4), the synthetic mean-0.25 head pattern of
``eval/bench_kernels.py`` (one kv head of 8 at 1.0, the rest at 0.14). A case is ``rows`` requests, each
with ``n_new`` new tokens after ``context`` cached ones, of which group g keeps k_g(context) in the pool:

- ``chunk_*``: one 8192-token prefill chunk after 0 / 16k / 40k cached tokens (a long document's chunks);
- ``questions``: 16 rows of 64 new tokens after 32k cached tokens (a question turn over long histories);
- ``question_4k`` / ``questions_4k``: 1 / 8 rows of 32 new tokens after 4k cached tokens (the short class's question
  turns, which session 16's trace caught at 176 us a layer against FlashInfer's 22 us).

Timed: ``tangram_sgl.kernels.extend.extend_attention`` at several block configurations (the serving default first)
without prefix splits, the serving call (default config, prefix splits from ``extend_splits``), and FlashInfer
0.6.15's ragged causal prefill on contiguous K/V as references — over the whole uncompressed context (what stock
SGLang's attention reads) and over a uniform cache of the mean kept length (what an ideal kernel over the
compressed cache could approach) — and a candidate replacement on the same compressed cache: FlashInfer's chunk
prefill + a pseudo-request paged prefill over the prefix, merged by log-sum-exp — the serving path of
``--tangram-extend-kernel flashinfer`` (``flashinfer_serving_path``: a page-size-1 view of the pool; one layer on a
planned step, and separately a whole step of one layer, its plans included: the plans are made once per step, for
all layers). Every output is checked against the default configuration's. The JSON is rewritten after every case (a
run cut short keeps the cases it finished).

GPU:  python eval/bench_extend.py --out eval/results
CPU smoke test (interpreter, tiny shapes, no FlashInfer):  TRITON_INTERPRET=1 python eval/bench_extend.py --tiny --out /tmp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_kernels import LLAMA_8B, TINY, Cache, Shape, build_cache, gpu_time_ms, synthetic_profile
from results_io import summary_row, write_result
from tangram_sgl.kernels.extend import EXTEND_CONFIG, extend_attention, extend_splits, token_blocks
from tqdm import tqdm

CONFIGS = (EXTEND_CONFIG, (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2))
CASES = {"chunk_0": (1, 8192, 0), "chunk_16k": (1, 8192, 16384), "chunk_40k": (1, 8192, 40960),
         "questions": (16, 64, 32768), "question_4k": (1, 32, 4096), "questions_4k": (8, 32, 4096)}
TINY_CASES = {"chunk_0": (1, 64, 0), "chunk_96": (1, 64, 96), "questions": (3, 5, 80)}


def workspace(dev: str | torch.device) -> torch.Tensor:
    """A FlashInfer wrapper's workspace buffer."""
    return torch.empty(256 << 20, dtype=torch.uint8, device=dev)


def flashinfer_ragged_ms(shape: Shape, rows: int, n_new: int, kv_len: int, dev: str) -> float:
    """FlashInfer's ragged causal prefill: ``rows`` x ``n_new`` queries over contiguous K/V of ``kv_len`` each
    (the queries are the last ``n_new`` positions); plan() outside the timing."""
    import flashinfer

    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(rows * n_new, shape.hq, shape.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(rows * kv_len, shape.hkv, shape.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    qo = torch.arange(rows + 1, dtype=torch.int32, device=dev) * n_new
    kvp = torch.arange(rows + 1, dtype=torch.int32, device=dev) * kv_len
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace(dev), "NHD")
    w.plan(qo, kvp, shape.hq, shape.hkv, shape.head_dim, causal=True, q_data_type=torch.bfloat16)
    return gpu_time_ms(lambda: w.run(q, k, v))[0]


def flashinfer_serving_path(c: Cache, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, rows: int,
                            n_new: int, scale: float) -> tuple[float, float, torch.Tensor]:
    """The serving path of ``--tangram-extend-kernel flashinfer`` (``kernels/flashinfer_extend.py``) on the same
    compressed cache. Returns (ms of one layer on a planned step: its prefix indices, both runs, the merge;
    ms of a one-layer step: the step's two plans and that layer; the output). CUDA events (plan() cannot be
    graph-captured)."""
    import numpy as np
    import triton
    from tangram_sgl.kernels.decode import launch_order
    from tangram_sgl.kernels.flashinfer_extend import FlashInferExtend

    offsets = [i * n_new for i in range(rows + 1)]
    maps = [x.cpu().numpy()[None] for x in (c.head_group, c.head_column)]
    fi = FlashInferExtend(q.device, *maps, np.array([launch_order(c.head_len)]), page_size=c.k.shape[2],
                          heads_per_group=c.k.shape[1])
    indptr = c.kv_indptr.cpu().numpy()

    def step() -> torch.Tensor:
        return fi.step(offsets, indptr, c.kv_indices).attend(0, q, k_new, v_new, c.k, c.v, scale)

    planned = fi.step(offsets, indptr, c.kv_indices)

    def layer() -> torch.Tensor:
        return planned.attend(0, q, k_new, v_new, c.k, c.v, scale)

    out = layer()
    return (triton.testing.do_bench(layer, rep=100, return_mode="median"),
            triton.testing.do_bench(step, rep=100, return_mode="median"), out)


def run_case(shape: Shape, name: str, rows: int, n_new: int, context: int, dev: str, with_fi: bool) -> dict:
    profile = synthetic_profile(shape, 0.25)
    gen = torch.Generator(device=dev).manual_seed(0)
    c = build_cache(shape, profile, rows, context, dev, torch.Generator().manual_seed(0))  # randperm: a CPU generator
    dtype = c.k.dtype
    q = torch.randn(rows * n_new, shape.hq, shape.head_dim, device=dev, dtype=dtype, generator=gen)
    k_new = torch.randn(rows * n_new, shape.hkv, shape.head_dim, device=dev, dtype=dtype, generator=gen)
    v_new = torch.randn_like(k_new)
    qo = torch.arange(rows + 1, dtype=torch.int32, device=dev) * n_new
    scale = shape.head_dim ** -0.5
    res: dict = {"case": name, "rows": rows, "n_new": n_new, "context": context, "kept_per_head": c.head_len}
    outs, times = {}, {}
    for cfg in CONFIGS:
        bm, bn, nw, ns = cfg
        if bm < max(16, shape.hq // shape.hkv):
            continue

        def ours(bm=bm, bn=bn, nw=nw, ns=ns) -> torch.Tensor:
            return extend_attention(q, k_new, v_new, qo, n_new, c.k, c.v, c.kv_indptr, c.kv_indices, c.head_group,
                                    c.head_column, sm_scale=scale, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)

        key = "x".join(map(str, cfg))
        try:
            times[key] = gpu_time_ms(ours)[0]
            outs[key] = ours().float()
        except Exception as e:  # noqa: BLE001 (a configuration that does not compile or fit is recorded)
            res.setdefault("config_errors", {})[key] = f"{type(e).__name__}: {e}"[:300]
    default = "x".join(map(str, EXTEND_CONFIG))
    res["ours_ms"] = times
    max_prefix = int(c.kv_indptr.diff().max())
    blocks = token_blocks(n_new, EXTEND_CONFIG[0], shape.hq // shape.hkv)
    res["serving_splits"] = extend_splits(rows, shape.hkv, blocks, max_prefix)

    def serving() -> torch.Tensor:
        return extend_attention(q, k_new, v_new, qo, n_new, c.k, c.v, c.kv_indptr, c.kv_indices, c.head_group,
                                c.head_column, sm_scale=scale, max_prefix=max_prefix)

    res["ours_serving_ms"] = gpu_time_ms(serving)[0]
    res["serving_max_abs_diff_vs_default"] = float((serving().float() - outs[default]).abs().max())
    res["max_abs_diff_vs_default"] = {k: float((o - outs[default]).abs().max()) for k, o in outs.items()}
    res["best_config"] = min(times, key=times.get)
    if with_fi:
        mean_kept = round(sum(c.head_len) / len(c.head_len))
        res["flashinfer_full_ms"] = flashinfer_ragged_ms(shape, rows, n_new, context + n_new, dev)
        res["flashinfer_mean_kept_ms"] = flashinfer_ragged_ms(shape, rows, n_new, mean_kept + n_new, dev)
        try:
            res["flashinfer_serving_ms"], res["flashinfer_serving_step_ms"], out = flashinfer_serving_path(
                c, q, k_new, v_new, rows, n_new, scale)
            res["flashinfer_serving_max_abs_diff"] = float((out.float() - outs[default]).abs().max())
        except Exception as e:  # noqa: BLE001 (recorded: a failure here must not lose the other cases)
            res["flashinfer_serving_error"] = f"{type(e).__name__}: {e}"[:500]
    return res


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        case = f"{r['case']} ({r['rows']} x {r['n_new']} new after {r['context']})"
        default, best = "x".join(map(str, EXTEND_CONFIG)), r["best_config"]
        rows.append(summary_row(f"extend {case}: Triton, default config", round(r["ours_ms"][default], 3), "ms"))
        rows.append(summary_row(f"extend {case}: Triton, best config {best}", round(r["ours_ms"][best], 3), "ms"))
        rows.append(summary_row(f"extend {case}: Triton as served (default config, {r['serving_splits']} prefix "
                                f"split(s))", round(r["ours_serving_ms"], 3), "ms"))
        if "flashinfer_full_ms" in r:
            rows.append(summary_row(f"extend {case}: FlashInfer over the uncompressed context",
                                    round(r["flashinfer_full_ms"], 3), "ms"))
            rows.append(summary_row(f"extend {case}: FlashInfer over a uniform cache of the mean kept length",
                                    round(r["flashinfer_mean_kept_ms"], 3), "ms"))
        if "flashinfer_serving_ms" in r:
            rows.append(summary_row(f"extend {case}: --tangram-extend-kernel flashinfer (chunk + prefix pass, "
                                    f"merged) on the same compressed cache, one layer of a planned step",
                                    round(r["flashinfer_serving_ms"], 3), "ms"))
        if "flashinfer_serving_step_ms" in r:
            rows.append(summary_row(f"extend {case}: --tangram-extend-kernel flashinfer, a one-layer step (its "
                                    f"two plans, made once per step for all layers, and that layer)",
                                    round(r["flashinfer_serving_step_ms"], 3), "ms"))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_extend.json")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1), no FlashInfer")
    a = ap.parse_args(argv)
    dev = "cpu" if a.tiny else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_extend needs a CUDA GPU (or --tiny with TRITON_INTERPRET=1 on the CPU)")
    shape, cases = (TINY, TINY_CASES) if a.tiny else (LLAMA_8B, CASES)
    results = []
    for name, case in tqdm(cases.items(), desc="cases"):
        results.append(run_case(shape, name, *case, dev, not a.tiny))
        path = write_result("bench_extend" + ("_tiny" if a.tiny else ""), {"shape": shape.__dict__, "configs": CONFIGS,
                            "results": results}, summary(results), directory=a.out)
    print("\n".join(f"{r['metric']}: {r['value']} {r['unit']}" for r in summary(results)))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
