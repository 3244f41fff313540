"""One decode layer at issue 8's anchor (batch 32 x 32k, one kv head of 8 at budget 1.0, seven at 0.14): the served
AOT-split kernel (at its block config, and at four deeper-pipelined ones: does the H200's faster memory want more
bytes in flight?) beside the token-balanced one, needing only torch and Triton — no SGLang bundle, so it fits a fresh
GPU machine's first call (``eval/device/gpu_checks.sh`` stage ``probe``; ``bench_kernels.py`` is the full study).

The cache: Llama-3.1-8B's shapes (32 / 8 heads of 128, pages of 16 tokens, 4 heads a group), layer 0's heads in three
groups (the 1.0 head; four and three 0.14 heads), each (request, group) list on shuffled pages; the AOT rows are the
served table's at this batch for 264 and 528 CTAs (the budget-1.0 group split 5 / 9 times, the others 1 / 2), and two
rows that give every CTA the same number of tokens (7 / 1 / 1 and 14 / 2 / 2).

    python eval/probe_decode.py --out eval/results
    python eval/probe_decode.py --batch 16 --context 65536 --rows 9/2/2,10/2/2 --name probe_rows_b16_64k

``--rows`` times only the given AOT rows at any batch and context (the table's splits per group, checked against the
first row's output), to test the launch simulation's choice of rows (``tangram_sgl/aot_table.py``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import triton
import triton.testing
from results_io import device_name, peak_hbm_bytes_per_s, summary_row, write_result
from tangram_sgl.kernels.decode import launch_order, paged_decode
from tangram_sgl.kernels.decode_balanced import THREE_PER_SM_MAXNREG, balanced_paged_decode

HQ, HKV, D, PAGE, HP = 32, 8, 128, 16, 4


def anchor_cache(batch: int, context: int, dev: str, dtype: torch.dtype, low_budget: float = 0.14) -> dict:
    """Slot lists, pool and query of the anchor's layer (see the module docstring); ``low_budget``: the seven heads'
    budget (1.0: every head keeps the whole context)."""
    # + 4 sink and 32 recent tokens, as the profile keeps
    lens = [context] + [min(context, math.ceil(low_budget * context) + 36)] * 2
    pages_per = [math.ceil(n / PAGE) for n in lens]
    gen = torch.Generator(device=dev).manual_seed(0)
    num_pages = batch * sum(pages_per) + 1
    perm = torch.randperm(num_pages - 1, device=dev, generator=gen) + 1
    starts, lists, used, at = [], [], 0, 0
    for _ in range(batch):
        for n, npages in zip(lens, pages_per):
            pages = perm[used:used + npages]
            used += npages
            lists.append((pages[:, None] * PAGE + torch.arange(PAGE, device=dev)).reshape(-1)[:n])
            starts.append(at)
            at += n
    return {
        "q": torch.randn(batch, HQ, D, device=dev, dtype=dtype, generator=gen),
        "k": torch.randn(num_pages, HP, PAGE, D, device=dev, dtype=dtype, generator=gen),
        "v": torch.randn(num_pages, HP, PAGE, D, device=dev, dtype=dtype, generator=gen),
        "kv_starts": torch.tensor(starts, dtype=torch.int32, device=dev),
        "kv_lens": torch.tensor(lens * batch, dtype=torch.int32, device=dev),
        "kv_indices": torch.cat(lists).int(),
        "head_group": torch.tensor([0, 1, 1, 1, 1, 2, 2, 2], dtype=torch.int32, device=dev),
        "head_column": torch.tensor([0, 0, 1, 2, 3, 0, 1, 2], dtype=torch.int32, device=dev),
        "kept_tokens": batch * (lens[0] + 7 * lens[1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=Path("eval/results"))
    ap.add_argument("--name", default="probe_decode")
    ap.add_argument("--low-budget", type=float, default=0.14,
                    help="budget of the seven heads beside the 1.0 head (default 0.14: the anchor's; 1.0: all full)")
    ap.add_argument("--rows", default="",
                    help="time only these AOT rows, e.g. 5/1/1,10/2/2 (splits of the 1.0 group and the two 0.14 "
                         "groups; the first is the reference the others are checked against)")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if not 0 < a.low_budget <= 1:
        ap.error(f"--low-budget must be in (0, 1], got {a.low_budget}")
    rows_given = [r.split("/") for r in a.rows.split(",") if r]
    if not all(len(r) == 3 and all(x.isdigit() and int(x) >= 1 for x in r) for r in rows_given):
        ap.error(f"--rows: each row is three split counts >= 1 (5/1/1), got {a.rows!r}")
    rows_given = [[int(x) for x in r] for r in rows_given]
    c = anchor_cache(a.batch, a.context, dev, torch.bfloat16 if dev == "cuda" else torch.float32, a.low_budget)
    lists = (c["q"], c["k"], c["v"], c["kv_starts"], c["kv_lens"], c["kv_indices"], c["head_group"], c["head_column"])
    scale = D**-0.5
    order = torch.tensor(launch_order([1.0] + [a.low_budget] * 7), dtype=torch.int32, device=dev)

    def aot(splits: list[int], **kw):
        s = torch.tensor(splits, dtype=torch.int32, device=dev)
        return lambda: paged_decode(*lists, s, head_order=order, max_splits=max(splits), min_split_tokens=256,
                                    sm_scale=scale, **kw)

    def balanced(programs: int, **kw):
        return lambda: balanced_paged_decode(*lists, sm_scale=scale, num_programs=programs, **kw)

    if rows_given:
        cases = {f"AOT split, row {'/'.join(map(str, r))}": aot(r) for r in rows_given}
    else:
        cases = {"AOT split, 264-CTA row (served)": aot([5, 1, 1]), "AOT split, 528-CTA row": aot([9, 2, 2]),
                 # equal tokens per CTA in every group (32k / 7 ~ 4.7k ~ one 0.14 list; half that at 14 / 2 / 2)
                 "AOT split, rows 7 / 1 / 1": aot([7, 1, 1]), "AOT split, rows 14 / 2 / 2": aot([14, 2, 2]),
                 **{f"AOT split, 264-CTA row, block {cfg}": aot([5, 1, 1], block_n=cfg[0], num_warps=cfg[1],
                                                                num_stages=cfg[2])
                    for cfg in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3))},
                 "balanced, 264 programs (default)": balanced(264), "balanced, 396 programs": balanced(396),
                 "balanced, 528 programs": balanced(528),
                 f"balanced, 396 programs, maxnreg {THREE_PER_SM_MAXNREG}": balanced(396, maxnreg=THREE_PER_SM_MAXNREG),
                 "balanced, 396 programs, block (64, 4, 2)": balanced(396, block_n=64, num_warps=4, num_stages=2)}
    roofline_ms = c["kept_tokens"] * D * 2 * c["k"].element_size() / peak_hbm_bytes_per_s(device_name()) * 1e3
    ref = next(iter(cases.values()))()
    anchor = (a.batch, a.context, a.low_budget) == (32, 32768, 0.14)  # the shape issue 8's 0.26 ms target is set for
    rows, summary = {}, []
    for name, fn in cases.items():
        try:
            diff = float((fn().float() - ref.float()).abs().max())
            ms = triton.testing.do_bench_cudagraph(fn, rep=200) if dev == "cuda" else None
            rows[name] = {"ms": ms, "max_abs_diff_vs_first_case": diff,
                          "roofline_frac": roofline_ms / ms if ms else None}
            if ms is not None:
                shape = f"B{a.batch} x {a.context // 1024}k"
                if a.low_budget != 0.14:
                    shape += f", budgets 1 / {a.low_budget:g}"
                metric = f"{'anchor ' if anchor else ''}decode layer ({shape}), {name}"
                summary.append(summary_row(metric, ms, "ms", "<= 0.26", ms <= 0.26) if anchor
                               else summary_row(metric, ms, "ms"))
        except Exception as e:  # noqa: BLE001 (recorded: the other cases still run)
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(name, rows[name], flush=True)
    data = {"batch": a.batch, "context": a.context, "low_budget": a.low_budget, "kept_tokens": c["kept_tokens"],
            "roofline_ms": roofline_ms, "cases": rows}
    print("wrote", write_result(a.name, data, summary, directory=a.out))


if __name__ == "__main__":
    main()
