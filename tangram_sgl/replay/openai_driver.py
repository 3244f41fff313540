"""Replay conversations against an OpenAI-compatible ``/v1/chat/completions`` endpoint.

Sessions arrive as a Poisson process of ``session_rate`` sessions/s (``inf``: all at once) and at most
``max_concurrency`` run at a time. Inside a session, each turn waits for the previous answer and resends
the whole history. Every turn streams, so TTFT (first chunk of a choice) and TPOT ((last chunk - first chunk)
/ (output tokens - 1)) are measured client-side; token counts and cache hits come from the final
``usage`` chunk (``stream_options.include_usage``), cache hits from
``usage.prompt_tokens_details.cached_tokens`` when the server reports them.
A failed turn is recorded with its error and ends its session (later turns would need its answer).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from tangram_sgl.replay.conversation import Conversation
from tangram_sgl.replay.records import TurnRecord


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests."""

    base_url: str
    model: str
    max_tokens: int = 128
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str | None = None
    ignore_eos: bool = False

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


async def _one_turn(client: httpx.AsyncClient, cfg: EndpointConfig, messages: list[dict], rec: TurnRecord) -> None:
    """Send one streamed request and fill ``rec`` (answer, times, usage). Raises on transport/HTTP errors."""
    body = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    parts: list[str] = []
    usage = None
    async with client.stream("POST", cfg.url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                # timing from every choice chunk (the server sends the first with the first token), since a
                # token can detokenize to nothing (e.g. a dummy-weight model's ids outside its tokenizer)
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    chunks += 1
                    parts.append(piece)
    end = time.perf_counter()
    rec.answer = "".join(parts)
    rec.latency_s = end - t0
    rec.ttft_s = (first - t0) if first is not None else None
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
    else:
        rec.output_tokens = chunks  # without usage, one streamed chunk per token is the best count available
    n = rec.output_tokens or 0
    if first is not None and n > 1:
        rec.tpot_s = (last - first) / (n - 1)


async def _session(conv: Conversation, cfg: EndpointConfig, client: httpx.AsyncClient, sem: asyncio.Semaphore,
                   t_start: float, delay_s: float, records: list[TurnRecord], bar: tqdm) -> None:
    await asyncio.sleep(delay_s)
    async with sem:
        answers: list[str] = []
        for ti, turn in enumerate(conv.turns):
            rec = TurnRecord(session=conv.id, turn=ti, start_s=time.perf_counter() - t_start, expected=turn.expected)
            records.append(rec)
            try:
                await _one_turn(client, cfg, conv.messages_for_turn(ti, answers), rec)
            except asyncio.CancelledError:  # the replay's duration ended with this turn in flight
                rec.cut = True
                raise
            except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
                rec.error = f"{type(e).__name__}: {e}"
                bar.update(len(conv.turns) - ti)
                return
            answers.append(rec.answer)
            bar.update(1)


def arrival_delays(num_sessions: int, session_rate: float, seed: int) -> list[float]:
    """Session start offsets (s): a Poisson process of ``session_rate``/s, all zero for rate inf."""
    if session_rate <= 0:
        raise ValueError(f"session rate must be positive, got {session_rate}")
    if math.isinf(session_rate):
        return [0.0] * num_sessions
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_sessions):
        out.append(t)
        t += rng.expovariate(session_rate)
    return out


async def replay_endpoint_async(conversations: Sequence[Conversation], cfg: EndpointConfig, *,
                                session_rate: float = math.inf, max_concurrency: int = 64, seed: int = 0,
                                progress: bool = True, duration_s: float | None = None
                                ) -> tuple[list[TurnRecord], float]:
    """Replay all sessions; returns (records in start order, wall seconds).

    ``duration_s``: stop after that long (a fixed measurement window): turns in flight are cancelled (their
    requests closed, so the server aborts them) and marked ``cut``; turns not yet started are not recorded.
    """
    records: list[TurnRecord] = []
    delays = arrival_delays(len(conversations), session_rate, seed)
    sem = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    total_turns = sum(len(c.turns) for c in conversations)
    with tqdm(total=total_turns, desc="turns", unit="turn", disable=not progress) as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:
            t0 = time.perf_counter()
            sessions = [asyncio.create_task(_session(c, cfg, client, sem, t0, d, records, bar))
                        for c, d in zip(conversations, delays)]
            _, running = await asyncio.wait(sessions, timeout=duration_s)
            wall = time.perf_counter() - t0
            for task in running:
                task.cancel()
            await asyncio.gather(*sessions, return_exceptions=True)
    records.sort(key=lambda r: (r.start_s, r.session, r.turn))
    return records, wall


def replay_endpoint(conversations: Sequence[Conversation], cfg: EndpointConfig, **kwargs) -> tuple[list[TurnRecord], float]:
    """Synchronous wrapper of :func:`replay_endpoint_async`."""
    return asyncio.run(replay_endpoint_async(conversations, cfg, **kwargs))
