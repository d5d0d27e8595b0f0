"""The registry of drop-ins (``torchrec_swp.drop_ins``) and the pipeline protocol
(``pipelines/protocol.py``): every list of the pipelines comes from the registry or is checked
against it, and a drop-in's task functions are checked when its class is defined.

Regenerate ``docs/pipelines.md`` and README.md's table after a change to the registry with
``SWP_UPDATE_GOLDEN=1 pytest tests/unit/test_drop_ins.py``."""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import torchrec_swp
from torchrec_swp import drop_ins

ROOT = Path(__file__).resolve().parents[2]
#: The tables made from the registry: the file, its markers, the function that writes the table.
TABLES = {
    "docs/pipelines.md": ("<!-- drop-ins: begin -->", "<!-- drop-ins: end -->", drop_ins.markdown_table),
    "README.md": (
        "<!-- replacements: begin (generated from torchrec_swp/drop_ins.py: readme_table()) -->",
        "<!-- replacements: end -->",
        drop_ins.readme_table,
    ),
    "docs/install.md": (
        "<!-- on cpu: begin (generated from torchrec_swp/drop_ins.py: install_table()) -->",
        "<!-- on cpu: end -->",
        drop_ins.install_table,
    ),
}


@pytest.mark.parametrize("path", TABLES)
def test_the_docs_tables_are_the_registrys(path: str) -> None:
    begin, end, table = TABLES[path]
    text = (ROOT / path).read_text()
    if os.environ.get("SWP_UPDATE_GOLDEN"):
        before, rest = text.split(begin)
        text = f"{before}{begin}\n{table()}{end}{rest.split(end)[1]}"
        (ROOT / path).write_text(text)
    assert text.split(begin)[1].split(end)[0].lstrip("\n") == table(), "run with SWP_UPDATE_GOLDEN=1 to regenerate"


def test_every_plan_driven_class_of_the_package_is_a_row_and_every_row_a_class() -> None:
    from torchrec_swp.integrations.torchrec import pipelines
    from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven

    def subclasses(cls: type) -> Iterator[type]:
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    ours = {
        c.__name__
        for c in subclasses(PlanDriven)
        if c.__module__.startswith("torchrec_swp.") and not c.__name__.startswith("_")
    }
    assert ours == set(pipelines.__all__)
    for name in pipelines.__all__:
        row = drop_ins.DROP_INS[name]
        assert getattr(pipelines, name).__module__ == row.module_path, name


def test_the_extras_are_what_their_modules_export_and_torchrec_swp_exports_them() -> None:
    """``drop_ins.EXTRAS`` (Maglev, the accumulation wrapper): each row's module exports it, every
    name those modules export is a row, and ``torchrec_swp`` exports those its TorchRec has."""
    from torchrec_swp.integrations.torchrec.compat import installed

    series = installed().series
    by_module: dict[str, set[str]] = {}
    for extra in drop_ins.extras():
        by_module.setdefault(extra.module, set()).add(extra.name)
    for module, rows in by_module.items():
        if all(e.since == "1.9" for e in drop_ins.extras() if e.module == module) and series == "1.8":
            with pytest.raises(ImportError, match="TorchRec 1.9"):
                importlib.import_module(module)
            continue
        assert set(importlib.import_module(module).__all__) == rows, module
    available = {e.name for e in drop_ins.extras(series)}
    assert available <= set(torchrec_swp.__all__)
    assert not {e.name for e in drop_ins.extras()} - available & set(torchrec_swp.__all__)
    for name in available:
        assert getattr(torchrec_swp, name).__name__ == name
    assert not set(drop_ins.EXTRAS) & set(drop_ins.names())  # a different kind of row


def test_the_dlrm_harness_runs_the_rows_that_have_an_example() -> None:
    from harness.dlrm import INFO

    rows = [d for d in drop_ins.drop_ins() if d.example is not None]
    assert set(INFO) == {d.name for d in rows}
    for d in rows:
        assert d.example is not None
        assert (INFO[d.name].kind, INFO[d.name].compiles) == (d.kind, d.example.compiles), d.name
        for run in d.example.stream_checks:  # what tools/stream_check.py's train() understands
            assert run is None or run.removeprefix("nonfinite").strip() in ("", "by_stream", "io", "main"), run


def test_every_drop_in_has_notes_and_each_upstream_import_of_the_readme_works() -> None:
    """Each row of README.md's table starts with the line a user has: upstream's module there
    exports the class (on the TorchRec installed, for the classes it has)."""
    from torchrec_swp.integrations.torchrec.compat import installed

    assert [d.name for d in drop_ins.drop_ins() if not d.notes] == []
    imports = re.findall(r"^\| `from ([\w.]+) import ([\w, ]+)`( \([\d.]+\))?", drop_ins.readme_table(), re.M)
    assert [names for _, names, _ in imports][: len(drop_ins.names())] == list(drop_ins.names())
    series = installed().series
    checked = 0
    for module, names, since in imports:
        if since and _release(since.strip(" ()")) > _release(series):
            continue
        for name in names.split(", "):
            assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"
            checked += 1
    assert checked >= len(drop_ins.names("1.8"))


def test_the_harness_and_the_install_table_agree_on_which_upstream_pipelines_fail_on_a_cpu() -> None:
    """A row says it twice: the harness's short reason (``example.upstream_fails``, whether it
    patches upstream) and docs/install.md's line (``on_cpu``)."""
    for d in drop_ins.drop_ins():
        if d.example is not None:
            runs = d.on_cpu.upstream.startswith("runs")
            assert runs == (not d.example.upstream_fails), (d.name, d.on_cpu.upstream, d.example.upstream_fails)
            assert runs == (not d.on_cpu.why), (d.name, d.on_cpu)


def test_the_cpu_parity_tests_cover_every_drop_in() -> None:
    # every drop-in is built by name in some tests/dist/test_parity_*.py
    text = "".join(p.read_text() for p in sorted((ROOT / "tests" / "dist").glob("test_parity*.py")))
    missing = [name for name in drop_ins.names() if not re.search(rf"\b{name}\b", text)]
    assert missing == []


TOY = '''
from typing import Any

from torchrec_swp.integrations.torchrec.pipelines.base import TrainPipelineBase
from torchrec_swp.integrations.torchrec.pipelines.protocol import task


class {name}(TrainPipelineBase):
    """A toy drop-in: TrainPipelineBase with a Forward of its own."""

    @task("{forward}")
    def _task_toy_forward(self, b: int, batch: Any) -> Any:
        return self._model(batch)
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """A module on sys.path for a toy drop-in, and the toy's row in the registry."""
    module = "swp_toy.drop_in"  # a dotted path: a module outside the package's pipelines
    (tmp_path / "swp_toy").mkdir()
    (tmp_path / "swp_toy" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = drop_ins.DropIn("TrainPipelineToy", module, "train_pipelines", "train_pipeline_base_plan")
    monkeypatch.setitem(drop_ins.DROP_INS, row.name, row)
    yield tmp_path / "swp_toy" / "drop_in.py", module
    sys.modules.pop(module, None)
    sys.modules.pop("swp_toy", None)


def test_a_toy_drop_in_is_exported_documented_and_in_the_parity_cases(toy: tuple[Path, str]) -> None:
    path, module = toy
    path.write_text(textwrap.dedent(TOY.format(name="TrainPipelineToy", forward="Forward")))
    cls = torchrec_swp.TrainPipelineToy
    assert cls is importlib.import_module(module).TrainPipelineToy
    assert cls._swp_tasks["Forward"] == "_task_toy_forward"
    assert "TrainPipelineToy" in torchrec_swp._available() and "TrainPipelineToy" in dir(torchrec_swp)
    assert "| `TrainPipelineToy` | `torchrec.distributed.train_pipeline.train_pipelines.TrainPipelineToy` |" in (
        drop_ins.markdown_table()
    )
    from benchmarks.gpu import parity

    assert "TrainPipelineToy" in [c.pipeline for c in parity.cases()]
    from torchrec_swp.catalog import torchrec as catalog

    assert "TrainPipelineToy" in catalog.default_plans()


def test_a_misspelt_task_is_an_error_when_the_class_is_defined(toy: tuple[Path, str]) -> None:
    path, module = toy
    path.write_text(textwrap.dedent(TOY.format(name="TrainPipelineToy", forward="Foward")))
    with pytest.raises(TypeError) as error:
        importlib.import_module(module)
    message = str(error.value)
    where = "TrainPipelineToy._task_toy_forward"
    assert message.startswith(f"{where} is marked @task('Foward'), a task no catalog plan has")
    assert "(close: Forward" in message


def test_a_drop_in_without_a_function_for_a_task_of_its_plan_is_an_error(toy: tuple[Path, str]) -> None:
    path, module = toy
    path.write_text(
        textwrap.dedent(TOY.format(name="TrainPipelineToy", forward="Forward"))
        + '\n    _swp_without_tasks = ("WaitBatch",)\n'
    )
    with pytest.raises(TypeError, match=r"TrainPipelineToy: its default plan .* has task 'WaitBatch', and no method"):
        importlib.import_module(module)


def test_a_drop_in_must_implement_the_abstract_hooks(toy: tuple[Path, str]) -> None:
    path, module = toy
    path.write_text(
        textwrap.dedent("""
        from torchrec.distributed.train_pipeline import train_pipelines as upstream

        from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven


        class TrainPipelineToy(PlanDriven, upstream.TrainPipelineBase):
            pass
        """)
    )
    with pytest.raises(TypeError, match="TrainPipelineToy .* does not implement _swp_default_plan, _swp_streams"):
        importlib.import_module(module)


def test_a_users_subclass_may_add_tasks_of_its_own() -> None:
    from torchrec_swp.integrations.torchrec.pipelines.protocol import task

    class Mine(torchrec_swp.TrainPipelineSparseDist):
        @task("MyTask")
        def _task_mine(self, b: int) -> None: ...

    assert "MyTask" in Mine._swp_tasks and "Forward" in Mine._swp_tasks


def _release(series: str) -> tuple[int, ...]:
    return tuple(int(part) for part in series.split("."))
