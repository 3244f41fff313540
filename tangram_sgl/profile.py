"""The budget-profile file: format, loading, and validation against a model config.

A profile is one JSON document (format ``tangram-profile``, version 1):

.. code-block:: text

    format, version, synthetic, created_by
    model:   {architecture, model_type, num_layers, num_kv_heads, num_attention_heads, head_dim, config_hash}
    scorer, target_ratio, alpha, num_samples, sink_tokens, recent_window, page_size, heads_per_group, grouping
    heads:   {mean: [L][H], std: [L][H], budget: [L][H]}      # budget = min(1, mean + alpha*std)
    groups:  [{members: [[layer, kv_head], ...], budget}]      # budget = max member budget
    aot_split: {min_split_tokens, max_splits, batch_buckets: [B], splits: [B][G]}
    notes:   free text (e.g. over-allocation report)

Every check fails with :class:`ProfileError` naming the field and the expected vs found value.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "tangram-profile"
PROFILE_VERSION = 1
GROUPINGS = ("per_layer", "cross_layer")

# Config keys whose values define the KV layout; the config hash covers exactly these.
_IDENTITY_KEYS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
)


class ProfileError(ValueError):
    """A profile file is malformed or does not fit the model it is used with."""


@dataclass(frozen=True)
class ModelIdentity:
    """The model facts a profile is bound to."""

    architecture: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    config_hash: str

    @classmethod
    def from_config(cls, config: Any) -> ModelIdentity:
        """Build from a transformers ``PretrainedConfig``, a config.json dict, or a path to one."""
        cfg = _config_dict(config)
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
        archs = cfg.get("architectures") or [""]
        return cls(
            architecture=str(archs[0] or ""),
            model_type=str(cfg.get("model_type", "")),
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            num_attention_heads=heads,
            head_dim=int(head_dim),
            config_hash=config_hash(cfg),
        )


def _config_dict(config: Any) -> dict:
    if isinstance(config, (str, Path)):
        p = Path(config)
        return json.loads((p / "config.json" if p.is_dir() else p).read_text())
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"cannot read a model config from {type(config).__name__}")


def config_hash(config: Any) -> str:
    """sha256 over the layout-defining config values (head_dim derived when absent)."""
    cfg = _config_dict(config)
    ident = {k: cfg.get(k) for k in _IDENTITY_KEYS}
    if ident["num_key_value_heads"] is None:
        ident["num_key_value_heads"] = cfg.get("num_attention_heads")
    if ident["head_dim"] is None and cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        ident["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    blob = json.dumps(ident, sort_keys=True).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


SYNTHETIC_RUNTIME_SCORER = "snapkv"


@dataclass(frozen=True)
class HeadGroup:
    """H_p (or fewer) kv heads sharing one page table; members are (layer, kv_head)."""

    members: tuple[tuple[int, int], ...]
    budget: float


@dataclass(frozen=True)
class AotSplitTable:
    """Ahead-of-time split-KV plan: ``splits[bucket][group]`` KV splits for batch-size bucket ``bucket``.

    At run time a (request, group) of retained length ``n`` is cut into
    ``ceil(n / max(min_split_tokens, ceil(n / S)))`` <= S chunks, computed on the GPU from lengths.
    """

    min_split_tokens: int
    max_splits: int
    batch_buckets: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]

    def bucket_index(self, batch_size: int) -> int:
        """Index of the smallest bucket holding ``batch_size`` (the largest one if none does)."""
        for i, b in enumerate(self.batch_buckets):
            if batch_size <= b:
                return i
        return len(self.batch_buckets) - 1

    def splits_for(self, batch_size: int) -> tuple[int, ...]:
        return self.splits[self.bucket_index(batch_size)]


@dataclass(frozen=True)
class TangramProfile:
    """A validated budget profile (see module docstring for the file layout)."""

    model: ModelIdentity
    scorer: str
    target_ratio: float
    alpha: float
    num_samples: int
    sink_tokens: int
    recent_window: int
    page_size: int
    heads_per_group: int
    grouping: str
    mean: tuple[tuple[float, ...], ...]
    std: tuple[tuple[float, ...], ...]
    budget: tuple[tuple[float, ...], ...]
    groups: tuple[HeadGroup, ...]
    aot_split: AotSplitTable
    synthetic: bool = False
    created_by: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def runtime_scorer(self) -> str:
        """The scorer that picks kept tokens at run time: the profiled one; SnapKV for synthetic budgets
        (``scorer: "synthetic"``: budgets drawn for throughput work, measured under no scorer)."""
        return SYNTHETIC_RUNTIME_SCORER if self.scorer == "synthetic" else self.scorer

    def mean_budget(self) -> float:
        """Mean per-head budget (the fraction of full KV the heads themselves need)."""
        flat = [b for row in self.budget for b in row]
        return sum(flat) / len(flat)

    def allocated_fraction(self) -> float:
        """Fraction of full KV reserved: sum over groups of H_p * b_g / total heads (padding included)."""
        total = self.model.num_layers * self.model.num_kv_heads
        return sum(self.heads_per_group * g.budget for g in self.groups) / total

    def to_dict(self) -> dict:
        m = self.model
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "synthetic": self.synthetic,
            "created_by": self.created_by,
            "model": {
                "architecture": m.architecture,
                "model_type": m.model_type,
                "num_layers": m.num_layers,
                "num_kv_heads": m.num_kv_heads,
                "num_attention_heads": m.num_attention_heads,
                "head_dim": m.head_dim,
                "config_hash": m.config_hash,
            },
            "scorer": self.scorer,
            "target_ratio": self.target_ratio,
            "alpha": self.alpha,
            "num_samples": self.num_samples,
            "sink_tokens": self.sink_tokens,
            "recent_window": self.recent_window,
            "page_size": self.page_size,
            "heads_per_group": self.heads_per_group,
            "grouping": self.grouping,
            "heads": {"mean": _lists(self.mean), "std": _lists(self.std), "budget": _lists(self.budget)},
            "groups": [{"members": [list(x) for x in g.members], "budget": g.budget} for g in self.groups],
            "aot_split": {
                "min_split_tokens": self.aot_split.min_split_tokens,
                "max_splits": self.aot_split.max_splits,
                "batch_buckets": list(self.aot_split.batch_buckets),
                "splits": _lists(self.aot_split.splits),
            },
            "notes": self.notes,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _lists(rows: Sequence[Sequence[Any]]) -> list[list[Any]]:
    return [list(r) for r in rows]


# --------------------------------------------------------------------------------------------- loading


def _need(d: Mapping, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise ProfileError(f"{where}{key}: missing")
    v = d[key]
    if kind is int and isinstance(v, bool) or not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProfileError(f"{where}{key}: expected {names}, found {type(v).__name__} {v!r:.60}")
    return v


def _matrix(d: Mapping, key: str, layers: int, heads: int) -> tuple[tuple[float, ...], ...]:
    rows = _need(d, key, "heads.", list)
    if len(rows) != layers:
        raise ProfileError(f"heads.{key}: expected {layers} layers (model.num_layers), found {len(rows)}")
    out = []
    for li, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != heads:
            found = len(row) if isinstance(row, list) else type(row).__name__
            raise ProfileError(
                f"heads.{key}[{li}]: expected {heads} kv heads (model.num_kv_heads), found {found}"
            )
        for hi, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ProfileError(f"heads.{key}[{li}][{hi}]: expected a finite number, found {v!r}")
        out.append(tuple(float(v) for v in row))
    return tuple(out)


def _check_budget(value: float, where: str) -> None:
    if not (0.0 < value <= 1.0):
        raise ProfileError(f"{where}: budget must lie in (0, 1], found {value!r}")


def profile_from_dict(doc: Any) -> TangramProfile:
    """Parse and self-check a profile document (without a model config; see :func:`validate_for_model`)."""
    if not isinstance(doc, Mapping):
        raise ProfileError(f"profile: expected a JSON object, found {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt != PROFILE_FORMAT:
        raise ProfileError(f"format: expected {PROFILE_FORMAT!r}, found {fmt!r}")
    version = doc.get("version")
    if version != PROFILE_VERSION:
        raise ProfileError(f"version: unknown profile version {version!r} (this tangram_sgl reads {PROFILE_VERSION})")

    m = _need(doc, "model", "", dict)
    model = ModelIdentity(
        architecture=_need(m, "architecture", "model.", str),
        model_type=_need(m, "model_type", "model.", str),
        num_layers=_need(m, "num_layers", "model.", int),
        num_kv_heads=_need(m, "num_kv_heads", "model.", int),
        num_attention_heads=_need(m, "num_attention_heads", "model.", int),
        head_dim=_need(m, "head_dim", "model.", int),
        config_hash=_need(m, "config_hash", "model.", str),
    )
    if model.num_layers <= 0 or model.num_kv_heads <= 0:
        raise ProfileError(f"model: num_layers and num_kv_heads must be positive, found {model.num_layers}, "
                           f"{model.num_kv_heads}")
    L, H = model.num_layers, model.num_kv_heads

    heads = _need(doc, "heads", "", dict)
    mean, std, budget = (_matrix(heads, k, L, H) for k in ("mean", "std", "budget"))
    for li in range(L):
        for hi in range(H):
            _check_budget(budget[li][hi], f"heads.budget[{li}][{hi}]")

    hp = _need(doc, "heads_per_group", "", int)
    if hp <= 0:
        raise ProfileError(f"heads_per_group: expected a positive integer, found {hp}")
    page_size = _need(doc, "page_size", "", int)
    if page_size <= 0:
        raise ProfileError(f"page_size: expected a positive integer, found {page_size}")
    grouping = _need(doc, "grouping", "", str)
    if grouping not in GROUPINGS:
        raise ProfileError(f"grouping: expected one of {GROUPINGS}, found {grouping!r}")

    groups = []
    owner: dict[tuple[int, int], int] = {}
    for gi, g in enumerate(_need(doc, "groups", "", list)):
        raw = _need(g, "members", f"groups[{gi}].", list)
        if not 0 < len(raw) <= hp:
            raise ProfileError(f"groups[{gi}].members: expected 1..{hp} heads (heads_per_group), found {len(raw)}")
        members = []
        for mem in raw:
            if (not isinstance(mem, list) or len(mem) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in mem)):
                raise ProfileError(f"groups[{gi}].members: expected [layer, kv_head] pairs, found {mem!r}")
            li, hi = mem
            if not (0 <= li < L and 0 <= hi < H):
                raise ProfileError(f"groups[{gi}].members: head {mem} outside the model's {L} layers x {H} kv heads")
            if (li, hi) in owner:
                raise ProfileError(f"groups: head [{li}, {hi}] is in two groups ({owner[(li, hi)]} and {gi})")
            owner[(li, hi)] = gi
            members.append((li, hi))
        if grouping == "per_layer" and len({li for li, _ in members}) != 1:
            raise ProfileError(f"groups[{gi}]: per_layer grouping but members span layers {sorted({li for li, _ in members})}")
        gb = float(_need(g, "budget", f"groups[{gi}].", (int, float)))
        _check_budget(gb, f"groups[{gi}].budget")
        want = max(budget[li][hi] for li, hi in members)
        if abs(gb - want) > 1e-9:
            raise ProfileError(f"groups[{gi}].budget: expected the max member budget {want}, found {gb}")
        groups.append(HeadGroup(members=tuple(members), budget=gb))
    missing = [(li, hi) for li in range(L) for hi in range(H) if (li, hi) not in owner]
    if missing:
        raise ProfileError(f"groups: {len(missing)} heads belong to no group, first {list(missing[0])}")

    a = _need(doc, "aot_split", "", dict)
    buckets = tuple(_need(a, "batch_buckets", "aot_split.", list))
    splits = _need(a, "splits", "aot_split.", list)
    max_splits = _need(a, "max_splits", "aot_split.", int)
    if not buckets or list(buckets) != sorted(set(buckets)) or not all(isinstance(b, int) and b > 0 for b in buckets):
        raise ProfileError(f"aot_split.batch_buckets: expected increasing positive integers, found {list(buckets)}")
    if len(splits) != len(buckets):
        raise ProfileError(f"aot_split.splits: expected {len(buckets)} rows (one per batch bucket), found {len(splits)}")
    for bi, row in enumerate(splits):
        if not isinstance(row, list) or len(row) != len(groups):
            found = len(row) if isinstance(row, list) else type(row).__name__
            raise ProfileError(f"aot_split.splits[{bi}]: expected {len(groups)} entries (one per group), found {found}")
        for gi, s in enumerate(row):
            if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= max_splits:
                raise ProfileError(f"aot_split.splits[{bi}][{gi}]: expected an integer in [1, {max_splits}], found {s!r}")
    aot = AotSplitTable(
        min_split_tokens=_need(a, "min_split_tokens", "aot_split.", int),
        max_splits=max_splits,
        batch_buckets=buckets,
        splits=tuple(tuple(r) for r in splits),
    )

    sink = _need(doc, "sink_tokens", "", int)
    window = _need(doc, "recent_window", "", int)
    if sink < 0 or window < 0:
        raise ProfileError(f"sink_tokens/recent_window: expected >= 0, found {sink}/{window}")
    target = float(_need(doc, "target_ratio", "", (int, float)))
    _check_budget(target, "target_ratio")
    return TangramProfile(
        model=model,
        scorer=_need(doc, "scorer", "", str),
        target_ratio=target,
        alpha=float(_need(doc, "alpha", "", (int, float))),
        num_samples=_need(doc, "num_samples", "", int),
        sink_tokens=sink,
        recent_window=window,
        page_size=page_size,
        heads_per_group=hp,
        grouping=grouping,
        mean=mean,
        std=std,
        budget=budget,
        groups=tuple(groups),
        aot_split=aot,
        synthetic=bool(doc.get("synthetic", False)),
        created_by=str(doc.get("created_by", "")),
        notes=dict(doc.get("notes") or {}),
    )


def validate_for_model(profile: TangramProfile, config: Any) -> None:
    """Fail with a precise message if ``profile`` was not made for the model whose config is given."""
    ident = ModelIdentity.from_config(config)
    m = profile.model
    for name in ("num_layers", "num_kv_heads", "num_attention_heads", "head_dim"):
        want, found = getattr(ident, name), getattr(m, name)
        if want != found:
            raise ProfileError(f"model.{name}: the served model has {want}, the profile was made for {found} "
                               f"(profile for another model)")
    if m.model_type and ident.model_type and m.model_type != ident.model_type:
        raise ProfileError(f"model.model_type: the served model is {ident.model_type!r}, the profile says "
                           f"{m.model_type!r} (profile for another model)")
    if ident.config_hash != m.config_hash:
        raise ProfileError(f"model.config_hash: the served model hashes to {ident.config_hash}, the profile "
                           f"expects {m.config_hash} (profile for another model)")


def load_profile(path: str | Path, config: Any | None = None) -> TangramProfile:
    """Read, parse and check a profile file; with ``config`` also check it fits that model."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ProfileError(f"profile {p}: cannot read ({e.strerror or e})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {p}: not valid JSON (truncated or malformed) at line {e.lineno} "
                           f"column {e.colno}: {e.msg}") from e
    try:
        profile = profile_from_dict(doc)
        if config is not None:
            validate_for_model(profile, config)
    except ProfileError as e:
        raise ProfileError(f"profile {p}: {e}") from None
    return profile
