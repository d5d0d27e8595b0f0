"""Writing a benchmark's results: ``OUT/<stem>.json`` and ``OUT/<stem>.md``, the markdown printed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import write_json


def write_report(out: Path, stem: str, data: Any, markdown: str) -> None:
    """Write ``data`` as JSON and ``markdown`` next to it, print the markdown and where both went."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", data)
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / f'{stem}.json'}, {out / f'{stem}.md'}")
