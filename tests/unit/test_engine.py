"""The engine on real threads: ordering, collectives, failures, timeouts, fake streams."""

from __future__ import annotations

import gc
import random
import threading
import time
import traceback
import weakref
from typing import Any

import pytest

from tests.unit.engine_fixtures import THREAD_MAPS, S, Toy, drawing, run, toy_plan
from torchrec_swp.engine import (
    CollectiveAborted,
    Engine,
    EngineError,
    EngineTimeout,
    RecordingStreamPool,
    Turnstile,
)
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, PlanError


@pytest.mark.parametrize("thread_map", THREAD_MAPS, ids=str)
@pytest.mark.parametrize("on_exhausted", ["drain", "stop"])
def test_any_thread_map_gives_the_single_thread_results(thread_map: Any, on_exhausted: str) -> None:
    reference = Toy(12)
    ref_engine = Engine(toy_plan(on_exhausted=on_exhausted), reference.bindings())
    expected = ref_engine.run_to_end()
    assert len(expected) == (12 if on_exhausted == "drain" else 10)
    for seed in range(3):
        toy = Toy(12, jitter_s=0.002, seed=seed)
        engine = Engine(toy_plan(on_exhausted=on_exhausted).with_thread_map(thread_map), toy.bindings())
        assert engine.run_to_end() == expected
        assert toy.state == reference.state
        # collectives were issued in the single-thread fire order
        assert toy.collectives == reference.collectives
        with pytest.raises(StopIteration):
            engine.step()  # stays exhausted
        engine.close()


def test_single_thread_plan_starts_no_threads_and_no_locks() -> None:
    toy = Toy(5)
    engine = Engine(toy_plan(), toy.bindings())
    before = threading.active_count()
    assert len(engine.run_to_end()) == 5
    assert threading.active_count() == before
    assert engine.worker_threads == [] and dict(engine.turnstiles) == {}
    assert all(engine.compiled.program(p, 5).flat for p in range(7))


def test_empty_data_raises_stop_iteration_at_once() -> None:
    for thread_map in THREAD_MAPS:
        engine = Engine(toy_plan().with_thread_map(thread_map), Toy(0).bindings())
        with pytest.raises(StopIteration):
            engine.step()
        assert engine.book.returned == 0 and engine.batches.end.end_at() == 0
        engine.close()


def test_turnstile_orders_collectives_under_contention() -> None:
    gate = Turnstile("world")
    order: list[int] = []
    rng = random.Random(7)
    delays = [rng.random() * 0.003 for _ in range(40)]

    def worker(tickets: list[int]) -> None:
        for t in tickets:
            time.sleep(delays[t])
            gate.acquire(t, timeout_s=10)
            order.append(t)
            gate.release(t)

    threads = [threading.Thread(target=worker, args=(list(range(k, 40, 4)),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == list(range(40))


def test_turnstile_failure_aborts_later_tickets_instead_of_hanging() -> None:
    gate = Turnstile("world")
    errors: list[BaseException] = []

    def later() -> None:
        try:
            gate.acquire(2, timeout_s=10)
        except CollectiveAborted as e:
            errors.append(e)

    t = threading.Thread(target=later)
    t.start()
    gate.acquire(0, timeout_s=1)
    gate.fail("ticket 0 raised")
    t.join(5)
    assert not t.is_alive()
    assert len(errors) == 1 and "ticket 0 raised" in str(errors[0])
    with pytest.raises(CollectiveAborted):
        gate.acquire(1, timeout_s=1)


def test_turnstile_times_out() -> None:
    gate = Turnstile("world")
    with pytest.raises(EngineTimeout, match="collective ticket 1"):
        gate.acquire(1, timeout_s=0.05)


@pytest.mark.parametrize("thread_map", THREAD_MAPS, ids=str)
@pytest.mark.parametrize("failing", [("H2D", 0), ("Dist", 2), ("Fwd", 3), ("Opt", 5), ("H2D", 7)])
def test_a_failing_task_surfaces_with_where_it_failed(thread_map: Any, failing: tuple[str, int]) -> None:
    task, batch = failing
    toy = Toy(8, jitter_s=0.001)
    bindings = toy.bindings()
    inner = bindings[task]

    def broken(b: int, **kw: Any) -> Any:
        if b == batch:
            raise ValueError(f"boom in {task}")
        return inner(b, **kw)

    bindings[task] = broken
    plan = toy_plan().with_thread_map(thread_map)
    engine = Engine(plan, bindings, timeout_s=10)
    with pytest.raises(ValueError, match=f"boom in {task}") as info:
        engine.run_to_end()
    err = info.value
    assert (err.swp_task, err.swp_batch) == (task, batch)  # type: ignore[attr-defined]
    assert err.swp_thread == plan.task(task).thread_group  # type: ignore[attr-defined]
    assert err.swp_iteration == batch + plan.task(task).stage  # type: ignore[attr-defined]
    assert f"task {task} (batch {batch}" in "\n".join(err.__notes__)
    # every walker is at rest again: its worker alive, waiting on its inbox
    engine.wait_until_blocked()  # every worker waits for a later step(): nothing left running
    assert all(t.is_alive() for t in engine.worker_threads)
    engine.close()
    assert not any(t.is_alive() for t in engine.worker_threads)


def test_failure_aborts_later_collectives_on_other_threads() -> None:
    toy = Toy(6)
    bindings = toy.bindings()
    inner = bindings["Dist"]

    def broken_dist(b: int, x: int) -> int:
        if b == 2:
            raise RuntimeError("all-to-all failed")
        return inner(b, x)

    bindings["Dist"] = broken_dist
    engine = Engine(toy_plan().with_thread_map({"Dist": "dd"}), bindings, timeout_s=10)
    with pytest.raises(RuntimeError, match="all-to-all failed"):
        engine.run_to_end()
    # iteration 3 fires Fwd(1) #0, Dist(2) #1, H2D(3), Opt(1) #2: Fwd(1) ran, Dist(2) failed,
    # and the collective after it, Opt(1), was aborted rather than issued
    assert ("Fwd", 1) in toy.finished and ("Opt", 1) not in toy.finished
    assert ("Opt", 1) not in toy.collectives
    assert engine.turnstiles["world"].failed is not None
    engine.reset()
    assert engine.turnstiles["world"].failed is None
    engine.close()


def test_a_deadlock_times_out_with_a_diagnostic() -> None:
    """A timeout is a deadlock: every thread waits and nothing changes for timeout_s. Here H2D
    of batch 3 waits on the board for what never comes, and the calling thread waits for H2D."""
    never = threading.Event()
    toy = Toy(6)
    bindings = toy.bindings()
    inner = bindings["H2D"]

    def stuck(b: int) -> int:
        if b == 3:  # (interrupted when the engine gives up; its own timeout is far away)
            engine.board.wait(never.is_set, lambda: "something never set", 60)
        return inner(b)

    bindings["H2D"] = stuck
    plan = PipelinePlan(
        schedule={"H2D": S(0, "memcpy", thread_group="io"), "Dist": S(0), "Fwd": S(1), "Opt": S(1)},
        tasks=toy_plan().tasks.values(),
        intra_iter_deps=[("Opt", "Fwd")],
        source="H2D",
        output="out",
        name="waits",
    )
    engine = Engine(plan, bindings, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(EngineTimeout) as info:
        engine.run_to_end()
    assert time.monotonic() - start < 5  # about the timeout, not H2D's own 60 s
    # the report says what each thread was doing, with the schedule
    message = str(info.value)
    assert "internal iteration 3 of plan waits did not finish: no thread made progress for 0.3s" in message
    assert "thread 'io': parked (interrupted) at run! H2D" in message
    assert "thread 'default': failed in wait H2D" in message
    assert "io       memcpy        | i0    i1    i2    i3" in message
    assert "no thread made progress for 0.3s while waiting for task H2D (batch 3)" in str(info.value.__cause__)
    engine.close()


SLOW_PLANS = {
    "main": toy_plan(),
    "H2D on a thread": toy_plan().with_thread_map({"H2D": "io"}),
    "2 loads": toy_plan().with_loads(2),
}


@pytest.mark.parametrize("plan", SLOW_PLANS.values(), ids=SLOW_PLANS.keys())
def test_a_slow_task_is_no_timeout_on_any_thread_map(plan: PipelinePlan) -> None:
    """One H2D call blocks three times engine_timeout_s: it runs (progress), so no thread map
    turns it into an EngineTimeout, as the plan on the calling thread alone never did."""
    timeout = 0.2
    bindings = drawing(Toy(6))
    inner = bindings["H2D"]
    blocked: list[float] = []

    def slow(b: int, data: Any) -> int:
        if b == 2:
            release = threading.Event()
            threading.Timer(3 * timeout, release.set).start()  # the slow loader's batch lands after 3 timeouts
            start = time.monotonic()
            assert release.wait(60)
            blocked.append(time.monotonic() - start)
        return inner(b, data)

    bindings["H2D"] = slow
    engine = Engine(plan, bindings, timeout_s=timeout)
    try:
        assert run(engine, n=6) == run(Engine(toy_plan(), drawing(Toy(6))), n=6)
    finally:
        engine.close()
    assert len(blocked) == 1 and blocked[0] > timeout  # it did block longer than the timeout


@pytest.mark.parametrize("plan", list(SLOW_PLANS.values())[1:], ids=list(SLOW_PLANS)[1:])
def test_the_caller_away_between_calls_is_no_timeout(plan: PipelinePlan) -> None:
    """Between two step() calls the workers wait for the caller (credit, its next request): the
    caller's thread runs its own code meanwhile, which is progress, however long it takes."""
    timeout = 0.2
    engine = Engine(plan, drawing(Toy(6)), timeout_s=timeout)
    try:
        first = run(engine, 1, n=6)
        time.sleep(3 * timeout)  # the caller's own work (evaluation, a checkpoint) between two calls
        assert first + run(engine) == run(Engine(toy_plan(), drawing(Toy(6))), n=6)
    finally:
        engine.close()


def test_unbound_or_extra_tasks_are_rejected() -> None:
    bindings = Toy(1).bindings()
    with pytest.raises(PlanError, match="no function bound to task Opt"):
        Engine(toy_plan(), {k: v for k, v in bindings.items() if k != "Opt"})
    with pytest.raises(PlanError, match="'Log', which is not a task"):
        Engine(toy_plan(), {**bindings, "Log": print})
    with pytest.raises(PlanError, match="has no source"):
        Engine(toy_plan(source=None), bindings)


def test_wrong_number_of_returned_values_is_an_error() -> None:
    plan = toy_plan(tasks=[*toy_plan().tasks.values()][:3] + [PipelineTask("Opt", reads=("out",), writes=("a", "b"))])
    bindings = Toy(3).bindings()
    bindings["Opt"] = lambda b, out: 1
    with pytest.raises(Exception, match="must return a tuple of 2 values"):
        Engine(plan, bindings).run_to_end()


def test_fake_streams_record_and_wait_in_dependency_order() -> None:
    pool = RecordingStreamPool()
    toy = Toy(4)
    engine = Engine(toy_plan(), toy.bindings(), streams=pool)
    assert len(engine.run_to_end()) == 4
    log = pool.log
    # H2D(b) runs on memcpy and is recorded; Dist(b) on data_dist waits that very event
    records = {e[2]: i for i, e in enumerate(log) if e[0] == "record"}
    waits = [(i, e) for i, e in enumerate(log) if e[0] == "wait"]
    assert waits, "no cross-stream waits were issued"
    for i, (_, stream, event) in waits:
        assert event in records and records[event] < i, f"{stream} waited {event} before it was recorded"
    assert ("enter", "memcpy") in log and ("enter", "data_dist") in log
    # Dist(b) waits H2D(b): the n-th wait on data_dist is on the n-th event recorded on memcpy
    memcpy_events = [e[2] for e in log if e[0] == "record" and e[1] == "memcpy"]
    dist_waits = [e[2] for e in log if e[0] == "wait" and e[1] == "data_dist"]
    assert dist_waits == memcpy_events


def test_one_stage_plan_delivers_every_batch_and_stops() -> None:
    # the exit stage is the source's stage: the iteration that finds no batch delivers nothing
    plan = PipelinePlan(
        schedule={"Load": S(0), "Step": S(0, thread_group="worker")},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Step", reads=("x",), writes=("y",))],
        source="Load",
        output="y",
    )
    for p in (plan, plan.with_thread_map("main")):
        data = iter(range(4))
        # the engine runs and is closed within this iteration: no late binding (B023)
        engine = Engine(p, {"Load": lambda b: next(data), "Step": lambda b, x: x * 2})  # noqa: B023
        assert engine.run_to_end() == [0, 2, 4, 6]
        engine.close()


class Recorder:
    def __init__(self) -> None:
        self.runs: list[tuple[str, int, str, int]] = []
        self.waits: list[tuple[str, str, int]] = []
        self.iterations: list[int] = []

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        assert end >= start
        self.runs.append((task, batch, thread, iteration))

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        self.waits.append((producer, thread, iteration))

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        self.iterations.append(iteration)


def test_instrumentation_reports_runs_waits_and_iterations_and_detaches() -> None:
    plan = PipelinePlan(
        schedule={"Load": S(0, "memcpy", thread_group="io"), "Prep": S(0), "Fwd": S(1)},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Prep", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",), writes=("out",)),
        ],
        source="Load",
        output="out",
    )
    data = iter(range(3))
    engine = Engine(plan, {"Load": lambda b: next(data), "Prep": lambda b, x: x, "Fwd": lambda b, y: y})
    recorder = Recorder()
    engine.instrument(recorder, labels=True)
    assert engine.run_to_end() == [0, 1, 2]
    assert recorder.iterations == [0, 1, 2, 3]
    assert ("Load", 0, "io", 0) in recorder.runs and ("Fwd", 2, "default", 3) in recorder.runs
    assert ("Load", "default", 1) in recorder.waits  # Prep waited for Load on the calling thread
    # detached: later runs report nothing
    engine.instrument()
    before = (list(recorder.runs), list(recorder.waits), list(recorder.iterations))
    data = iter(range(3))
    engine.new_data()
    assert engine.run_to_end() == [0, 1, 2]
    assert (recorder.runs, recorder.waits, recorder.iterations) == before
    engine.close()


@pytest.mark.parametrize("thread_map", ["main", "per_task"])
@pytest.mark.parametrize("instrumented", [False, True], ids=["bare", "observed"])
def test_a_failing_tasks_traceback_ends_in_its_own_function(thread_map: str, instrumented: bool) -> None:
    """Between the walk and the task's function: the instruction's op and the task's call,
    named after the task; no wrapper (stream, profiler label, timing) has a frame of its own."""
    toy = Toy(4)
    bindings = toy.bindings()
    dist = bindings["Dist"]

    def broken_dist(b: int, **kw: Any) -> Any:
        if b == 1:
            raise ValueError("boom")
        return dist(b, **kw)

    bindings["Dist"] = broken_dist
    engine = Engine(toy_plan().with_thread_map(thread_map), bindings, streams=RecordingStreamPool(), timeout_s=10)
    if instrumented:
        engine.instrument(Recorder(), labels=True)
    with pytest.raises(ValueError, match="boom") as info:
        engine.run_to_end()
    names = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    walk = len(names) - 1 - names[::-1].index("_walk")
    # on one thread a plain call; spread over threads Dist holds a collective ticket
    between = ["run"] if thread_map == "main" else ["run", "ticketed"]
    assert names[walk + 1 :] == [*between, "<task Dist>", "broken_dist"], names
    assert info.value.swp_task == "Dist"  # type: ignore[attr-defined]
    engine.close()


def test_noop_tasks_become_aliases_on_their_device() -> None:
    calls: dict[str, int] = {"Copy": 0, "Fwd": 0}
    plan = PipelinePlan(
        schedule={"Load": S(0), "Copy": S(0, "memcpy"), "Fwd": S(1)},
        tasks=[
            PipelineTask("Load", writes=("host",)),
            PipelineTask("Copy", reads=("host",), writes=("batch",), noop_on=("cpu",)),
            PipelineTask("Fwd", reads=("batch",), writes=("out",)),
        ],
        source="Load",
        output="out",
    )
    data = iter(range(5))

    def count(name: str, value: Any) -> Any:
        calls[name] += 1
        return value

    bindings = {
        "Load": lambda b: next(data),
        "Copy": lambda b, host: count("Copy", host),
        "Fwd": lambda b, batch: count("Fwd", batch * 3),
    }
    cpu = Engine(plan, bindings, device_type="cpu")
    assert "alias Copy batch=host" in [str(i) for i in cpu.compiled.program(1, None).instructions("default")]
    assert cpu.run_to_end() == [0, 3, 6, 9, 12]
    assert calls == {"Copy": 0, "Fwd": 5}  # Copy never called
    # on another device the copy is real
    data = iter(range(5))
    assert Engine(plan.with_thread_map({"Copy": "io"}), bindings, device_type="cuda").run_to_end() == [0, 3, 6, 9, 12]
    assert calls["Copy"] == 5


GUARDED = PipelinePlan(
    schedule={
        "Load": S(0, "memcpy"),
        "Pair": S(1),
        "Init": S(1, when="first"),
        "Start": S(1, when="not_first"),
        "Fwd": S(2),
        "Sync": S(2, when="has_next"),
        "Finish": S(2, when="last"),
        "Warm": S(1, when="fill"),
    },
    tasks=[
        PipelineTask("Load", writes=("x",)),
        PipelineTask("Pair", reads=("x", "x@1"), writes=("out",)),
        PipelineTask("Fwd", reads=("out",)),
    ],
    source="Load",
    output="out",
    name="guarded",
)


@pytest.mark.parametrize("thread_map", ["main", {"Load": "io"}, "per_task"], ids=str)
def test_guards_and_previous_batch_reads(thread_map: Any) -> None:
    log: list[tuple[str, int]] = []
    data = iter(range(10, 14))
    bindings = {
        "Load": lambda b: next(data),
        "Pair": lambda b, x, prev_x: (x, prev_x),
        "Fwd": lambda b, out: None,
        **{t: (lambda b, t=t: log.append((t, b))) for t in ("Init", "Start", "Sync", "Finish", "Warm")},
    }
    engine = Engine(GUARDED.with_thread_map(thread_map), bindings, timeout_s=10)
    # batch b's Pair gets batch b-1's x, None for the first batch of the epoch
    assert engine.run_to_end() == [(10, None), (11, 10), (12, 11), (13, 12)]
    assert sorted(log) == sorted(
        [("Init", 0), ("Start", 1), ("Start", 2), ("Start", 3),  # first / not_first
         ("Sync", 0), ("Sync", 1), ("Sync", 2), ("Finish", 3),  # has_next / last
         ("Warm", 0)]  # fill: iteration 1 only (iterations before batch 0 reaches stage 2)
    )
    engine.close()


@pytest.mark.parametrize("thread_map", ["main", {"Load": "io"}, "per_task"], ids=str)
@pytest.mark.parametrize("lookahead", [0, 2])
def test_train_guard_follows_the_mode_of_the_step_that_trains_each_batch(thread_map: Any, lookahead: int) -> None:
    # TrainEvalHybridPipelineBase's guard: Step runs for a batch only if the step() call that
    # trains it finds training on, whatever thread runs Step and however far the threads ran ahead
    plan = PipelinePlan(
        schedule={"Load": S(0, "memcpy"), "Fwd": S(2), "Step": S(2, when="train")},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Fwd", reads=("x",), writes=("out",))],
        source="Load",
        output="out",
        name="hybrid",
        lookahead=lookahead,
    )
    data = iter(range(8))
    stepped: list[int] = []
    mode = {"training": True}
    bindings = {"Load": lambda b: next(data), "Fwd": lambda b, x: x, "Step": lambda b: stepped.append(b)}
    engine = Engine(plan.with_thread_map(thread_map), bindings, timeout_s=10, training=lambda: mode["training"])
    training = [True, True, False, False, False, True, False, True]
    outputs = []
    for on in training:
        mode["training"] = on
        outputs.append(engine.step())
    assert outputs == list(range(8))
    assert stepped == [b for b, on in enumerate(training) if on]
    engine.close()


def test_train_guard_only_at_the_highest_stage() -> None:
    with pytest.raises(PlanError, match="Step runs when=train at stage 1"):
        PipelinePlan(
            schedule={"Load": S(0), "Step": S(1, when="train"), "Fwd": S(2)},
            tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Fwd", reads=("x",), writes=("out",))],
            source="Load",
            output="out",
            name="bad",
        )


def _tagging(phases: list[tuple[int, str]], data: list[Any], **options: Any) -> tuple[Engine, list[str]]:
    """An engine over two-stage plans ``a`` and ``b`` taking turns at ``phases`` (start, name);
    each batch appends its plan's name to the list returned. ``options``: the PhasedPlan's."""
    a = PipelinePlan(
        schedule={"Load": S(0), "Fwd": S(1), "Tag": S(1)},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Fwd", reads=("x",), writes=("out",))],
        source="Load", output="out", name="a",
    )
    b = a.replace(schedule={"Load": S(0), "Fwd": S(1), "Other": S(1)}, name="b")
    seen: list[str] = []
    phased = PhasedPlan([(start, {"a": a, "b": b}[name]) for start, name in phases], **options)
    assert PhasedPlan.from_text(phased.to_text()) == phased
    engine = Engine(
        phased,
        {
            "Load": lambda n: next(data[0]),
            "Fwd": lambda n, x: x,
            "Tag": lambda n: seen.append("a"),
            "Other": lambda n: seen.append("b"),
        },
    )
    return engine, seen


def test_phases_take_turns_at_batch_numbers_across_epochs() -> None:
    data: list[Any] = [iter(range(3))]
    engine, seen = _tagging([(0, "a"), (2, "b")], data)
    assert engine.run_to_end() == [0, 1, 2] and seen == ["a", "a", "b"]
    # batch numbers count source calls across epochs (3 batches + the call that found none):
    # the next epoch is all in phase b
    data[0] = iter(range(2))
    engine.new_data()
    assert engine.run_to_end() == [0, 1] and seen[3:] == ["b", "b"]
    engine.reset()  # reset() starts the batch numbers again
    data[0] = iter(range(1))
    assert engine.run_to_end() == [0] and seen[5:] == ["a"]


def test_phases_on_the_drawn_clock_count_batches_drawn_over_the_engine_life() -> None:
    # TrainPipelinePT2's compile step: its _iter counts forwards across epochs and reset(); the
    # "drawn" clock counts batches drawn, not the calls that found none, and reset() keeps it
    data: list[Any] = [iter(range(2))]
    engine, seen = _tagging([(0, "a"), (3, "b"), (4, "a")], data, clock="drawn")
    assert "clock drawn" in engine.phased.to_text()
    assert engine.phased != PhasedPlan(engine.phased.phases)  # the index clock
    assert engine.run_to_end() == [0, 1] and seen == ["a", "a"]
    data[0] = iter(range(2))
    engine.new_data()
    # drawn 2 and 3 (the index clock would have numbered them 3 and 4)
    assert engine.run_to_end() == [0, 1] and seen[2:] == ["a", "b"]
    engine.reset()  # the drawn clock goes on
    data[0] = iter(range(1))
    assert engine.run_to_end() == [0] and seen[4:] == ["a"]


def test_phases_on_the_trained_clock_repeat_in_a_cycle_and_count_trained_batches() -> None:
    # GradientAccumulationWrapper's counter: calls that trained a batch, across epochs (the calls
    # that found none left out), from 0 again after reset(); the cycle repeats phases 1-2 of 3
    data: list[Any] = [iter(range(4))]
    engine, seen = _tagging([(0, "a"), (1, "b"), (2, "a")], data, clock="trained", cycle=(1, 2))
    assert "clock trained\ncycle 1 2\n" in engine.phased.to_text()
    assert engine.run_to_end() == [0, 1, 2, 3] and seen == ["a", "b", "a", "b"]
    assert engine.trained_since_reset == 4
    data[0] = iter(range(3))
    engine.new_data()
    # trained 4, 5, 6 (the index clock would have numbered them 5, 6, 7)
    assert engine.run_to_end() == [0, 1, 2] and seen[4:] == ["a", "b", "a"]
    engine.reset()
    data[0] = iter(range(2))
    engine.count_trained_from(1)  # upstream's set_step
    assert engine.run_to_end() == [0, 1] and seen[7:] == ["b", "a"]
    data[0] = iter(range(2))
    engine.new_data()
    engine.step()
    with pytest.raises(EngineError, match="only before the first step"):
        engine.count_trained_from(0)
    engine.close()


@pytest.mark.parametrize("clock", ["index", "drawn"])
def test_phases_of_a_one_stage_plan_switch_where_the_source_draws(clock: str) -> None:
    # the batch a one-stage plan trains is drawn in the same iteration: choosing its phase must
    # not wait for the draw (it did, until the engine timed out)
    load, fwd = PipelineTask("Load", writes=("x",)), PipelineTask("Fwd", reads=("x",), writes=("out",))
    a = PipelinePlan(
        schedule={"Load": S(0), "Fwd": S(0), "Tag": S(0)},
        tasks=[load, fwd, PipelineTask("Tag", reads=("x",))],
        source="Load", output="out", name="a",
    )
    b = a.replace(
        schedule={"Load": S(0), "Fwd": S(0), "Other": S(0)},
        tasks=[load, fwd, PipelineTask("Other", reads=("x",))],
        name="b",
    )
    seen: list[str] = []
    data = iter(range(4))
    engine = Engine(
        PhasedPlan([(0, a), (2, b), (3, a)], clock=clock),
        {"Load": lambda n: next(data), "Fwd": lambda n, x: x, "Tag": lambda n, x: seen.append("a"),
         "Other": lambda n, x: seen.append("b")},
        timeout_s=10,
    )
    assert engine.run_to_end() == [0, 1, 2, 3] and seen == ["a", "a", "b", "a"]


def test_one_thread_plans_enter_each_task_stream_on_a_device_with_streams() -> None:
    # no cross-stream dependency, so the program is a flat list: each task must still be
    # submitted inside its own stream
    plan = PipelinePlan(
        schedule={"Load": S(0), "Post": S(1, "postproc")},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Post", writes=("out",))],
        source="Load",
        output="out",
    )
    streams = RecordingStreamPool()
    data = iter(range(3))
    engine = Engine(plan, {"Load": lambda b: next(data), "Post": lambda b: b * 2}, streams=streams)
    assert engine.compiled.program(1, None).flat
    assert engine.run_to_end() == [0, 2, 4]
    assert streams.log == [("enter", "postproc")] * 3  # Post, once per batch; Load stays on the default stream


class _Value:
    """A value a task writes, to watch when the engine lets it go."""

    def __init__(self, name: str, b: int) -> None:
        self.name, self.b = name, b


@pytest.mark.parametrize("thread_map", ["main", {"Load": "io"}, "per_task"], ids=str)
def test_a_batch_that_leaves_keeps_only_what_a_later_batch_reads(thread_map: Any) -> None:
    """Where a task reads a value of the batch before (``x@1``), the batch that leaves keeps that
    value until the next one leaves, and nothing else: its other values (here ``big``, as a
    PEC batch's losses, batch and gradients) go when it leaves, as upstream drops them."""
    plan = PipelinePlan(
        schedule={"Load": S(0), "Pair": S(1), "Top": S(2)},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Pair", reads=("x", "x@1"), writes=("pair",)),
            PipelineTask("Top", reads=("pair",), writes=("big", "out")),
        ],
        source="Load",
        output="out",
        name="previous",
    ).with_thread_map(thread_map)
    made: dict[tuple[str, int], weakref.ref] = {}

    def value(name: str, b: int) -> _Value:
        v = _Value(name, b)
        made[(name, b)] = weakref.ref(v)
        return v

    data = iter(range(8))
    bindings = {
        "Load": lambda b, data: (next(data), value("x", b))[1],
        "Pair": lambda b, x, prev_x: value("pair", b),
        "Top": lambda b, pair: (value("big", b), b),
    }
    engine = Engine(plan, bindings, timeout_s=10)
    try:
        for d in range(5):
            assert engine.step(data) == d
            gc.collect()
            assert made[("big", d)]() is None and made[("pair", d)]() is None, d
            assert made[("x", d)]() is not None, d  # batch d + 1's Pair read it (kept: a later read)
            assert d == 0 or made[("x", d - 1)]() is None, d
    finally:
        engine.close()


def test_an_edited_program_runs_as_written_in_steady_calls_too() -> None:
    """Outside checked mode (no stream checker), in the calls after the pipeline filled: an edit
    of the program (``edit_program``) reaches every op the engine runs."""
    from tests.unit.engine_fixtures import toy_plan

    optimized: list[int] = []
    data = iter(range(8))
    bindings = {
        "H2D": lambda b: next(data),
        "Dist": lambda b, x: x,
        "Fwd": lambda b, y: y,
        "Opt": lambda b, out: optimized.append(b),
    }
    engine = Engine(toy_plan(), bindings, timeout_s=10)
    try:
        assert engine._checker is None
        (text,) = engine.program_texts()
        engine.edit_program(0, "\n".join(line for line in text.splitlines() if line.strip() != "run Opt"))
        outputs = [engine.step(None) for _ in range(6)]
        assert outputs == list(range(6)) and optimized == []  # Opt is no longer in the program
    finally:
        engine.stop_threads()
