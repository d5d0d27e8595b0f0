"""``Engine.switch_plan``: a running engine moves to another plan of the same tasks and stages at a
batch boundary - nothing lost, nothing repeated, the same outputs and collective order as if it
had run one plan throughout - and refuses what it cannot switch, naming why."""

from __future__ import annotations

import pytest

from tests.unit.engine_fixtures import THREAD_MAPS, Toy, drawing, run, toy_plan
from torchrec_swp.engine import Engine, EngineError
from torchrec_swp.plan import PhasedPlan, PipelinePlan, TaskSchedule

S = TaskSchedule

N = 14


def reference() -> tuple[list[int], list[tuple[str, int]], int]:
    toy = Toy(N)
    engine = Engine(toy_plan(), drawing(toy))
    try:
        return run(engine), toy.collectives, toy.state
    finally:
        engine.close()


def targets() -> list[PipelinePlan]:
    plans = [toy_plan().with_thread_map(tm) for tm in THREAD_MAPS]
    ahead = toy_plan(lookahead=2).with_thread_map({"H2D": "io"})
    loads = toy_plan().with_thread_map({"H2D": "load"}).with_loads(2, lookahead=2)
    return [*plans, ahead, loads]


@pytest.mark.parametrize("after", [4, 0])
@pytest.mark.parametrize(
    "target", targets(), ids=lambda p: repr(p.thread_groups) + f"/ahead{p.lookahead}/loads{p.loads}"
)
def test_a_switch_between_steps_trains_exactly_as_one_plan(target: PipelinePlan, after: int) -> None:
    outputs, collectives, state = reference()
    toy = Toy(N, jitter_s=0.002, seed=after)
    engine = Engine(toy_plan(), drawing(toy))
    try:
        got = run(engine, after)
        engine.switch_plan(target)
        assert engine.plan == target
        got += run(engine)
        threads = {w.name for w in engine.worker_threads}
    finally:
        engine.close()
    assert got == outputs and toy.collectives == collectives and toy.state == state
    assert engine.ledger.trained == N and not engine.untrained()
    if set(target.thread_groups) - {"default"}:
        assert threads, "the new plan's threads ran"


def test_switching_twice_and_back() -> None:
    outputs, collectives, _ = reference()
    toy = Toy(N, jitter_s=0.001)
    engine = Engine(toy_plan(), drawing(toy))
    try:
        got = run(engine, 3)
        engine.switch_plan(toy_plan().with_thread_map("per_task"))
        got += run(engine, 3)
        engine.switch_plan(toy_plan())
        got += run(engine)
    finally:
        engine.close()
    assert got == outputs and toy.collectives == collectives


@pytest.mark.parametrize("after", [1, 2, 5])
def test_threads_that_ran_ahead_stop_running_ahead_and_the_switch_follows(after: int) -> None:
    outputs, collectives, state = reference()
    toy = Toy(N, jitter_s=0.002, seed=after)
    engine = Engine(toy_plan(lookahead=2).with_thread_map({"H2D": "io"}), drawing(toy))
    target = toy_plan().with_thread_map("per_task")
    try:
        got = run(engine, after)
        switched = engine.switch_plan(target)
        steps = 0
        while engine.switch_pending:
            got += run(engine, 1)
            steps += 1
        assert switched or steps >= 1
        assert steps <= 3  # lookahead steps to catch up; the next call switches before it walks
        assert engine.plan == target
        got += run(engine)
    finally:
        engine.close()
    assert got == outputs and toy.collectives == collectives and toy.state == state


def test_what_a_switch_keeps_is_checked() -> None:
    toy = Toy(N)
    engine = Engine(toy_plan(), drawing(toy))
    try:
        run(engine, 1)
        moved = toy_plan(
            schedule={
                "Fwd": S(2, comm_group="world"),
                "H2D": S(0, "memcpy"),
                "Dist": S(0, "data_dist", comm_group="world"),
                "Opt": S(2, comm_group="world"),
            }
        )
        with pytest.raises(EngineError, match="task Dist runs at stage 0 on stream data_dist in plan toy, at stage 1"):
            engine.switch_plan(moved)
        restreamed = toy_plan().with_schedule("Dist", stream="default")
        with pytest.raises(EngineError, match="keeps every task's stage and stream"):
            engine.switch_plan(restreamed)
        phased = PhasedPlan([(0, toy_plan()), (5, toy_plan().with_thread_map("per_task"))])
        with pytest.raises(EngineError, match=r"phases start at batches \[0, 5\], the running plan's at \[0\]"):
            engine.switch_plan(phased)
        cycled = PhasedPlan([(0, toy_plan())], clock="trained", cycle=(0, 1))
        with pytest.raises(
            EngineError, match="on clock trained with cycle \\(0, 1\\), the running plan's on clock index"
        ):
            engine.switch_plan(cycled)
        with pytest.raises(TypeError, match="plan must be a PipelinePlan or a PhasedPlan"):
            engine.switch_plan("toy")  # type: ignore[arg-type]
        assert len(run(engine)) == N - 1
    finally:
        engine.close()


def test_a_phased_plan_switches_every_phase() -> None:
    first = PhasedPlan([(0, toy_plan()), (6, toy_plan(name="toy2"))])
    toy = Toy(N)
    engine = Engine(first, drawing(toy))
    try:
        got = run(engine, 3)
        engine.switch_plan(first.each(lambda p: p.with_thread_map("by_stream")))
        got += run(engine)
    finally:
        engine.close()
    outputs, collectives, _ = reference()
    assert got == outputs and toy.collectives == collectives

