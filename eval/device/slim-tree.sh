#!/bin/bash
# Keep the device tool's copy of the working tree small. Every `run` call copies the tracked files (~15 MB by session
# 34) beside its carried bundle, under a 64 MiB limit: .device-bundle/b2 (52 MB) no longer fitted beside the whole
# tree. No device stage reads the result plots or the exactness records, so they can leave the tree for the calls.
#   bash eval/device/slim-tree.sh out    delete them from the working tree (refused while any has uncommitted changes)
#   bash eval/device/slim-tree.sh back   restore them from HEAD (`git checkout`), as they were
# Run from the repository root; `back` before committing and before `eval/report.py` (its results table lists the
# exactness records; git status shows them as deleted while out).
set -euo pipefail
files() { git ls-files -- 'eval/results/*.png' 'eval/results/**/*.png' 'eval/results/exactness_*.json'; }
case "${1:-}" in
  out)
    if ! git diff --quiet HEAD -- $(files); then
      echo "slim-tree: result plots or exactness records have uncommitted changes; commit them first" >&2; exit 1
    fi
    files | xargs rm -f
    echo "slim-tree: tracked files now $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
    ;;
  back)
    gone=$(git ls-files --deleted -- eval/results)
    if [ -n "$gone" ]; then git checkout -- $gone; fi
    echo "slim-tree: restored $(echo "$gone" | grep -c . || true) files"
    ;;
  *) echo "usage: bash eval/device/slim-tree.sh out|back" >&2; exit 2 ;;
esac
