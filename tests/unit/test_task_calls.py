"""A plan row is checked against its task's function when the plan is bound to it (issue 46, item 6).

A row whose reads name no parameter of the function, that leaves a parameter without a default
unread, or whose writes disagree with the function's declared result is refused when the pipeline
or engine is built (or the plan switched in), not at the first ``progress()`` with a TypeError:
at the row's line where the plan came from a file, naming the plan and task otherwise. What works
today still binds: every drop-in's default plan, every catalog and golden plan.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrec_swp
from tests.unit.test_plans_golden import ALL, VARIANTS
from torchrec_swp import drop_ins
from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.engine import Engine
from torchrec_swp.integrations.torchrec.compat import installed
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven
from torchrec_swp.integrations.torchrec.pipelines.protocol import task_methods
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, PlanError, TaskSchedule
from torchrec_swp.plan.calls import TaskCall, check_call

S = TaskSchedule


class Summing(torch.nn.Module):
    """``model(x) -> (loss, output)``, as TrainPipelineBase's Forward unpacks it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x)
        return out.sum(), out


def base_pipeline(**kwargs: Any) -> Any:
    model = Summing()
    return torchrec_swp.TrainPipelineBase(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **kwargs
    )


def data() -> Iterator[torch.Tensor]:
    return iter([torch.randn(4, 2) for _ in range(4)])


def edited_base_text(row: str, cell: str, edit: str) -> tuple[str, int]:
    """TrainPipelineBase's default plan text with the reads cell ``cell`` of the row of task ``row``
    replaced by ``edit`` (the issue's slip: a row's reads edited to a wrong list), and that row's line."""
    lines = catalog.train_pipeline_base_plan().to_text().splitlines()
    (at,) = [k for k, ln in enumerate(lines) if ln.startswith(f"task {row} ")]
    cells = lines[at].split()
    assert cells[7] == cell, lines[at]
    lines[at] = " ".join([*cells[:7], edit, *cells[8:]])
    return "\n".join(lines) + "\n", at + 1


# ------------------------------------------------------------------ the report, as it was filed
def test_a_plan_file_whose_row_reads_what_its_function_does_not_take_is_refused_at_the_row(tmp_path: Path) -> None:
    """Before: the plan loaded and the first progress() raised ``TypeError: ..._task_backward() got
    an unexpected keyword argument 'output'``. Now the plan file is refused at Backward's row, at
    the column of the read."""
    text, line = edited_base_text("Backward", "losses", "losses,output")
    path = tmp_path / "edited.plan"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        base_pipeline(plan=str(path))
    e = info.value
    raw = text.splitlines()[line - 1]
    assert (e.line, e.column, e.culprit) == (line, raw.index("output") + 1, "Backward")
    assert str(e) == (
        f"line {line}, column {raw.index('output') + 1}: task Backward reads 'output', which its function "
        "TrainingTasks._task_backward(b, losses, context=None) has no parameter for (it takes context, losses) "
        f"(in {raw!r})"
    )
    assert "\n" not in str(e)


def test_a_plan_object_with_such_a_row_is_refused_when_the_pipeline_is_built() -> None:
    text, _ = edited_base_text("Backward", "losses", "losses,output")
    plan = PipelinePlan.from_text(text)  # the plan alone is fine: nothing says what Backward takes
    with pytest.raises(PlanError, match=r"^plan TrainPipelineBase: task Backward reads 'output', ") as info:
        base_pipeline(plan=plan)
    assert info.value.culprit == "Backward"


def test_a_plan_file_whose_row_leaves_a_parameter_unread_is_refused_at_the_row(tmp_path: Path) -> None:
    text, line = edited_base_text("Forward", "batch", "-")
    path = tmp_path / "edited.plan"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        base_pipeline(plan=str(path))
    assert info.value.line == line
    assert "task Forward does not read 'batch', which its function TrainPipelineBase._task_forward(b, batch) needs" in (
        str(info.value)
    )


def test_a_phased_plan_file_is_refused_at_the_row_of_its_phase(tmp_path: Path) -> None:
    text, _ = edited_base_text("Backward", "losses", "losses,output")
    bad = PipelinePlan.from_text(text)
    phased = PhasedPlan([(0, bad), (5, bad.with_thread_map("io"))])  # phases keep each task's reads
    path = tmp_path / "phased.plan"
    path.write_text(phased.to_text())
    row = next(k for k, ln in enumerate(phased.to_text().splitlines(), 1) if ln.startswith("task Backward "))
    with pytest.raises(PlanError, match="task Backward reads 'output'") as info:
        base_pipeline(plan=str(path))
    assert info.value.line == row


def test_the_unedited_plan_text_still_trains(tmp_path: Path) -> None:
    path = tmp_path / "same.plan"
    path.write_text(catalog.train_pipeline_base_plan().to_text())
    pipeline = base_pipeline(plan=str(path))
    output = pipeline.progress(data())
    assert output.shape == (4, 1)


def test_replan_with_such_a_row_is_refused_and_the_pipeline_keeps_its_plan() -> None:
    pipeline = base_pipeline()
    text, _ = edited_base_text("Backward", "losses", "losses,output")
    with pytest.raises(PlanError, match="task Backward reads 'output'"):
        pipeline.replan(PipelinePlan.from_text(text))
    assert pipeline.plan == catalog.train_pipeline_base_plan()
    pipeline.progress(data())


# ------------------------------------------------------------------ the engine's check, rule by rule
def plan(
    fwd_reads: tuple[str, ...] = ("y",), fwd_writes: tuple[str, ...] = ("out",), dist_reads: tuple[str, ...] = ("x",)
) -> PipelinePlan:
    return PipelinePlan(
        schedule={"Fwd": S(2), "Dist": S(1), "H2D": S(0)},
        tasks=[
            PipelineTask("H2D", writes=("x",)),
            PipelineTask("Dist", reads=dist_reads, writes=("y",)),
            PipelineTask("Fwd", reads=fwd_reads, writes=fwd_writes),
        ],
        source="H2D",
        output=fwd_writes[0] if fwd_writes else None,
        name="p",
    )


def bindings(**functions: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """The plan's tasks bound to functions that fit ``plan()``, but for ``functions``."""
    return {"H2D": lambda b: b, "Dist": lambda b, x: x, "Fwd": lambda b, y: y, **functions}


def fwd_none(b: int, y: int) -> None:
    pass


def fwd_pair(b: int, y: int) -> tuple[int, int]:
    return y, y


def fwd_positional_only(b: int, y: int, /) -> int:
    return y


REFUSED = [
    # (what, plan, task, its function, the message after "plan p: ")
    ("a read no parameter takes", plan(), "Fwd", lambda b: b,
     "task Fwd reads 'y', which its function <lambda>(b) has no parameter for (it takes no read)"),
    ("a previous batch's read, as prev_x", plan(dist_reads=("x", "x@1")), "Dist", lambda b, x: x,
     "task Dist reads 'x@1' (as keyword prev_x), which its function <lambda>(b, x) has no parameter for "
     "(it takes x)"),
    ("a parameter without a default left unread", plan(), "Fwd", lambda b, y, z: y,
     "task Fwd does not read 'z', which its function <lambda>(b, y, z) needs (it reads y)"),
    ("prev_x left unread", plan(), "Dist", lambda b, x, prev_x: x,
     "task Dist does not read 'x@1', which its function <lambda>(b, x, prev_x) needs (it reads x)"),
    ("no positional parameter for the batch", plan(), "Fwd", lambda *, y: y,
     "task Fwd: its function <lambda>(*, y) takes no positional argument, and tasks are called fn(b, **reads) "
     "with the batch index first"),
    ("a read that can only be given by position", plan(), "Fwd", fwd_positional_only,
     "task Fwd reads 'y', which its function fwd_positional_only(b, y, /) has no parameter for (it takes no read)"),
    ("two writes of a function returning None", plan(fwd_writes=("out", "aux")), "Fwd", fwd_none,
     "task Fwd writes 2 values (out, aux), but its function fwd_none(b, y) returns None"),
    ("one write of a function returning None", plan(), "Fwd", fwd_none,
     "task Fwd writes 1 value (out), but its function fwd_none(b, y) returns None"),
    ("three writes of a function returning a pair", plan(fwd_writes=("out", "aux", "more")), "Fwd", fwd_pair,
     "task Fwd writes 3 values (out, aux, more), but its function fwd_pair(b, y) returns a tuple of 2 values"),
]


@pytest.mark.parametrize("what,plan_,task,fn,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_row_its_function_cannot_take_is_refused_when_the_engine_is_built(
    what: str, plan_: PipelinePlan, task: str, fn: Callable[..., Any], message: str
) -> None:
    with pytest.raises(PlanError) as info:
        Engine(plan_, bindings(**{task: fn}))
    assert str(info.value) == f"plan p: {message}"
    assert info.value.culprit == task


def fwd_any(b: int, y: int) -> Any:
    return y, y, y


ACCEPTED = [
    ("a parameter with a default left unread", plan(), "Fwd", lambda b, y, context=None: y),
    ("**kwargs takes any read", plan(dist_reads=("x", "x@1")), "Dist", lambda b, **reads: reads["x"]),
    ("prev_x read as x@1", plan(dist_reads=("x", "x@1")), "Dist", lambda b, x, prev_x: x),
    ("*args takes the batch", plan(), "Fwd", lambda *args, y: y),
    ("a result it does not declare", plan(fwd_writes=("out", "aux", "more")), "Fwd", fwd_any),
    ("a declared pair kept whole in one write", plan(), "Fwd", fwd_pair),
    ("a declared pair written to two names", plan(fwd_writes=("out", "aux")), "Fwd", fwd_pair),
    ("a result dropped: no writes", plan(fwd_writes=()), "Fwd", fwd_pair),
    ("a callable without a readable signature", plan(), "Fwd", max),
]


@pytest.mark.parametrize("what,plan_,task,fn", ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_what_the_signature_does_not_rule_out_is_accepted(
    what: str, plan_: PipelinePlan, task: str, fn: Callable[..., Any]
) -> None:
    Engine(plan_, bindings(**{task: fn})).close()


def test_the_source_may_take_data_without_reading_it() -> None:
    """The engine hands the source ``data=`` itself; a source that does not take it (user-filled
    batches) binds as well."""
    draws = Engine(plan(), bindings(H2D=lambda b, data: next(data)))
    assert [draws.step(iter([1, 2, 3, 4])) for _ in range(2)] == [1, 2]
    draws.close()
    with pytest.raises(PlanError, match="task Dist does not read 'data'"):
        Engine(plan(), bindings(Dist=lambda b, x, data: x))


def test_a_switch_to_a_plan_with_such_a_row_is_refused_and_the_running_plan_goes_on() -> None:
    engine = Engine(plan(), bindings(H2D=lambda b, data: next(data)))
    items = iter(range(10))
    assert engine.step(items) == 0
    with pytest.raises(PlanError, match=r"^plan p: task Fwd reads 'x', which its function .*<lambda>\(b, y\)"):
        engine.switch_plan(plan(("x",)))
    assert not engine.switch_pending
    assert engine.step(items) == 1
    engine.close()


# ------------------------------------------------------------------ what works today still binds
def _rows() -> list[drop_ins.DropIn]:
    """The rows of the drop-ins the installed TorchRec has (PEC: 1.9 on) whose task functions are
    methods (not made from their arguments)."""
    here = drop_ins.names(installed().series)
    return [
        row
        for row in drop_ins.drop_ins()
        if row.name in here and _class(row)._swp_task_functions is PlanDriven._swp_task_functions
    ]


def _class(row: drop_ins.DropIn) -> type:
    return getattr(importlib.import_module(row.module_path), row.name)  # type: ignore[no-any-return]


def _calls(cls: type) -> dict[str, TaskCall | None]:
    """``cls``'s task functions as a pipeline binds them (methods of an instance)."""
    holder = object()
    return {t: TaskCall.of(t, types.MethodType(getattr(cls, m), holder)) for t, m in task_methods(cls).items()}


def _catalog_plans(row: drop_ins.DropIn) -> list[PipelinePlan | PhasedPlan]:
    """``row``'s default plan, with each switch of its catalog function flipped, and its golden variants."""
    plans = [catalog.default_plan(row)]
    for parameter in inspect.signature(getattr(catalog, row.plan)).parameters.values():
        if isinstance(parameter.default, bool):
            flipped = {**row.plan_arguments, parameter.name: not parameter.default}
            plans.append(catalog.default_plan(replace(row, plan_arguments=flipped)))
    golden = {**ALL, **VARIANTS}
    plans += [p for name, p in golden.items() if name.split(".")[0] == row.name]
    return plans


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r.name)
def test_every_catalog_and_golden_plan_fits_its_pipelines_functions(row: drop_ins.DropIn) -> None:
    calls = _calls(_class(row))
    checked = 0
    for p in _catalog_plans(row):
        for one in getattr(p, "plans", (p,)):
            for task in one.fire_order:
                check_call(one.task(task).io, calls[task], source=task == one.source)
                checked += calls[task] is not None
    assert checked


def test_the_function_in_a_message_is_the_bound_method_without_self() -> None:
    call = _calls(torchrec_swp.TrainPipelineBase)["Backward"]
    assert call == TaskCall(
        "Backward",
        "TrainingTasks._task_backward(b, losses, context=None)",
        takes=frozenset({"losses", "context"}),
        needs=frozenset({"losses"}),
        results=0,
    )
