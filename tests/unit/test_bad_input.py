"""Catalogue of bad input: every kind is rejected before anything runs, with a typed error that
names the culprit. docs/reliability.md ("Bad input fails before anything runs") points here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_swp.catalog.torchrec import staged_plan, train_pipeline_base_plan
from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, PlanError, TaskSchedule
from torchrec_swp.plans import with_parallel_loads

S = TaskSchedule


def plan(**changes: Any) -> PipelinePlan:
    args: dict[str, Any] = dict(
        schedule={"Fwd": S(2), "Dist": S(1, "data_dist"), "H2D": S(0, "memcpy")},
        tasks=[
            PipelineTask("H2D", writes=("x",)),
            PipelineTask("Dist", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",), writes=("out",)),
        ],
        source="H2D",
        output="out",
        name="p",
    )
    args.update(changes)
    return PipelinePlan(**args)


BINDINGS: dict[str, Any] = {"H2D": lambda b: b, "Dist": lambda b, x: x, "Fwd": lambda b, y: y}


def _base_text(row: str, word: str, slip: str) -> str:
    """TrainPipelineBase's plan text with ``word`` of the row beginning ``row`` misspelt ``slip``."""
    lines = train_pipeline_base_plan().to_text().splitlines()
    return "\n".join(ln.replace(word, slip, 1) if ln.startswith(row) else ln for ln in lines) + "\n"


def base_pipeline(**kwargs: Any) -> Any:
    import torchrec_swp

    model = torch.nn.Linear(2, 2)
    return torchrec_swp.TrainPipelineBase(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), **kwargs
    )


def hybrid_pipeline(**kwargs: Any) -> Any:
    import torchrec_swp

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return torchrec_swp.TrainEvalHybridPipelineBase(model, optimizer, torch.device("cpu"), **kwargs)


def plan_file(tmp: Path, text: str) -> str:
    path = tmp / "bad.plan"
    path.write_text(text)
    return str(path)


# (kind, how to provoke it, error type, text the message must contain: the culprit)
CATALOGUE: list[tuple[str, Callable[[Path], Any], type[BaseException], str]] = [
    ("empty plan", lambda t: PipelinePlan(schedule={}), PlanError, "no tasks"),
    (
        "duplicate task",
        lambda t: plan(tasks=[PipelineTask("H2D"), PipelineTask("H2D")], output=None),
        PlanError,
        "duplicate task name H2D",
    ),
    ("unknown task in a dep", lambda t: plan(intra_iter_deps=[("Fwd", "Loss")]), PlanError, "'Loss'"),
    (
        "dependency cycle",
        lambda t: plan(intra_iter_deps=[("H2D", "Fwd")], schedule={"Fwd": S(0), "Dist": S(0), "H2D": S(0)}),
        PlanError,
        "cycle",
    ),
    (
        "dep against the stages",
        lambda t: plan(schedule={"Fwd": S(0), "Dist": S(1, "data_dist"), "H2D": S(0, "memcpy")}),
        PlanError,
        "Fwd <- Dist",
    ),
    (
        "dep against the fire order",
        lambda t: plan(fire_order=["Fwd", "Dist", "H2D"], schedule={"Fwd": S(1), "Dist": S(1), "H2D": S(0)}),
        PlanError,
        "Dist must come before Fwd",
    ),
    ("depth below the stage span", lambda t: plan(pipeline_depth=1), PlanError, "task Fwd is at stage 2"),
    (
        "read nobody writes",
        lambda t: plan(tasks=[PipelineTask("Fwd", reads=("loss",))], output=None),
        PlanError,
        "'loss'",
    ),
    (
        "two writers of one name",
        lambda t: plan(tasks=[PipelineTask("H2D", writes=("x",)), PipelineTask("Dist", writes=("x",))], output=None),
        PlanError,
        "'x'",
    ),
    ("source not at stage 0", lambda t: plan(source="Fwd"), PlanError, "source Fwd"),
    (
        "stage-0 task not fed by the source",
        lambda t: plan(schedule={"Fwd": S(2), "Dist": S(1), "H2D": S(0), "Log": S(0)}),
        PlanError,
        "task Log",
    ),
    ("negative stage", lambda t: S(-1), PlanError, "stage must be >= 0"),
    ("stage of the wrong type", lambda t: S(1.5), PlanError, "stage must be an int"),  # type: ignore[arg-type]
    ("name with a space", lambda t: S(0, stream="mem copy"), PlanError, "'mem copy'"),
    (
        "schedule of the wrong type",
        lambda t: PipelinePlan(schedule=[("A", S(0))]),  # type: ignore[arg-type]
        PlanError,
        "schedule must be a mapping",
    ),
    ("thread_map naming an unknown task", lambda t: plan().with_thread_map({"h2d": "io"}), PlanError, "'h2d'"),
    ("unknown thread_map strategy", lambda t: plan().with_thread_map("by_threads"), PlanError, "'by_threads'"),
    ("thread_map of the wrong type", lambda t: plan().with_thread_map(["io"]), PlanError, "list"),  # type: ignore[arg-type]
    (
        "more threads than allowed",
        lambda t: Engine(plan().with_thread_map("per_task"), BINDINGS, max_threads=2),
        PlanError,
        "3 threads",
    ),
    (
        "more batches in flight than allowed",
        lambda t: Engine(plan(pipeline_depth=6), BINDINGS, max_in_flight=5),
        PlanError,
        "6 batches in flight",
    ),
    (
        "a task on two comm groups",
        lambda t: PipelinePlan.from_text("plan p\ndepth 1\ntask A 0 default default world,pg2 - - - - -\n"),
        PlanError,
        "world,pg2",
    ),
    (
        "unknown keyword in a plan file",
        lambda t: PipelinePlan.from_text("plan p\ndepth 1\ntsak A\n"),
        PlanError,
        "'tsak'",
    ),
    ("task with no function", lambda t: Engine(plan(), {"H2D": BINDINGS["H2D"]}), PlanError, "task Fwd"),
    ("function that is not callable", lambda t: Engine(plan(), {**BINDINGS, "Fwd": 42}), TypeError, "task Fwd"),
    ("timeout that is not positive", lambda t: Engine(plan(), BINDINGS, timeout_s=0), ValueError, "timeout_s"),
    ("plan without a source", lambda t: Engine(plan(source=None), BINDINGS), PlanError, "no source"),
    ("engine given something else than a plan", lambda t: Engine("plan", BINDINGS), TypeError, "str"),  # type: ignore[arg-type]
    ("pipeline plan with a task it does not have", lambda t: base_pipeline(plan=plan()), PlanError, "'Fwd'"),
    ("pipeline plan of the wrong type", lambda t: base_pipeline(plan=3), TypeError, "int"),
    (
        "pipeline plan file that does not exist",
        lambda t: base_pipeline(plan=str(t / "missing.plan")),
        FileNotFoundError,
        "missing.plan",
    ),
    (
        "pipeline plan file with a bad line",
        lambda t: base_pipeline(plan=plan_file(t, "plan p\ndepth 1\ntask A stage=x\n")),
        PlanError,
        "line 3",
    ),
    (  # issue 30: the comm group misspelt in the pipeline's own plan, spread over threads by stream
        "pipeline plan file with a misspelt comm group",
        lambda t: base_pipeline(plan=plan_file(t, _base_text("task Backward ", "world", "wrold")),
                                thread_map="by_stream"),
        PlanError,
        "comm group 'wrold' is not declared",
    ),
    (
        "pipeline plan file with a task it has no function for",
        lambda t: base_pipeline(plan=plan_file(t, _base_text("task ZeroGrad ", "ZeroGrad", "ZeroGard"))),
        PlanError,
        "task 'ZeroGard' is not one of the pipeline's tasks; did you mean 'ZeroGrad'?",
    ),
    (
        "pipeline thread_map naming an unknown task",
        lambda t: base_pipeline(thread_map={"Fwd": "io"}),
        PlanError,
        "'Fwd'",
    ),
    (
        "pipeline thread_map of an unknown strategy",
        lambda t: base_pipeline(thread_map="by_threads"),
        PlanError,
        "'by_threads'",
    ),
    ("pipeline loads below 1", lambda t: base_pipeline(loads=0), ValueError, "loads must be an int >= 1, got 0"),
    ("pipeline loads given as a bool", lambda t: base_pipeline(loads=True), TypeError, "got True"),
    (
        "pipeline lookahead below 0",
        lambda t: base_pipeline(lookahead=-2),
        ValueError,
        "lookahead must be an int >= 0, got -2",
    ),
    ("pipeline lookahead given as a bool", lambda t: base_pipeline(lookahead=True), TypeError, "got True"),
    (
        "loads on a source that cannot be split",
        lambda t: with_parallel_loads(staged_plan(["copy"]), 2),
        ValueError,
        "source is copy",
    ),
    ("loads on a source on the calling thread", lambda t: plan(loads=2), PlanError, "`plan.with_loads(2)`"),
    (
        "train guard below the highest stage",
        lambda t: plan(schedule={"Fwd": S(2), "Dist": S(1, "data_dist", when="train"), "H2D": S(0, "memcpy")}),
        PlanError,
        "task Dist runs when=train at stage 1",
    ),
    (
        "hybrid pipeline that would stop early",
        lambda t: hybrid_pipeline(execute_all_batches=False),
        ValueError,
        "execute_all_batches=False",
    ),
]


@pytest.mark.parametrize("kind,provoke,error,culprit", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_is_rejected_with_a_typed_error_naming_the_culprit(
    kind: str, provoke: Callable[[Path], Any], error: type[BaseException], culprit: str, tmp_path: Path
) -> None:
    with pytest.raises(error) as info:
        provoke(tmp_path)
    assert culprit in str(info.value), f"{kind}: {info.value}"
    if isinstance(info.value, PlanError):
        assert info.value.culprit, f"{kind}: no culprit attribute"

