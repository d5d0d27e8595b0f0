"""The ownership rules of docs/engine.md ("The parts and what each owns"), held by code: each rule
is a row of ``RULES`` - whose state, which attributes, who may write them - and a static check
over the package's source that fails, naming file and line, where any other code writes that
state: an assignment or ``del`` of the attribute, a store into it (``x.attr[k] = v``), a mutating
call on it (``x.attr.pop(...)``), or any of those through a local bound to it
(``latches = board.latches; latches.pop(...)``). Writes through ``self`` are the owning class's
own. Two more rules: no engine part copies the plan shape's threads and stages into attributes of
its own, and no code reaches another object's private attribute."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchrec_swp.engine.batches import BatchBook, BatchLedger
from torchrec_swp.engine.installed import InstalledPlan, PlanShape
from torchrec_swp.engine.walkers import Walker

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrec_swp"
ENGINE = PACKAGE / "engine"
MUTATORS = {"append", "add", "discard", "pop", "popitem", "clear", "update", "remove", "setdefault", "extend", "insert"}


def _fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class Rule:
    """``what`` (the attributes ``attrs``) is written only in the modules ``owners`` (a module may
    be given as ``file.py:Class``: only that class's methods), and by ``also[module]``'s
    attributes there; checked over ``scope``."""

    what: str
    attrs: frozenset[str]
    owners: frozenset[str]
    also: tuple[tuple[str, frozenset[str]], ...] = ()
    scope: Path = ENGINE


# what the ops set as it walks (``i``: the stage op moves it through the instructions it executes)
WALKER_ON_ITS_THREAD = frozenset({"current", "inst", "bases", "waited", "i"})

RULES = [
    Rule("the board's latches", frozenset({"latches"}), frozenset({"board.py"}), scope=PACKAGE),
    Rule("the batches' slots", frozenset({"slots"}), frozenset({"batches.py"}), scope=PACKAGE),
    Rule(
        "the book and the ledger",
        _fields(BatchBook) | _fields(BatchLedger),
        frozenset({"batches.py"}),
        scope=PACKAGE,  # (Engine.book, Engine.ledger and a pipeline's batch_ledger hand out the live objects)
    ),
    Rule("an installed plan", _fields(InstalledPlan), frozenset({"installed.py:InstalledPlan"})),
    Rule(
        "a walker",
        _fields(Walker),
        frozenset({"walkers.py", "interpreter.py"}),
        also=(
            ("ops.py", WALKER_ON_ITS_THREAD),
            ("source.py", frozenset({"current"})),
            ("programs.py", frozenset({"current"})),
        ),
    ),
]


def _module(path: Path) -> str:
    return path.name if path.parent == ENGINE else str(path.relative_to(ROOT))


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _root_attr(node: ast.expr) -> ast.Attribute | None:
    """The attribute a subscript chain stores into (``x.attr[a][b]`` -> ``x.attr``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return node if isinstance(node, ast.Attribute) else None


def _read_of(node: ast.expr, attrs: frozenset[str]) -> bool:
    """``x.attr``, ``x.attr[k]`` or ``x.attr.get(k)`` for an attribute of ``attrs``, not on self."""
    while isinstance(node, ast.Subscript) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
    ):
        node = node.func.value if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Attribute) and node.attr in attrs and not _is_self(node.value)


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment or ``del`` writes, tuples unpacked."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [e for target in targets for e in (target.elts if isinstance(target, ast.Tuple) else [target])]


def _classes(tree: ast.AST) -> dict[ast.AST, str]:
    """Every node -> the class whose body holds it."""
    owner: dict[ast.AST, str] = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            owner[node] = cls.name
    return owner


def writes(path: Path, attrs: frozenset[str]) -> list[tuple[int, str, str | None]]:
    """``(line, what, class)`` of every write to an attribute in ``attrs`` in ``path`` other than
    through ``self`` (module docstring)."""
    tree = ast.parse(path.read_text())
    in_class = _classes(tree)
    aliases = {  # locals bound to such an attribute, an item of it or what its get() returns
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _read_of(node.value, attrs)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def held(node: ast.expr) -> bool:  # an attribute of ``attrs`` (not on self), or an alias of one
        root = node
        while isinstance(root, (ast.Subscript, ast.Call)) or (
            isinstance(root, ast.Attribute) and root.attr not in attrs
        ):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Attribute):
            return root.attr in attrs and not _is_self(root.value)
        return isinstance(root, ast.Name) and root.id in aliases

    found = []
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and t.attr in attrs and not _is_self(t.value):
                found.append((node.lineno, ast.unparse(t), in_class.get(node)))
            elif isinstance(t, ast.Subscript) and held(t.value):
                found.append((node.lineno, ast.unparse(t), in_class.get(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if held(node.func.value):
                found.append((node.lineno, ast.unparse(node.func), in_class.get(node)))
    return found


def violations(rule: Rule) -> list[str]:
    """Every write of ``rule``'s state outside its owners, as ``file:line: what``."""
    also = dict(rule.also)
    found = []
    for path in sorted(rule.scope.rglob("*.py")):
        module = _module(path)
        for line, what, cls in writes(path, rule.attrs):
            if module in rule.owners or f"{module}:{cls}" in rule.owners:
                continue
            if _names_only(what, also.get(module, frozenset())):
                continue
            found.append(f"{module}:{line}: {what} ({rule.what})")
    return found


def _names_only(what: str, allowed: frozenset[str]) -> bool:
    """Whether the attribute ``what`` writes is one of ``allowed`` (``w.bases[g]`` -> ``bases``)."""
    node = ast.parse(what, mode="eval").body
    attr = _root_attr(node) if isinstance(node, ast.Subscript) else node
    if isinstance(node, ast.Attribute) and node.attr in MUTATORS:  # x.attr.pop
        attr = node.value if isinstance(node.value, ast.Attribute) else None
    return isinstance(attr, ast.Attribute) and attr.attr in allowed


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.what)
def test_only_the_owner_writes(rule: Rule) -> None:
    assert violations(rule) == []


SHAPE_STATE = frozenset({"top", "lanes", "threaded", "main", "tasked", "walkers"})


def test_no_part_copies_the_plan_shapes_threads_and_stages() -> None:
    """``self.top = ...`` (or ``_top``...) in an engine part would be a copy to keep in step."""
    names = SHAPE_STATE | {f"_{n}" for n in SHAPE_STATE}
    assert SHAPE_STATE <= _fields(PlanShape)
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and _is_self(t.value) and t.attr in names:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
    assert found == []


def test_no_code_reaches_another_objects_private_attributes() -> None:
    """Parts are used through their public methods: ``x._private`` only on ``self`` (torch's own
    internals, ``torch._C...``, are a library's, not a part's)."""
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not _is_self(node.value) and not ast.unparse(node).startswith("torch."):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


# ------------------------------------------------------------- the checks can fail
@pytest.mark.parametrize(
    "source, attrs, expected",
    [
        ("def f(board):\n    board.latches.pop(('T', 1), None)\n", {"latches"}, ["board.latches.pop"]),
        ("def f(board):\n    latches = board.latches\n    latches.pop(1)\n", {"latches"}, ["latches.pop"]),
        ("def f(board):\n    del board.latches[1]\n", {"latches"}, ["board.latches[1]"]),
        ("def f(w):\n    w.ahead = 0\n", {"ahead"}, ["w.ahead"]),
        ("def f(inst):\n    inst.programs['t'] = ()\n", {"programs"}, ["inst.programs['t']"]),
        ("def f(e):\n    e.slots[1]['x'] = 2\n", {"slots"}, ["e.slots[1]['x']"]),
        ("def f(e):\n    slot = e.slots.get(1)\n    slot['x'] = 2\n", {"slots"}, ["slot['x']"]),
        ("def f(board):\n    return (1, 2) in board.latches or board.latches.get(1)\n", {"latches"}, []),
        ("class B:\n    def f(self):\n        self.latches.clear()\n", {"latches"}, []),
    ],
)
def test_the_check_finds_each_kind_of_write(tmp_path: Path, source: str, attrs: set[str], expected: list[str]) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert [what for _, what, _ in writes(path, frozenset(attrs))] == expected


def test_only_the_batches_part_hands_out_the_slots() -> None:
    """Nothing outside batches.py holds the slots dict itself (a function given it could write
    it): elsewhere ``x.slots`` is read only inside ``MappingProxyType(...)`` (``Engine.slots``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ENGINE / "batches.py":
            continue
        tree = ast.parse(path.read_text())
        viewed = {
            id(a)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "MappingProxyType"
            for a in n.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "slots" and not _is_self(node.value):
                if id(node) not in viewed:
                    found.append(f"{_module(path)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


#: Where the board's latches are read without its lock: the wait op's fast path (a latch, once
#: set, stays until its batch is returned, which the same predicate accepts too; a reader that
#: finds neither waits on the board, which reads them again under the lock).
LATCH_READERS = frozenset({("board.py", "Board"), ("ops.py", "_wait_op")})


def latch_readers(package: Path = PACKAGE) -> list[str]:
    """``file:line (function)`` of every ``x.latches`` not inside a function or class of ``LATCH_READERS``."""
    found: list[str] = []

    def visit(node: ast.AST, path: Path, inside: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if (path.name, node.name) in LATCH_READERS:
                return
            inside = (*inside, node.name)
        if isinstance(node, ast.Attribute) and node.attr == "latches":
            found.append(f"{path.name}:{node.lineno} ({'.'.join(inside) or 'module'})")
        for child in ast.iter_child_nodes(node):
            visit(child, path, inside)

    for path in sorted(package.rglob("*.py")):
        visit(ast.parse(path.read_text()), path, ())
    return found


def test_the_latches_are_read_without_the_lock_only_on_the_wait_ops_fast_path() -> None:
    assert latch_readers() == []


def test_the_latch_reader_check_sees_one(tmp_path: Path) -> None:
    (tmp_path / "ops.py").write_text(
        "class PlanOps:\n    def _wait_op(self):\n        return self._board.latches\n"
        "    def _signal_op(self):\n        def signal():\n"
        "            return 1 in self._board.latches\n        return signal\n"
    )
    assert latch_readers(tmp_path) == ["ops.py:6 (PlanOps._signal_op.signal)"]
