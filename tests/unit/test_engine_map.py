"""docs/engine.md stays a true map: every ``file:function`` it names is defined in that file, every
``Class.member`` of an engine class it names (the glossary's words) exists, its numbered path
stays within 15 calls and six engine files, and a task's call from ``step()`` goes through as few
engine frames as the map says."""

from __future__ import annotations

import ast
import re
import sys
import traceback
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "engine.md"
ENGINE = ROOT / "torchrec_swp" / "engine"
REF = re.compile(r"`((?:[\w.]+/)*[\w]+\.py):(\w+)`")


def _defined(path: Path) -> set[str]:
    """Every function and class name defined anywhere in ``path`` (nested ones included)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _refs() -> list[tuple[int, Path, str]]:
    refs = []
    for line_no, line in enumerate(MAP.read_text().splitlines(), 1):
        for file, name in REF.findall(line):
            path = ROOT / file if "/" in file else ENGINE / file  # a bare file name is an engine module
            refs.append((line_no, path, name))
    return refs


def test_the_map_names_functions() -> None:
    assert len(_refs()) >= 20


@pytest.mark.parametrize("line_no, path, name", _refs(), ids=lambda x: str(x).rsplit("/", 1)[-1])
def test_every_function_the_map_names_is_in_its_file(line_no: int, path: Path, name: str) -> None:
    assert path.is_file(), f"docs/engine.md:{line_no}: {path.relative_to(ROOT)} does not exist"
    assert name in _defined(path), f"docs/engine.md:{line_no}: {path.relative_to(ROOT)} defines no {name}"


def _members() -> dict[str, set[str]]:
    """Every class of the engine -> the names it has: its methods, its class-level fields, what
    its methods assign on ``self``, and those of its bases defined in the engine."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in ENGINE.glob("*.py"):
        for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
            names = own.setdefault(cls.name, set())
            bases[cls.name] = [b.id for b in cls.bases if isinstance(b, ast.Name)]
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for t in targets:
                    for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            names.add(e.attr)

    def all_of(name: str) -> set[str]:
        return own[name].union(*(all_of(b) for b in bases[name] if b in own))

    return {name: all_of(name) for name in own}


MEMBER = re.compile(r"`([A-Z]\w*)\.(\w+)")


def test_every_class_member_the_map_names_exists() -> None:
    """``Class.name`` in docs/engine.md (the glossary's words among them), for a class of the
    engine, is a method, a field or an attribute of that class."""
    members = _members()
    missing = [
        f"docs/engine.md:{line_no}: {cls}.{name}"
        for line_no, line in enumerate(MAP.read_text().splitlines(), 1)
        for cls, name in MEMBER.findall(line)
        if cls in members and name not in members[cls]
    ]
    assert missing == []
    assert sum(len(MEMBER.findall(line)) for line in MAP.read_text().splitlines()) >= 30


def test_the_path_of_one_batch_stays_short() -> None:
    """The numbered list: at most 15 calls, at most six engine files besides the pipeline's."""
    text = MAP.read_text()
    section = text[text.index("## One batch through one `progress()`") : text.index("## What `step()` promises")]
    steps = re.findall(r"^(\d+)\. (.*)$", section, re.MULTILINE)
    assert [int(n) for n, _ in steps] == list(range(1, len(steps) + 1))
    assert len(steps) <= 15
    files = {f for _, line in steps for f, _ in REF.findall(line) if f.startswith("torchrec_swp/engine/")}
    assert 1 <= len(files) <= 6, sorted(files)


def _stand_ins(fail: str | None = None, at: int = 3) -> dict[str, Any]:
    """Task functions for the SparseDist plan that write their batch number; ``fail`` raises at batch ``at``."""
    plan = catalog.sparse_dist_plan()
    fns = {}
    for t in plan.fire_order:
        writes = plan.task(t).io.writes

        def fn(b: int, *, _t: str = t, _w: tuple[str, ...] = writes, **kw: Any) -> Any:
            if _t == fail and b == at:
                raise ValueError(f"{_t} failed")
            if "data" in kw:
                next(kw["data"])
            return None if not _w else b if len(_w) == 1 else tuple(b for _ in _w)

        fns[t] = fn
    return fns


def _engine_code(filename: str) -> bool:
    """An engine module (the task's call is named ``<task T>`` inside ``batches.py``)."""
    return Path(filename).is_relative_to(ENGINE)


@pytest.mark.parametrize("batch", [0, 3], ids=["filling call", "steady call"])
def test_a_failing_tasks_traceback_goes_from_step_to_the_task_in_few_engine_frames(batch: int) -> None:
    # batch 0 trains in a call that fills the pipeline, batch 3 in a steady call: the same loop
    engine = Engine(catalog.sparse_dist_plan(), _stand_ins(fail="Forward", at=batch))
    data = iter(range(100))
    with pytest.raises(ValueError, match="Forward failed") as info:
        for _ in range(10):
            engine.step(data)
    engine.close()
    frames = traceback.extract_tb(info.value.__traceback__)
    names = [f.name for f in frames]
    assert names[-1] == "fn"  # the task's own function
    assert names[-4:-1] == ["_walk", "run", "<task Forward>"], names  # the loop, the op, the task's call
    assert frames[-4].line == "ops[i](w, P)", frames[-4]
    chain = frames[names.index("step") : -1]  # step() ... the call, re-raised where the caller stopped
    assert all(_engine_code(f.filename) for f in chain), names
    assert len(chain) <= 7, names
    assert {Path(f.filename).name for f in chain} <= {"engine.py", "interpreter.py", "ops.py", "batches.py"}, names


#: The engine functions a call runs once per instruction of the calling thread's program (or
#: per draw): the op (a stage op for several), its batch's existence, the guard, the task's call and its slot.
PER_INSTRUCTION = {"run", "run_stage", "exists_at", "_admits", "many", "_store", "end_at", "draws_for"}


def test_one_step_calls_each_engine_function_of_its_path_once_or_per_instruction() -> None:
    """Every call of the SparseDist plan on one thread, profiled: the engine functions called stay
    within the six files the map's numbered path names, the loop (``_walk``) runs once a call,
    and every other function once, or once per instruction (``PER_INSTRUCTION``, the task calls)."""
    engine = Engine(catalog.sparse_dist_plan(), _stand_ins())
    data = iter(range(100))
    called: list[tuple[str, str]] = []
    (inst,) = engine.installed.by_id.values()
    instructions = len(inst.programs["default"])

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(ENGINE):
            called.append((path.name, frame.f_code.co_name))

    for step in range(5):
        called.clear()
        sys.setprofile(profile)
        try:
            engine.step(data)
        finally:
            sys.setprofile(None)
        if step == 0:  # new data: the call takes it first (epochs.py:take_data)
            assert ("epochs.py", "take_data") in called
            continue
        files = {f for f, _ in called}
        assert files <= {"engine.py", "interpreter.py", "ops.py", "batches.py", "end_of_data.py", "source.py"}, files
        assert called.count(("interpreter.py", "_walk")) == 1
        for (file, name), count in Counter(called).items():
            limit = instructions if name in PER_INSTRUCTION or name.startswith("<task ") else 1
            assert count <= limit, (file, name, count)
    engine.close()
    # the last (steady) call: step, ended, begin_step, ask, _walk, program, walks_to, per
    # instruction its op and what it asks, the source's draw (credit, draw_batch, open_slot,
    # draws_for, the task's call and its data argument, Draws' drawing, __next__ with its turn
    # taken and claimed, called: the item kept until the call returned, for a retry), drawn,
    # iteration_done, _finish, _outcome, _retire and retire
    assert len(called) <= 4 * instructions + 30, called
