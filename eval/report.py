"""Regenerate the README's tables from the ``summary`` rows of eval/results/*.json: every row of every result, and the
issues' targets at a glance (:data:`HEADLINES`: each target read from the newest result of the configuration served
by default; a metric that is missing from its result fails loudly)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"
HEAD_START, HEAD_END = "<!-- targets-table:start -->", "<!-- targets-table:end -->"
R1_EAGER = "tangram_mixed_ov_llama-3.1-8b.uniform.r1.0"  # eager prefill: tangram's default through session 26
R1 = "tangram_mixed_bcg1024_ov_llama-3.1-8b.uniform.r1.0"  # prefill graphs for steps <= 1024 tokens: since session 27
QWEN_R05 = "tangram_flashinfer_qwen2.5-coder-0.5b-instruct.snapkv-p31.r0.5"
QWEN_R025 = "tangram_flashinfer_qwen2.5-coder-0.5b-instruct.snapkv-p31.r0.25"
QWEN_EA = "tangram_mixed_ov_qwen2.5-coder-0.5b-instruct.ea.r{}"
SMOL_R05 = "tangram_mixed_bcg_ov_smollm2-135m-instruct.snapkv-p31.r0.5"


def _accuracy_sources(name: str, scorer: str, model: str, turns: int, kept: dict[str, str],
                      profile_stem: str = "") -> list[tuple[str, str]]:
    """The (result, metric) pairs of a pooled accuracy result over ``turns`` turns, in the order tangram / uniform
    @0.5, tangram / uniform @0.25, full (``kept``: each method's "KV kept" figure as its metric names it;
    ``profile_stem``: for a result whose tangram turns came from other profiles, their name before ``.r<budget>``,
    which each tangram label names)."""
    def metric(method: str) -> str:
        tags = [scorer] if method != "full" else []
        tags += [f"{profile_stem}.r{method.split('@')[1]}"] if profile_stem and method.startswith("tangram@") else []
        tag = f" [{'; '.join(tags)}]" if tags else ""
        return f"retrieval accuracy {method}{tag}{model} (n={turns}, KV kept {kept[method]})"

    return [(name, metric(m)) for m in ("tangram@0.5", "uniform@0.5", "tangram@0.25", "uniform@0.25", "full")]


# (issue, target, [(result name, summary metric), ...] whose values are shown together)
LONG, GRID = "bench_serving_long", "bench_serving_grid"
LONG_H100, GRID_H100 = "bench_serving_long_h100", "bench_serving_grid_h100"
KERNELS, SHORT_KERNELS, KERNELS_H100 = "bench_kernels_study", "bench_kernels_short", "bench_kernels_fi_h100"
# the 32k-64k grid's summary metrics, shared by the H200 file (KERNELS) and the H100 one (KERNELS_H100)
K_ANCHOR = "decode ms/layer, B32 x 32k, mean budget 0.25 (Triton, AOT splits)"
K_VS_PLAN = "speed-up vs FlashInfer plan()+run, same cache (anchor)"
K_VS_FULL = "speed-up vs FlashInfer uncompressed decode (anchor)"
K_ROOFLINE = "worst roofline share at batch >= 16 (18 cases: batch 16/32/64, context 32k/64k, budget 0.25/0.5/1)"
K_R1 = "budget 1.0: worst Triton time / FlashInfer uncompressed (6 cases: batch 16/32/64, context 32k/64k, budget 1)"
HEADLINES = (
    (5, "long class (48k documents), budget 0.25: output tok/s >= 3.0x stock",
     [(LONG, "tangram_llama-3.1-8b.synthetic.r0.25 long: throughput vs stock_flashinfer")]),
    (5, "long class, budget 0.25: sessions in the same KV memory >= 3.5x stock",
     [(LONG, ("tangram_llama-3.1-8b.synthetic.r0.25 long: sessions the KV pool holds vs stock_flashinfer (pool "
             "tokens / measured kept fraction per session)"))]),
    (5, "budget 1.0 >= 0.95x stock: long class", [(LONG, ("tangram_mixed_llama-3.1-8b.uniform.r1.0 long: throughput vs "
                                                        "stock_flashinfer"))]),
    (5, "budget 1.0 >= 0.95x stock: mid class (16k documents, 64 sessions)",
     [(GRID, "tangram_flashinfer_llama-3.1-8b.uniform.r1.0 mid: throughput vs stock_flashinfer")]),
    (5, ("budget 1.0 >= 0.95x stock: short class (4k documents) at 8 / 32 / 128 sessions (eager prefill, the "
         "default until session 27)"),
     [(GRID, f"{R1_EAGER} short x{n}: throughput vs stock_flashinfer") for n in (8, 32, 128)]),
    (5, ("budget 1.0 >= 0.95x stock, H100 (its KV pool holds 64 short sessions): short class at 8 / 32 / 64 sessions "
         "(today's default: prefill graphs for steps <= 1024 tokens), then long class (eager prefill, session 23)"),
     [(GRID_H100, f"{R1} short x{n}: throughput vs stock_flashinfer") for n in (8, 32, 64)]
     + [(LONG_H100, f"{R1_EAGER} long: throughput vs stock_flashinfer")]),
    (5, ("accuracy, SmolLM2-135M (CPU path, 14 seeds pooled), tangram >= uniform at 0.5 and 0.25, and within 5 points "
         "of full at 0.5; shown: tangram / uniform @0.5, tangram / uniform @0.25, full; profiles with conversation "
         "retention (session 36)"),
     _accuracy_sources("accuracy_cpu_p31_conv_pooled", "snapkv:pool_kernel=31", "", 1120,
                       {"full": "1.000", "uniform@0.5": "0.596", "tangram@0.5": "0.607", "uniform@0.25": "0.360",
                        "tangram@0.25": "0.369"},
                       "smollm2-135m-instruct.snapkv-p31-conv")),
    (5, "accuracy, SmolLM2-135M, the same turns with the segment-retention profiles (before session 36)",
     _accuracy_sources("accuracy_cpu_p31_pooled", "snapkv:pool_kernel=31", "", 1120,
                       {"full": "1.000", "uniform@0.5": "0.596", "tangram@0.5": "0.608", "uniform@0.25": "0.360",
                        "tangram@0.25": "0.372"})),
    (5, "accuracy, Qwen2.5-Coder-0.5B (CPU path, 5 seeds pooled): the same, shown the same way",
     _accuracy_sources("accuracy_cpu_qwen_ea_pooled", "expected_attention", " on Qwen2.5-Coder-0.5B-Instruct", 400,
                       {"full": "1.000", "uniform@0.5": "0.595", "tangram@0.5": "0.617", "uniform@0.25": "0.359",
                        "tangram@0.25": "0.373"})),
    (5, ("accuracy, Qwen2.5-Coder-0.5B, the same turns with conversation-retention profiles (session 37; not the "
         "default: expected_attention scores barely depend on the window, its budgets moved by at most 0.025)"),
     _accuracy_sources("accuracy_cpu_qwen_ea_conv_pooled", "expected_attention", " on Qwen2.5-Coder-0.5B-Instruct", 400,
                       {"full": "1.000", "uniform@0.5": "0.595", "tangram@0.5": "0.619", "uniform@0.25": "0.359",
                        "tangram@0.25": "0.372"},
                       "qwen2.5-coder-0.5b-instruct.ea-conv")),
    (5, "accuracy, GPU server / CPU path on the same turns (Qwen, snapkv r0.5, then r0.25)",
     [("accuracy_server_qwen", f"{QWEN_R05}: answers containing the expected text"),
      ("accuracy_server_qwen", f"{QWEN_R05}: CPU reference tangram@0.5 on the same turns"),
      ("accuracy_server_qwen", f"{QWEN_R025}: answers containing the expected text"),
      ("accuracy_server_qwen", f"{QWEN_R025}: CPU reference tangram@0.25 on the same turns")]),
    (5, ("accuracy, GPU server / CPU path on the same turns (Qwen, expected_attention r0.5, then r0.25: the profiles "
         "of the pooled row above)"),
     [("accuracy_server_qwen_ea", f"{QWEN_EA.format(b)}: {m}") for b in ("0.5", "0.25")
      for m in ("answers containing the expected text", f"CPU reference tangram@{b} on the same turns")]),
    (5, "accuracy, GPU server / CPU path on the same turns (SmolLM2, snapkv pool-31 r0.5, then stock / full KV)",
     [("accuracy_server_p31", f"{SMOL_R05}: answers containing the expected text"),
      ("accuracy_server_p31", f"{SMOL_R05}: CPU reference tangram@0.5 on the same turns"),
      ("accuracy_server_p31", "stock_triton: answers containing the expected text"),
      ("accuracy_server_p31", "stock_triton: CPU reference full on the same turns")]),
    (8, "decode, batch 32 x 32k, mean budget 0.25 (the anchor): <= 0.26 ms a layer", [(KERNELS, K_ANCHOR)]),
    (8, "the anchor: >= 2.7x FlashInfer plan()+run / >= 3.6x uncompressed FlashInfer",
     [(KERNELS, K_VS_PLAN), (KERNELS, K_VS_FULL)]),
    (8, "decode >= 85 % of the 4.8 TB/s roofline at batch >= 16, worst case: 32k-64k grid / 4k",
     [(KERNELS, K_ROOFLINE),
      (SHORT_KERNELS, "worst roofline share at batch >= 16 (4 cases: batch 32/128, context 4k, budget 0.25/1)")]),
    (8, "budget 1.0 within 10 % of FlashInfer's uncompressed decode, worst case: 32k-64k grid / 4k",
     [(KERNELS, K_R1),
      (SHORT_KERNELS, ("budget 1.0: worst Triton time / FlashInfer uncompressed (3 cases: batch 8/32/128, context 4k, "
                      "budget 1)"))]),
    (8, "host time planning a decode step: 0", [(KERNELS, "host planning per decode step (ours)")]),
    (8, "H100, FlashInfer timed on the same card (`bench_kernels_fi_h100`): the anchor, <= 0.26 ms a layer (H200 target)",
     [(KERNELS_H100, K_ANCHOR)]),
    (8, "H100: the anchor >= 2.7x FlashInfer plan()+run / >= 3.6x uncompressed FlashInfer",
     [(KERNELS_H100, K_VS_PLAN), (KERNELS_H100, K_VS_FULL)]),
    (8, "H100: decode >= 85 % of its 3.35 TB/s roofline at batch >= 16, worst case of the 32k-64k grid",
     [(KERNELS_H100, K_ROOFLINE)]),
    (8, "H100: budget 1.0 within 10 % of FlashInfer's uncompressed decode, worst case of the 32k-64k grid",
     [(KERNELS_H100, K_R1)]),
    (3, "page fragmentation <= 10 % of kept", [("pool_memory", "page fragmentation, worst conversation shape")]),
)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _device(doc: dict) -> str:
    """The device a result file names (older files name the GPU under ``versions``)."""
    return doc.get("device") or doc.get("versions", {}).get("gpu", "")


def table() -> str:
    lines = ["| result | metric | measured | target | met | device | date |", "|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "eval" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc.get("name", path.stem)
        device = _device(doc)
        for row in doc.get("summary", []):
            met = {True: "yes", False: "**no**", None: "—"}[row.get("met")]
            value = f"{_fmt(row['value'])} {row.get('unit', '')}".strip()
            lines.append(f"| [{name}](eval/results/{path.name}) | {row['metric']} | {value} | "
                         f"{row.get('target', '') or '—'} | {met} | {device} | "
                         f"{doc.get('date', '')[:10]} |")
    return "\n".join(lines)


def headline_table() -> str:
    """One line per :data:`HEADLINES` entry: its metrics' values from their result files, and met when every one
    with a target is met (``—`` when none has one); a missing result or metric raises ``KeyError``."""
    lines = ["| issue | target | measured | met | result | device | date |", "|---|---|---|---|---|---|---|"]
    docs: dict[str, dict] = {}
    for issue, target, sources in HEADLINES:
        found = []
        for name, metric in sources:
            if name not in docs:
                docs[name] = json.loads((ROOT / "eval" / "results" / f"{name}.json").read_text())
            rows = {row["metric"]: row for row in docs[name].get("summary", [])}
            if metric not in rows:
                raise KeyError(f"{name}.json has no summary metric {metric!r} (HEADLINES in eval/report.py)")
            found.append(rows[metric])
        mets = [row.get("met") for row in found if row.get("met") is not None]
        met = "—" if not mets else "yes" if all(mets) else "**no**"
        value = " / ".join(_fmt(round(row["value"], 3) if isinstance(row["value"], float) else row["value"])
                           for row in found)
        names = list(dict.fromkeys(name for name, _ in sources))
        devices = dict.fromkeys(_device(docs[n]) for n in names)
        lines.append(f"| {issue} | {target} | {value} {found[0].get('unit', '')} | {met} | "
                     f"{', '.join(f'[{n}](eval/results/{n}.json)' for n in names)} | {', '.join(devices)} | "
                     f"{max(docs[n].get('date', '')[:10] for n in names)} |")
    return "\n".join(lines)


def _fill(text: str, start: str, end: str, body: str) -> str:
    if start not in text or end not in text:
        raise ValueError(f"README.md lacks the {start} ... {end} markers")
    return re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", text,
                  flags=re.DOTALL)


def main() -> None:
    readme = ROOT / "README.md"
    headlines = headline_table()
    text = _fill(readme.read_text(), HEAD_START, HEAD_END, headlines)
    readme.write_text(_fill(text, START, END, table()))
    print(headlines)


if __name__ == "__main__":
    main()
