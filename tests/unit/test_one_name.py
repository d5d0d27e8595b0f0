"""One word, one meaning: no class (or Protocol) name is defined twice in the package, so that a
name in a traceback, a docstring or a review points at one thing; and no class sets an attribute
of the name of a method of its bases (``Engine._ops = PlanOps(...)`` hid ``Interpreter._ops()``)."""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

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


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def attributes_over_methods(package: Path = PACKAGE) -> list[str]:
    """``module.Class.name (a method of Base)`` for every ``self.name = ...`` in a class of the
    package whose bases (upstream's included) define ``name`` as a method. Modules that do not
    import here (a TorchRec release without them) are skipped."""
    found = []
    for path in sorted(package.rglob("*.py")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(_module_name(path, package))
        except ImportError:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not inspect.isclass(cls):
                continue
            assigned = {
                t.attr
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Assign, ast.AnnAssign))
                for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
            for name in sorted(assigned):
                base = next((b for b in cls.__mro__[1:] if _is_method(b.__dict__.get(name))), None)
                if base is not None:
                    found.append(f"{module.__name__}.{node.name}.{name} (a method of {base.__qualname__})")
    return found


def _is_method(value: object) -> bool:
    return inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))


def test_no_attribute_hides_a_method_of_a_base() -> None:
    assert attributes_over_methods() == []


def test_the_attribute_check_sees_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "torchrec_swp_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shapes.py").write_text(
        "class Base:\n    def _ops(self):\n        return 1\n\n"
        "class Child(Base):\n    def __init__(self):\n        self._ops = 2\n        self.fine = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert attributes_over_methods(package) == ["torchrec_swp_probe.shapes.Child._ops (a method of Base)"]
