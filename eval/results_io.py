"""Write a benchmark result with its provenance, in the envelope `eval/report.py` reads.

Every JSON under eval/results/ carries: name, the exact command, versions, the device, the date, the
raw data, and ``summary`` rows ({metric, value, unit, target, met}) that the README table is built from.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_PACKAGES = ("tangram-sgl", "torch", "triton", "sglang", "flashinfer-python", "transformers")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return out


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()})"


# Peak HBM bandwidth (bytes/s) the decode rooflines divide by, by a substring of the device's name. Any other device
# (the CPU smoke runs) gets the H200's: the GPU the targets are set for.
_PEAK_HBM = (("H200", 4.8e12), ("H100 80GB HBM3", 3.35e12))


def peak_hbm_bytes_per_s(device: str) -> float:
    """The roofline bandwidth of ``device`` (a ``torch.cuda.get_device_name``): the H100 SXM's 3.35 TB/s, else 4.8."""
    return next((bw for key, bw in _PEAK_HBM if key in device), _PEAK_HBM[0][1])


def save_figure(fig: Any, path: Path, title: str | None = None) -> None:
    """Lay out ``fig`` (under ``title``, if given), write it to ``path`` as a PNG and close it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_row(metric: str, value: float, unit: str = "", target: str = "", met: bool | None = None) -> dict:
    return {"metric": metric, "value": value, "unit": unit, "target": target, "met": met}


def write_result(name: str, data: Any, summary: list[dict], *, command: str | None = None,
                 directory: Path | None = None, measured_on: dict | None = None) -> Path:
    """Save ``<directory>/<name>.json`` (default ``eval/results/``) and return its path.

    ``measured_on``: ``{"versions", "device"}`` of the machine that measured ``data`` when this one only
    combines results (default: this machine)."""
    directory = RESULTS if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "command": command or " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "versions": measured_on["versions"] if measured_on else versions(),
        "device": measured_on["device"] if measured_on else device_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "summary": summary,
        "data": data,
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
