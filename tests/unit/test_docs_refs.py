"""The docs name only files and modules that exist: every repository path in backquotes
(``torchrec_swp/...``, ``benchmarks/...``, ``tests/...``, ...) and every dotted name under
``torchrec_swp.``/``harness.`` in README.md and docs/*.md. Pure text: nothing is imported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("torchrec_swp", "harness", "benchmarks", "examples", "tools", "tests", "docs", "requirements")

CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"(?<![\w./-])((?:{})/[\w./*<>{{}}-]*)".format("|".join(TOP)))
NAME = re.compile(r"(?<![\w./-])((?:torchrec_swp|harness)(?:\.\w+)+)")


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _name_missing(name: str) -> str | None:
    """Why ``name`` (a module, or a module then one attribute) does not resolve, or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        found = _module_file(parts[:i])
        if found is None:
            continue
        rest = parts[i:]
        if not rest:
            return None
        text = found.read_text()
        if found == ROOT / "torchrec_swp" / "__init__.py":  # the package exports the rows of drop_ins.py
            text += (ROOT / "torchrec_swp" / "drop_ins.py").read_text()
        if re.search(rf"\b{re.escape(rest[0])}\b", text):
            return None
        return f"{found.relative_to(ROOT)} has no {rest[0]}"
    return "no such module"


def _refs() -> list[tuple[str, str, str]]:
    refs = []
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for code in CODE.findall(line):
                where = f"{doc.relative_to(ROOT)}:{line_no}"
                refs += [(where, "path", p) for p in PATH.findall(code)]
                refs += [(where, "name", n) for n in NAME.findall(code)]
    return refs


def test_the_docs_are_read() -> None:
    kinds = {kind for _, kind, _ in _refs()}
    assert kinds == {"path", "name"}


@pytest.mark.parametrize("where,kind,ref", _refs())
def test_every_path_and_name_in_the_docs_exists(where: str, kind: str, ref: str) -> None:
    if kind == "path":
        path = ref.split("::")[0].rstrip(".,;:)")
        if any(c in path for c in "*<{"):
            return
        assert (ROOT / path).exists(), f"{where}: {path} does not exist"
    else:
        assert _name_missing(ref) is None, f"{where}: {ref}: {_name_missing(ref)}"
