"""``tangram-sgl``: the project's command line (profile, synth, validate, replay)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, add-args function, run function, help)
_SUBCOMMANDS = {
    "profile": ("tangram_sgl.profiler.cli", "add_profile_args", "run_profile",
                "profile a model's per-head budgets into a profile file"),
    "synth": ("tangram_sgl.profiler.cli", "add_synth_args", "run_synth",
              "write a synthetic profile for a dummy-weight model (throughput work)"),
    "validate": ("tangram_sgl.profile_cli", "add_validate_args", "run_validate",
                 "check a profile file (and that it fits a model config)"),
    "replay": ("tangram_sgl.replay.cli", "add_replay_args", "run_replay",
               "replay multi-turn conversations (CPU reference engine or an OpenAI endpoint)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tangram-sgl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, add_fn, run_fn, help_text) in _SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, add_fn)(p)
        p.set_defaults(_run=getattr(mod, run_fn))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
