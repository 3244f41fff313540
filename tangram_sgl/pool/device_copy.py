"""Copies between host and device that do not make the host wait for the device.

A plain ``tensor.to("cuda")`` from pageable host memory is a copy plus a stream synchronisation: the host waits
until everything queued before it has run. Building a step's metadata must not wait like that under SGLang's
overlap scheduler, which builds batch k while batch k-1 still runs. So metadata goes through a page-locked copy
(PyTorch's caching host allocator keeps that block until the copy has run) with ``non_blocking``; results the host
reads later come back the same way, with an event to wait for at the first read (:func:`to_host`).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host) on ``device``; on CUDA without waiting for the device (page-locked, non-blocking)."""
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(a host copy of ``t``, the CUDA event after which it holds ``t``'s values — None when it already does)."""
    if t.device.type != "cuda":
        return t.cpu(), None
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return out, ready
