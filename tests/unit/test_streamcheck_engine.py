"""The engine in checked mode: a plan's real tasks on emulated streams, watched by the checker.

The compiled waits and event records make a two-stream plan clean; remove one wait and the
checker names both accesses (tasks, batches, streams, op, shape); the engine's cross-thread
hand-offs (latches) order the threads' host work, so a plan on two threads is clean too; the
same holds for the pipeline-parallel ``ProgramEngine``'s wait/signal pairs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchrec_swp.compile import IterationProgram, RunAction, Signal, WaitTask
from torchrec_swp.engine import Engine, ProgramEngine
from torchrec_swp.plan import PipelinePlan, PipelineTask, PlanError, TaskSchedule
from torchrec_swp.streamcheck import CheckedStreamPool, EarlyFree, StreamChecker, UnsyncedAccess

S = TaskSchedule
N = 6


def copy_plan(**changes: Any) -> PipelinePlan:
    """H2D (memcpy stream) fills a tensor, Fwd (default stream) reads it, Opt updates a weight."""
    args: dict[str, Any] = dict(
        schedule={"H2D": S(0, "memcpy"), "Fwd": S(1), "Opt": S(1)},
        tasks=[
            PipelineTask("H2D", writes=("x",)),
            PipelineTask("Fwd", reads=("x",), writes=("out",)),
            PipelineTask("Opt", reads=("out",)),
        ],
        source="H2D",
        output="out",
        name="copy",
    )
    args.update(changes)
    return PipelinePlan(**args)


class Model:
    """``record`` False: Fwd forgets what TorchRec's ``_wait_for_batch`` does, ``record_stream``
    of the batch on the stream that uses it (its memory could be handed out again too early)."""

    def __init__(self, record: bool = True) -> None:
        self.w = torch.ones(4)
        self.record = record

    def bindings(self) -> dict[str, Any]:
        def h2d(b: int, data: Any) -> torch.Tensor:
            host = next(data)
            x = torch.empty(4)
            x.copy_(host)  # written on the memcpy stream
            return x

        def fwd(b: int, x: torch.Tensor) -> torch.Tensor:
            if self.record:
                x.record_stream(torch.cpu.current_stream())  # used on this stream too
            return (x * self.w).sum()  # read on the default stream

        def opt(b: int, out: torch.Tensor) -> None:
            self.w.add_(out * 0.01)

        return {"H2D": h2d, "Fwd": fwd, "Opt": opt}


def run(plan: PipelinePlan, checker: StreamChecker, mutate: Any = None, record: bool = True) -> list[float]:
    engine = Engine(plan, Model(record).bindings(), streams=CheckedStreamPool(checker), timeout_s=10)
    if mutate is not None:
        mutate(engine)
    data = iter([torch.full((4,), float(k)) for k in range(N)])
    outs = []
    with torch.no_grad():
        while True:
            try:
                outs.append(float(engine.step(data)))
            except StopIteration:
                break
    engine.close()
    return outs


def without_waits(engine: Engine) -> None:
    """The compiled programs with every stream wait removed (what a forgotten wait_stream is)."""
    for k, text in enumerate(engine.program_texts()):
        lines = text.splitlines()
        kept = [line for line in lines if not line.strip().startswith("stream ")]
        assert len(kept) < len(lines), text
        engine.edit_program(k, "\n".join(kept))


@pytest.mark.parametrize("thread_map", ["main", "by_stream"])
def test_the_compiled_syncs_make_a_two_stream_plan_clean(thread_map: str) -> None:
    with StreamChecker() as checker:
        outs = run(copy_plan().with_thread_map(thread_map), checker)
    assert len(outs) == N
    assert checker.findings == []
    checker.check()


def test_a_removed_wait_is_caught_naming_both_accesses() -> None:
    with StreamChecker() as checker:
        run(copy_plan(), checker, mutate=without_waits)
    races = [f for f in checker.findings if isinstance(f, UnsyncedAccess)]
    assert races, checker.findings
    text = str(races[0])
    for needed in ("H2D", "Fwd", "memcpy", "default", "[4]"):
        assert needed in text, text


def test_a_missing_record_stream_is_caught_as_an_early_free() -> None:
    with StreamChecker() as checker:
        run(copy_plan(), checker, record=False)
    frees = [f for f in checker.findings if isinstance(f, EarlyFree)]
    assert frees, checker.findings
    text = str(frees[0])
    for needed in ("Fwd", "memcpy", "default", "[4]"):
        assert needed in text, text


def run_program(program: IterationProgram, checker: StreamChecker) -> None:
    """F writes a buffer on the main thread, SF reads it on the comm thread (a send would)."""
    buf = torch.zeros(4)
    bindings = {"F": lambda s, mb: buf.fill_(float(mb)), "SF": lambda s, mb: buf.sum()}
    engine = ProgramEngine(bindings, streams=CheckedStreamPool(checker), timeout_s=10)
    try:
        for _ in range(2):
            engine.run_program(program)
    finally:
        engine.close()


def test_a_program_engines_wait_signal_pairs_order_its_threads() -> None:
    ordered = IterationProgram(
        (0,),
        (
            ("default", (RunAction("0F0", "F", 0, 0), Signal("0F0"))),
            ("comm", (WaitTask("0F0"), RunAction("0SF0", "SF", 0, 0))),
        ),
    )
    with StreamChecker() as checker:
        run_program(ordered, checker)
    assert checker.findings == []

    unordered = IterationProgram(
        (0,),
        (("default", (RunAction("0F0", "F", 0, 0), Signal("0F0"))), ("comm", (RunAction("0SF0", "SF", 0, 0),))),
    )
    with StreamChecker() as checker:
        run_program(unordered, checker)
    races = [f for f in checker.findings if isinstance(f, UnsyncedAccess)]
    assert races, checker.findings
    text = str(races[0])
    for needed in ("0F0", "0SF0", "[4]"):  # the actions are the checker's task labels
        assert needed in text, text


def test_an_edited_program_runs_as_written_and_bad_text_is_refused_at_its_line() -> None:
    engine = Engine(copy_plan(), Model(True).bindings(), streams=CheckedStreamPool(StreamChecker()), timeout_s=10)
    try:
        (text,) = engine.program_texts()
        lines = text.splitlines()
        record = next(n for n, line in enumerate(lines) if line.strip().startswith("record "))
        edited = "\n".join(lines[:record] + lines[record + 1 :])
        engine.edit_program(0, edited)
        assert engine.program_texts() == [edited]
        with pytest.raises(PlanError, match=rf"line {record + 1}: unknown task 'Fwdd'"):
            engine.edit_program(0, "\n".join([*lines[:record], "  run Fwdd", *lines[record + 1 :]]))
        assert engine.program_texts() == [edited]  # a refused edit changes nothing
    finally:
        engine.close()
