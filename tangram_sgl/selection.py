"""Which tokens each head keeps: protected tokens (sink, recent window) plus its own top scores."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def protected_mask(n: int, start: int, sink: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool [n]: positions of segment [start, start+n) that every head keeps (sink ∪ last ``window``)."""
    pos = torch.arange(start, start + n, device=device)
    return (pos < sink) | (pos >= start + n - window)


def protected_count(n: int, start: int, sink: int, window: int) -> int:
    """``protected_mask(...).sum()`` without touching a device: the sink part is a prefix of the segment,
    the window part a suffix."""
    return min(n, max(0, min(n, sink - start)) + max(0, min(n, window)))


def select_kept_ragged(scores: torch.Tensor, ks: Sequence[int], start: int, sink: int, window: int,
                       ks_on_device: torch.Tensor | None = None, protected: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """int64 ``[H, max(ks)]``: row h holds the ``ks[h]`` segment-relative positions head h keeps, ascending
    (entries past ``ks[h]`` are ``n``). No host synchronisation when ``ks_on_device`` (``ks`` as a tensor on
    the scores' device) is given; without it ``ks`` is copied there, which waits for the device's queue.
    ``protected``: :func:`protected_mask` of this segment, when the caller holds it already.

    Each ``ks[h]`` comes from :func:`tangram_sgl.budget.kept_tokens` and is at least the protected count, so
    every protected position is kept and the remaining slots go to the highest scores (ties broken by lower
    position, so the choice is deterministic).
    """
    h, n = scores.shape
    if len(ks) != h:
        raise ValueError(f"{len(ks)} kept counts for {h} heads")
    prot_n = protected_count(n, start, sink, window)
    for k in ks:
        if not prot_n <= k <= n:
            raise ValueError(f"cannot keep {k} of {n} tokens with {prot_n} protected")
    prot = protected_mask(n, start, sink, window, scores.device) if protected is None else protected
    if ks_on_device is None:
        ks_on_device = torch.tensor(list(ks), device=scores.device)
    return select_kept_padded(scores[None], ks_on_device[None], prot[None], max(ks, default=0))[0]


def pad_scores(scores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Several segments' ``[H, n_r]`` scores as one ``[R, H, max n_r]`` tensor, padding ``-inf`` (never kept)."""
    return torch.nn.utils.rnn.pad_sequence([s.t() for s in scores], batch_first=True,
                                           padding_value=float("-inf")).transpose(1, 2)


def select_kept_padded(scores: torch.Tensor, counts: torch.Tensor, protected: torch.Tensor, kmax: int) -> torch.Tensor:
    """The same rule for several segments at once: ``scores`` ``[R, H, n]`` (a shorter segment padded with
    ``-inf``), ``counts`` ``[R, H]`` kept tokens per head (each at most the row's length, at least its
    protected count), ``protected`` bool ``[R, n]`` (padding not protected) -> int64 ``[R, H, kmax]``, each
    head's kept positions ascending, then ``n``. Device work only (``kmax``: a host bound on ``counts``)."""
    n = scores.shape[-1]
    # Protected positions rank above every score; a stable sort breaks ties by lower position.
    key = scores.float().masked_fill(protected[:, None, :], float("inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    take = torch.arange(n, device=scores.device) < counts[..., None]
    return torch.where(take, order, n).sort(dim=-1).values[..., :kmax]


def kept_positions_reference(scores: Sequence[float], k: int, start: int, sink: int, window: int) -> list[int]:
    """One head's kept positions by the same rule, in plain Python: the independent reference the
    token-by-token checker (``pool/reference_store.py``) and the tests compare the batched path against."""
    n = len(scores)
    prot = [start + p < sink or p >= n - window for p in range(n)]
    ranked = sorted(range(n), key=lambda p: (not prot[p], -float(scores[p]), p))
    return sorted(ranked[:k])
