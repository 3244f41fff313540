"""What the tangram attention backend can serve: its refusal error and the setting rules that both the backend (at
construction, ``attention/backend.py``) and the ``--kv-policy`` hook (at argument parsing, ``patches/server_args.py``)
apply, so that the SGLang hooks import them from the library rather than the library from the hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TangramNotServable(RuntimeError):
    """The tangram KV policy was selected with settings this build cannot serve."""


PREFILL_GRAPH_BACKENDS = ("disabled", "breakable")  # the prefill CUDA-graph kinds the tangram backend serves

# Settings refused while SGLang's overlap scheduler runs: ServerArgs field -> (flag, why).
OVERLAP_UNSUPPORTED = {
    "enable_mixed_chunk": ("--enable-mixed-chunk", ("under overlap SGLang places a running request's row one "
                                                    "position ahead when its previous batch left it out; untested")),
    "strip_thinking_cache": ("--strip-thinking-cache", "it caches fewer tokens than the backend computed"),
}


def overlap_conflict(setting: Callable[[str], Any]) -> str | None:
    """The refusal of the first :data:`OVERLAP_UNSUPPORTED` setting that ``setting(field name)`` reports on, if any."""
    for name, (flag, why) in OVERLAP_UNSUPPORTED.items():
        if setting(name):
            return (f"--kv-policy tangram with SGLang's overlap scheduler does not support {flag} ({why}); add "
                    f"--disable-overlap-schedule")
    return None
