"""The stage op (``PlanOps._stage_op``): on the calling thread, plain runs of one stage in a row
execute in one op, their batch's existence asked once. A task among them that fails parks the
walk at its own instruction, and the next call resumes with it: nothing before it runs twice,
nothing after it is skipped, and the calls are those of a run that never failed."""

from __future__ import annotations

import sys
import traceback
from types import FrameType
from typing import Any

import pytest

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.engine import Engine


def _recording(calls: list[tuple[str, int]], fail: set[tuple[str, int]]) -> dict[str, Any]:
    """SparseDist's tasks as stand-ins appending ``(task, batch)`` to ``calls``; each of ``fail``
    raises once, on its first call."""
    plan = catalog.sparse_dist_plan()
    fns = {}
    for t in plan.fire_order:
        writes = plan.task(t).io.writes

        def fn(b: int, *, _t: str = t, _w: tuple[str, ...] = writes, **kw: Any) -> Any:
            if (_t, b) in fail:
                fail.discard((_t, b))
                raise ValueError(f"{_t} failed at batch {b}")
            calls.append((_t, b))
            if "data" in kw:
                next(kw["data"])
            return None if not _w else b if len(_w) == 1 else tuple(b for _ in _w)

        fns[t] = fn
    return fns


def _run(fail: set[tuple[str, int]]) -> tuple[list[tuple[str, int]], list[Any], list[traceback.FrameSummary]]:
    calls: list[tuple[str, int]] = []
    engine = Engine(catalog.sparse_dist_plan(), _recording(calls, fail))
    data, outputs, frames = iter(range(8)), [], []
    while True:
        try:
            outputs.append(engine.step(data))
        except StopIteration:
            break
        except ValueError as e:
            frames = traceback.extract_tb(e.__traceback__)
    engine.close()
    return calls, outputs, frames


def test_the_calling_threads_program_has_stage_ops_where_a_stage_runs_plain_tasks_in_a_row() -> None:
    engine = Engine(catalog.sparse_dist_plan(), _recording([], set()))
    (inst,) = engine.installed.by_id.values()
    instrs, ops = inst.walks["default"]
    stage_ops = [str(i) for i, op in zip(instrs, ops) if op.__name__ == "run_stage"]
    engine.close()
    # ZeroGrad+WaitBatch and Backward+OptimizerStep+Dequeue (stage 2); H2D is the source, the
    # stage-1 tasks are guarded or alone, Forward stands between H2D and InputDistWait
    assert stage_ops == ["run ZeroGrad", "run Backward"]


@pytest.mark.parametrize(
    "task, position",
    [("ZeroGrad", "first of two"), ("WaitBatch", "last of two"), ("OptimizerStep", "middle of three"),
     ("Dequeue", "last of three")],  # fmt: skip
)
@pytest.mark.parametrize("batch", [0, 4])
def test_a_task_failing_inside_a_stage_op_resumes_at_itself(task: str, position: str, batch: int) -> None:
    clean, clean_outputs, _ = _run(set())
    calls, outputs, frames = _run({(task, batch)})
    assert calls == clean  # nothing before it twice, nothing after it skipped
    assert outputs == clean_outputs == list(range(8))
    names = [f.name for f in frames]
    assert names[-2] == f"<task {task}>", names
    assert names[-3] in ("run_stage", "run"), names  # the stage op, or the task's own op on resume
    if position.startswith("first"):
        assert names[-3] == "run_stage", names


def test_a_stage_op_asks_its_batchs_existence_once() -> None:
    engine = Engine(catalog.sparse_dist_plan(), _recording([], set()))
    data = iter(range(100))
    for _ in range(3):
        engine.step(data)
    asked: list[int] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "exists_at" and code.co_filename.endswith("end_of_data.py"):
            asked.append(frame.f_locals["b"])

    sys.setprofile(profile)
    try:
        engine.step(data)
    finally:
        sys.setprofile(None)
    engine.close()
    # batch 3 (stage 2, six tasks): the two stage ops and Forward, where an op per task would
    # ask six times; batch 4 (stage 1): its three runs; batch 5: the source, before its draw
    assert asked.count(3) == 3 and asked.count(4) == 3 and asked.count(5) == 1, asked
