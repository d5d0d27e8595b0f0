"""Marks the tests whose result cannot depend on TorchRec's version: ``torchrec_free``.

A test module is TorchRec-free when nothing it imports reaches ``torchrec`` or ``fbgemm_gpu``:
its own imports and, transitively, those of every module of this checkout they name (imports
inside functions count, and so do those under ``if TYPE_CHECKING:``), and it neither starts
processes, imports by name at run time, reads package metadata nor names TorchRec in a string (each
could reach TorchRec where no import statement shows it). ``make test`` runs everything on TorchRec 1.9 and, on 1.8, the
parity tests and the single-process tests that are not TorchRec-free: running a test that cannot
touch TorchRec a second time with another TorchRec installed tells nothing new.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ("torchrec", "fbgemm_gpu")
# a test that runs code no import statement shows
_DYNAMIC = re.compile(
    r"\b(subprocess|sys\.executable|import_module|__import__|find_spec|run_on_ranks|multiprocessing|runpy|metadata)\b"
    r"|site-packages|[\"']torchrec[\"'./]"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torchrec_free: imports nothing that reaches TorchRec (set by tests/conftest.py, not by hand)"
    )


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _lazy(package: str) -> bool:
    """Whether ``package``'s ``__init__`` hands out names on first use (a module ``__getattr__``)."""
    f = _module_file(package)
    return f is not None and f.name == "__init__.py" and "\ndef __getattr__(" in f.read_text()


def _imports(f: Path, module: str) -> set[str]:
    """Every module name ``f``'s import statements name (``from a import b`` names ``a`` and ``a.b``),
    with ``torchrec`` for a name taken from a package that hands out names on first use (what that
    name loads is not in an import statement); imports inside such a package's ``__getattr__`` run
    only then, and count there."""
    names: set[str] = set()
    package = module if f.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(f.read_text())
    lazy_bodies = {
        id(n) for d in tree.body if isinstance(d, ast.FunctionDef) and d.name == "__getattr__" for n in ast.walk(d)
    }
    for node in ast.walk(tree):
        if id(node) in lazy_bodies:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
            if _lazy(base) and any(_module_file(f"{base}.{a.name}") is None for a in node.names):
                names.add("torchrec")
    source = ast.unparse(tree)
    for name in [n for n in names if _lazy(n)]:  # ``import pkg`` then ``pkg.Name``
        for attr in re.findall(rf"\b{re.escape(name)}\.([A-Za-z_]\w*)", source):
            if _module_file(f"{name}.{attr}") is None:
                names.add("torchrec")
    return {n for n in names if n}


@functools.cache
def _edges(module: str) -> tuple[bool, frozenset[str]]:
    """Whether ``module`` (of this checkout) imports TorchRec itself, and the modules of this
    checkout importing it runs (a package's ``__init__`` runs before any of its submodules)."""
    f = _module_file(module)
    if f is None:
        return False, frozenset()
    direct = False
    local: set[str] = set()
    for name in _imports(f, module):
        parts = name.split(".")
        direct = direct or parts[0] in UPSTREAM
        local.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if _module_file(p))
    return direct, frozenset(local - {module})


def _reaches_upstream(module: str) -> bool:
    """Whether importing ``module`` may import TorchRec (a walk over the checkout's imports)."""
    seen, todo = {module}, [module]
    while todo:
        direct, local = _edges(todo.pop())
        if direct:
            return True
        todo.extend(local - seen)
        seen |= local
    return False


@functools.cache
def torchrec_free(test_file: Path) -> bool:
    source = test_file.read_text()
    if _DYNAMIC.search(source):
        return False
    module = ".".join(test_file.relative_to(ROOT).with_suffix("").parts)
    return not _reaches_upstream(module)


#: The test files that take longest (measured with --durations on 2 cores, most first): they are
#: collected first, so that ``make test``'s two workers (pytest-xdist, one file at a time each)
#: start them first and the short files fill in around them, rather than one long file running
#: alone at the end. A file missing here only runs later; within a file the order is unchanged.
LONGEST_FIRST = (
    "tests/dist/test_readme_commands.py",
    "tests/dist/test_dlrm_eval.py",
    "tests/dist/test_torchx_dlrm.py",
    "tests/dist/test_checkpoint_kill.py",
    "tests/dist/test_parity_lite_compiled.py",
    "tests/dist/test_autotune_ranks.py",
    "tests/dist/test_harness_upstream.py",
    "tests/dist/test_launch_nodes.py",
    "tests/dist/test_uneven_data.py",
    "tests/dist/test_checkpoint_resume.py",
    "tests/dist/test_dlrm_nonfinite.py",
)


def _longest_first(item: pytest.Item) -> int:
    path = Path(str(item.path))
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
    return LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if path.is_relative_to(ROOT) and torchrec_free(path):
            item.add_marker(pytest.mark.torchrec_free)
    items.sort(key=_longest_first)  # stable: each file's own order kept


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A default process group of one gloo rank in this process for a module's tests. One made
    here is destroyed after them (a later module may need a process without one); a group of
    another size already there skips them."""
    import os
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a default process group of another size exists in this process")
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
