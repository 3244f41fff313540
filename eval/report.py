"""Regenerate the README's results table from the ``summary`` rows of eval/results/*.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table() -> str:
    lines = ["| result | metric | measured | target | met | device | date |", "|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "eval" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc.get("name", path.stem)
        device = doc.get("device") or doc.get("versions", {}).get("gpu", "")
        for row in doc.get("summary", []):
            met = {True: "yes", False: "**no**", None: "—"}[row.get("met")]
            value = f"{_fmt(row['value'])} {row.get('unit', '')}".strip()
            lines.append(f"| [{name}](eval/results/{path.name}) | {row['metric']} | {value} | "
                         f"{row.get('target', '') or '—'} | {met} | {device} | "
                         f"{doc.get('date', '')[:10]} |")
    return "\n".join(lines)


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), f"{START}\n{table()}\n{END}", text, flags=re.DOTALL)
    readme.write_text(new)
    print(table())


if __name__ == "__main__":
    main()
