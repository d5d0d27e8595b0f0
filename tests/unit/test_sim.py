"""The simulator: hand-computed timings, tickets, deadlocks, races, and every compiled program
of a few plans replayed without deadlock or race."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import subprocess
import sys
from collections.abc import Callable

import pytest

from torchrec_swp.catalog.torchrec import sparse_dist_plan, train_pipeline_base_plan
from torchrec_swp.compile import CompiledPlan, IterationProgram, Run, Signal, WaitStream, WaitTask
from torchrec_swp.plan import Dep, PipelinePlan, PipelineTask, PlanError, TaskSchedule
from torchrec_swp.sim import (
    SimDeadlock,
    SimError,
    SimRace,
    check_happens_before,
    find_races,
    format_timeline,
    simulate,
    simulate_programs,
    to_chrome_trace,
)

S = TaskSchedule


def two_stage(**changes: object) -> PipelinePlan:
    """H2D (stage 0, the source) feeds Compute (stage 1) of the same batch one iteration later."""
    args: dict[str, object] = dict(
        schedule={"Compute": S(1), "H2D": S(0, "memcpy")},
        tasks=[PipelineTask("H2D", writes=("batch",)), PipelineTask("Compute", reads=("batch",))],
        source="H2D",
        name="two_stage",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def sparse_like(**changes: object) -> PipelinePlan:
    """A 3-stage SparseDist-like plan: H2D(b+2) || input dist(b+1) || forward/backward(b)."""
    args: dict[str, object] = dict(
        schedule={
            "ZeroGrad": S(2),
            "WaitBatch": S(2),
            "DistStart": S(1, "data_dist", comm_group="world"),
            "H2D": S(0, "memcpy"),
            "Forward": S(2, comm_group="world"),
            "DistWait": S(1, "data_dist", comm_group="world"),
            "Backward": S(2, comm_group="world"),
            "Opt": S(2),
        },
        tasks=[
            PipelineTask("H2D", writes=("batch",)),
            PipelineTask("DistStart", reads=("batch",), writes=("splits",)),
            PipelineTask("DistWait", reads=("splits",), writes=("features",)),
            PipelineTask("WaitBatch", reads=("batch", "features")),
            PipelineTask("Forward", reads=("batch", "features"), writes=("loss",)),
            PipelineTask("Backward", reads=("loss",)),
        ],
        intra_iter_deps=[("WaitBatch", "ZeroGrad"), ("Forward", "WaitBatch"), ("Opt", "Backward")],
        inter_iter_deps=[("Forward", "Opt")],
        source="H2D",
        name="sparse_like",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def load_prep() -> PipelinePlan:
    """Load (stage 0) feeds Prep in the same iteration: on two threads that needs wait/signal.
    Fwd(b) also needs Fwd(b-2) (semi-sync style distance 2)."""
    return PipelinePlan(
        schedule={"Load": S(0, "memcpy"), "Prep": S(0), "Fwd": S(1)},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Prep", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",)),
        ],
        inter_iter_deps=[("Fwd", "Fwd", 2)],
        source="Load",
        name="load_prep",
    )


THREAD_MAPS: list[object] = ["main", "by_stream", "per_task", {"H2D": "io"}]
PLANS: dict[str, Callable[[], PipelinePlan]] = {
    "sparse_like": sparse_like,
    "sparse_like_stop": lambda: sparse_like(on_exhausted="stop"),
    "load_prep": load_prep,
    "TrainPipelineSparseDist": sparse_dist_plan,
    "TrainPipelineSparseDist_options": lambda: sparse_dist_plan(
        enqueue_batch_after_forward=True, execute_all_batches=False, clear_data_dist_inputs=True
    ),
    "TrainPipelineBase": train_pipeline_base_plan,
}


def mapped(plan: PipelinePlan, thread_map: object) -> PipelinePlan:
    """``plan`` with ``thread_map`` applied; a dict map ignores tasks the plan does not have."""
    if isinstance(thread_map, dict):
        thread_map = {t: g for t, g in thread_map.items() if t in plan.schedule}
    return plan.with_thread_map(thread_map)  # type: ignore[arg-type]


# ------------------------------------------------------------ hand-computed timings
def test_one_thread_iteration_is_the_sum_of_its_tasks() -> None:
    # One thread: P0 runs H2D(0) = 2 (fill); P1..P3 run Compute(b) + H2D(b+1) = 5 + 2 = 7;
    # P4 runs Compute(3) = 5 (drain). Makespan 2 + 3 * 7 + 5 = 28, steady iteration 7.
    r = simulate(two_stage(), {"H2D": 2, "Compute": 5}, 4)
    assert r.makespan == 28
    assert r.steady_iterations == (1, 2, 3)
    assert r.steady_iteration_time == 7
    assert [(s.iteration, s.start, s.end) for s in r.iterations] == [
        (0, 0, 2),
        (1, 2, 9),
        (2, 9, 16),
        (3, 16, 23),
        (4, 23, 28),
    ]
    assert r.busy == {"cpu:default": 28}


def test_h2d_on_its_own_thread_hides_behind_compute() -> None:
    # H2D(b+1) on thread io overlaps Compute(b) on the main thread; the barrier ends each
    # iteration when the slower one does: P0 = 2, P1..P3 = max(2, 5) = 5, P4 = 5.
    # Makespan 2 + 3 * 5 + 5 = 22, steady iteration 5; io is busy 4 * 2 = 8.
    r = simulate(two_stage().with_thread_map({"H2D": "io"}), {"H2D": 2, "Compute": 5}, 4)
    assert r.makespan == 22
    assert r.steady_iteration_time == 5
    assert r.busy == {"cpu:default": 20, "cpu:io": 8}
    check_happens_before(r, two_stage())


def test_per_batch_durations() -> None:
    # Compute(b) takes 5 + b: P0 = 2, P1 = 2 + 5 = 7, P2 = 2 + 6 = 8, P3 = Compute(2) = 7.
    # Steady iterations P1, P2 end at 9 and 17: the slope over the steady run is 8.
    r = simulate(two_stage(), lambda task, b: 2 if task == "H2D" else 5 + b, 3)
    assert r.makespan == 24
    assert r.steady_iteration_time == 8
    assert [(i.task, i.batch, i.duration) for i in r.timeline if i.task == "Compute"] == [
        ("Compute", 0, 5),
        ("Compute", 1, 6),
        ("Compute", 2, 7),
    ]


def test_too_few_batches_have_no_steady_iteration() -> None:
    r = simulate(sparse_like(), dict.fromkeys(sparse_like().schedule, 1.0), 2)
    assert r.steady_iterations == () and r.steady_iteration_time is None


def test_device_work_is_fifo_per_stream_and_waits_for_recorded_events() -> None:
    # One thread, CPU 1 per task; device H2D = 4 on memcpy, Compute = 3 on default.
    # CPU: P0 H2D(0) 0-1 | P1 Compute(0) 1-2, H2D(1) 2-3 | P2 Compute(1) 3-4, H2D(2) 4-5 | P3 Compute(2) 5-6.
    # memcpy: H2D(0) 1-5, H2D(1) 5-9, H2D(2) 9-13 (FIFO: each waits for the one before).
    # default: Compute(b) waits for the event after H2D(b): 5-8, 9-12, 13-16.
    # Iterations end at 5, 9, 13, 16: the copy engine is the bottleneck, period 4.
    plan = two_stage()
    r = simulate(plan, {"H2D": 1, "Compute": 1}, 3, device_durations={"H2D": 4, "Compute": 3})
    device = [(i.lane, i.task, i.batch, i.start, i.end) for i in r.timeline if i.lane.startswith("stream:")]
    assert device == [
        ("stream:memcpy", "H2D", 0, 1, 5),
        ("stream:default", "Compute", 0, 5, 8),  # the timeline is sorted by start, then lane
        ("stream:memcpy", "H2D", 1, 5, 9),
        ("stream:default", "Compute", 1, 9, 12),
        ("stream:memcpy", "H2D", 2, 9, 13),
        ("stream:default", "Compute", 2, 13, 16),
    ]
    assert [s.end for s in r.iterations] == [5, 9, 13, 16]
    assert r.makespan == 16 and r.steady_iteration_time == 4
    check_happens_before(r, plan)


def test_device_race_without_stream_syncs() -> None:
    # Compiled without device syncs, Compute(0) is submitted at 2 and starts on the default
    # stream at once, while H2D(0) copies until 5.
    plan = two_stage()
    r = simulate(CompiledPlan(plan), {"H2D": 1, "Compute": 1}, 3, device_durations={"H2D": 4, "Compute": 3})
    races = find_races(r, plan)
    assert {(x.kind, x.consumer, x.batch) for x in races} >= {
        ("device-order", "Compute", 0),
        ("device-time", "Compute", 0),
    }
    assert not [x for x in races if x.kind.startswith("cpu")]


# ------------------------------------------------------------------------ tickets
def collectives(fire_order: list[str]) -> PipelinePlan:
    return PipelinePlan(
        schedule={"A": S(0, thread_group="x", comm_group="world"), "B": S(0, thread_group="y", comm_group="world")},
        fire_order=fire_order,
        name="collectives",
    )


def test_tickets_serialize_collectives_across_threads() -> None:
    # A (3) and B (4) share no dependency and run on two threads, but every rank must issue
    # them in fire order: B takes ticket 1 and starts when A releases ticket 0, at 3.
    r = simulate(collectives(["A", "B"]), {"A": 3, "B": 4}, 1)
    assert [(i.task, i.start, i.end) for i in r.timeline] == [("A", 0, 3), ("B", 3, 7)]
    assert r.makespan == 7
    # the other fire order: A waits for B
    r = simulate(collectives(["B", "A"]), {"A": 3, "B": 4}, 1)
    assert [(i.task, i.start, i.end) for i in r.timeline] == [("B", 0, 4), ("A", 4, 7)]
    # without a comm group they overlap
    free = collectives(["A", "B"]).with_schedule("A", globally_ordered=False).with_schedule("B", globally_ordered=False)
    assert simulate(free, {"A": 3, "B": 4}, 1).makespan == 4


def test_tickets_order_a_chain_over_two_threads() -> None:
    # x runs A #0 and C #2, y runs B #1: A 0-1, B 1-2, C 2-3 although x is free at 1.
    prog = IterationProgram(
        (0,),
        (("default", ()), ("x", (Run("A", 0, 0, "world"), Run("C", 0, 2, "world"))), ("y", (Run("B", 0, 1, "world"),))),
        (("world", 3),),
    )
    plan = PipelinePlan(schedule={t: S(0, comm_group="world") for t in "ABC"}, name="chain")
    r = simulate_programs(plan, [(0, prog)], dict.fromkeys("ABC", 1))
    assert [(i.task, i.lane, i.start) for i in r.timeline] == [("A", "cpu:x", 0), ("B", "cpu:y", 1), ("C", "cpu:x", 2)]


# ---------------------------------------------------------------------- deadlocks
def test_two_threads_waiting_on_each_other_deadlock() -> None:
    plan = PipelinePlan(schedule={"A": S(0, thread_group="a"), "B": S(0, thread_group="b")}, name="crossed")
    prog = IterationProgram(
        (0,),
        (
            ("default", ()),
            ("a", (WaitTask("B"), Run("A", 0), Signal("A"))),
            ("b", (WaitTask("A"), Run("B", 0), Signal("B"))),
        ),
    )
    with pytest.raises(SimDeadlock) as info:
        simulate_programs(plan, [(0, prog)], {"A": 1, "B": 1})
    err = info.value
    assert [(b.thread, b.iteration, b.instruction) for b in err.blocked] == [("a", 0, "wait B"), ("b", 0, "wait A")]
    msg = str(err)
    assert "thread 'a' (internal iteration 0, instruction 0) blocked on `wait B`: no thread has signalled B" in msg
    assert "thread 'b' (internal iteration 0, instruction 0) blocked on `wait A`" in msg
    # the schedule grid marks the task thread 'a' could not start
    assert any(line.split()[1] == "A" and "i0*" in line for line in msg.splitlines() if line.strip()[:1].isdigit())


def test_tickets_contradicting_a_wait_deadlock() -> None:
    # B holds ticket 0 but waits for A, which holds ticket 1: A waits for B's ticket to be released.
    plan = PipelinePlan(
        schedule={"A": S(0, thread_group="x", comm_group="world"), "B": S(0, thread_group="y", comm_group="world")},
        fire_order=["A", "B"],
        name="contradiction",
    )
    prog = IterationProgram(
        (0,),
        (
            ("default", ()),
            ("x", (Run("A", 0, 1, "world"), Signal("A"))),
            ("y", (WaitTask("A"), Run("B", 0, 0, "world"))),
        ),
        (("world", 2),),
    )
    with pytest.raises(SimDeadlock) as info:
        simulate_programs(plan, [(0, prog)], {"A": 1, "B": 1})
    blocked = {b.thread: b for b in info.value.blocked}
    assert blocked["x"].instruction == "run A #1@world"
    assert "ticket 1 of comm group 'world' is not next: 0 released so far" in blocked["x"].reason
    assert blocked["y"].instruction == "wait A"


def test_a_deadlock_in_a_later_iteration_names_it() -> None:
    # iterations 0 and 1 run as compiled; in iteration 2 the two threads wait on each other
    plan = two_stage().with_thread_map({"H2D": "io"})
    phases = CompiledPlan(plan).iterations(4)
    p, prog = phases[2]
    crossed = (
        ("default", (WaitTask("H2D"), Run("Compute", 1), Signal("Compute"))),
        ("io", (WaitTask("Compute"), Run("H2D", 0, source=True), Signal("H2D"))),
    )
    phases[2] = (p, dataclasses.replace(prog, threads=crossed))
    with pytest.raises(SimDeadlock) as info:
        simulate_programs(plan, phases, {"H2D": 2, "Compute": 5})
    assert [(b.thread, b.iteration, b.instruction) for b in info.value.blocked] == [
        ("default", 2, "wait H2D"),
        ("io", 2, "wait Compute"),
    ]
    assert "Compute                1  default  default       |  --   i0    i1*" in str(info.value)


# -------------------------------------------------------------------------- races
def without_first_wait(
    phases: list[tuple[int, IterationProgram]], thread: str
) -> tuple[list[tuple[int, IterationProgram]], str]:
    """The phases with the first ``wait`` of ``thread`` removed from every iteration; returns
    the task whose wait was removed."""
    removed = ""
    out = []
    for p, prog in phases:
        threads = []
        for name, instrs in prog.threads:
            waits = [i for i in instrs if isinstance(i, WaitTask)]
            if name == thread and waits:
                removed = waits[0].task
                instrs = tuple(i for i in instrs if i is not waits[0])
            threads.append((name, instrs))
        out.append((p, dataclasses.replace(prog, threads=tuple(threads))))
    return out, removed


def test_removing_a_wait_is_a_race_even_when_timing_hides_it() -> None:
    plan = load_prep().with_thread_map({"Load": "io"})
    phases, removed = without_first_wait(CompiledPlan(plan).iterations(4), "default")
    assert removed == "Load"
    # Load is fast: Prep still starts after it in time, but nothing in the program says so
    r = simulate_programs(plan, phases, {"Load": 0, "Prep": 1, "Fwd": 1})
    races = find_races(r, plan)
    assert {(x.kind, x.consumer, x.batch, x.producer) for x in races} == {
        ("cpu-order", "Prep", b, "Load") for b in range(4)
    }
    # Load is slow: Prep really starts first
    r = simulate_programs(plan, phases, {"Load": 3, "Prep": 1, "Fwd": 1})
    with pytest.raises(SimRace) as info:
        check_happens_before(r, plan)
    kinds = {(x.kind, x.batch) for x in info.value.races}
    assert ("cpu-time", 0) in kinds and ("cpu-order", 0) in kinds
    msg = str(info.value)
    assert "cpu-order: Prep(0) on thread 'default' at internal iteration 0 may run before Load(0)" in msg
    assert "i0*" in msg
    # the compiled programs themselves are fine, with or without timing
    check_happens_before(CompiledPlan(plan).iterations(4), plan)
    check_happens_before(simulate(plan, {"Load": 3, "Prep": 1, "Fwd": 1}, 4), plan)


def test_removing_a_wait_in_a_sparse_dist_plan_on_a_thread_per_task() -> None:
    plan = sparse_like().with_thread_map("per_task")
    phases, removed = without_first_wait(CompiledPlan(plan).iterations(5), "WaitBatch")
    assert removed == "ZeroGrad"
    with pytest.raises(SimRace) as info:
        check_happens_before(phases, plan)
    assert {(x.consumer, x.producer) for x in info.value.races} == {("WaitBatch", "ZeroGrad")}
    assert {x.batch for x in info.value.races} == set(range(5))


def test_removing_a_stream_wait_is_a_device_race() -> None:
    plan = two_stage()
    phases = [
        (
            p,
            dataclasses.replace(
                prog,
                threads=tuple(
                    (t, tuple(i for i in instrs if not isinstance(i, WaitStream))) for t, instrs in prog.threads
                ),
            ),
        )
        for p, prog in CompiledPlan(plan, device_streams=True).iterations(3)
    ]
    assert find_races(phases, plan) == []  # CPU order is intact
    with pytest.raises(SimRace) as info:
        check_happens_before(phases, plan, device_streams=True)
    assert {(x.kind, x.consumer, x.batch) for x in info.value.races} == {
        ("device-order", "Compute", b) for b in range(3)
    }


def test_a_collective_ticket_orders_like_a_wait() -> None:
    # B(b) needs A(b); no wait, but B holds the ticket after A's: the turnstile orders them.
    plan = collectives(["A", "B"]).replace(intra_iter_deps=[("B", "A")])
    prog = IterationProgram(
        (0,), (("default", ()), ("x", (Run("A", 0, 0, "world"),)), ("y", (Run("B", 0, 1, "world"),))), (("world", 2),)
    )
    assert find_races([(0, prog)], plan) == []
    untick = IterationProgram((0,), (("default", ()), ("x", (Run("A", 0),)), ("y", (Run("B", 0),))))
    assert [x.kind for x in find_races([(0, untick)], plan)] == ["cpu-order"]


def test_without_the_barrier_the_compiled_waits_across_iterations_are_what_orders_them() -> None:
    # No barrier between iterations (the engine's threads walk them independently): H2D(b) on io
    # ends iteration b and Compute(b), on the main thread, starts iteration b + 1 with a
    # `wait H2D@P-1`. Without that wait they race on every batch.
    plan = two_stage().with_thread_map({"H2D": "io"})
    phases = CompiledPlan(plan).iterations(4)
    assert "wait H2D@P-1" in [str(i) for i in phases[2][1].instructions("default")]
    r = simulate(plan, {"H2D": 2, "Compute": 5}, 4, iteration_barrier=False)
    assert not find_races(r, plan)
    assert not find_races(phases, plan, iteration_barrier=False)
    unwaited = [
        (p, IterationProgram(prog.active_stages, tuple(
            (t, tuple(i for i in instrs if not isinstance(i, WaitTask))) for t, instrs in prog.threads), prog.tickets))
        for p, prog in phases
    ]
    races = find_races(unwaited, plan, iteration_barrier=False)
    assert {(x.kind, x.batch) for x in races if x.kind == "cpu-order"} == {("cpu-order", b) for b in range(4)}
    # on one thread program order is enough
    assert not find_races(CompiledPlan(two_stage()).iterations(4), two_stage(), iteration_barrier=False)


def random_durations(
    rng: random.Random, plan: PipelinePlan, num_batches: int, choices: list[float]
) -> Callable[[str, int], float]:
    """Per-batch durations drawn from ``choices`` for every task instance of the run."""
    table = {(t, b): rng.choice(choices) for t in plan.schedule for b in range(num_batches)}
    return lambda task, batch: table[(task, batch)]


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("thread_map", THREAD_MAPS, ids=str)
@pytest.mark.parametrize("device_streams", [False, True])
def test_every_compiled_program_replays_without_deadlock_or_race(
    name: str, thread_map: object, device_streams: bool
) -> None:
    plan = mapped(PLANS[name](), thread_map)
    compiled = CompiledPlan(plan, device_streams=device_streams)
    check_happens_before(compiled.iterations(6), plan, device_streams=device_streams)
    rng = random.Random(f"{name}{thread_map}{device_streams}")
    tasks = list(plan.schedule)
    for _ in range(5):
        cpu = random_durations(rng, plan, 6, [0.0, 0.5, 1.0, 4.0])
        dev = random_durations(rng, plan, 6, [0.0, 1.0, 3.0]) if device_streams else None
        r = simulate(compiled, cpu, 6, device_durations=dev)
        check_happens_before(r, plan)
        assert r.steady_iteration_time is not None
        ran = sorted((i.task, i.batch) for i in r.timeline if i.lane.startswith("cpu:"))
        assert ran == sorted((t, b) for t in tasks for b in range(6))


def random_plan(rng: random.Random) -> PipelinePlan:
    """A valid plan with 2-6 tasks on random stages, streams, threads and comm groups, and the
    random dependencies (distance 0-2) that stages and fire order can satisfy."""
    names = [f"T{i}" for i in range(rng.randint(2, 6))]
    schedule = {
        t: S(
            rng.randint(0, 2),
            rng.choice(["default", "s1", "s2"]),
            rng.choice(["default", "t1", "t2"]),
            comm_group=rng.choice([None, None, "world", "pg2"]),
        )
        for t in names
    }
    fire = rng.sample(names, len(names))
    plan = PipelinePlan(schedule=schedule, fire_order=fire, name="random")
    for _ in range(rng.randint(0, 8)):
        consumer, producer = rng.sample(names, 2)
        deps = [*plan.explicit_deps, Dep(consumer, producer, rng.choice([0, 0, 1, 2]))]
        with contextlib.suppress(PlanError):  # unsatisfiable with these stages and fire order: skip it
            plan = plan.replace(
                intra_iter_deps=[d for d in deps if d.distance == 0],
                inter_iter_deps=[d for d in deps if d.distance > 0],
            )
    return plan


@pytest.mark.parametrize("seed", range(100))
def test_random_plans_compile_to_programs_without_deadlock_or_race(seed: int) -> None:
    rng = random.Random(seed)
    plan = random_plan(rng)
    num_batches = rng.randint(1, 5)
    for device_streams in (False, True):
        compiled = CompiledPlan(plan, device_streams=device_streams)
        check_happens_before(compiled.iterations(num_batches), plan, device_streams=device_streams)
        cpu = random_durations(rng, plan, num_batches, [0.0, 1.0, 3.0])
        dev = random_durations(rng, plan, num_batches, [0.0, 1.0, 5.0]) if device_streams else None
        r = simulate(compiled, cpu, num_batches, device_durations=dev)
        check_happens_before(r, plan)


# --------------------------------------------------------------- boundary checks
def test_bad_programs_and_durations_are_named() -> None:
    plan = two_stage().with_thread_map({"H2D": "io"})
    with pytest.raises(
        SimError, match=r"no CPU duration for task Compute \(batch 0, thread 'default', internal iteration 1\)"
    ):
        simulate(plan, {"H2D": 1}, 2)
    with pytest.raises(SimError, match=r"CPU duration of task H2D \(batch 1, .*must be a finite number >= 0, got -1"):
        simulate(plan, lambda t, b: -1 if b == 1 else 1, 2)
    lonely = IterationProgram((0,), (("default", (WaitTask("H2D"),)), ("io", (Run("H2D", 0),))))
    with pytest.raises(
        SimError, match=r"thread 'default', internal iteration 0, instruction 0 `wait H2D`: no thread signals H2D"
    ):
        simulate_programs(plan, [(0, lonely)], {"H2D": 1})
    wrong_stage = IterationProgram((0,), (("default", (Run("Compute", 0),)),))
    with pytest.raises(SimError, match="stage 0, but Compute is at stage 1"):
        simulate_programs(plan, [(0, wrong_stage)], {"Compute": 1})
    with pytest.raises(SimError, match="ticket 2 of comm group 'world' is not among"):
        simulate_programs(
            collectives(["A", "B"]),
            [(0, IterationProgram((0,), (("x", (Run("A", 0, 2, "world"),)),), (("world", 2),)))],
            {"A": 1},
        )


# -------------------------------------------------------------------- renderings
def test_format_timeline_has_one_row_per_lane() -> None:
    r = simulate(two_stage().with_thread_map({"H2D": "io"}), {"H2D": 2, "Compute": 5}, 4)
    text = format_timeline(r, width=66)
    lines = text.splitlines()
    assert lines[0] == "plan two_stage: makespan 22, steady iteration time 5"
    # 3 columns per time unit: H2D(b) takes 6 columns, Compute(b) 15; idle time is "."
    assert lines[2] == "cpu:default  ......[Compute 0    ][Compute 1    ][Compute 2    ][Compute 3    ]  busy 20 (91%)"
    assert lines[3] == "cpu:io       [H2D ][H2D ].........[H2D ].........[H2D ]........................  busy 8 (36%)"
    assert len(lines) == 4


def test_chrome_trace_has_one_complete_event_per_interval() -> None:
    r = simulate(two_stage(), {"H2D": 1, "Compute": 1}, 3, device_durations={"H2D": 4, "Compute": 3})
    trace = to_chrome_trace(r, us_per_unit=1000.0)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(r.timeline)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"cpu:default", "stream:memcpy", "stream:default"}
    compute0 = [e for e in spans if e["name"] == "Compute 0" and e["cat"] == "device"]
    assert compute0 and compute0[0]["ts"] == 5000.0 and compute0[0]["dur"] == 3000.0


def test_the_simulator_does_not_import_torch() -> None:
    code = "import sys, torchrec_swp.sim; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
