"""docs/adding_a_pipeline.md stays true: each of its code blocks is in the file the text before it
names, word for word. Pure text: nothing is imported."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adding_a_pipeline.md"


def _blocks() -> list[tuple[str, str]]:
    """(the file named last before the block, the block) for every python block."""
    found = []
    text = DOC.read_text()
    for match in re.finditer(r"```python\n(.*?)```", text, re.S):
        named = re.findall(r"From\s+`([\w/.]+\.py)`", text[: match.start()])
        found.append((named[-1], match.group(1)))
    return found


def test_every_code_block_is_in_the_file_it_names() -> None:
    blocks = _blocks()
    assert len(blocks) == 3
    for path, block in blocks:
        assert block in (ROOT / path).read_text(), f"docs/adding_a_pipeline.md: a block is not in {path}"
