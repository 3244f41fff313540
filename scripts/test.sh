#!/usr/bin/env bash
# The project's test command (README, .ci/run): sets up the CPU venv if needed, then runs every test.
# Triton kernels run under the interpreter (TRITON_INTERPRET=1): no GPU is needed or used.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/setup-dev.sh" | tail -n 1)"
cd "$root"
export TRITON_INTERPRET=1 PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" -m pytest -q tests "$@"
