"""Host-to-device copies that do not make the host wait for the device.

A plain ``tensor.to("cuda")`` from pageable host memory is a copy plus a stream synchronisation: the host waits
until everything queued before it has run. Building a step's metadata must not wait like that under SGLang's
overlap scheduler, which builds batch k while batch k-1 still runs. So metadata goes through a page-locked copy
(PyTorch's caching host allocator keeps that block until the copy has run) with ``non_blocking``.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host) on ``device``; on CUDA without waiting for the device (page-locked, non-blocking)."""
    dev = torch.device(device)
    if dev.type != "cuda" or t.device.type != "cpu":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)
