"""Greedy token-level agreement of tangram servers with stock SGLang on a real model (issue 4, GPU).

Each run starts one server (``stock:<attention backend>`` or ``tangram:<profile.json>``), replays the
32 three-turn ShareGPT conversations of ``eval/data/exactness_conversations.json`` one request at a time
(the batch composition is then the same for every server), greedy, through SGLang's native ``/generate``
with the chat template applied client-side and logprobs returned; later turns resend the history with the
server's own answers. A spec given twice starts that server again (label ``..._restart``). Every run is
compared with the first: turns whose output token ids are identical,
conversations identical in all turns, and the largest |logprob difference| over the positions where both
runs produced the same tokens so far.

    python eval/exactness.py --model-path DIR --out DIR --runs stock:triton tangram:P1.json tangram:P05.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests
from results_io import summary_row, write_result
from server_proc import ServerProcess, parse_server_spec, server_args

CONVERSATIONS = Path(__file__).resolve().parent / "data" / "exactness_conversations.json"


def collect(url: str, tokenizer, conversations: list[dict], max_tokens: int) -> list[list[dict]]:
    """Per conversation, per turn: output ids, their logprobs, cached prompt tokens."""
    out = []
    for conv in conversations:
        messages = [{"role": "system", "content": conv["system"]}] if conv.get("system") else []
        turns = []
        for turn in conv["turns"]:
            messages.append({"role": "user", "content": turn["user"]})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            r = requests.post(url + "/generate", json={
                "input_ids": ids, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}, timeout=600)
            r.raise_for_status()
            res = r.json()
            meta = res["meta_info"]
            turns.append({"output_ids": list(res["output_ids"]), "cached_tokens": meta.get("cached_tokens"),
                          "prompt_tokens": meta["prompt_tokens"],
                          "logprobs": [lp[0] for lp in meta["output_token_logprobs"]]})
            messages.append({"role": "assistant", "content": res["text"]})
        out.append(turns)
    return out


def compare(base: list[list[dict]], other: list[list[dict]]) -> dict:
    """Agreement of ``other`` with ``base`` (see module docstring)."""
    same_turns = same_convs = tokens = same_tokens = same_first = 0
    max_lp = max_lp_first = 0.0
    for bc, oc in zip(base, other):
        conv_same = True
        for t, (bt, ot) in enumerate(zip(bc, oc)):
            same = bt["output_ids"] == ot["output_ids"]
            same_turns += same
            same_first += same and t == 0
            conv_same &= same
            tokens += len(bt["output_ids"])
            for i, (a, b) in enumerate(zip(bt["output_ids"], ot["output_ids"])):
                if a != b:
                    break
                same_tokens += 1
                diff = abs(bt["logprobs"][i] - ot["logprobs"][i])
                max_lp = max(max_lp, diff)
                if t == 0:
                    max_lp_first = max(max_lp_first, diff)
            if not conv_same:
                break  # later turns resend diverged histories
        same_convs += conv_same
    n_turns = sum(len(c) for c in base)
    return {"identical_turns": same_turns, "turns": n_turns, "identical_conversations": same_convs,
            "conversations": len(base), "prefix_token_agreement": same_tokens / max(tokens, 1),
            "max_logprob_diff_on_agreeing_prefix": max_lp,
            # first turns alone: no history cached by the server (the overlap scheduler caches one more token
            # of each answer, whose K/V a decode step computed instead of the next turn's prefill)
            "identical_first_turns": same_first, "max_logprob_diff_first_turns": max_lp_first}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", nargs="+", required=True, help="stock:<attention backend> | tangram:<profile>")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--name", default="exactness_smollm2")
    p.add_argument("server_extra", nargs="*", help="after --: more launch_server arguments for every run")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_path)
    convs = json.loads(CONVERSATIONS.read_text())["conversations"]
    runs: dict[str, dict] = {}
    for spec in a.runs:
        label, profile, extra = parse_server_spec(spec)
        if label in runs:  # the same server again: how repeatable it is (stock: bit for bit)
            label += "_restart"
        args = server_args(a.model_path, profile=profile, extra=extra + list(a.server_extra))
        server = ServerProcess(args, a.out / f"server_{a.name}_{label}.log", a.port)
        with server:
            try:
                server.wait_ready()
                runs[label] = {"spec": spec, "results": collect(server.url, tok, convs, a.max_tokens)}
            except Exception as e:  # noqa: BLE001 (recorded; the remaining runs still go)
                runs[label] = {"spec": spec, "error": f"{type(e).__name__}: {e}", "log_tail": server.tail()}
        print(label, "error" if "error" in runs[label] else "ok", flush=True)
    labels = list(runs)
    base = labels[0]
    summary, comparisons = [], {}
    for label in labels[1:]:
        if "error" in runs[label] or "error" in runs[base]:
            continue
        c = compare(runs[base]["results"], runs[label]["results"])
        comparisons[label] = c
        # budget 1.0 must equal stock; the overlap scheduler must not change a tangram server's outputs; a
        # restarted server must repeat its outputs
        exact_target = (("1.0" in label and "tangram" in label) or label.replace("_ov_", "_") == base
                        or label.removesuffix("_restart") == base)
        summary.append(summary_row(f"{label} vs {base}: identical turns", c["identical_turns"] / c["turns"], "",
                                   "1.0" if exact_target else "report",
                                   c["identical_turns"] == c["turns"] if exact_target else None))
        summary.append(summary_row(f"{label} vs {base}: max |dlogprob| on agreeing tokens",
                                   c["max_logprob_diff_on_agreeing_prefix"], "",
                                   "<= 1e-2" if exact_target else "report",
                                   c["max_logprob_diff_on_agreeing_prefix"] <= 1e-2 if exact_target else None))
    path = write_result(a.name, {"base": base, "comparisons": comparisons, "runs": runs}, summary,
                        directory=a.out)
    print(json.dumps({"comparisons": comparisons, "errors": {k: v.get("error") for k, v in runs.items()}},
                     indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
