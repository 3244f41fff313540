"""Memory per conversation on the head-group pool vs full KV, and page fragmentation (issue 3).

Runs 8k-token conversations through the real :class:`TangramKVManager` (admit -> reserve -> per-layer
select/compact -> commit -> decode -> finish, each turn matching the previous one in the radix tree) with
the Llama-3.1-8B synthetic profile at mean budget 0.25 (H_p = 4, page_size 16, cross-layer groups). The
pool stores head_dim 1 to keep the run light; bytes are computed for the real head_dim and fp16.

Per conversation (all its tree nodes after the last turn):
- ``allocated``: pages x page_size x H_p slots (what the pool really holds);
- ``kept``: k_g x H_p slots summed over (segment, group) — what the budget rule keeps (group level);
- ``head_need``: sum over heads of the head's own kept_tokens(b_h) — what the heads alone would need;
- ``fragmentation`` = (allocated - kept) / kept (target <= 10% at page_size 16, 8k tokens);
- ``memory vs full`` = allocated / (tokens x layers x kv heads).

    python eval/pool_memory.py [--profile PATH] [--config PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

from results_io import RESULTS, save_figure, summary_row, write_result

from tangram_sgl.budget import kept_tokens
from tangram_sgl.pool.kv_manager import TangramKVManager
from tangram_sgl.profile import TangramProfile, load_profile
from tangram_sgl.radix.tree import SegmentTree

PROFILES = ROOT / "tangram_sgl" / "profiles"
DEFAULT_PROFILE = PROFILES / "llama-3.1-8b.synthetic.r0.25.json"
DEFAULT_CONFIG = PROFILES / "llama-3.1-8b.config.json"

# (name, [(new prompt tokens, decoded tokens) per turn]) — each conversation totals 8192 tokens
CONVERSATIONS = [
    ("1 turn", [(7936, 256)]),
    ("4 turns", [(1792, 256)] * 4),
    ("8 turns", [(768, 256)] * 8),
    ("16 turns, chunked 512", [(384, 128)] * 16),
]
CHUNK = 2048  # prefill chunk = one segment (the scheduler's chunked_prefill_size)


def run_conversation(mgr: TangramKVManager, cid: int, turns: list[tuple[int, int]], gen: torch.Generator,
                     chunk: int) -> list:
    """Run every turn; return the conversation's tree nodes (root excluded, in order)."""
    L, H = mgr.layout.num_layers, mgr.layout.num_kv_heads
    history: list[int] = []
    for t, (n_prompt, n_decode) in enumerate(turns):
        rid = (cid, t)
        prompt = history + torch.randint(1, 32000, (n_prompt,), generator=gen).tolist()
        m = mgr.admit(rid, prompt, max_prefix_len=len(prompt) - 1)
        assert m.length == len(history), f"turn {t} must hit the whole previous turn"
        rest = prompt[m.length:]
        for i in range(0, len(rest), chunk):
            part = rest[i: i + chunk]
            mgr.reserve(rid, part, n_decode if i + chunk >= len(rest) else 0)
            for layer in range(L):
                kv = torch.zeros(H, len(part), 1)
                mgr.write_segment_layer(rid, layer, kv, kv, torch.rand(H, len(part), generator=gen))
            mgr.commit_segment(rid)
            if i + chunk < len(rest):
                mgr.checkpoint(rid)
        zero = torch.zeros(L, H, 1)
        for _ in range(n_decode):
            mgr.append_decode(rid, int(torch.randint(1, 32000, (1,), generator=gen)), zero, zero)
        history = list(mgr.requests[rid].token_ids)
        end = mgr.finish(rid)
    return SegmentTree.path(end.node)


def measure(profile: TangramProfile, name: str, turns: list[tuple[int, int]], chunk: int) -> dict:
    ps, hp = profile.page_size, profile.heads_per_group
    total_tokens = sum(a + b for a, b in turns)
    L, H = profile.model.num_layers, profile.model.num_kv_heads
    per_group_pages = sum(-(-kept_tokens(g.budget, 1, 0, 0, 0) // ps) for g in profile.groups)  # lower bound
    num_pages = 2 * per_group_pages + len(profile.groups) * (total_tokens // ps + 2 * len(turns) + 4)
    mgr = TangramKVManager.from_profile(profile, num_pages, head_dim=1, dtype=torch.float16)
    nodes = run_conversation(mgr, 0, turns, torch.Generator().manual_seed(0), chunk)
    allocated = kept = head_need = decoded = 0
    for node in nodes:
        seg = node.segment
        decoded += seg.n * L * H if seg.full else 0
        allocated += seg.num_pages() * ps * hp
        kept += sum(gs.length for gs in seg.groups) * hp
        head_need += sum(
            seg.n if seg.full else kept_tokens(profile.budget[li][hi], seg.n, seg.start, profile.sink_tokens,
                                               profile.recent_window)
            for li in range(L) for hi in range(H))
    full = total_tokens * L * H
    assert sum(n.segment.n for n in nodes) == total_tokens
    bytes_per_slot = 2 * profile.model.head_dim * 2  # K and V, fp16
    return {
        "conversation": name, "turns": len(turns), "tokens": total_tokens, "segments": len(nodes),
        "slots_full_kv": full, "slots_head_need": head_need, "slots_kept": kept, "slots_allocated": allocated,
        "bytes_full_kv": full * bytes_per_slot, "bytes_allocated": allocated * bytes_per_slot,
        "slots_decoded": decoded,
        "memory_vs_full": allocated / full, "head_need_vs_full": head_need / full,
        "decoded_vs_full": decoded / full,
        "grouping_overhead_vs_full": (kept - head_need) / full,
        "fragmentation": (allocated - kept) / kept,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["conversation"] for r in rows]
    dec = [r["decoded_vs_full"] for r in rows]
    need = [r["head_need_vs_full"] - r["decoded_vs_full"] for r in rows]
    group = [r["grouping_overhead_vs_full"] for r in rows]
    frag = [(r["slots_allocated"] - r["slots_kept"]) / r["slots_full_kv"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.bar(names, dec, label="decoded tokens (kept by every head)")
    ax.bar(names, need, bottom=dec, label="prompt tokens kept by each head's own budget (+ sink, window)")
    below = [a + b for a, b in zip(dec, need)]
    ax.bar(names, group, bottom=below, label="grouping (k_g from the group's max budget)")
    ax.bar(names, frag, bottom=[a + b for a, b in zip(below, group)], label="page fragmentation")
    for i, r in enumerate(rows):
        ax.text(i, r["memory_vs_full"] + 0.005, f"{r['memory_vs_full']:.3f}\nfrag {r['fragmentation']:.1%}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("memory / full KV")
    ax.set_ylim(0, max(r["memory_vs_full"] for r in rows) * 1.6)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE))
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--name", default="pool_memory")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile, args.config)
    rows = []
    for name, turns in CONVERSATIONS:
        chunk = 512 if "chunked" in name else CHUNK
        rows.append(measure(profile, name, turns, chunk))
        print(f"{name:>24}: memory/full {rows[-1]['memory_vs_full']:.4f}  head need {rows[-1]['head_need_vs_full']:.4f}"
              f"  fragmentation {rows[-1]['fragmentation']:.2%}")
    worst = max(r["fragmentation"] for r in rows)
    title = (f"{Path(args.profile).name}: mean budget {profile.mean_budget():.2f}, H_p {profile.heads_per_group}, "
             f"page {profile.page_size}, 8k-token conversations")
    plot(rows, RESULTS / f"{args.name}.png", title)
    data = {"profile": str(Path(args.profile).relative_to(ROOT)) if Path(args.profile).is_relative_to(ROOT)
            else args.profile, "profile_sha256": hashlib.sha256(Path(args.profile).read_bytes()).hexdigest(),
            "synthetic_profile": profile.synthetic, "mean_budget": profile.mean_budget(),
            "heads_per_group": profile.heads_per_group, "page_size": profile.page_size,
            "grouping": profile.grouping, "sink_tokens": profile.sink_tokens,
            "recent_window": profile.recent_window, "prefill_chunk": CHUNK, "rows": rows}
    summary = [
        summary_row("pool memory per 8k conversation vs full KV (4 turns)",
                    round(rows[1]["memory_vs_full"], 4), "x full KV", "", None),
        summary_row("page fragmentation, worst conversation shape", round(worst, 4), "of kept", "<= 0.10",
                    worst <= 0.10),
    ]
    write_result(args.name, data, summary)


if __name__ == "__main__":
    main()
