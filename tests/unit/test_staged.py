"""Our StagedTrainPipeline against upstream's, on CPU stages that need no process group.

Same stages (simple CPU transforms), same data: the same batches (and None at the end) on
every call, and the same callback pattern: each progress() call makes the same stage calls and
callback calls. Within a call, stages run in upstream's order, except in the fill, where the
engine interleaves stages iteration by iteration (upstream goes batch by batch); so the fill
calls are compared stage by stage, the others exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage
from torchrec.streamable import Pipelineable

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from torchrec_swp.integrations.torchrec.pipelines.staged import StagedTrainPipeline, stage_task_names
from torchrec_swp.plan import PlanError

Event = tuple[Any, ...]


@dataclass
class Batch(Pipelineable):
    x: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(self.x.to(device, non_blocking=non_blocking, copy=True))

    def record_stream(self, stream: Any) -> None:
        self.x.record_stream(stream)


TRANSFORMS: list[Callable[[Batch], Batch]] = [
    lambda b: b.to(torch.device("cpu"), non_blocking=True),  # "H2D"
    lambda b: Batch(b.x * 2 + 1),  # post-processing
    lambda b: Batch(torch.cumsum(b.x, 0)),
]


def make_stages(n: int, log: list[Event], stream: Callable[[], Any]) -> list[PipelineStage]:
    def stage(k: int) -> PipelineStage:
        def run(b: Batch) -> Batch:
            log.append(("run", k, int(b.x[0])))
            return TRANSFORMS[k](b)

        return PipelineStage(
            name=f"stage {k}",  # not an identifier: the plan's task is "stage_k"
            runnable=run,
            stream=stream(),
            fill_callback=lambda: log.append(("fill", k)),
            data_exhausted_callback=lambda: log.append(("exhausted", k)),
        )

    return [stage(k) for k in range(n)]


def data(n: int, start: int = 0) -> Iterator[Batch]:
    return iter([Batch(torch.arange(4.0) + 10 * (start + i)) for i in range(n)])


@dataclass
class Call:
    events: list[Event]
    out: torch.Tensor | None


# A scenario drives a pipeline: it gets (pipeline, log) and returns one Call per progress().
Scenario = Callable[[Any, list[Event]], list[Call]]


def _calls(
    pipeline: Any,
    log: list[Event],
    iterators: list[tuple[Iterator[Batch], int]],
    flush_at: int | None = None,
    reset_at: int | None = None,
) -> list[Call]:
    """``num_calls`` progress() calls per (iterator, num_calls); set_flush(True) before call
    ``flush_at``, reset() before call ``reset_at``. (The log is only appended to: a worker thread
    may still log after a call returned.)"""
    calls = []
    for it, num_calls in iterators:
        for _ in range(num_calls):
            if flush_at is not None and len(calls) == flush_at:
                pipeline.set_flush(True)
            if reset_at is not None and len(calls) == reset_at:
                pipeline.reset()  # upstream's does nothing: the batches in flight go on
            start = len(log)
            out = pipeline.progress(it)
            calls.append(Call(log[start:], None if out is None else out.x.clone()))
    return calls


SCENARIOS: dict[str, tuple[int, Scenario]] = {
    "3 stages, end of data": (3, lambda p, log: _calls(p, log, [(data(7), 12)])),
    "2 stages, end of data": (2, lambda p, log: _calls(p, log, [(data(7), 11)])),
    "fewer batches than stages": (3, lambda p, log: _calls(p, log, [(data(1), 5)])),
    "no batch": (2, lambda p, log: _calls(p, log, [(data(0), 3)])),
    "flush": (3, lambda p, log: _calls(p, log, [(data(12), 16)], flush_at=3)),
    "flush at the end of data": (2, lambda p, log: _calls(p, log, [(data(4), 8)], flush_at=5)),
    "reset mid-run": (3, lambda p, log: _calls(p, log, [(data(8), 11)], reset_at=4)),
    "new iterator after the end": (3, lambda p, log: _calls(p, log, [(data(3), 6), (data(4, start=5), 9)])),
}


def upstream_run(n: int, scenario: Scenario) -> list[Call]:
    log: list[Event] = []
    # Test-only tweak: upstream's default compute stream (torch.cpu.current_stream()) has no
    # .device, and its stages need a stream with one; record_stream on CPU tensors is patched.
    with upstream_cpu_patch():
        pipeline = upstream.StagedTrainPipeline(
            make_stages(n, log, lambda: torch.Stream(device="cpu")),
            compute_stream=torch.Stream(device="cpu"),
            on_flush_end=lambda: log.append(("on_flush_end",)),
        )
        return scenario(pipeline, log)


def our_run(n: int, scenario: Scenario, stream: Callable[[], Any], **options: Any) -> list[Call]:
    log: list[Event] = []
    pipeline = StagedTrainPipeline(
        make_stages(n, log, stream), on_flush_end=lambda: log.append(("on_flush_end",)), **options
    )
    try:
        return scenario(pipeline, log)
    finally:
        pipeline.close()


def by_stage(events: list[Event]) -> dict[Any, list[Event]]:
    out: dict[Any, list[Event]] = {}
    for e in events:
        out.setdefault(e[1] if len(e) > 1 else e[0], []).append(e)
    return out


def by_stage_and_kind(events: list[Event]) -> dict[Any, list[Event]]:
    out: dict[Any, list[Event]] = {}
    for e in events:
        out.setdefault((e[0] == "fill", e[1] if len(e) > 1 else e[0]), []).append(e)
    return out


def assert_same_calls(expected: list[Call], got: list[Call], what: str, *, one_thread: bool) -> None:
    """Same outputs; per call, the same events of each stage; with everything on one thread,
    also the same order outside the fill (threads run the stages of a call concurrently). In a
    fill call, on threads, a stage's calls and its fill callbacks (a task of their own, here on
    another thread) keep their own orders: iterations of the fill overlap."""
    assert len(expected) == len(got), what
    for i, (a, b) in enumerate(zip(expected, got)):
        where = f"{what}, call {i}"
        assert (a.out is None) == (b.out is None), f"{where}: {a.out} vs {b.out}"
        if a.out is not None:
            assert torch.equal(a.out, b.out), f"{where}: {a.out} vs {b.out}"
        if one_thread and not any(e[0] == "fill" for e in a.events):
            assert a.events == b.events, f"{where}:\n{a.events}\n{b.events}"
        elif one_thread or not any(e[0] == "fill" for e in a.events):
            assert by_stage(a.events) == by_stage(b.events), f"{where}:\n{a.events}\n{b.events}"
        else:
            assert by_stage_and_kind(a.events) == by_stage_and_kind(b.events), f"{where}:\n{a.events}\n{b.events}"


VARIANTS: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {
    "torch.cpu.Stream": (torch.cpu.Stream, {}),
    "torch.Stream(cpu)": (lambda: torch.Stream(device="cpu"), {}),
    "by_stream": (torch.cpu.Stream, {"thread_map": "by_stream"}),
    "stage 0 on an io thread": (torch.cpu.Stream, {"thread_map": {"stage_0": "io"}}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_same_batches_and_callbacks_as_upstream(scenario: str) -> None:
    n, drive = SCENARIOS[scenario]
    expected = upstream_run(n, drive)
    for label, (stream, options) in VARIANTS.items():
        got = our_run(n, drive, stream, **options)
        assert_same_calls(expected, got, f"{scenario} [{label}]", one_thread="thread_map" not in options)


def test_flush_returns_no_none_and_refills_in_the_same_call() -> None:
    calls = our_run(3, SCENARIOS["flush"][1], torch.cpu.Stream)
    outs = [None if c.out is None else int(c.out[0]) for c in calls]
    # batch k's first value is 10k -> (20k + 1) after stage 1 -> cumsum keeps it
    assert outs[:12] == [20 * k + 1 for k in range(12)]
    assert outs[12:] == [None] * 4
    flush_call = next(i for i, c in enumerate(calls) if ("on_flush_end",) in c.events)
    assert flush_call == 6  # flushing from call 3: batches 3, 4, 5 drain, call 6 refills
    assert ("fill", 0) in calls[flush_call].events


def test_end_of_data_returns_none_repeatedly() -> None:
    calls = our_run(2, SCENARIOS["2 stages, end of data"][1], torch.cpu.Stream)
    assert [c.out is None for c in calls] == [False] * 7 + [True] * 4
    assert calls[-1].events == [("exhausted", 0), ("exhausted", 1)]


def test_plan_and_names() -> None:
    pipeline = StagedTrainPipeline(make_stages(3, [], torch.cpu.Stream))
    try:
        plan = pipeline.plan
        # each stage with a fill callback is followed by its NAME.fill task, run during the fill
        assert plan.fire_order == (
            "Emit",
            "stage_0",
            "stage_0.fill",
            "stage_1",
            "stage_1.fill",
            "stage_2",
            "stage_2.fill",
        )
        assert [plan.task(t).stage for t in plan.fire_order] == [3, 0, 0, 1, 1, 2, 2]
        assert {plan.task(t).when.value for t in plan.fire_order if t.endswith(".fill")} == {"fill"}
        assert plan.pipeline_depth == 4
    finally:
        pipeline.close()
    stages = [PipelineStage(name, lambda b: b, torch.cpu.Stream()) for name in ("a", "a", "Emit", "1x")]
    assert stage_task_names(stages) == ["a", "a_1", "Emit_2", "stage3_1x"]
    shared = torch.cpu.Stream()
    stages = [PipelineStage(name, lambda b: b, shared) for name in ("copy", "post")]
    pipeline = StagedTrainPipeline(stages, thread_map="by_stream")
    try:
        assert [pipeline.plan.task(t).stream for t in ("copy", "post")] == ["copy", "copy"]
        assert pipeline.plan.task("post").thread_group == "copy"
    finally:
        pipeline.close()
    # no stream of its own, or the compute stream itself: the plan's default stream
    compute = torch.Stream(device="cpu")
    pipeline = StagedTrainPipeline(
        [PipelineStage("a", lambda b: b, None), PipelineStage("b", lambda b: b, compute)],  # type: ignore[arg-type]
        compute_stream=compute,
    )
    try:
        assert [pipeline.plan.task(t).stream for t in ("a", "b")] == ["default", "default"]
    finally:
        pipeline.close()


def test_errors_name_the_culprit() -> None:
    with pytest.raises(ValueError, match="at least one PipelineStage"):
        StagedTrainPipeline([])
    with pytest.raises(PlanError, match="unknown task 'nope'"):
        StagedTrainPipeline(make_stages(2, [], torch.cpu.Stream), thread_map={"nope": "io"})
