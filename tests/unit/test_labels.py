"""``torchrec_swp.engine.labels.record_function`` gives a profiler what torch's gives it, and our
task code uses it (torch's costs about four times as much per label, whether a profiler is on or not)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.autograd.profiler import record_function as torch_record_function
from torch.profiler import profile

from torchrec_swp.engine import labels
from torchrec_swp.engine.labels import record_function

ROOT = Path(__file__).resolve().parents[2]


def _trace(rf: type) -> list[tuple[str, str | None, bool]]:
    """(name, parent's name, whether the parent is a label) of every event of a small nested run."""
    with profile() as p:
        with rf("## outer 0 ##"):
            x = torch.ones(3) + 1
            with rf("## inner 0 ##"):
                x = x * 2
            with pytest.raises(ValueError), rf("## raises 0 ##"):
                raise ValueError("inside a label")
        with rf("## after 0 ##"):
            x = x - 1
    return [(e.name, e.cpu_parent.name if e.cpu_parent else None, e.name.startswith("##")) for e in p.events()]


def test_a_profiler_sees_the_same_ranges_as_with_torchs_record_function() -> None:
    ours, torchs = _trace(record_function), _trace(torch_record_function)
    assert ours == torchs
    labels = [(name, parent) for name, parent, label in ours if label]
    assert labels == [
        ("## outer 0 ##", None),
        ("## inner 0 ##", "## outer 0 ##"),
        ("## raises 0 ##", "## outer 0 ##"),
        ("## after 0 ##", None),
    ]


def test_the_supported_torch_versions_get_the_cheap_labels() -> None:
    """torch 2.13 and 2.14 have the C++ calls: the fallback to torch's context manager is not taken."""
    assert record_function is labels._Label


def test_without_a_profiler_the_block_runs_and_exceptions_pass() -> None:
    with record_function("## quiet ##") as rf:
        value = torch.ones(2).sum().item()
    assert value == 2.0 and rf.name == "## quiet ##"
    with pytest.raises(KeyError), record_function("## fails ##"):
        raise KeyError("x")


def test_the_package_labels_with_ours_not_torchs() -> None:
    """No module of the package imports torch's ``record_function`` (or calls it through
    ``torch.profiler`` / ``torch.autograd.profiler``): each would pay torch's op dispatch per label."""
    offenders = []
    for path in sorted((ROOT / "torchrec_swp").rglob("*.py")):
        if path.name == "labels.py" and path.parent.name == "engine":
            continue  # the module that stands in for it (and falls back to it)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("torch.autograd.profiler", "torch.profiler"):
                if any(a.name == "record_function" for a in node.names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "record_function":
                if ast.unparse(node.value) in ("torch.profiler", "torch.autograd.profiler", "profiler"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
