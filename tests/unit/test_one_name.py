"""One word, one meaning: no class (or Protocol) name is defined twice in the package, so that a
name in a traceback, a docstring or a review points at one thing."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchrec_swp"


def class_definitions() -> dict[str, list[str]]:
    """Every class name defined in the package, with where (``path:line``)."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_class_name_is_defined_twice() -> None:
    twice = {name: where for name, where in class_definitions().items() if len(where) > 1}
    assert twice == {}


def test_the_check_sees_every_module_and_nested_classes() -> None:
    found = class_definitions()
    assert "EndEvent" in found and "Carried" in found and "InputDistCache" in found
    assert len(found) > 250, len(found)
