"""The multi-rank simulator: collectives as rendezvous across ranks, threads sharing cores,
off-CPU time, per-iteration overhead; its calibration from measured runs.

Golden tests compute timelines by hand; property tests check over random plans and durations
that one rank with enough cores is ``simulate`` exactly, that a rendezvous or contention never
makes anything faster, and that calibrating from a simulated run and replaying it gives the
same run back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from torchrec_swp.catalog.torchrec import sparse_dist_plan, train_pipeline_base_plan
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.sim import (
    Rank,
    SimDeadlock,
    SimError,
    SimResult,
    calibrate,
    check_happens_before,
    simulate,
    simulate_ranks,
)

S = TaskSchedule


def local_then_collective(**changes: object) -> PipelinePlan:
    """Load (stage 0, the source) feeds Local then Reduce (a collective) one iteration later."""
    args: dict[str, object] = dict(
        schedule={"Local": S(1), "Reduce": S(1, comm_group="world"), "Load": S(0)},
        tasks=[
            PipelineTask("Load", writes=("batch",)),
            PipelineTask("Local", reads=("batch",), writes=("x",)),
            PipelineTask("Reduce", reads=("x",)),
        ],
        source="Load",
        name="local_then_collective",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def two_threads() -> PipelinePlan:
    """A on thread a and B on thread b, independent, one stage."""
    return PipelinePlan(schedule={"A": S(0, thread_group="a"), "B": S(0, thread_group="b")}, name="two_threads")


def runs(r: SimResult, task: str) -> list[tuple[int, float, float]]:
    return [(i.batch, i.start, i.end) for i in r.timeline if i.task == task and i.lane.startswith("cpu:")]


def key(i: object) -> tuple[object, ...]:
    return (i.start, i.lane, i.end, i.task, i.batch)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- golden
def test_a_slower_rank_delays_the_other_at_the_next_collective() -> None:
    # Per iteration: Local, then Reduce (a collective), then Load of the next batch.
    # Rank 0: Local 1, Reduce 2, Load 1; rank 1: Local 3, Reduce 2, Load 1.
    # P0: Load(0) 0-1 on both. P1: rank 0 Local(0) 1-2, Reduce(0) from 2; rank 1 Local(0) 1-4,
    # Reduce(0) from 4; the rendezvous ends at max(2 + 2, 4 + 2) = 6 on both ranks; Load(1) 6-7.
    # Rank 0 waited 6 - 4 = 2 in each Reduce.
    plan = local_then_collective()
    r = simulate_ranks(
        [Rank(plan, {"Load": 1, "Local": 1, "Reduce": 2}), Rank(plan, {"Load": 1, "Local": 3, "Reduce": 2})],
        2,
        model="barrier",
    )
    fast, slow = r.ranks
    assert runs(fast, "Reduce") == [(0, 2, 6), (1, 8, 12)]
    assert runs(slow, "Reduce") == [(0, 4, 6), (1, 10, 12)]
    assert runs(fast, "Load") == runs(slow, "Load") == [(0, 0, 1), (1, 6, 7)]
    assert [s.end for s in fast.iterations] == [s.end for s in slow.iterations] == [1, 7, 12]
    assert r.rendezvous_wait[0] == {"Reduce": 4} and r.rendezvous_wait[1] == {"Reduce": 0}
    # alone, the fast rank would take 1 + 4 + 3 = 8
    assert simulate(plan, {"Load": 1, "Local": 1, "Reduce": 2}, 2).makespan == 8
    assert r.makespan == 12


def test_threads_share_cores_by_processor_sharing() -> None:
    # A and B need 4 units of CPU each, on two threads of one rank.
    plan = two_threads()
    work = {"A": 4, "B": 4}
    assert simulate_ranks([Rank(plan, work)], 1, cores=2, model="barrier").makespan == 4
    one = simulate_ranks([Rank(plan, work)], 1, cores=1, model="barrier")
    assert runs(one.ranks[0], "A") == runs(one.ranks[0], "B") == [(0, 0, 8)]  # each at half speed
    assert one.contention == (8,)  # 4 + 4 beyond their work
    # one background thread on 2 cores: 3 runnable, each at 2/3: 4 / (2/3) = 6
    assert simulate_ranks([Rank(plan, work)], 1, cores=2, background=1, model="barrier").makespan == 6
    # B needs 2: both at 1/2 until B ends at 4, then A alone at full speed: 2 more, ends at 6
    r = simulate_ranks([Rank(plan, {"A": 4, "B": 2})], 1, cores=1, model="barrier").ranks[0]
    assert runs(r, "B") == [(0, 0, 4)] and runs(r, "A") == [(0, 0, 6)]


def test_two_ranks_on_one_machine_share_its_cores_and_separate_machines_do_not() -> None:
    plan = PipelinePlan(schedule={"A": S(0)}, name="one_task")
    ranks = [Rank(plan, {"A": 3}), Rank(plan, {"A": 3})]
    assert simulate_ranks(ranks, 2, cores=1, model="barrier").makespan == 12  # 2 ranks x 2 batches x 3 on one core
    apart = [Rank(plan, {"A": 3}, machine=0), Rank(plan, {"A": 3}, machine=1)]
    assert simulate_ranks(apart, 2, cores=1, model="barrier").makespan == 6
    assert simulate_ranks(apart, 2, cores={0: 1, 1: 2}, model="barrier").makespan == 6


def test_off_cpu_time_needs_no_core() -> None:
    # A sleeps 4 then computes 1; B computes 4; one core. A's sleep overlaps B entirely; A's CPU
    # part starts at 4, when B ends: A ends at 5.
    r = simulate_ranks([Rank(two_threads(), {"A": 1, "B": 4}, off_cpu={"A": 4})], 1, cores=1, model="barrier").ranks[0]
    assert runs(r, "A") == [(0, 0, 5)] and runs(r, "B") == [(0, 0, 4)]


def test_overhead_runs_on_the_calling_thread_before_every_iteration() -> None:
    # TrainPipelineBase on one thread, every task 1 (H2D a no-op alias is not compiled for the
    # simulator: it costs 1 too); 7 tasks per steady iteration plus 2 of overhead.
    plan = train_pipeline_base_plan()
    d = dict.fromkeys(plan.fire_order, 1.0)
    base = simulate_ranks([Rank(plan, d)], 6, model="barrier").steady_iteration_time
    with_overhead = simulate_ranks([Rank(plan, d, overhead=2.0)], 6, model="barrier")
    assert base == 7 and with_overhead.steady_iteration_time == 9
    assert with_overhead.median_iteration_time == 9
    # With the barrier the other threads wait for it: Load (6) on thread io starts after the
    # overhead (3), so a steady iteration takes 3 + max(Local + Reduce, Load) = 3 + 6.
    io = local_then_collective().with_thread_map({"Load": "io"})
    costs = {"Load": 6, "Local": 1, "Reduce": 1}
    r = simulate_ranks([Rank(io, costs, overhead=3)], 5, model="barrier").ranks[0]
    assert r.steady_periods == (9, 9, 9, 9)
    assert runs(r, "Load")[1] == (1, 9 + 3, 9 + 3 + 6)  # P0: 3 + Load(0) 6 = 9; P1: overhead 9-12, Load(1) 12-18
    # without the barrier it only delays the calling thread's own instructions
    free = simulate_ranks([Rank(io, costs, overhead=3)], 5, model="free").ranks[0]
    assert runs(free, "Load") == [(b, 6 * b, 6 * b + 6) for b in range(5)]


def test_ranks_issuing_different_collectives_are_an_error() -> None:
    # On one thread, rank 0 issues A then B; rank 1, with the other fire order, B then A.
    schedule = {"A": S(0, comm_group="world"), "B": S(0, comm_group="world")}
    ab = PipelinePlan(schedule=schedule, fire_order=["A", "B"], name="ab")
    ba = PipelinePlan(schedule=schedule, fire_order=["B", "A"], name="ba")
    with pytest.raises(SimError, match="collective 0 of comm group 'world' is A on rank 0 but B .* on rank 1"):
        simulate_ranks([Rank(ab, {"A": 1, "B": 1}), Rank(ba, {"A": 1, "B": 1})], 1, model="barrier")


def test_a_rendezvous_no_rank_joins_is_a_deadlock_naming_the_missing_rank() -> None:
    # Rank 1 sees fewer batches: rank 0's third Reduce waits for it forever.
    plan = local_then_collective()
    d = {"Load": 1, "Local": 1, "Reduce": 1}
    from torchrec_swp.compile import CompiledPlan
    from torchrec_swp.sim.multirank import simulate_rank_programs

    compiled = CompiledPlan(plan)
    with pytest.raises(SimDeadlock) as info:
        simulate_rank_programs(
            [(Rank(plan, d), compiled.iterations(3)), (Rank(plan, d), compiled.iterations(2))], model="barrier"
        )
    (stuck,) = info.value.blocked
    assert stuck.rank == 0 and stuck.thread == "default"
    assert "collective 2 of comm group 'world' (Reduce, batch 2) waits for rank(s) [1], which never join it" in str(
        info.value
    )


def test_results_render_and_check_per_rank() -> None:
    plan = sparse_dist_plan().with_thread_map({"H2D": "io"})
    d = {t: 1.0 + k % 3 for k, t in enumerate(plan.fire_order)}
    r = simulate_ranks([Rank(plan, d), Rank(plan, {**d, "Forward": 5.0})], 6, cores=2, model="barrier")
    for one in r.ranks:
        check_happens_before(one, plan)
    trace = r.to_chrome_trace(1000.0)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0: sim TrainPipelineSparseDist", "rank 1: sim TrainPipelineSparseDist"]
    text = r.format_timeline(60)
    assert text.startswith("rank 0:\nplan TrainPipelineSparseDist") and "\nrank 1:\n" in text
    assert r.steady_iteration_time == max(x.steady_iteration_time for x in r.ranks)  # type: ignore[type-var]


def test_bad_arguments() -> None:
    plan = two_threads()
    with pytest.raises(SimError, match="cores of machine 0 must be an int >= 1"):
        simulate_ranks([Rank(plan, {"A": 1, "B": 1})], 1, cores=0, model="barrier")
    with pytest.raises(SimError, match="background of machine 0"):
        simulate_ranks([Rank(plan, {"A": 1, "B": 1})], 1, background=-1, model="barrier")
    with pytest.raises(SimError, match="overhead of rank 0"):
        simulate_ranks([Rank(plan, {"A": 1, "B": 1}, overhead=float("nan"))], 1, model="barrier")
    with pytest.raises(SimError, match="off-CPU duration of task A"):
        simulate_ranks([Rank(plan, {"A": 1, "B": 1}, off_cpu={"A": -1})], 1, model="barrier")
    with pytest.raises(SimError, match="no CPU duration for task B"):
        simulate_ranks([Rank(plan, {"A": 1})], 1, model="barrier")
    with pytest.raises(SimError, match="at least one rank"):
        simulate_ranks([], 1, model="barrier")


# -------------------------------------------------------------------- properties
PLANS = {
    "local_then_collective": local_then_collective,
    "TrainPipelineSparseDist": sparse_dist_plan,
    "TrainPipelineBase": train_pipeline_base_plan,
}
THREAD_MAPS: list[object] = ["main", "by_stream", "per_task", "io"]


def random_durations(plan: PipelinePlan, rng: random.Random) -> dict[str, float]:
    # integers: every sum is exact, so timelines compare with ==
    return {t: float(rng.randint(0, 6)) for t in plan.fire_order}


CASES = [(name, tm, seed) for name in PLANS for tm in THREAD_MAPS for seed in range(3)]


@pytest.mark.parametrize("name,thread_map,seed", CASES)
def test_one_rank_with_enough_cores_is_the_old_simulator(name: str, thread_map: object, seed: int) -> None:
    plan = PLANS[name]().with_thread_map(thread_map)  # type: ignore[arg-type]
    d = random_durations(plan, random.Random(seed))
    for barrier in (True, False):
        old = simulate(plan, d, 7, iteration_barrier=barrier)
        for cores in (None, len(plan.thread_groups)):
            new = simulate_ranks([Rank(plan, d)], 7, cores=cores, model="barrier" if barrier else "free").ranks[0]
            assert sorted(new.timeline, key=key) == sorted(old.timeline, key=key)
            assert new.iterations == old.iterations
            assert sorted(new.steps, key=lambda s: (s.thread, s.seq)) == sorted(
                old.steps, key=lambda s: (s.thread, s.seq)
            )


@pytest.mark.parametrize("name,thread_map,seed", CASES)
def test_rendezvous_and_contention_never_make_anything_faster(name: str, thread_map: object, seed: int) -> None:
    plan = PLANS[name]().with_thread_map(thread_map)  # type: ignore[arg-type]
    rng = random.Random(100 + seed)
    costs = [random_durations(plan, rng) for _ in range(2)]
    alone = [simulate(plan, d, 6) for d in costs]
    together = simulate_ranks([Rank(plan, d) for d in costs], 6, model="barrier")
    for cores in (None, 1, 2, 3):
        shared = simulate_ranks([Rank(plan, d) for d in costs], 6, cores=cores, model="barrier")
        for r in range(2):
            # every run ends no earlier than with a rendezvous and unlimited cores, which ends
            # no earlier than the rank alone
            for a, b, c in zip(
                sorted(alone[r].timeline, key=lambda i: (i.task, i.batch)),
                sorted(together.ranks[r].timeline, key=lambda i: (i.task, i.batch)),
                sorted(shared.ranks[r].timeline, key=lambda i: (i.task, i.batch)),
                strict=True,
            ):
                assert (a.task, a.batch) == (b.task, b.batch) == (c.task, c.batch)
                assert a.end <= b.end + 1e-9 <= c.end + 2e-9
            check_happens_before(shared.ranks[r], plan)
    # a rank that is slower everywhere sets the pace of both: every collective ends on both
    # ranks together, no earlier than on the slow rank alone
    slow = {t: v + 1 for t, v in costs[0].items()}
    pair = simulate_ranks([Rank(plan, costs[0]), Rank(plan, slow)], 6, model="barrier")
    slow_alone = {(i.task, i.batch): i.end for i in simulate(plan, slow, 6).timeline}
    ends = [{(i.task, i.batch): i.end for i in r.timeline} for r in pair.ranks]
    collectives = [
        (t, b)
        for t, b in ends[0]
        if plan.task(t).comm_group is not None
        and plan.task(t).when.admits(b, 6, b + plan.task(t).stage, plan.max_stage)
    ]
    assert collectives
    for k in collectives:
        assert ends[0][k] == ends[1][k] >= slow_alone[k]


# ------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Run_:
    task: str
    batch: int
    thread: str
    start: float
    end: float
    cpu: float | None = None  # the thread CPU time, where the profiler measured one


@dataclass(frozen=True)
class Iteration:
    iteration: int
    start: float
    end: float
    runs: tuple[Run_, ...]


def records_of(result: SimResult, offset: float = 0.0) -> list[Iteration]:
    """What a TaskProfiler would have recorded of a simulated rank (times shifted by ``offset``):
    the runs its ``when`` guards admit (the engine skips the others)."""
    plan, n = result.plan, result.num_batches
    out = []
    for span in result.iterations:
        mine = tuple(
            Run_(i.task, i.batch, i.lane.removeprefix("cpu:"), i.start + offset, i.end + offset)
            for i in result.timeline
            if i.iteration == span.iteration
            and i.lane.startswith("cpu:")
            and plan.task(i.task).when.admits(i.batch, n, i.iteration, plan.max_stage)
        )
        out.append(Iteration(span.iteration, span.start + offset, span.end + offset, mine))
    return out


def test_calibration_takes_a_collectives_part_after_the_last_rank_arrived() -> None:
    plan = local_then_collective()
    r = simulate_ranks(
        [Rank(plan, {"Load": 1, "Local": 1, "Reduce": 2}), Rank(plan, {"Load": 1, "Local": 3, "Reduce": 2})],
        8,
        model="barrier",
    )
    cal = calibrate(plan, [records_of(x) for x in r.ranks], off_cpu={"Load": 0.25})
    assert cal.iterations == 7  # the steady iterations: Load, Local and Reduce ran
    fast, slow = cal.ranks
    # fast waited 6 - 4 = 2 in every Reduce: its own part is 2, as the slow rank's
    assert fast.measured() == {"Load": 1, "Local": 1, "Reduce": 2}
    assert slow.measured() == {"Load": 1, "Local": 3, "Reduce": 2}
    assert fast.medians() == ({"Load": 0.75, "Local": 1, "Reduce": 2}, {"Load": 0.25, "Local": 0, "Reduce": 0})
    assert slow.medians()[0] == {"Load": 0.75, "Local": 3, "Reduce": 2}


@pytest.mark.parametrize("thread_map", ["main", "io", "per_task"])
def test_calibrating_a_simulated_run_and_replaying_it_gives_it_back(thread_map: str) -> None:
    plan = sparse_dist_plan().with_thread_map(thread_map)  # type: ignore[arg-type]
    rng = random.Random(7)
    per_batch = [{(t, b): float(rng.randint(1, 6)) for t in plan.fire_order for b in range(12)} for _ in range(2)]
    ranks = [Rank(plan, lambda t, b, d=d: d[(t, b)]) for d in per_batch]
    truth = simulate_ranks(ranks, 12, model="barrier")
    # rank 1's clock is the same clock (one machine): its records line up with rank 0's
    cal = calibrate(plan, [records_of(x) for x in truth.ranks])
    replay = simulate_ranks(cal.simulation_ranks("replay"), 12, model="barrier")
    for t, x in zip(truth.ranks, replay.ranks, strict=True):
        # Steady iteration P is replayed with measured iteration P's costs. The fill and drain
        # iterations cost other measured ones, so the ranks may enter the first steady iteration
        # with another skew; from the second on, every steady iteration takes what it took.
        steady = t.steady_iterations[1:]
        assert steady == x.steady_iterations[1:]
        took = {s.iteration: s.end - s.start for s in t.iterations}
        again = {s.iteration: s.end - s.start for s in x.iterations}
        assert [again[p] for p in steady] == pytest.approx([took[p] for p in steady])


def test_calibration_with_cores_removes_the_contention_the_simulator_adds_back() -> None:
    plan = two_threads()
    truth = simulate_ranks([Rank(plan, {"A": 4, "B": 2})], 5, cores=1, model="barrier")
    cal = calibrate(plan, [records_of(truth.ranks[0])], cores=1)
    assert cal.ranks[0].medians()[0] == {"A": 4, "B": 2}  # measured 6 and 4, deflated
    uncorrected = calibrate(plan, [records_of(truth.ranks[0])])
    assert uncorrected.ranks[0].medians()[0] == {"A": 6, "B": 4}
    again = simulate_ranks(cal.simulation_ranks("median"), 5, cores=1, model="barrier")
    assert again.ranks[0].timeline == truth.ranks[0].timeline


def test_calibration_needs_common_complete_iterations() -> None:
    plan = two_threads()
    with pytest.raises(SimError, match="no iteration complete on every rank after 0 warm-up"):
        calibrate(plan, [[Iteration(0, 0.0, 1.0, (Run_("A", 0, "a", 0.0, 1.0),))]])
