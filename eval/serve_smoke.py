"""End-to-end serving check (issue 4, GPU): one server, three kinds of client, prefix hits on later turns.

Starts ``sglang.launch_server`` (tangram when ``--profile`` is given, else stock), then:

1. a 4-turn conversation through the OpenAI client (``/v1/chat/completions``), recording each turn's
   ``usage.prompt_tokens_details.cached_tokens``;
2. SGLang's native ``/generate`` on a 3-turn token-id conversation (``meta_info.cached_tokens``);
3. a multi-turn SGLang frontend program (``sgl.function`` with user/assistant turns via ``sgl.gen``)
   against the server (``RuntimeEndpoint``), cache hits from each answer's meta info;
4. ``/metrics`` lines about the cache and tangram, and the server log's tangram lines.

Writes ``<out>/serve_smoke_<label>.json`` (the eval envelope) and the server log beside it.

    python eval/serve_smoke.py --model-path M --profile P.json --label tangram_r0.25 --out DIR -- <server args>
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import requests
from results_io import summary_row, write_result
from server_proc import TEMPLATES, ServerProcess, graph_batches, server_args

QUESTIONS = ["Tell me about the history of the city and its old harbour walls.",
             "Which of those places would a visitor see first when arriving by boat?",
             "Summarise what we discussed so far in two sentences.",
             "Now list three questions a historian might still ask about it."]


def openai_conversation(url: str, model: str, max_tokens: int, ignore_eos: bool) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages, turns = [{"role": "system", "content": "You are a careful travel guide. " * 40}], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        t0 = time.time()
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": ignore_eos})
        answer = r.choices[0].message.content or ""
        details = r.usage.prompt_tokens_details
        turns.append({"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                      "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
                      "latency_s": time.time() - t0, "answer_head": answer[:80]})
        messages.append({"role": "assistant", "content": answer})
    return turns


def native_generate(url: str, max_tokens: int, ignore_eos: bool) -> list[dict]:
    ids, turns = list(range(5, 805)), []
    for turn in range(3):
        ids += [7 + turn] * 50
        r = requests.post(url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": ignore_eos}}, timeout=600)
        r.raise_for_status()
        out = r.json()
        meta = out["meta_info"]
        turns.append({"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                      "cached_tokens": meta.get("cached_tokens")})
        ids += list(out["output_ids"])
    return turns


def frontend_program(url: str, max_tokens: int) -> list[dict]:
    import sglang as sgl

    @sgl.function
    def multi_turn(s, questions):
        s += sgl.system("You answer in short, plain sentences. " * 30)
        for i, q in enumerate(questions):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=max_tokens, temperature=0))

    backend = sgl.RuntimeEndpoint(url)
    state = multi_turn.run(questions=QUESTIONS[:3], backend=backend)
    turns = []
    for i in range(3):
        meta = state.get_meta_info(f"a{i}")
        turns.append({"prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens"),
                      "answer_head": state[f"a{i}"][:80]})
    return turns


def metric_lines(url: str) -> list[str]:
    text = requests.get(url + "/metrics", timeout=30).text
    keys = ("cache_hit", "tangram", "token_usage", "num_used_tokens")
    return [ln for ln in text.splitlines() if not ln.startswith("#") and any(k in ln for k in keys)]


def run_check(name: str, fn, results: dict) -> None:
    try:
        results[name] = {"ok": True, "turns": fn()}
    except Exception as e:  # noqa: BLE001 (a failing client check is recorded, the others still run)
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}


def later_turns_hit(check: dict, first: int = 1) -> bool:
    return check.get("ok", False) and all((t.get("cached_tokens") or 0) > 0 for t in check["turns"][first:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--profile", help="tangram profile (omit for stock SGLang)")
    p.add_argument("--label", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="dummy weights: answers would stop at random")
    p.add_argument("server_extra", nargs="*", help="after --: more launch_server arguments")
    a = p.parse_args(argv)
    args = server_args(a.model_path, profile=a.profile, extra=a.server_extra,
                       chat_template=str(TEMPLATES / "plain-chat.jinja"))
    server = ServerProcess(args, a.out / f"server_{a.label}.log", a.port)
    results: dict = {"label": a.label, "server_args": args}
    with server:
        try:
            results["ready_s"] = server.wait_ready()
        except (RuntimeError, TimeoutError) as e:
            results["startup_error"] = str(e)
        if "startup_error" not in results:
            model = server.served_model()
            run_check("openai_chat", lambda: openai_conversation(server.url, model, a.max_tokens, a.ignore_eos),
                      results)
            run_check("native_generate", lambda: native_generate(server.url, a.max_tokens, a.ignore_eos), results)
            run_check("frontend_program", lambda: frontend_program(server.url, a.max_tokens), results)
            run_check("metrics", lambda: metric_lines(server.url), results)
    log = server.log.read_text(errors="replace").splitlines()
    results["log_tangram_lines"] = [ln for ln in log if "tangram" in ln.lower()][:80]
    results["log_cuda_graph_lines"] = [ln for ln in log if "cuda graph" in ln.lower()][:20]
    for kind in ("decode", "prefill"):
        results[f"{kind}_batches"], results[f"{kind}_batches_in_graphs"] = graph_batches(log, kind.capitalize())
    summary = [summary_row(f"{a.label}: server ready", results.get("ready_s", -1), "s", "starts",
                           "ready_s" in results)]
    for check, what in (("openai_chat", "OpenAI turns 2-4 hit the prefix cache"),
                        ("native_generate", "/generate turns 2-3 hit"), ("frontend_program", "frontend turns 2-3 hit")):
        hit = later_turns_hit(results.get(check, {}))
        summary.append(summary_row(f"{a.label}: {what}", float(hit), "", "all", hit))
    for kind in ("decode", "prefill"):
        summary.append(summary_row(f"{a.label}: logged {kind} batches run as CUDA-graph replays",
                                   results[f"{kind}_batches_in_graphs"], f"of {results[f'{kind}_batches']}", "report",
                                   None))
    path = write_result(f"serve_smoke_{a.label}", results, summary, directory=a.out)
    print(path.read_text()[:6000])
    return 0 if all(r["met"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
