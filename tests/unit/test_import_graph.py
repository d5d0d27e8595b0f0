"""The imports flow one way: no circle among the package's modules, nor among those of harness/,
benchmarks/, examples/ and tools/ (imports inside functions and those under ``if TYPE_CHECKING:``
count: a type-only back edge is still a module that needs to know the one that imports it), pp
does not import autosched, harness/ does not import benchmarks/, and nothing outside tests/
imports tests/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "torchrec_swp"


def _modules(top: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for f in top.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _runtime_imports(tree: ast.AST, *, type_only: bool = False) -> list[str]:
    """Every module an import statement names, skipping ``if TYPE_CHECKING:`` blocks unless
    ``type_only``."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend(f"{node.module}.{a.name}" for a in node.names)
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(*, type_only: bool = False, top: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports (a name imported from a package counts as an
    import of the submodule it names, if it is one, else of the package); with ``type_only`` the
    imports under ``if TYPE_CHECKING:`` count too. ``top``: another top-level folder's modules
    (``harness``, ...) instead of the package's."""
    mods = _modules(top)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for m, f in mods.items():
        names = _runtime_imports(ast.parse(f.read_text()), type_only=type_only)
        targets = {resolve(n) for n in names if n.split(".")[0] == top.name}
        # a package's own __init__ importing its submodules is how packages are built, and a
        # submodule importing a sibling through the package name resolves to the sibling
        graph[m] = {t for t in targets if t and t != m and not m.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_tool_finds_a_circle_when_there_is_one() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_among_the_package_modules() -> None:
    assert circles(import_graph(type_only=True)) == []


@pytest.mark.parametrize("top", ["harness", "benchmarks", "examples", "tools"])
def test_no_circle_among_the_other_folders_modules(top: str) -> None:
    assert circles(import_graph(type_only=True, top=ROOT / top)) == []


def test_type_only_imports_are_edges_of_the_graph() -> None:
    """``plan.threads`` names the plan view only for its annotations: the graph keeps that edge."""
    assert "torchrec_swp.plan.view" in import_graph(type_only=True)["torchrec_swp.plan.threads"]
    assert "torchrec_swp.plan.view" not in import_graph()["torchrec_swp.plan.threads"]


def test_harness_does_not_import_benchmarks() -> None:
    """harness/ is the room below benchmarks/ (the benchmarks run on it), type-only imports included."""
    offenders = []
    for f in (ROOT / "harness").rglob("*.py"):
        for name in _runtime_imports(ast.parse(f.read_text()), type_only=True):
            if name == "benchmarks" or name.startswith("benchmarks."):
                offenders.append(f"{f.relative_to(ROOT)}: {name}")
    assert sorted(set(offenders)) == []


def test_pp_does_not_import_autosched() -> None:
    graph = import_graph()
    offenders = sorted(
        m
        for m, targets in graph.items()
        if m.startswith("torchrec_swp.pp")
        for t in targets
        if t.startswith("torchrec_swp.autosched")
    )
    assert offenders == []


def test_nothing_outside_tests_imports_tests() -> None:
    offenders = []
    for top in ("torchrec_swp", "benchmarks", "examples", "tools"):
        for f in (ROOT / top).rglob("*.py"):
            for name in _runtime_imports(ast.parse(f.read_text())):
                if name == "tests" or name.startswith("tests."):
                    offenders.append(f"{f.relative_to(ROOT)}: {name}")
    assert sorted(set(offenders)) == []


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = []
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchrec_swp"):
                offenders += [f"{f.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert offenders == []


# docs/layout.md calls these rooms pure: no torch or torchrec at runtime, and imports only
# from each other (OR-Tools on demand).
PURE_ROOMS = (
    "drop_ins", "plan", "plans", "catalog", "compile", "solve", "sim", "pp", "profiler", "autosched", "sharding",
)  # fmt: skip


def test_the_pure_rooms_import_neither_torch_nor_the_other_rooms() -> None:
    pure = tuple(f"torchrec_swp.{room}" for room in PURE_ROOMS)
    graph = import_graph()
    offenders = []
    for m, f in _modules().items():
        if not m.startswith(pure):
            continue
        for name in _runtime_imports(ast.parse(f.read_text())):
            if name.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu"):
                offenders.append(f"{m}: {name}")
        offenders += [f"{m}: {t}" for t in graph[m] if not t.startswith(pure)]
    assert sorted(set(offenders)) == []
