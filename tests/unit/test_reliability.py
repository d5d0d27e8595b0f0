"""Nothing lost: failures, resumes, resets and stops keep an exact account of every batch."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.engine_fixtures import THREAD_MAPS, Toy, toy_plan
from torchrec_swp.engine import CollectiveAborted, Engine, EngineError

N = 9


def flaky(toy: Toy, task: str, batch: int) -> dict[str, Any]:
    """Bindings where ``task`` fails the first time it sees ``batch`` (a transient error)."""
    bindings = toy.bindings()
    inner = bindings[task]
    failed: list[bool] = []

    def once(b: int, **kw: Any) -> Any:
        if b == batch and not failed:
            failed.append(True)
            raise OSError(f"transient failure of {task} on batch {b}")
        return inner(b, **kw)

    bindings[task] = once
    return bindings


# Thread maps without collective tickets: a failed collective poisons its comm group on purpose
# (later collectives must not be issued out of step with other ranks) until reset().
RESUMABLE = ["main", {"H2D": "io"}, "per_task without collectives"]


def resumable_plan(thread_map: Any) -> Any:
    if thread_map == "per_task without collectives":
        plan = toy_plan()
        local = {t: s.replace(globally_ordered=False) for t, s in plan.schedule.items()}
        return plan.replace(schedule=local).with_thread_map("per_task")
    return toy_plan().with_thread_map(thread_map)


@pytest.mark.parametrize("thread_map", RESUMABLE, ids=str)
@pytest.mark.parametrize("where", [("H2D", 0), ("H2D", 4), ("Dist", 3), ("Fwd", 0), ("Fwd", 5), ("Opt", 8)])
def test_calling_progress_again_after_a_failure_resumes_without_losing_or_repeating(
    thread_map: Any, where: tuple[str, int]
) -> None:
    reference = Toy(N)
    expected = Engine(toy_plan(), reference.bindings()).run_to_end()
    toy = Toy(N, jitter_s=0.001)
    engine = Engine(resumable_plan(thread_map), flaky(toy, *where), timeout_s=10)
    outs: list[Any] = []
    failures = 0
    while True:
        try:
            outs.append(engine.step())
        except StopIteration:
            break
        except OSError:
            failures += 1
    assert failures == 1
    assert outs == expected and toy.state == reference.state
    assert engine.ledger.drawn == engine.ledger.trained == N
    assert engine.untrained() == []
    engine.close()


def test_reset_after_a_failure_reports_the_batches_it_drops() -> None:
    toy = Toy(N)
    engine = Engine(toy_plan(), flaky(toy, "Fwd", 3))
    assert [engine.step() for _ in range(3)] == Engine(toy_plan(), Toy(3).bindings()).run_to_end()
    with pytest.raises(OSError):
        engine.step()
    # batches 3 and 4 were drawn (batch 5's H2D fires after Fwd, so it was not)
    assert engine.in_flight() == [3, 4]
    engine.reset()
    assert engine.ledger.dropped == [(3, "in flight when reset() was called"), (4, "in flight when reset() was called")]
    rest = engine.run_to_end()  # resumes on the same data iterator: batches 5..8 as a new epoch
    assert len(rest) == N - 5
    ledger = engine.ledger
    assert ledger.drawn == N and ledger.trained == 3 + len(rest)
    assert ledger.drawn == ledger.trained + len(ledger.dropped)


@pytest.mark.parametrize("thread_map", THREAD_MAPS, ids=str)
def test_stop_policy_reports_the_batches_left_in_flight(thread_map: Any) -> None:
    engine = Engine(toy_plan(on_exhausted="stop").with_thread_map(thread_map), Toy(N).bindings(), timeout_s=10)
    assert len(engine.run_to_end()) == N - 2
    reason = "left in flight: the plan stopped at the end of data"
    assert engine.untrained() == [(N - 2, reason), (N - 1, reason)]
    assert engine.ledger.drawn == N
    engine.close()


def test_after_a_failure_collectives_on_several_threads_stay_aborted_until_reset() -> None:
    toy = Toy(N)
    engine = Engine(toy_plan().with_thread_map({"Opt": "io"}), flaky(toy, "H2D", 4), timeout_s=10)
    for _ in range(2):
        engine.step()
    with pytest.raises(OSError):
        engine.step()
    # resuming would issue this rank's collectives out of step with the other ranks
    with pytest.raises(CollectiveAborted, match="transient failure of H2D on batch 4"):
        engine.step()
    engine.reset()
    rest = engine.run_to_end()  # a new epoch on what is left of the data
    ledger = engine.ledger
    assert ledger.trained == 2 + len(rest)
    assert ledger.drawn == ledger.trained + len(ledger.dropped) == N
    engine.close()


class Refillable:
    """An iterator object that a new epoch refills in place (like a DataLoader with persistent
    workers, whose ``iter()`` returns the same iterator object every epoch)."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def refill(self, items: list[int]) -> None:
        self.items = list(items)

    def __iter__(self) -> Refillable:
        return self

    def __next__(self) -> int:
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


def counting_plan_bindings(source: list[Any]) -> dict[str, Any]:
    return {
        "H2D": lambda b: next(source[0]),
        "Dist": lambda b, x: x,
        "Fwd": lambda b, y: y,
        "Opt": lambda b, out: None,
    }


# by_stream and per_task spread comm group "world" over threads: its tasks hold tickets. A
# ticketed task that already ran before the stop is skipped on resume, and must still pass its
# ticket on, or the next holder waits until the timeout.
@pytest.mark.parametrize("thread_map", ["main", {"H2D": "io"}, "by_stream", "per_task"], ids=str)
def test_new_data_after_a_stop_trains_what_was_left_in_flight(thread_map: Any) -> None:
    source: list[Any] = [iter(range(6))]
    engine = Engine(
        toy_plan(on_exhausted="stop").with_thread_map(thread_map), counting_plan_bindings(source), timeout_s=5
    )
    first = engine.run_to_end()
    assert first == [0, 1, 2, 3]  # batches 4 and 5 stayed in flight
    source[0] = iter(range(100, 103))
    engine.new_data()
    second = engine.run_to_end()
    assert second == [4, 5, 100]  # 101 and 102 in flight: the plan stopped again
    assert [s for s, _ in engine.untrained()] == [7, 8]
    engine.close()


def test_new_data_while_draining_continues_without_a_stop() -> None:
    source: list[Any] = [iter(range(4))]
    engine = Engine(toy_plan(), counting_plan_bindings(source))
    outs = [engine.step() for _ in range(3)]  # batch 4 was looked for: the drain has begun
    assert engine.batches.end.end_at() == 4
    source[0] = iter(range(10, 12))
    engine.new_data()
    outs += engine.run_to_end()
    assert outs == [0, 1, 2, 3, 10, 11]
    assert engine.ledger.drawn == engine.ledger.trained == 6


@pytest.mark.parametrize("thread_map", THREAD_MAPS, ids=str)
def test_same_iterator_object_refilled_for_a_new_epoch(thread_map: Any) -> None:
    # threads whose next iteration waits for a step() call learn that the epoch ended instead
    data = Refillable()
    source: list[Any] = [data]
    engine = Engine(toy_plan().with_thread_map(thread_map), counting_plan_bindings(source), timeout_s=5)
    for epoch in range(3):
        data.refill([10 * epoch + k for k in range(5)])
        if epoch:
            engine.new_data()
        assert engine.run_to_end() == [10 * epoch + k for k in range(5)]
    assert engine.ledger.drawn == engine.ledger.trained == 15
    engine.close()


FAULT_MAPS: list[Any] = ["main", "by_stream", "per_task", {"H2D": "io"}]
FAULTS = [(task, batch) for task in ("H2D", "Dist", "Fwd", "Opt") for batch in range(6)]


@pytest.mark.parametrize("thread_map", FAULT_MAPS, ids=str)
def test_fault_injection_matrix_every_task_every_phase(thread_map: Any) -> None:
    """6 batches: batch 0 and 1 fail during fill, 2-3 in steady state, 4-5 while draining.
    Each fault surfaces from step() within the timeout, names task/batch/thread/iteration,
    and leaves every walker at rest."""
    import time

    for task, batch in FAULTS:
        toy = Toy(6, jitter_s=0.0005)
        bindings = toy.bindings()
        inner = bindings[task]

        def broken(b: int, _inner: Any = inner, _task: str = task, _batch: int = batch, **kw: Any) -> Any:
            if b == _batch:
                raise KeyError(f"fault in {_task}({b})")
            return _inner(b, **kw)

        bindings[task] = broken
        plan = toy_plan().with_thread_map(thread_map)
        engine = Engine(plan, bindings, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(KeyError) as info:
            engine.run_to_end()
        assert time.monotonic() - start < 5
        err = info.value
        assert (err.swp_task, err.swp_batch, err.swp_thread) == (task, batch, plan.task(task).thread_group)  # type: ignore[attr-defined]
        assert err.swp_iteration == batch + plan.task(task).stage  # type: ignore[attr-defined]
        engine.wait_until_blocked()  # every worker waits for a later step(): nothing left running
        assert all(t.is_alive() for t in engine.worker_threads)
        engine.close()
        assert all(not t.is_alive() for t in engine.worker_threads)


def test_adopted_batches_continue_as_if_the_engine_had_loaded_them() -> None:
    """Batches loaded elsewhere (user code filling a pipeline's deques) are taken as in flight:
    batch j at stage max_stage - j, its lower stages done; the source draws only what follows."""
    source: list[Any] = [iter(range(100, 103))]
    engine = Engine(toy_plan(), counting_plan_bindings(source))
    # batch 0 at stage 2 (Fwd reads y), batch 1 at stage 1 (Dist reads x), batch 2 at stage 0 (drawn)
    engine.adopt([{"x": 0, "y": 7}, {"x": 1}, {"x": 2}])
    assert engine.in_flight() == [0, 1, 2]
    assert engine.run_to_end() == [7, 1, 2, 100, 101, 102]
    assert engine.ledger.drawn == engine.ledger.trained == 6


def test_adopting_fewer_batches_than_stages_drains_them() -> None:
    engine = Engine(toy_plan(), counting_plan_bindings([iter(range(100, 103))]))
    engine.adopt([{"x": 0, "y": 5}])
    assert engine.run_to_end() == [5]


def test_adopt_names_what_a_slot_lacks_and_refuses_while_batches_are_in_flight() -> None:
    engine = Engine(toy_plan(), counting_plan_bindings([iter(range(10))]))
    with pytest.raises(EngineError, match="batch 0 at stage 2 .* read y"):
        engine.adopt([{"x": 0}, {"x": 1}])
    engine.step()
    with pytest.raises(EngineError, match="in flight"):
        engine.adopt([{"x": 0, "y": 1}, {"x": 1}])
