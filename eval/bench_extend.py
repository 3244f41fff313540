"""Microbenchmark of one extend (prefill) attention layer on the head-group pool: where tangram's prefill time goes.

Llama-3.1-8B shapes (32 q / 8 kv heads, d 128, bf16, page 16, H_p 4), the synthetic mean-0.25 head pattern of
``eval/bench_kernels.py`` (one kv head of 8 at 1.0, the rest at 0.14). A case is ``rows`` requests, each
with ``n_new`` new tokens after ``context`` cached ones, of which group g keeps k_g(context) in the pool:

- ``chunk_*``: one 8192-token prefill chunk after 0 / 16k / 40k cached tokens (a long document's chunks);
- ``questions``: 16 rows of 64 new tokens after 32k cached tokens (a question turn over long histories).

Timed: ``tangram_sgl.kernels.extend.extend_attention`` at several block configurations (the serving default
first), and FlashInfer 0.6.15's ragged causal prefill on contiguous K/V as references — over the whole
uncompressed context (what stock SGLang's attention reads) and over a uniform cache of the mean kept length
(what an ideal kernel over the compressed cache could approach) — and a candidate replacement on the same
compressed cache: FlashInfer's chunk prefill + a pseudo-request paged prefill over the prefix, merged by
log-sum-exp (``flashinfer_two_pass``). Every output is checked against the default configuration's.

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
from tangram_sgl.kernels.extend import extend_attention
from tqdm import tqdm

DEFAULT_CONFIG = (64, 64, 4, 2)  # extend_attention's defaults: block_m, block_n, num_warps, num_stages
CONFIGS = (DEFAULT_CONFIG, (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2))
CASES = {"chunk_0": (1, 8192, 0), "chunk_16k": (1, 8192, 16384), "chunk_40k": (1, 8192, 40960),
         "questions": (16, 64, 32768)}
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


def flashinfer_two_pass(shape: Shape, c: Cache, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, rows: int,
                        n_new: int) -> tuple[float, torch.Tensor]:
    """The same extend through FlashInfer, as SGLang's flashinfer backend splits prefix and chunk: a ragged causal
    prefill of the new tokens (all heads), a paged prefill over the compressed prefix with each (row, kv head) a
    pseudo-request of its GQ query heads on single-head page views, merged by log-sum-exp. plan() outside the
    timing (an extend step would plan per layer). Returns (ms, output)."""
    import flashinfer
    from tangram_sgl.kernels.flashinfer_decode import pool_as_single_head_pages, pseudo_request_pages

    dev, hq, hkv, d, ps = q.device, shape.hq, shape.hkv, shape.head_dim, shape.page_size
    gq, t = hq // hkv, rows * n_new

    qo = torch.arange(rows + 1, dtype=torch.int32, device=dev) * n_new
    chunk = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace(dev), "NHD")
    chunk.plan(qo, qo, hq, hkv, d, causal=True, q_data_type=q.dtype)
    indptr, pages, last = pseudo_request_pages(c.kv_indptr, c.kv_indices, c.head_group, c.head_column, batch=rows,
                                               page_size=ps, heads_per_group=shape.heads_per_group)
    prefix = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(dev), "NHD")
    prefix.plan(torch.arange(rows * hkv + 1, dtype=torch.int32, device=dev) * n_new, indptr, pages, last, gq, 1, d,
                ps, causal=False, q_data_type=q.dtype)
    kv_pages = (pool_as_single_head_pages(c.k), pool_as_single_head_pages(c.v))

    def run() -> torch.Tensor:
        o1, s1 = chunk.run(q, k_new, v_new, return_lse=True)
        q_rows = q.view(rows, n_new, hkv, gq, d).permute(0, 2, 1, 3, 4).reshape(rows * hkv * n_new, gq, d)
        o2, s2 = prefix.run(q_rows, kv_pages, return_lse=True)
        o2 = o2.view(rows, hkv, n_new, gq, d).permute(0, 2, 1, 3, 4).reshape(t, hq, d)
        s2 = s2.view(rows, hkv, n_new, gq).permute(0, 2, 1, 3).reshape(t, hq)
        return flashinfer.merge_state(o1, s1, o2.contiguous(), s2.contiguous())[0]

    return gpu_time_ms(run, events_if_uncapturable=True)[0], run()


def run_case(shape: Shape, name: str, rows: int, n_new: int, context: int, dev: str, with_fi: bool) -> dict:
    profile = synthetic_profile(shape, 0.25)
    gen = torch.Generator(device=dev).manual_seed(0)
    c = build_cache(shape, profile, rows, context, dev, gen)
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
    default = "x".join(map(str, DEFAULT_CONFIG))
    res["ours_ms"] = times
    res["max_abs_diff_vs_default"] = {k: float((o - outs[default]).abs().max()) for k, o in outs.items()}
    res["best_config"] = min(times, key=times.get)
    if with_fi:
        mean_kept = round(sum(c.head_len) / len(c.head_len))
        res["flashinfer_full_ms"] = flashinfer_ragged_ms(shape, rows, n_new, context + n_new, dev)
        res["flashinfer_mean_kept_ms"] = flashinfer_ragged_ms(shape, rows, n_new, mean_kept + n_new, dev)
        if context:  # with an empty prefix the chunk pass alone is the extend (flashinfer_full_ms)
            try:
                res["flashinfer_two_pass_ms"], out = flashinfer_two_pass(shape, c, q, k_new, v_new, rows, n_new)
                res["flashinfer_two_pass_max_abs_diff"] = float((out.float() - outs[default]).abs().max())
            except Exception as e:  # noqa: BLE001 (recorded: the API path is untested on this FlashInfer)
                res["flashinfer_two_pass_error"] = f"{type(e).__name__}: {e}"[:500]
    return res


def summary(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        case = f"{r['case']} ({r['rows']} x {r['n_new']} new after {r['context']})"
        default, best = "x".join(map(str, DEFAULT_CONFIG)), r["best_config"]
        rows.append(summary_row(f"extend {case}: Triton, default config", round(r["ours_ms"][default], 3), "ms"))
        rows.append(summary_row(f"extend {case}: Triton, best config {best}", round(r["ours_ms"][best], 3), "ms"))
        if "flashinfer_full_ms" in r:
            rows.append(summary_row(f"extend {case}: FlashInfer over the uncompressed context",
                                    round(r["flashinfer_full_ms"], 3), "ms"))
            rows.append(summary_row(f"extend {case}: FlashInfer over a uniform cache of the mean kept length",
                                    round(r["flashinfer_mean_kept_ms"], 3), "ms"))
        if "flashinfer_two_pass_ms" in r:
            rows.append(summary_row(f"extend {case}: FlashInfer two-pass (chunk + pseudo-request prefix, merged) "
                                    f"on the same compressed cache", round(r["flashinfer_two_pass_ms"], 3), "ms"))
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
    results = [run_case(shape, name, *case, dev, not a.tiny) for name, case in tqdm(cases.items(), desc="cases")]
    path = write_result("bench_extend" + ("_tiny" if a.tiny else ""), {"shape": shape.__dict__, "configs": CONFIGS,
                        "results": results}, summary(results), directory=a.out)
    print("\n".join(f"{r['metric']}: {r['value']} {r['unit']}" for r in summary(results)))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
