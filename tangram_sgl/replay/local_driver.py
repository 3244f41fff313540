"""Replay conversations through the in-process reference engine, printing every turn.

Sessions are interleaved round-robin (turn 1 of every session, then turn 2, ...), so the radix tree holds
all of them at once, as a server's would. A turn the cache cannot admit (:class:`AdmissionError`: the pool
is too small even after evicting every unlocked tree node) is recorded with its error and ends its session.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from tqdm import tqdm

from tangram_sgl.pool.reservation import AdmissionError
from tangram_sgl.replay.conversation import Conversation
from tangram_sgl.replay.records import TurnRecord
from tangram_sgl.replay.reference_engine import ReferenceEngine


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 10 * 1024 * 1024 else f"{n / 2**20:.1f} MiB"


def print_turn(console: Console, rec: TurnRecord) -> None:
    """One turn: prompt size, prefix hit, KV kept/pages vs full, times, and the answer."""
    head = f"[bold]{escape(rec.session)}[/] turn {rec.turn + 1}"
    if rec.error:
        console.print(f"{head}: [red]error[/] {escape(rec.error)}")
        return
    kept, pages, full = rec.kv_bytes_kept, rec.kv_bytes_pages, rec.kv_bytes_full
    console.print(
        f"{head}: prompt {rec.prompt_tokens} tok, prefix hit {rec.cached_tokens} tok, "
        f"answer {rec.output_tokens} tok | KV kept {_kib(kept)} ({kept / full:.0%}), pages {_kib(pages)} "
        f"({pages / full:.0%}) of full {_kib(full)} | TTFT {rec.ttft_s:.2f} s"
        + (f", TPOT {rec.tpot_s * 1000:.0f} ms" if rec.tpot_s is not None else "")
    )
    console.print(f"  [green]answer:[/] {escape(rec.answer)}")
    if rec.expected:
        console.print(f"  [dim]expected: {escape(rec.expected)}[/]")


def replay_reference(engine: ReferenceEngine, conversations: Sequence[Conversation], *, max_new_tokens: int,
                     console: Console | None = None, progress: bool = True) -> tuple[list[TurnRecord], float]:
    """Run every turn of every session through ``engine``; returns (records in run order, wall seconds)."""
    answers: dict[str, list[str]] = {c.id: [] for c in conversations}
    alive = {c.id for c in conversations}
    records: list[TurnRecord] = []
    total = sum(len(c.turns) for c in conversations)
    t0 = time.perf_counter()
    with tqdm(total=total, desc="turns", unit="turn", disable=not progress) as bar:
        for ti in range(max(len(c.turns) for c in conversations)):
            for conv in conversations:
                if ti >= len(conv.turns) or conv.id not in alive:
                    continue
                rec = TurnRecord(session=conv.id, turn=ti, start_s=time.perf_counter() - t0,
                                 expected=conv.turns[ti].expected)
                records.append(rec)
                try:
                    text, gen = engine.chat((conv.id, ti), conv.messages_for_turn(ti, answers[conv.id]),
                                            max_new_tokens)
                except AdmissionError as e:
                    rec.error = f"AdmissionError: {e}"
                    alive.discard(conv.id)
                    bar.update(len(conv.turns) - ti)
                else:
                    answers[conv.id].append(text)
                    fp = gen.footprint
                    rec.answer = text
                    rec.prompt_tokens = len(gen.prompt_ids)
                    rec.output_tokens = len(gen.output_ids)
                    rec.cached_tokens = gen.prefix_hit
                    rec.ttft_s, rec.tpot_s = gen.ttft_s, gen.tpot_s
                    rec.latency_s = gen.ttft_s + gen.decode_s
                    rec.kv_bytes_kept, rec.kv_bytes_pages, rec.kv_bytes_full = fp.kept_bytes, fp.page_bytes, fp.full_bytes
                    bar.update(1)
                if console is not None:
                    bar.clear()
                    print_turn(console, rec)
                    bar.refresh()
    return records, time.perf_counter() - t0
