"""The simulator's engine model: walkers without a barrier, the caller's calls, run-ahead within
the source's credit, parallel loads taking turns, wake-up latency (by what the other threads do),
cores and each process's GIL.

Golden timelines are computed by hand in the comments; properties check the engine's
invariants on the simulated timelines (credit, collectives never ahead of the call, the
training step only for a batch asked for) and that with lookahead 0 and one load the steady
state is the barrier model's.
"""

from __future__ import annotations

import random

import pytest

from torchrec_swp.catalog.torchrec import sparse_dist_plan, train_pipeline_base_plan
from torchrec_swp.catalog.transforms import with_parallel_loads
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.sim import Rank, SimDeadlock, SimError, Wake, check_happens_before, simulate_ranks
from torchrec_swp.sim.cores import fair_rates

S = TaskSchedule


def load_then_train(**changes: object) -> PipelinePlan:
    """Load (the source, stage 0, thread io) feeds Train (stage 1, the calling thread)."""
    args: dict[str, object] = dict(
        schedule={"Load": S(0, thread_group="io"), "Train": S(1)},
        tasks=[PipelineTask("Load", writes=("batch",)), PipelineTask("Train", reads=("batch",))],
        source="Load",
        name="load_then_train",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def runs(r: object, task: str) -> list[tuple[int, float, float]]:
    return sorted((i.batch, i.start, i.end) for i in r.timeline if i.task == task and i.lane.startswith("cpu:"))  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- golden
def test_a_loader_thread_without_lookahead_starts_at_the_call() -> None:
    # Load 4 off the CPU on io, Train 3 on the caller. With lookahead 0 the io thread may run
    # internal iteration P only once step() asked for batch P - 1 (P <= requested - 1 + top):
    # step(0) walks iterations 0 and 1 (Load(0) 0-4, Load(1) 4-8 on io; Train(0) 4-7), returns at
    # 7 when io finished iteration 1 at 8 -> returns at 8. step(1): Load(2) 8-12, Train(1) 8-11,
    # returns at 12. Every later step: 4 (the loader binds, nothing runs ahead).
    r = simulate_ranks([Rank(load_then_train(), {"Load": 0, "Train": 3}, off_cpu={"Load": 4})], 6)
    assert r.returns[0] == (8, 12, 16, 20, 24, 27)
    assert runs(r.ranks[0], "Load")[:3] == [(0, 0, 4), (1, 4, 8), (2, 8, 12)]


def test_lookahead_lets_the_loader_run_ahead_within_the_credit() -> None:
    # Train 5 now binds: with lookahead 1 the loader draws batch b once b < returned + depth + 1
    # and b < requested + top + 1, so it keeps one batch ahead and every step takes 5.
    plan = load_then_train(lookahead=1)
    r = simulate_ranks([Rank(plan, {"Load": 0, "Train": 5}, off_cpu={"Load": 4})], 8)
    gaps = [b - a for a, b in zip(r.returns[0], r.returns[0][1:])]
    assert gaps[2:-1] == [5, 5, 5, 5]
    # without lookahead each step is the loader's 4 after the call plus waiting for Train: 4 + 5
    r0 = simulate_ranks([Rank(load_then_train(), {"Load": 0, "Train": 5}, off_cpu={"Load": 4})], 8)
    assert [b - a for a, b in zip(r0.returns[0], r0.returns[0][1:])][2:-1] == [5, 5, 5, 5]
    slow = {"Load": 0, "Train": 3}
    ahead = simulate_ranks([Rank(load_then_train(lookahead=2), slow, off_cpu={"Load": 4})], 10)
    assert ahead.step_period == pytest.approx(4)  # the loader binds either way
    assert simulate_ranks([Rank(load_then_train(), slow, off_cpu={"Load": 4})], 10).step_period == pytest.approx(4)


def test_parallel_loads_overlap_split_draws_and_take_turns_otherwise() -> None:
    # 3 loads of 6 (off the CPU), Train 2: split draws (claim, then fetch) overlap three fetches,
    # so a batch arrives every 2 and Train binds; whole draws take turns: one every 6.
    plan = load_then_train(loads=3, lookahead=3)
    d, off = {"Load": 0, "Train": 2}, {"Load": 6}
    split = simulate_ranks([Rank(plan, d, off_cpu=off, split_draws=True)], 20)
    whole = simulate_ranks([Rank(plan, d, off_cpu=off, split_draws=False)], 20)
    assert split.step_period == pytest.approx(2)
    assert whole.step_period == pytest.approx(6)
    # batch b is loaded on lane b % 3, and draws start in batch order
    lanes = {i.batch: i.lane for i in split.ranks[0].timeline if i.task == "Load"}
    assert all(lanes[b] == ("cpu:io" if b % 3 == 0 else f"cpu:io.{b % 3}") for b in lanes)
    starts = [s for _, s, _ in runs(split.ranks[0], "Load")]
    assert starts == sorted(starts)


def test_a_woken_thread_resumes_after_the_wake_up_latency() -> None:
    # As in the first test, with wake 0.5: io waits at its gate for every call and the caller
    # waits for io in every step, so a steady step is 4 + 2 * 0.5.
    r = simulate_ranks([Rank(load_then_train(), {"Load": 0, "Train": 3}, off_cpu={"Load": 4}, wake=0.5)], 8)
    assert r.step_period == pytest.approx(5)


def test_the_wake_up_latency_follows_what_the_other_threads_do() -> None:
    # With sim.Wake(busy=0.5, idle=0.1, walk_end=0.25): at each call io is woken at its gate while
    # the caller starts Train (computing: 0.5); the caller, waiting for io's iteration, is woken
    # when io ends its walk (0.25). A steady step: 0.5 + Load's 4 + 0.25. With Train costing
    # nothing the caller is idle when io wakes (0.1): 0.1 + 4 + 0.25.
    wake = Wake(busy=0.5, idle=0.1, walk_end=0.25)
    for train, step in ((3, 4.75), (0, 4.35)):
        r = simulate_ranks([Rank(load_then_train(), {"Load": 0, "Train": train}, off_cpu={"Load": 4}, wake=wake)], 10)
        assert r.step_period == pytest.approx(step), train
    # a number is the same latency in every case, as a Wake with it three times
    assert Wake.of(0.5) == Wake(busy=0.5, idle=0.5, walk_end=0.5) and Wake.of(0.5).uniform
    same = Rank(load_then_train(), {"Load": 0, "Train": 3}, off_cpu={"Load": 4}, wake=Wake.of(0.5))
    assert simulate_ranks([same], 8).step_period == pytest.approx(5)


def test_a_bad_wake_up_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="Wake.idle must be a finite number >= 0"):
        Wake(busy=0.5, idle=-1, walk_end=0.25)
    with pytest.raises(ValueError, match="a number of seconds or a sim.Wake"):
        Wake.of("0.5")  # type: ignore[arg-type]
    plan = load_then_train()
    with pytest.raises(SimError, match="wake of rank 0 must be a finite number >= 0 or a sim.Wake"):
        simulate_ranks([Rank(plan, {"Load": 0, "Train": 1}, wake=float("nan"))], 2)


def test_the_gil_keeps_one_process_threads_from_computing_at_once() -> None:
    # Src (4 of CPU) on thread a feeds B (4 of CPU) on thread b one stage later, lookahead 1:
    # on 2 cores they compute side by side, a step every 4; with the GIL held all the time one
    # process computes at one core's pace, a step every 8; held half the time, 4 again.
    plan = PipelinePlan(
        schedule={"Src": S(0, thread_group="a"), "B": S(1, thread_group="b")},
        tasks=[PipelineTask("Src", writes=("x",)), PipelineTask("B", reads=("x",))],
        source="Src",
        lookahead=1,
        name="two",
    )
    d = {"Src": 4, "B": 4}
    assert simulate_ranks([Rank(plan, d)], 12, cores=2).step_period == pytest.approx(4)
    assert simulate_ranks([Rank(plan, d, gil=1.0)], 12, cores=2).step_period == pytest.approx(8)
    assert simulate_ranks([Rank(plan, d, gil=0.5)], 12, cores=2).step_period == pytest.approx(4)


def test_fair_rates_share_cores_and_each_gil() -> None:
    assert fair_rates({0: 1}, None) == {0: 1.0}
    assert fair_rates({0: 2, 1: 2}, 2) == {0: 0.5, 1: 0.5}
    assert fair_rates({0: 2}, 2, background=2) == {0: 0.5}
    # process 0 is held to one core by its GIL; process 1 takes what is left of 3 cores
    assert fair_rates({0: 2, 1: 2}, 3, gil={0: 1.0, 1: None}) == {0: 0.5, 1: 1.0}
    assert fair_rates({0: 4}, None, gil={0: 0.5}) == {0: 0.5}
    assert fair_rates({}, 2) == {}


# -------------------------------------------------------------------- invariants
def mapped(plan: PipelinePlan, thread_map: str) -> PipelinePlan:
    if thread_map == "io":
        return plan.with_thread_map(lambda t: "io" if t.stage == 0 else t.thread_group)
    return plan.with_thread_map(thread_map)


PLANS = {"TrainPipelineSparseDist": sparse_dist_plan, "TrainPipelineBase": train_pipeline_base_plan}
CASES = [(name, tm, seed) for name in PLANS for tm in ("main", "by_stream", "per_task", "io") for seed in range(3)]


def random_costs(plan: PipelinePlan, rng: random.Random) -> dict[str, float]:
    return {t: float(rng.randint(0, 6)) for t in plan.fire_order}


@pytest.mark.parametrize("name,thread_map,seed", CASES)
def test_without_run_ahead_the_steady_step_is_the_barrier_models(name: str, thread_map: str, seed: int) -> None:
    plan = mapped(PLANS[name](), thread_map)
    rng = random.Random(seed)
    ranks = [Rank(plan, random_costs(plan, rng), overhead=float(rng.randint(0, 2))) for _ in range(2)]
    engine = simulate_ranks(ranks, 12, cores=None)
    barrier = simulate_ranks(ranks, 12, cores=None, model="barrier")
    assert engine.step_period == pytest.approx(barrier.steady_iteration_time)


@pytest.mark.parametrize("name,thread_map,seed", CASES)
def test_the_engines_gates_hold_on_every_timeline(name: str, thread_map: str, seed: int) -> None:
    rng = random.Random(50 + seed)
    base = mapped(PLANS[name](), thread_map)
    source_alone = base.with_thread_map({base.source: "load"})  # type: ignore[dict-item]
    for plan in (base, base.replace(lookahead=2), source_alone.with_loads(2, lookahead=2)):
        costs = random_costs(plan, rng)
        ranks = [Rank(plan, costs, off_cpu={plan.source: 3.0}, wake=0.25, split_draws=True)]  # type: ignore[dict-item]
        result = simulate_ranks(ranks, 10, cores=2)
        r, returns = result.ranks[0], result.returns[0]
        check_happens_before(r, plan)
        top, depth, ahead = plan.max_stage, plan.pipeline_depth, plan.lookahead
        # step(d) is called when step(d - 1) returned (the caller's overhead is 0 here)
        called = [0.0, *returns]
        for i in r.timeline:
            if not i.lane.startswith("cpu:"):
                continue
            t = plan.task(i.task)
            if i.task == plan.source:
                # credit: batch b is drawn once batch b - depth - lookahead was returned, and no
                # more than lookahead calls ahead of the call that single-thread order draws it in
                assert i.batch < depth + ahead or i.start >= returns[i.batch - depth - ahead] - 1e-9
                assert i.start >= called[max(0, i.batch - top - ahead)] - 1e-9
            if t.comm_group is not None or (t.stage == top and i.lane != f"cpu:{MAIN_THREAD}"):
                # collectives and the training step never run ahead of the call: internal
                # iteration b + stage only once step() asked for batch b + stage - top
                assert i.start >= called[max(0, i.batch + t.stage - top)] - 1e-9


def test_a_rendezvous_no_rank_joins_is_a_deadlock_in_the_engine_model_too() -> None:
    plan = PipelinePlan(
        schedule={"Load": S(0), "Reduce": S(1, comm_group="world")},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Reduce", reads=("x",))],
        source="Load",
        name="reduce",
    )
    from torchrec_swp.compile import CompiledPlan
    from torchrec_swp.sim.multirank import simulate_rank_programs

    compiled = CompiledPlan(plan)
    d = {"Load": 1, "Reduce": 1}
    with pytest.raises(SimDeadlock, match="waits for rank"):
        simulate_rank_programs([(Rank(plan, d), compiled.iterations(3)), (Rank(plan, d), compiled.iterations(2))])


def test_parallel_loads_of_the_catalog_plans_replay() -> None:
    plan = with_parallel_loads(sparse_dist_plan(), 2)
    d = {t: 1.0 for t in plan.fire_order}
    r = simulate_ranks([Rank(plan, d, off_cpu={"Fetch": 12.0}, split_draws=True)], 30, cores=2)
    # the calling thread's 9 tasks bind: 2 loads bring a batch every (12 + 1) / 2 = 6.5 < 9
    assert r.step_period == pytest.approx(9)
    check_happens_before(r.ranks[0], plan)


def test_bad_engine_arguments() -> None:
    plan = load_then_train()
    d = {"Load": 1, "Train": 1}
    with pytest.raises(SimError, match="model must be one of engine, barrier, free"):
        simulate_ranks([Rank(plan, d)], 2, model="fast")  # type: ignore[arg-type]
    with pytest.raises(SimError, match="wake of rank 0 must be a finite number >= 0"):
        simulate_ranks([Rank(plan, d, wake=-1)], 2)
    with pytest.raises(SimError, match=r"gil of rank 0 must be None or a number in \(0, 1\]"):
        simulate_ranks([Rank(plan, d, gil=2)], 2)
