"""Accuracy on the GPU server vs the CPU reference path, on the same conversations (issue 5, GPU half).

Rebuilds the exact conversations of a CPU run of ``eval/accuracy.py`` (its recorded tasks, seed, samples and
sizes, with the served model's tokenizer), replays them through ``tangram-sgl replay`` against each server
(greedy, the CPU run's answer limit; each server's own answers form its history, as on the CPU), and compares
per method: the share of turns whose answer contains the expected text, and the share of turns whose answer
is identical to the CPU method's. Server -> CPU method: ``stock:<backend>`` -> ``full``; ``tangram:<profile>``
-> ``tangram@<profile target ratio>``. The CPU run is float32 and the server bf16, so identical answers are
not expected everywhere (the greedy floor between two stock bf16 backends is in
``eval/results/exactness_smollm2_floor.json``); the accuracies should agree within their intervals.

    python eval/accuracy_server.py --model-path SMOL_DIR --cpu eval/results/accuracy_cpu_n16.json \
        --servers stock:triton tangram:P05.json --out DIR

``--replays DIR`` compares the replay files an earlier run wrote to DIR instead of starting servers (the GPU
run made while its CPU run was still going, compared once the CPU results exist; the conversations depend only
on the CPU run's tasks, samples, seed and sizes). The earlier run's ``<name>.json`` in DIR names the machine
and versions that measured them; without it (a run cut off after its replays), the replay files' own records do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from accuracy import FULL_SIZES, QUICK_SIZES, TASK_BUILDERS, contains
from results_io import summary_row, write_result
from server_proc import ServerProcess, parse_server_spec, server_args

from tangram_sgl.profile import load_profile
from tangram_sgl.replay.conversation import conversation_to_dict


def rebuild_conversations(cpu: dict, tokenizer) -> list:
    """The conversations a CPU accuracy run (its results' ``data``) was scored on, rebuilt from its recorded
    tasks, samples, seed and sizes."""
    sizes = QUICK_SIZES if cpu["quick"] else FULL_SIZES
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [c for t in cpu["tasks"] for c in TASK_BUILDERS[t](cpu["samples_per_task"], sizes, count_tokens,
                                                                cpu["seed"])]


CONVERSATION_KEYS = ("model", "quick", "seed", "tasks", "samples_per_task", "sizes", "max_new_tokens")


def load_cpu_runs(paths: list[Path]) -> dict:
    """The ``data`` of one CPU accuracy run, or of several runs over the same conversations (e.g. one per budget)
    with their turns joined; runs over other conversations are refused."""
    runs = [json.loads(p.read_text())["data"] for p in paths]
    for path, run in zip(paths[1:], runs[1:]):
        differ = [k for k in CONVERSATION_KEYS if run[k] != runs[0][k]]
        if differ:
            raise SystemExit(f"{path}: other conversations than {paths[0]} (differs in {', '.join(differ)})")
    return {**runs[0], "turns": [t for run in runs for t in run["turns"]]}


def cpu_label(profile: str | None) -> str:
    """The CPU method a server is compared with: full KV for stock SGLang, tangram at the profile's target."""
    return "full" if profile is None else f"tangram@{load_profile(profile).target_ratio:g}"


def replay_on_server(a: argparse.Namespace, label: str, profile: str | None, extra: list[str], conv_file: Path,
                     max_tokens: int, out: Path) -> None:
    """Start the server, replay the conversations greedily into ``out``, stop it."""
    server = ServerProcess(server_args(a.model_path, profile=profile, extra=extra + list(a.server_extra)),
                           a.out / f"server_accuracy_{label}.log", a.port)
    with server:
        server.wait_ready()
        subprocess.run([sys.executable, "-m", "tangram_sgl.cli", "replay", "--endpoint", server.url + "/v1",
                        "--model", server.served_model(), "--conversations", str(conv_file), "--output",
                        str(out), "--max-tokens", str(max_tokens), "--temperature", "0", "--no-progress"],
                       check=False, timeout=900, cwd=a.out)


def replays_machine(folder: Path, name: str, labels: list[str]) -> dict:
    """``{"versions", "device"}`` of the run that wrote the replays in ``folder``: its own ``<name>.json``, or,
    when that run was cut off before writing it, the environment every replay file records (which must agree)."""
    earlier = folder / f"{name}.json"
    if earlier.exists():
        return {k: json.loads(earlier.read_text())[k] for k in ("versions", "device")}
    envs = []
    for label in labels:
        replay = folder / f"replay_accuracy_{label}.json"
        if not replay.exists():
            raise SystemExit(f"{replay}: no replay of server {label} there")
        envs.append(json.loads(replay.read_text())["environment"])
    if any(e != envs[0] for e in envs):
        raise SystemExit(f"{folder}: the replays were written on different machines: {envs}")
    env = dict(envs[0])
    return {"device": env.pop("gpu", None) or env["platform"], "versions": env}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="the HF directory of the model the CPU run used")
    p.add_argument("--cpu", type=Path, nargs="+", required=True,
                   help="results JSON of eval/accuracy.py; several: runs of the same conversations (other budgets)")
    p.add_argument("--servers", nargs="+", required=True, help="stock:<attention backend> | tangram:<profile>")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="accuracy_server", help="result name (<out>/<name>.json)")
    p.add_argument("--port", type=int, default=30400)
    p.add_argument("--replays", type=Path, help="compare the replay_accuracy_<label>.json files in this folder "
                   "(no servers started)")
    p.add_argument("server_extra", nargs="*", help="after --: more launch_server arguments")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    cpu = load_cpu_runs(a.cpu)
    cpu_turns = {(r["method"] if r["method"] == "full" else f"{r['method']}@{r['budget']:g}",
                  r["conversation"], r["turn"]): r for r in cpu["turns"]}
    servers = [parse_server_spec(spec) for spec in a.servers]
    methods = [cpu_label(profile) for _, profile, _ in servers]  # each server's CPU method (its profile read once)
    cpu_methods = {key[0] for key in cpu_turns}
    for spec, method in zip(a.servers, methods):  # before any server starts
        if method not in cpu_methods:
            raise SystemExit(f"server {spec}: the CPU results {[c.name for c in a.cpu]} have no {method} turns")
    conv_file = a.out / "accuracy_conversations.json"
    if not a.replays:
        convs = rebuild_conversations(cpu, AutoTokenizer.from_pretrained(a.model_path))
        conv_file.write_text(json.dumps({"conversations": [conversation_to_dict(c) for c in convs]}))
    runs, summary, measured_on = [], [], None
    if a.replays:
        measured_on = replays_machine(a.replays, a.name, [label for label, _, _ in servers])
    for spec, (label, profile, extra), method in zip(a.servers, servers, methods):
        out = (a.replays or a.out) / f"replay_accuracy_{label}.json"
        if not a.replays:
            replay_on_server(a, label, profile, extra, conv_file, cpu["max_new_tokens"], out)
        elif not out.exists():
            raise SystemExit(f"{out}: no replay of server {spec} there")
        doc = json.loads(out.read_text()) if out.exists() else None
        turns = doc["turns"] if doc else []
        pairs = [(t, cpu_turns.get((method, t["session"], t["turn"]))) for t in turns if t["error"] is None]
        pairs = [(t, c) for t, c in pairs if c is not None and c["answer"] is not None]
        hits = sum(contains(t["expected"], t["answer"]) for t, _ in pairs)
        cpu_hits = sum(c["correct"] for _, c in pairs)
        same = sum(t["answer"].strip() == c["answer"].strip() for t, c in pairs)
        n = max(len(pairs), 1)
        replayed = {k: doc[k] for k in ("date", "command")} if doc else None
        runs.append({"server": spec, "cpu_method": method, "turns": len(turns), "compared": len(pairs),
                     "hits": hits, "cpu_hits": cpu_hits, "identical_answers": same, "replay": replayed})
        summary += [summary_row(f"{label}: answers containing the expected text", round(100 * hits / n, 1), "%"),
                    summary_row(f"{label}: CPU reference {method} on the same turns", round(100 * cpu_hits / n, 1),
                                "%"),
                    summary_row(f"{label}: answers identical to the CPU reference", round(100 * same / n, 1), "%")]
    path = write_result(a.name, {"cpu_results": [c.name for c in a.cpu], "runs": runs}, summary, directory=a.out,
                        measured_on=measured_on)
    print(json.dumps(summary, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
