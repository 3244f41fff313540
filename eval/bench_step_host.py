"""Host time of the tangram forward metadata per step, beside the GPU time of the step's attention (issue 5).

Fills a tangram pool (Llama-3.1-8B shapes from a profile, random K/V and scores) with ``--requests``
sessions of ``--context`` tokens prefilled in ``--chunk``-token segments through the same manager calls the
SGLang backend makes, then times, per step:

- decode: building the ``ForwardStep`` (rows -> requests, decode slots, the device slot lists appended in
  place) on the host, and the attention of every layer on the GPU (token K/V write + split-KV decode), timed
  as eager launches and (CUDA) as a CUDA-graph replay of the last step, which is how serving runs decode;
  beside it, what the previous design cost: rebuilding every (request, group) slot list on the host and
  copying it to the device (``TangramKVManager.slot_lists``);
- extend: one question per session as one extend batch (host metadata, then per layer the extend kernel +
  segment writes), for each ``--questions`` length: 16 tokens are kept whole (shorter than sink + window),
  96 are compressed (scored and selected for all rows at once); and the prefill chunks' per-layer segment
  writes.

Writes ``<out>/<name>.json``. Runs on CPU too at toy sizes (``--device cpu``: torch kernels);
``--host-only`` times just the host work (no attention, CSR or extend): the decode step's metadata, and what a
question turn's admission costs per request in the scheduler's hooks (match, attach, reservation: each session's
context finished into the radix tree first), which is host-bound on any machine.

    python eval/bench_step_host.py --requests 16 --context 32768 --out eval/results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

from results_io import RESULTS, summary_row, write_result
from tangram_sgl.patches.server_args import DEFAULT_EXTEND_KERNEL, EXTEND_KERNELS

from tangram_sgl.attention.forward_step import AttentionContext, StepRow
from tangram_sgl.budget import pages_for
from tangram_sgl.layout import HeadGroupLayout
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.pool.reservation import segment_kept_counts
from tangram_sgl.profile import load_profile

DEFAULT_PROFILE = ROOT / "tangram_sgl" / "profiles" / "llama-3.1-8b.synthetic.r0.25.json"


def write_profile(prof: cProfile.Profile, path: Path) -> None:
    """The top 40 functions by own time, then by cumulative time, as pstats prints them."""
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    print("wrote", path)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(dev: torch.device, fn, profile_to: Path | None = None) -> tuple[float, object]:
    """(milliseconds, result) of ``fn()`` with the device idle before and after; with ``profile_to``, ``fn`` runs
    under cProfile and its top functions go to that file (:func:`write_profile`)."""
    prof = cProfile.Profile() if profile_to is not None else None
    sync(dev)
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    out = fn()
    if prof is not None:
        prof.disable()
    sync(dev)
    ms = (time.perf_counter() - t0) * 1e3
    if prof is not None:
        write_profile(prof, profile_to)
    return ms, out


def pool_pages(layout: HeadGroupLayout, profile, requests: int, context: int, chunk: int, extra: int) -> int:
    """Pages the filled pool needs: every chunk's kept tokens per group, then decoded / question tokens."""
    pages = 0
    for start in range(0, context, chunk):
        counts = segment_kept_counts(layout, min(chunk, context - start), start, profile.sink_tokens,
                                     profile.recent_window)
        pages += sum(pages_for(k, layout.page_size) for k in counts)
    return requests * (pages + layout.num_groups * (pages_for(extra, layout.page_size) + 2)) + 16


def csr_lists(kv: TangramKVManager, rids: list[str], dev: torch.device) -> torch.Tensor:
    """What the arena replaces: every (request, group) list rebuilt on the host and copied to ``dev``."""
    indptr, indices = kv.slot_lists(rids)
    indptr.to(dev)
    return indices.to(dev)


def write_layers(kv: TangramKVManager, rid: str, n: int, gen: torch.Generator, dev: torch.device) -> float:
    """Write every layer of ``rid``'s pending n-token segment with random K/V and scores; ms of host+device."""
    lay = kv.layout
    d = kv.pool.head_dim
    k = torch.randn(lay.num_kv_heads, n, d, generator=gen, device=dev, dtype=kv.pool.k_buffer.dtype)
    scores = torch.rand(lay.num_kv_heads, n, generator=gen, device=dev)

    def run() -> None:
        for layer in range(lay.num_layers):
            kv.write_segment_layer(rid, layer, k, k, scores)
        kv.commit_segment(rid)

    return timed(dev, run)[0]


def admission_us(kv: TangramKVManager, rids: list[str], question: int, decode: int) -> dict[str, list]:
    """What the scheduler's hooks cost per request on a question turn (microseconds, one per session): each session
    finishes (``finish``: its context goes into the radix tree, ``cache_finished_req``), then a new request on its
    tokens plus ``question`` more is matched (``match_prefix``), attached and reserved (the ``alloc_for_extend``
    hook), then aborted; ``matched``: the cached tokens each match found."""
    out: dict[str, list[float]] = {"finish": [], "match": [], "attach": [], "reserve": [], "matched": []}
    for rid in rids:
        tokens = list(kv.requests[rid].token_ids)
        tf = time.perf_counter()
        kv.finish(rid)
        out["finish"].append((time.perf_counter() - tf) * 1e6)
        tokens += [7] * question
        t0 = time.perf_counter()
        node, _ = kv.tree.match(tokens)
        t1 = time.perf_counter()
        kv.attach(rid, node, tokens)
        t2 = time.perf_counter()
        kv.reserve(rid, tokens[node.end:], decode)
        t3 = time.perf_counter()
        kv.abort(rid)
        for key, dt in zip(("match", "attach", "reserve"), (t1 - t0, t2 - t1, t3 - t2)):
            out[key].append(dt * 1e6)
        out["matched"].append(node.end)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=str(DEFAULT_PROFILE))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--head-dim", type=int, help="default: the profile's (use a small one on CPU)")
    p.add_argument("--questions", default="16,96", help="question lengths of the timed extend batches")
    p.add_argument("--extend-kernel", choices=EXTEND_KERNELS, help="extend attention, as --tangram-extend-kernel "
                   f"(default: {DEFAULT_EXTEND_KERNEL} on CUDA, as the server; the Triton/torch kernel set elsewhere)")
    p.add_argument("--host-only", action="store_true", help="time the decode step's host metadata only")
    p.add_argument("--cprofile", action="store_true",
                   help="cProfile each timed extend batch's layers and its metadata: the top functions by own "
                        "time go to <out>/<name>_extend<question>.prof.txt and ..._extend<question>_host.prof.txt "
                        "(where the host waits shows up as own time)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="bench_step_host")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    profile = load_profile(a.profile)
    questions = [int(x) for x in a.questions.split(",")]
    # decode steps, then each question three times (warm-ups, timed) and once more to profile
    room = a.steps + (4 if a.cprofile else 3) * sum(questions) + 16
    num_pages = pool_pages(HeadGroupLayout.from_profile(profile), profile, a.requests, a.context, a.chunk, room)
    kv = TangramKVManager.from_profile(profile, num_pages, head_dim=a.head_dim, dtype=torch.bfloat16
                                       if dev.type == "cuda" else torch.float32, device=dev)
    kernel = a.extend_kernel or (DEFAULT_EXTEND_KERNEL if dev.type == "cuda" else "triton")
    ctx = AttentionContext.create(kv, profile, extend_kernel=kernel)
    gen = torch.Generator(device=dev).manual_seed(0)
    rids = [f"s{i}" for i in range(a.requests)]
    prefill_ms = []
    for i, rid in enumerate(rids):
        tokens = [(i * 7919 + j) % 50000 + 1 for j in range(a.context)]
        kv.admit(rid, tokens)  # nothing cached: every session's context is its own
        for start in range(0, a.context, a.chunk):
            seg = tokens[start:start + a.chunk]
            kv.reserve(rid, seg, decode_tokens=a.steps + 16 if start + a.chunk >= a.context else 0)
            prefill_ms.append(write_layers(kv, rid, len(seg), gen, dev))
    lay = kv.layout
    hq = profile.model.num_attention_heads
    d = kv.pool.head_dim
    scale = d ** -0.5
    q = torch.randn(a.requests, hq, d, generator=gen, device=dev, dtype=kv.pool.k_buffer.dtype)
    kn = torch.randn(a.requests, lay.num_kv_heads, d, generator=gen, device=dev, dtype=kv.pool.k_buffer.dtype)

    host_ms, gpu_ms, csr_ms, csr_entries = [], [], [], []
    for s in range(a.steps):
        rows = [StepRow(rid, len(kv.requests[rid].token_ids), 1, True) for rid in rids]
        ms, step = timed(dev, lambda rows=rows: ctx.step(rows, [5] * len(rows)))
        host_ms.append(ms)
        if a.host_only:
            continue
        gpu_ms.append(timed(dev, lambda step=step: [step.attend(layer, q, kn, kn, scale)
                                                    for layer in range(lay.num_layers)])[0])
        ms, indices = timed(dev, lambda: csr_lists(kv, rids, dev))
        csr_ms.append(ms)
        csr_entries.append(indices.numel())
    graph_ms = None  # the last step's attention replayed from a CUDA graph (median), as serving runs decode
    if dev.type == "cuda" and not a.host_only:
        graph_ms = triton.testing.do_bench_cudagraph(
            lambda: [step.attend(layer, q, kn, kn, scale) for layer in range(lay.num_layers)], return_mode="median")
    # extend batches of one question per session on its whole cached context: per length, a batch of one
    # session and one of every session warm the kernels up (Triton specialises on argument values, e.g. 1),
    # the third (every session) is timed; the second's layer time is kept too (``first_full_batch_layers_ms``);
    # with --cprofile a fourth batch (every session) is profiled, so the profiler's overhead stays out of the times
    extend = {}
    for question in questions if not a.host_only else []:
        host_times, layer_times = [], []
        for i, batch in enumerate((rids[:1], rids, rids, rids)[:4 if a.cprofile else 3]):
            for rid in batch:
                kv.reserve(rid, [3] * question)
            rows = [StepRow(rid, len(kv.requests[rid].token_ids) - question, question, False) for rid in batch]
            stem = f"{a.name}_extend{question}" if i == 3 else None  # the profiled batch
            ms, step = timed(dev, lambda rows=rows: ctx.step(rows, []), stem and a.out / f"{stem}_host.prof.txt")
            host_times.append(ms)
            qe = torch.randn(len(batch) * question, hq, d, generator=gen, device=dev, dtype=kv.pool.k_buffer.dtype)
            ke = torch.randn(len(batch) * question, lay.num_kv_heads, d, generator=gen, device=dev, dtype=qe.dtype)
            layer_times.append(timed(dev, lambda step=step, qe=qe, ke=ke: (
                [step.attend(layer, qe, ke, ke, scale) for layer in range(lay.num_layers)], step.commit()),
                stem and a.out / f"{stem}.prof.txt")[0])
        extend[question] = {"host_ms": host_times[2], "layers_ms": layer_times[2],
                            "first_full_batch_layers_ms": layer_times[1], "compressed": bool(step.compressed)}

    admission = admission_us(kv, rids, questions[0], 64)
    med = statistics.median
    data = {"profile": Path(a.profile).name, "extend_kernel": kernel if kernel != "triton" else ctx.kernels.name,
            "requests": a.requests, "context": a.context, "chunk": a.chunk,
            "groups": lay.num_groups, "heads_per_group": lay.heads_per_group, "page_size": lay.page_size,
            "head_dim": d, "decode_steps": a.steps, "decode_host_ms": host_ms, "decode_attention_ms": gpu_ms,
            "decode_attention_graph_ms": graph_ms,
            "csr_rebuild_ms": csr_ms, "csr_entries": csr_entries, "extend": extend, "prefill_chunk_write_ms": prefill_ms,
            "arena_used": kv.device_lists.used,
            "arena_capacity": kv.device_lists.capacity, "arena_fallback_steps": kv.arena_fallback_steps,
            "admission_us": admission}
    tag = f"{a.requests} x {a.context // 1024}k, {Path(a.profile).stem}, {data['extend_kernel']} extend"
    if a.host_only:
        tag += f", {lay.num_groups} groups, host only on {a.device}"
    summary = [summary_row(f"decode step host metadata (median, {tag})", round(med(host_ms[1:] or host_ms), 3), "ms")]
    summary += [] if a.host_only else [
        summary_row(f"decode step attention, all layers, eager launches (median, {tag})",
                    round(med(gpu_ms[1:] or gpu_ms), 3), "ms"),
        *([summary_row(f"decode step attention, all layers, CUDA graph replay ({tag})", round(graph_ms, 3), "ms")]
          if graph_ms is not None else []),
        summary_row(f"host CSR rebuild + copy the arena replaces (median, {tag})", round(med(csr_ms), 3), "ms"),
        *(row for n, e in extend.items() for row in (
            summary_row(f"extend step host metadata, {n}-token questions{' (compressed)' * e['compressed']} "
                        f"({tag})", round(e["host_ms"], 3), "ms"),
            summary_row(f"extend step layers incl. segment writes, {n}-token questions ({tag})",
                        round(e["layers_ms"], 3), "ms"))),
        summary_row(f"prefill chunk segment writes, all layers (median, {a.chunk} tokens)",
                    round(med(prefill_ms), 3), "ms"),
    ]
    summary += [summary_row(f"question turn admission, {key} (median per request, {questions[0]}-token question on a "
                            f"cached {a.context // 1024}k context, {tag})", round(med(v), 1), "us")
                for key, v in admission.items() if key != "matched"]
    for row in summary:
        print(f"{row['metric']}: {row['value']} {row['unit']}")
    print("wrote", write_result(a.name, data, summary, directory=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
