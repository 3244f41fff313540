"""Triton kernels and their torch references (installed as ``tangram_sgl.kernels``)."""

from __future__ import annotations

import importlib
import pkgutil


def triton_kernels() -> dict[str, object]:
    """Every ``triton.jit`` function of this package's modules (kernels and the helpers they call), by name:
    ``JITFunction`` objects, or interpreted ones under ``TRITON_INTERPRET=1``."""
    import triton

    found = {}
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        found |= {obj.fn.__name__: obj for obj in vars(mod).values()
                  if isinstance(obj, triton.runtime.jit.KernelInterface) and callable(getattr(obj, "fn", None))}
    return found
