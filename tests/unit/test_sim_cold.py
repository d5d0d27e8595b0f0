"""A cold thread computes slower (``torchrec_swp.sim.cold``): the rule, the simulator charging it,
the calibration taking measured costs back to warm ones, and a prediction for another plan on a
synthetic profile where the effect is known.

The synthetic profile: the default plan loads on the calling thread (4 off the CPU, then 0.5 of
CPU) and trains (3 of CPU) after it, so every step the training thread wakes cold; with two
parallel loads on their own threads the training thread works back to back and stays warm. A
profile of the first plan shows Train costing ``cost(0.5, 3)``; the second plan trains at 3.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from tests.unit.test_sim_ranks import Iteration, Run_, local_then_collective
from torchrec_swp.catalog.torchrec import sparse_dist_plan
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.sim import Cold, Rank, SimError, SimResult, calibrate, simulate_ranks
from torchrec_swp.sim.cold import Warmth

S = TaskSchedule
COLD = Cold(after=1.0, extra=0.5, span=2.0)


def load_then_train(**changes: object) -> PipelinePlan:
    """Load (the source, stage 0) feeds Train (stage 1), both on the calling thread."""
    args: dict[str, object] = dict(
        schedule={"Load": S(0), "Train": S(1)},
        tasks=[PipelineTask("Load", writes=("batch",)), PipelineTask("Train", reads=("batch",))],
        source="Load",
        name="load_then_train",
    )
    args.update(changes)
    return PipelinePlan(**args)  # type: ignore[arg-type]


def profile_of(result: SimResult, off: Callable[[str, int], float]) -> list[Iteration]:
    """What a TaskProfiler records of a simulated rank with enough cores: the runs the engine
    admits, each with its wall time and its thread CPU time (the wall time less its off-CPU part)."""
    plan, n = result.plan, result.num_batches
    by_iteration: dict[int, list[Run_]] = {}
    for i in result.timeline:
        if i.lane.startswith("cpu:") and plan.task(i.task).when.admits(i.batch, n, i.iteration, plan.max_stage):
            cpu = i.end - i.start - off(i.task, i.batch)
            run = Run_(i.task, i.batch, i.lane.removeprefix("cpu:"), i.start, i.end, cpu)
            by_iteration.setdefault(i.iteration, []).append(run)
    return [
        Iteration(p, min(r.start for r in rs), max(r.end for r in rs), tuple(rs))
        for p, rs in sorted(by_iteration.items())
    ]


# ------------------------------------------------------------------------- the rule
def test_cold_work_costs_more_first_and_the_extra_decays() -> None:
    assert COLD.cost(math.inf, 3.0) == 3.0  # warm
    assert Cold(1.0, 0.0, 2.0).cost(0.0, 3.0) == 3.0
    # the first instant runs 1 + extra times slower
    assert COLD.cost(0.0, 1e-6) == pytest.approx(1.5e-6)
    # a whole burst pays extra * span at most
    assert COLD.cost(0.0, 1e3) - 1e3 == pytest.approx(0.5 * 2.0)
    # closed form and additivity: work split in two parts costs what it costs in one
    assert COLD.cost(0.5, 3.0) == pytest.approx(3.0 + 0.5 * 2.0 * (math.exp(-0.25) - math.exp(-1.75)))
    assert COLD.cost(0.0, 1.0) + COLD.cost(1.0, 2.0) == pytest.approx(COLD.cost(0.0, 3.0))


@pytest.mark.parametrize("position", [0.0, 0.3, 2.0, 7.0, math.inf])
def test_work_inverts_cost(position: float) -> None:
    for work in (0.0, 1e-4, 0.2, 1.0, 3.0, 20.0):
        assert COLD.work(position, COLD.cost(position, work)) == pytest.approx(work, abs=1e-9)


def test_a_thread_is_cold_after_a_long_stretch_off_the_cpu() -> None:
    w = Warmth()
    assert w.charge(COLD, 0.0, 1.0) == 1.0  # never ran: warm
    w.ended(1.0)
    assert w.charge(COLD, 1.5, 1.0) == 1.0  # 0.5 off the CPU: still warm
    w.ended(2.5)
    assert w.charge(COLD, 3.5, 1.0) == pytest.approx(COLD.cost(0.0, 1.0))  # 1.0 off: cold
    w.ended(4.5 + 0.2)
    assert w.charge(COLD, 4.8, 1.0) == pytest.approx(COLD.cost(1.0, 1.0))  # warming up


def test_bad_rules() -> None:
    for bad in (dict(after=-1.0), dict(extra=math.nan), dict(span=math.inf), dict(after=True)):
        with pytest.raises(ValueError, match="Cold"):
            Cold(**{"after": 1.0, "extra": 0.5, "span": 2.0, **bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="span"):
        Cold(1.0, 0.5, 0.0)
    with pytest.raises(SimError, match="cold"):
        simulate_ranks([Rank(load_then_train(), {"Load": 1, "Train": 1}, cold=0.5)], 4)  # type: ignore[arg-type]


# -------------------------------------------------------------------- the simulator
def test_the_simulator_charges_a_cold_thread() -> None:
    # Load sleeps 4 then computes 0.5; Train computes 3 right after it on the same thread. From
    # the second step on, Load's CPU part starts 4 after Train's ended: cold at position 0;
    # Train goes on from position 0.5.
    warm = {"Load": 0.5, "Train": 3.0}
    r = simulate_ranks([Rank(load_then_train(), warm, off_cpu={"Load": 4.0}, cold=COLD)], 12)
    step = 4.0 + COLD.cost(0.0, 0.5) + COLD.cost(0.5, 3.0)
    assert r.step_period == pytest.approx(step)
    assert step > 7.5
    # off the CPU for less than ``after``: nothing changes
    short = simulate_ranks([Rank(load_then_train(), warm, off_cpu={"Load": 0.9}, cold=COLD)], 12)
    assert short.step_period == pytest.approx(0.9 + 3.5)


def test_a_thread_working_back_to_back_stays_warm() -> None:
    plan = load_then_train(schedule={"Load": S(0, thread_group="load"), "Train": S(1)}, loads=2, lookahead=2)
    warm = {"Load": 0.5, "Train": 3.0}
    r = simulate_ranks([Rank(plan, warm, off_cpu={"Load": 4.0}, split_draws=True, cold=COLD)], 20)
    assert r.step_period == pytest.approx(3.0)  # Train binds, back to back


# ------------------------------------------------------------------- the calibration
def test_calibration_takes_cold_costs_back_to_warm_and_predicts_the_plan_that_stays_warm() -> None:
    default = load_then_train()
    warm, off = {"Load": 0.5, "Train": 3.0}, {"Load": 4.0}
    truth = simulate_ranks([Rank(default, warm, off_cpu=off, cold=COLD)], 16)
    profile = [profile_of(truth.ranks[0], lambda t, b: off.get(t, 0.0))]

    cal = calibrate(default, profile, warmup=2, cold=COLD)
    cpu, off_cpu = cal.ranks[0].medians()
    assert cpu == pytest.approx(warm)
    assert off_cpu == pytest.approx({"Load": 4.0, "Train": 0.0})
    # the profiled plan replays as it ran
    again = simulate_ranks(cal.simulation_ranks("median"), 16)
    assert again.step_period == pytest.approx(truth.step_period)

    # the plan with two loads: the training thread stays warm
    loads = load_then_train(schedule={"Load": S(0, thread_group="load"), "Train": S(1)}, loads=2, lookahead=2)
    real = simulate_ranks([Rank(loads, warm, off_cpu=off, split_draws=True, cold=COLD)], 20).step_period
    predicted = simulate_ranks(cal.simulation_ranks("mean", plans=[loads], split_draws=True), 20).step_period
    assert predicted == pytest.approx(real) == pytest.approx(3.0)
    # without the rule, the profile's cold Train is taken for what Train costs
    blind = calibrate(default, profile, warmup=2)
    assert blind.ranks[0].medians()[0]["Train"] == pytest.approx(COLD.cost(0.5, 3.0))
    unaware = simulate_ranks(blind.simulation_ranks("mean", plans=[loads], split_draws=True), 20).step_period
    assert unaware == pytest.approx(COLD.cost(0.5, 3.0))  # 20% too long


@pytest.mark.parametrize("thread_map", ["main", "io", "per_task"])
def test_calibrating_a_cold_simulated_run_and_replaying_it_gives_it_back(thread_map: str) -> None:
    plan = sparse_dist_plan().with_thread_map(thread_map)  # type: ignore[arg-type]
    rng = random.Random(11)
    costs = {(t, b): float(rng.randint(1, 6)) for t in plan.fire_order for b in range(14)}
    # the collectives wait nothing of their own (``profile_of`` takes what is not CPU for the sleep
    # given; a collective's waits are charged on its transport, tested above)
    sleeps = {
        (t, b): 0.0 if plan.task(t).comm_group else float(rng.choice([0, 0, 2]))
        for t in plan.fire_order
        for b in range(14)
    }
    truth = simulate_ranks([Rank(plan, lambda t, b: costs[(t, b)], off_cpu=lambda t, b: sleeps[(t, b)], cold=COLD)], 14)
    cal = calibrate(plan, [profile_of(truth.ranks[0], lambda t, b: sleeps[(t, b)])], cold=COLD)
    # every steady run's warm cost comes back
    stage = {t: s.stage for t, s in plan.schedule.items()}
    for p, sample in zip(cal.ranks[0].iterations, cal.ranks[0].samples, strict=True):
        for t, (cpu, off) in sample.items():
            assert cpu == pytest.approx(costs[(t, p - stage[t])])
            assert off == pytest.approx(sleeps[(t, p - stage[t])])


def test_the_calibration_reads_a_rank_s_records_once_so_an_iterator_gives_what_a_list_gives() -> None:
    # ``records[r]`` is any iterable of iterations: the calibration walked it once per pass (the
    # complete iterations, the once-only runs, each thread's warmth), so a generator's later passes
    # saw nothing and its cold runs were never taken back to warm
    default = load_then_train()
    warm, off = {"Load": 0.5, "Train": 3.0}, {"Load": 4.0}
    truth = simulate_ranks([Rank(default, warm, off_cpu=off, cold=COLD)], 16)
    profile = profile_of(truth.ranks[0], lambda t, b: off.get(t, 0.0))
    listed = calibrate(default, [profile], warmup=2, cold=COLD)
    streamed = calibrate(default, [iter(profile)], warmup=2, cold=COLD)
    assert streamed.ranks == listed.ranks


# ------------------------------------------------------- a collective's waits are no sleep
def load_then_collective(collective: bool) -> PipelinePlan:
    """``load_then_train`` with Train a collective (a comm group) or not."""
    return load_then_train(schedule={"Load": S(0), "Train": S(1, comm_group="world" if collective else None)})


def test_a_collectives_waits_do_not_make_its_thread_cold_a_sleep_before_it_does() -> None:
    # Load sleeps 4 then computes 0.5 (cold: Train's CPU ended 4 before); Train waits 3 off the CPU
    # then computes 3. As a collective, Train's 3 are waits between its own CPU work (its
    # transfers): it goes on warming up from 0.5, where the run started. As a task that sleeps
    # 3 first (not a collective), its thread is cold again. The collective's 3 are transfers on
    # a transport idle since the last step's: cold too (the next test).
    warm, off = {"Load": 0.5, "Train": 3.0}, {"Load": 4.0, "Train": 3.0}
    load = 4.0 + COLD.cost(0.0, 0.5)
    collective = simulate_ranks([Rank(load_then_collective(True), warm, off_cpu=off, cold=COLD)], 12)
    assert collective.step_period == pytest.approx(load + COLD.cost(0.0, 3.0) + COLD.cost(0.5, 3.0))
    sleeps = simulate_ranks([Rank(load_then_collective(False), warm, off_cpu=off, cold=COLD)], 12)
    assert sleeps.step_period == pytest.approx(load + 3.0 + COLD.cost(0.0, 3.0))
    # a collective that starts after a long stretch off the CPU is cold all the same
    after_sleep = {"Load": 0.0, "Train": 3.0}
    off_first = simulate_ranks([Rank(load_then_collective(True), after_sleep, off_cpu=off, cold=COLD)], 12)
    assert off_first.step_period == pytest.approx(4.0 + COLD.cost(0.0, 3.0) + COLD.cost(0.0, 3.0))


def load_then_two_collectives() -> PipelinePlan:
    """``local_then_collective`` with Local a collective too: Load feeds A (Local) then B (Reduce)."""
    return local_then_collective(
        schedule={"Load": S(0), "Local": S(1, comm_group="world"), "Reduce": S(1, comm_group="world")}
    )


def test_a_rank_transfers_slower_after_its_transport_sat_idle_and_warms_up_as_it_transfers() -> None:
    # A's 2 of transfers come 4 + after B's of the step before: the transport is cold. B's come
    # right after A ended (A computed 1.5 after its transfers, longer than ``after``, but a run
    # computes and transfers in turns: the transport idles between collectives, not inside one):
    # it goes on from position 2. Each thread part as in the rule: A's CPU after the 4 of Load's
    # sleep (cold), B's right after A's (from 1.5).
    warm, off = {"Load": 0.0, "Local": 1.5, "Reduce": 0.5}, {"Load": 4.0, "Local": 2.0, "Reduce": 2.0}
    r = simulate_ranks([Rank(load_then_two_collectives(), warm, off_cpu=off, cold=COLD)], 12)
    transfers = COLD.cost(0.0, 2.0) + COLD.cost(2.0, 2.0)
    assert transfers == pytest.approx(COLD.cost(0.0, 4.0))  # one warm-up over both
    assert r.step_period == pytest.approx(4.0 + transfers + COLD.cost(0.0, 1.5) + COLD.cost(1.5, 0.5))
    # back to back, the transport never sits idle that long: the transfers take what they take
    busy = simulate_ranks([Rank(load_then_two_collectives(), warm, off_cpu={**off, "Load": 0.0}, cold=COLD)], 12)
    assert busy.step_period == pytest.approx(6.0)
    # with a profile of the idle run, the calibration gives back the warm transfers
    profile = [profile_of(r.ranks[0], lambda t, b: 0.0)]
    profile = [
        Iteration(it.iteration, it.start, it.end, tuple(replace(x, cpu=r_cpu(x.task)) for x in it.runs))
        for it in profile[0]
    ]
    cal = calibrate(load_then_two_collectives(), [profile], warmup=2, cold=COLD)
    assert cal.ranks[0].medians() == (pytest.approx(warm), pytest.approx(off))


def r_cpu(task: str) -> float:
    """The CPU each task of ``load_then_two_collectives`` is charged in the idle run above."""
    return {"Load": 0.0, "Local": COLD.cost(0.0, 1.5), "Reduce": COLD.cost(1.5, 0.5)}[task]


def test_two_ranks_calibrated_with_their_collectives_waits_give_back_the_warm_costs() -> None:
    # rank 1's Load sleeps 1 longer: rank 0 arrives at every rendezvous first and waits for it.
    # Each rank's Train computed cost(0.5, 3) (asked where the run started, right after Load's
    # CPU) between its waits; the calibration asks at the same moment and gives back 3.
    plan = load_then_collective(True)
    warm = {"Load": 0.5, "Train": 3.0}
    off = [{"Load": 4.0, "Train": 3.0}, {"Load": 5.0, "Train": 3.0}]
    truth = simulate_ranks([Rank(plan, warm, off_cpu=o, cold=COLD) for o in off], 16)
    charged = {"Load": COLD.cost(0.0, 0.5), "Train": COLD.cost(0.5, 3.0)}
    profiles = []
    for r in truth.ranks:  # what a TaskProfiler records: each run's thread CPU time, waits not in it
        profiles.append(
            [
                Iteration(it.iteration, it.start, it.end, tuple(replace(x, cpu=charged[x.task]) for x in it.runs))
                for it in profile_of(r, lambda t, b: 0.0)
            ]
        )
    cal = calibrate(plan, profiles, warmup=2, cold=COLD)
    for got, o in zip(cal.ranks, off, strict=True):
        assert got.medians() == (pytest.approx(warm), pytest.approx(o))
    again = simulate_ranks(cal.simulation_ranks("median"), 16)
    assert again.step_period == pytest.approx(truth.step_period)
