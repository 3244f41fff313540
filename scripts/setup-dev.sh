#!/usr/bin/env bash
# Creates (or reuses) the CPU dev/test venv and prints its path on the last line of stdout.
# The venv lives outside the clone ($TANGRAM_VENV_ROOT, default ~/.cache/tangram-sgl) so CI and later
# checkouts reuse it. Its name hashes the torch pin (the 5 GB part); a stamp holds the hash of all
# requirement files, and the pip steps rerun only when that stamp differs. The project itself is
# installed editable on every call (cheap), so the entry point always points at this checkout.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TANGRAM_VENV_ROOT:-$HOME/.cache/tangram-sgl}"
torch_pin="torch==2.14.1 torchvision==0.29.1"
venv="$cache/venv-$(echo "$torch_pin" | sha256sum | cut -c1-12)"
want="$(cat "$root"/requirements/*.txt "$root/scripts/setup-dev.sh" | sha256sum | cut -c1-16)"
pipq() {
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; } >&2
  return "${PIPESTATUS[0]}"
}
if [ "$(cat "$venv/.requirements-hash" 2>/dev/null)" != "$want" ]; then
  echo "[setup-dev] preparing $venv (a fresh machine needs several minutes)" >&2
  mkdir -p "$cache"
  [ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
  pipq $torch_pin
  pipq --no-deps -r "$root/requirements/cpu-nodeps.txt"
  pipq -r "$root/requirements/cpu-dev.txt"
  "$venv/bin/python" -c "import torch, torchvision, sglang, triton, transformers; print('[setup-dev] torch', torch.__version__, 'sglang', sglang.__version__, 'triton', triton.__version__)" >&2
  echo "$want" > "$venv/.requirements-hash"
fi
pipq --no-deps --no-build-isolation -e "$root"
echo "$venv"
