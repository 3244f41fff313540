"""The OpenAI-endpoint driver against a tiny fake OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from tangram_sgl.replay.conversation import Conversation, Turn
from tangram_sgl.replay.openai_driver import EndpointConfig, arrival_delays, replay_endpoint
from tangram_sgl.replay.records import TurnRecord, summarize

TOKEN_DELAY_S = 0.01


class FakeChat(BaseHTTPRequestHandler):
    """Streams an answer of 4 word-tokens; cached_tokens = words shared with the longest earlier prompt."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[list[dict]]] = []
    prompts: ClassVar[list[list[str]]] = []
    disconnected: ClassVar[list[str]] = []
    lock = threading.Lock()

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        msgs = body["messages"]
        if msgs[-1]["content"] == "FAIL":
            self.send_response(500)
            payload = b'{"error": "boom"}'
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        words = " ".join(m["content"] for m in msgs).split()
        with self.lock:
            cached = max((_common(words, p) for p in self.prompts), default=0)
            self.prompts.append(words)
            self.seen.append(msgs)
        answer = [f"a{len(msgs)}", "b", "c", "d"]
        delay = TOKEN_DELAY_S
        if msgs[-1]["content"] == "SLOW":  # a turn that outlasts a short --duration window
            answer, delay = answer * 10, 0.1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for i, w in enumerate(answer):
                time.sleep(delay)
                if i == 0:  # as SGLang: the first token's chunk opens with the role and empty content
                    self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                self._event({"choices": [{"index": 0, "delta": {"content": w + " "}}]})
        except (BrokenPipeError, ConnectionResetError):  # the client closed the stream (SGLang aborts here)
            with self.lock:
                self.disconnected.append(msgs[-1]["content"])
            return
        usage = {"prompt_tokens": len(words), "completion_tokens": len(answer),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture()
def fake_server():
    FakeChat.seen, FakeChat.prompts, FakeChat.disconnected = [], [], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeChat)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _convs(n: int) -> list[Conversation]:
    return [Conversation(id=f"s{i}", system="sys", turns=(Turn(f"hello {i}"), Turn("more"), Turn("last")))
            for i in range(n)]


def test_history_is_resent_and_metrics_recorded(fake_server):
    cfg = EndpointConfig(base_url=fake_server, model="m", max_tokens=8)
    records, wall = replay_endpoint(_convs(3), cfg, max_concurrency=3, progress=False)
    assert len(records) == 9 and all(r.ok for r in records)
    # Turn 3 of a session carries system + 2 (user, assistant) pairs + the new user message, with the
    # assistant messages equal to the server's own earlier answers.
    third = [m for m in FakeChat.seen if len(m) == 6]
    assert len(third) == 3
    assert [m["role"] for m in third[0]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[0][2]["content"] == "a2 b c d " and third[0][4]["content"] == "a4 b c d "
    for r in records:
        assert r.output_tokens == 4
        assert r.ttft_s >= TOKEN_DELAY_S * 0.9
        assert r.tpot_s == pytest.approx(TOKEN_DELAY_S, rel=2.0)
        assert r.latency_s >= r.ttft_s
    by_session = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        # each later turn's prompt starts with the whole previous prompt -> cached tokens reported
        assert turns[1].cached_tokens >= turns[0].prompt_tokens
        assert turns[2].cached_tokens >= turns[1].prompt_tokens
    s = summarize(records, wall)
    assert s["turns_ok"] == 9 and s["errors"] == 0 and s["output_tokens"] == 36
    assert 0 < s["cache_hit_ratio"] < 1
    assert s["ttft_s"]["p50"] > 0


def test_summary_sets_the_later_turns_apart():
    """Later turns (a prefix cache's turns) get their own TTFT/TPOT percentiles; failed and cut turns count in
    neither."""
    recs = [TurnRecord("a", 0, 0.0, ttft_s=1.0, tpot_s=0.01), TurnRecord("a", 1, 2.0, ttft_s=0.1, tpot_s=0.02),
            TurnRecord("a", 2, 3.0, ttft_s=0.3, tpot_s=0.04), TurnRecord("b", 0, 0.0, ttft_s=2.0, tpot_s=0.01),
            TurnRecord("b", 1, 2.5, error="HTTP 500", ttft_s=9.0), TurnRecord("b", 2, 4.0, ttft_s=9.0, cut=True)]
    later = summarize(recs, 5.0)["later_turns"]
    assert later["turns"] == 2
    assert later["ttft_s"]["p50"] == pytest.approx(0.2) and later["tpot_s"]["max"] == pytest.approx(0.04)
    assert "later_turns" not in summarize(recs[:1], 1.0)


def test_failed_turn_is_recorded_and_ends_session(fake_server):
    convs = [Conversation(id="bad", turns=(Turn("hi"), Turn("FAIL"), Turn("never"))), *_convs(1)]
    records, _ = replay_endpoint(convs, EndpointConfig(base_url=fake_server + "/v1", model="m"), progress=False)
    bad = [r for r in records if r.session == "bad"]
    assert [r.turn for r in bad] == [0, 1]
    assert bad[0].ok and "HTTP 500" in bad[1].error
    assert sum(r.ok for r in records if r.session == "s0") == 3


def test_duration_window_cuts_turns_in_flight(fake_server):
    """A fixed window ends the replay: the turn in flight is cut (its stream closed, so the server sees the
    client leave), later turns never start, and neither counts as served or as an error."""
    convs = [Conversation(id="slow", turns=(Turn("hi"), Turn("SLOW"), Turn("never"))), *_convs(1)]
    cfg = EndpointConfig(base_url=fake_server, model="m")
    records, wall = replay_endpoint(convs, cfg, progress=False, duration_s=1.0)
    slow = sorted((r for r in records if r.session == "slow"), key=lambda r: r.turn)
    assert [(r.turn, r.ok, r.cut) for r in slow] == [(0, True, False), (1, False, True)]
    assert sum(r.ok for r in records if r.session == "s0") == 3
    assert 1.0 <= wall < 1.5
    s = summarize(records, wall)
    assert (s["turns"], s["turns_ok"], s["turns_cut"], s["errors"]) == (5, 4, 1, 0)
    deadline = time.time() + 5
    while not FakeChat.disconnected and time.time() < deadline:
        time.sleep(0.05)
    assert FakeChat.disconnected == ["SLOW"]


def test_unreachable_endpoint_gives_errors_not_exceptions():
    cfg = EndpointConfig(base_url="http://127.0.0.1:9", model="m", timeout_s=2)
    records, wall = replay_endpoint(_convs(2), cfg, progress=False)
    assert len(records) == 2 and all(r.error for r in records)
    assert summarize(records, wall)["errors"] == 2


def test_arrival_delays_poisson():
    assert arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    d = arrival_delays(2000, 4.0, 1)
    gaps = [b - a for a, b in itertools.pairwise(d)]
    assert d[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        arrival_delays(1, 0.0, 0)


def test_cli_endpoint_mode_writes_results(fake_server, tmp_path):
    from tangram_sgl.cli import main

    convs = tmp_path / "c.json"
    convs.write_text(json.dumps({"conversations": [{"id": "x", "turns": ["one", "two"]}]}))
    out = tmp_path / "r.json"
    rc = main(["replay", "--endpoint", fake_server, "--conversations", str(convs), "--output", str(out),
               "--no-progress", "--max-tokens", "4"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "endpoint" and doc["summary"]["turns_ok"] == 2
    assert [t["output_tokens"] for t in doc["turns"]] == [4, 4]
    assert doc["turns"][1]["cached_tokens"] > 0
    assert doc["environment"]["torch"] and doc["command"]


def test_cli_duration_window(fake_server, tmp_path):
    """``--duration`` reaches the driver: the slow turn is cut, the run still exits 0 (a cut is no error)."""
    from tangram_sgl.cli import main

    convs = tmp_path / "c.json"
    convs.write_text(json.dumps({"conversations": [{"id": "x", "turns": ["one", "SLOW", "three"]}]}))
    out = tmp_path / "r.json"
    rc = main(["replay", "--endpoint", fake_server, "--conversations", str(convs), "--output", str(out),
               "--no-progress", "--duration", "1"])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["config"]["duration_s"] == 1.0
    assert (doc["summary"]["turns_ok"], doc["summary"]["turns_cut"], doc["summary"]["errors"]) == (1, 1, 0)
