"""The auto-scheduler: the direct estimate against the simulator, the stage oracle's rules,
the beam search's hard constraints on every plan it proposes, and the CLI."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from harness.workloads import TORCHREC_MS, Workload, random_workload, torchrec_workloads
from torchrec_swp.autosched import (
    Layout,
    Problem,
    assign_stages,
    auto_assign_stages,
    beam_search,
    check_constraints,
    iteration_time,
    layout_of,
    to_plan,
)
from torchrec_swp.autosched.__main__ import main
from torchrec_swp.autosched.estimate import lead
from torchrec_swp.autosched.inputs import DEFAULT_COLD, from_profiles
from torchrec_swp.catalog.torchrec import default_plans, sparse_dist_plan
from torchrec_swp.plan import DEFAULT_STREAM, PipelinePlan, PipelineTask, PlanError
from torchrec_swp.profiler import Profile, TaskStats
from torchrec_swp.sim import check_happens_before, simulate


def random_layout(problem: Problem, rng: random.Random) -> Layout:
    order = list(range(len(problem.tasks)))
    rng.shuffle(order)
    return Layout(
        tuple(rng.choice(problem.thread_pool) for _ in order),
        tuple(problem.plan.task(t).stream for t in problem.tasks),
        tuple(order),
    )


def test_anchors_are_declared_by_the_plan_or_named_by_the_caller() -> None:
    plan = sparse_dist_plan()
    problem = Problem(plan, {t: 1.0 for t in plan.fire_order})
    assert problem.anchors == {"Forward", "Backward", "OptimizerStep"}  # declared anchor in the table
    more = Problem(plan, problem.durations, anchor_names=frozenset({"Dequeue"}))
    assert more.anchors == {"Forward", "Backward", "OptimizerStep", "Dequeue"}
    undeclared = plan.replace(tasks=[PipelineTask(t.name, t.reads, t.writes) for t in plan.tasks.values()])
    assert Problem(undeclared, problem.durations).anchors == frozenset()
    with pytest.raises(PlanError, match="anchor 'Fwd' is not a task"):
        Problem(plan, problem.durations, anchor_names=frozenset({"Fwd"}))


def test_tasks_that_run_once_per_epoch_cost_nothing_in_the_steady_state() -> None:
    plan = sparse_dist_plan()
    problem = Problem(plan, {t: 1.0 for t in plan.fire_order})
    steady = dict(zip(problem.tasks, problem.cpu))
    assert steady["InitPipelinedModules"] == 0.0 and steady["InputDistStart"] == 1.0


def test_the_estimate_is_the_simulated_iteration_and_every_staged_layout_is_race_free() -> None:
    rng = random.Random(1)
    checked = 0
    for plan in (p for entry in default_plans().values() for p in getattr(entry, "plans", (entry,))):
        problem = Problem(plan, {t: rng.uniform(0.1, 5.0) for t in plan.fire_order})
        for _ in range(80):
            layout = random_layout(problem, rng)
            stages = assign_stages(problem, layout)
            if stages is None:
                continue
            candidate = to_plan(problem, layout, stages)
            result = simulate(candidate, problem.durations, candidate.max_stage + 3)
            assert result.steady_iteration_time == pytest.approx(iteration_time(problem, layout, stages), abs=1e-9)
            check_happens_before(result, candidate)
            checked += 1
    assert checked > 150


def test_oracle_rules_on_a_per_task_layout() -> None:
    plan = sparse_dist_plan().with_thread_map("per_task")
    problem = Problem(plan, {t: TORCHREC_MS[t] for t in plan.fire_order})
    layout = layout_of(problem, plan)
    stages = assign_stages(problem, layout)
    assert stages is not None
    staged = to_plan(problem, layout, stages)
    top = staged.max_stage
    # rule 1: anchors at the highest stage, source at stage 0, depth within the limit
    for anchor in ("Forward", "Backward", "OptimizerStep"):
        assert staged.task(anchor).stage == top
    assert staged.task("H2D").stage == 0 and staged.pipeline_depth == top + 1 <= 5
    # rule 3: the input-dist chain is cut off the anchors' iteration; what is left is the comm
    # group's tickets in fire order (InputDistStart, Forward, InputDistWait, Backward: each on its
    # own thread, so they serialize) and the optimizer after Backward
    chain = ("InputDistStart", "Forward", "InputDistWait", "Backward", "OptimizerStep", "Dequeue")
    assert iteration_time(problem, layout, stages) == pytest.approx(sum(TORCHREC_MS[t] for t in chain))
    assert staged.task("InputDistWait").stage < top
    # threads, streams and fire order are kept
    assert staged.fire_order == plan.fire_order
    assert all(staged.task(t).thread_group == plan.task(t).thread_group for t in plan.fire_order)
    assert auto_assign_stages(plan, problem.durations) == staged


def test_oracle_cuts_a_dependency_the_fire_order_reverses_and_respects_the_limit() -> None:
    plan = sparse_dist_plan()  # InputDistStart fires before H2D: only a cut (stage difference) allows it
    problem = Problem(plan, {t: 1.0 for t in plan.fire_order})
    layout = layout_of(problem, plan)
    stages = assign_stages(problem, layout)
    assert stages is not None
    k = next(
        d for d in problem.deps if problem.tasks[d.consumer] == "InputDistStart" and problem.tasks[d.producer] == "H2D"
    )
    assert lead(k, stages) >= 1
    # with one batch in flight, InputDistStart firing before its producer cannot be staged
    tight = Problem(plan, problem.durations, max_in_flight=1)
    assert assign_stages(tight, layout) is None
    with pytest.raises(PlanError, match="at most 1 batches in flight"):
        auto_assign_stages(plan, problem.durations, max_in_flight=1)
    # an anchor firing before its producer cannot be staged at all
    backward = problem.index["Backward"]
    backwards = Layout(layout.threads, layout.streams, (backward, *(i for i in layout.order if i != backward)))
    assert assign_stages(problem, backwards) is None


WORKLOADS: list[tuple[Workload, dict[str, int]]] = [
    *((w, {}) for w in torchrec_workloads()),
    (torchrec_workloads()[1], {"max_threads": 2, "max_in_flight": 2}),
    (random_workload(0, 10), {}),
    (random_workload(1, 10), {"max_threads": 2, "max_in_flight": 2}),
    (random_workload(2, 9), {"max_threads": 4, "max_in_flight": 5}),
]


@pytest.mark.parametrize("workload,limits", WORKLOADS, ids=[f"{w.name}-{lim}" for w, lim in WORKLOADS])
def test_no_proposed_plan_breaks_a_constraint(workload: Workload, limits: dict[str, int]) -> None:
    problem = Problem(
        workload.plan,
        workload.durations,
        max_threads=limits.get("max_threads", workload.max_threads),
        max_in_flight=limits.get("max_in_flight", workload.max_in_flight),
    )
    result = beam_search(problem, beam_width=4, max_passes=2)
    plan = result.plan
    assert check_constraints(plan, problem) == []
    # the same rules, spelled out
    assert len(plan.thread_groups) <= problem.max_threads
    assert plan.pipeline_depth <= problem.max_in_flight
    for anchor in problem.anchors:
        assert plan.task(anchor).stream == DEFAULT_STREAM and plan.task(anchor).stage == plan.max_stage
    assert set(workload.plan.deps) <= set(plan.deps)
    assert plan.tasks == workload.plan.tasks and plan.source == workload.plan.source
    run = simulate(plan, problem.durations, plan.max_stage + 4)
    check_happens_before(run, plan)
    # collectives of one comm group never overlap, whatever their threads
    for group in {plan.task(t).comm_group for t in plan.fire_order} - {None}:
        spans = sorted((i.start, i.end) for i in run.timeline if plan.task(i.task).comm_group == group)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert PipelinePlan.from_text(plan.to_text()) == plan
    assert result.predicted <= result.baseline + 1e-9


def test_check_constraints_names_every_broken_rule() -> None:
    workload = torchrec_workloads()[0]
    problem = Problem(workload.plan, workload.durations, max_threads=2, max_in_flight=2)
    plan = workload.plan.with_thread_map("per_task").with_schedule("Forward", stream="data_dist")
    rules = {v.rule: v for v in check_constraints(plan, problem)}
    assert set(rules) == {"threads", "in_flight", "anchor"}
    assert rules["anchor"].culprit == "Forward" and "data_dist" in rules["anchor"].message
    dropped = workload.plan.replace(inter_iter_deps=[("Forward", "OptimizerStep")])
    assert [v.rule for v in check_constraints(dropped, Problem(workload.plan, workload.durations))] == ["deps"]
    other = workload.plan.with_schedule("H2D", comm_group="world")
    assert [v.rule for v in check_constraints(other, Problem(workload.plan, workload.durations))] == ["tasks"]


def test_device_durations_move_only_device_work_between_streams() -> None:
    workload = torchrec_workloads()[0]
    device = {
        "H2D": 3.0,
        "InputDistStart": 2.0,
        "InputDistWait": 2.0,
        "Forward": 8.0,
        "Backward": 12.0,
        "OptimizerStep": 3.0,
    }
    problem = Problem(workload.plan, workload.durations, device_durations=device)
    result = beam_search(problem, beam_width=3, max_passes=1)
    assert check_constraints(result.plan, problem) == []
    for t in workload.plan.fire_order:
        if t not in device:
            assert result.plan.task(t).stream == workload.plan.task(t).stream
    assert result.bounds.binding.kind == "stream"  # the anchors' 23 units of device time
    assert result.predicted >= 23.0 - 1e-9


def test_problem_rejects_bad_input() -> None:
    plan = sparse_dist_plan()
    durations = {t: 1.0 for t in plan.fire_order}
    with pytest.raises(PlanError, match="no CPU duration for task"):
        Problem(plan, {t: 1.0 for t in plan.fire_order[1:]})
    with pytest.raises(PlanError, match="'Nope'"):
        Problem(plan, {**durations, "Nope": 1.0})
    with pytest.raises(PlanError, match="finite number"):
        Problem(plan, {**durations, "H2D": -1.0})
    with pytest.raises(PlanError, match="cannot be an anchor"):
        Problem(plan, durations, anchor_names=frozenset({"H2D"}))
    with pytest.raises(ValueError, match="max_threads"):
        Problem(plan, durations, max_threads=0)


def profile_of(workload: Workload) -> Profile:
    """A Profile as a TaskProfiler would write it, with the workload's durations in seconds."""
    plan = workload.plan
    stats = tuple(
        TaskStats(
            t,
            plan.task(t).thread_group,
            plan.task(t).stream,
            plan.task(t).stage,
            20,
            d / 1e3,
            d / 1e3,
            d / 1e3,
            d / 1e3,
        )
        for t, d in ((t, workload.durations[t]) for t in plan.fire_order)
    )
    total = sum(workload.durations.values()) / 1e3
    return Profile(plan, stats, 20, 2, total, total, 0.0)


def sleep_profile(**where: object) -> Profile:
    """A profile of a real run: TrainPipelineSparseDist's plan on the engine, every task sleeping
    its ``TORCHREC_MS`` / 4 (the source 6 ms: a loader waiting on storage)."""
    from harness.sleep import SleepWorkload

    plan = sparse_dist_plan()
    durations = {t: TORCHREC_MS[t] / 4e3 for t in plan.fire_order} | {"H2D": 6e-3}
    return SleepWorkload(plan, durations).profile(num_batches=24, warmup=2).with_where(**where)


def test_cli_searches_the_overlap_from_every_ranks_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for rank in range(2):
        paths.append(tmp_path / f"rank{rank}.profile.json")
        sleep_profile(rank=rank, world_size=2, host="h", cores=2).save(str(paths[-1]))
    out = tmp_path / "best.plan"
    assert main(["--profile", str(paths[0]), "--profile", str(paths[1]), "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "profiles of rank(s) [0, 1] of 2" in text
    # which file is which rank's, and whose table is printed
    assert f"  rank 0: {paths[0]} (" in text and f"  rank 1: {paths[1]} (" in text and "rank 0's profile:" in text
    assert "the starting plan is bound by" in text and "the change:" in text and "now bound by" in text
    found, start = PipelinePlan.load(str(out)), sparse_dist_plan()
    assert found.task("H2D").thread_group != "default"  # the loader's wait leaves the training thread
    assert [found.task(t).stage for t in found.fire_order] == [start.task(t).stage for t in start.fire_order]
    # one rank's file of two: refused, naming the missing rank, unless told to fill it in
    assert main(["--profile", str(paths[0]), "--out", str(out), "--quiet"]) == 2
    assert "missing rank(s) [1]" in capsys.readouterr().err
    assert main(["--profile", str(paths[0]), "--out", str(out), "--quiet", "--fill-missing"]) == 0
    assert "rank(s) [1] taken to cost what rank 0 costs" in capsys.readouterr().out
    # the file given may be any rank's: the CLI says which it read and whom it stands for
    assert main(["--profile", str(paths[1]), "--out", str(out), "--quiet", "--fill-missing"]) == 0
    text = capsys.readouterr().out
    assert "profiles of rank(s) [1] of 2" in text and f"  rank 1: {paths[1]} (" in text and "rank 1's profile:" in text
    assert "rank(s) [0] taken to cost what rank 1 costs (their profiles were not given)" in text
    # the reordering search takes every rank's profile too, each task at its slowest rank
    code = main(["--profile", str(paths[0]), "--profile", str(paths[1]), "--out", str(out), "--quiet", "--reorder"])
    assert code == 0
    assert "each task at its slowest median of rank(s) [0, 1]" in capsys.readouterr().out


def test_cli_wakes_threads_by_the_default_rule_unless_given_one_latency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchrec_swp.autosched.__main__ as cli
    from torchrec_swp.autosched.inputs import DEFAULT_WAKE

    path = tmp_path / "rank0.profile.json"
    sleep_profile().save(str(path))
    seen: list[object] = []
    real = cli.from_profiles

    def spy(profiles: object, **kwargs: object) -> object:
        seen.append(kwargs["wake"])
        return real(profiles, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "from_profiles", spy)
    out = tmp_path / "best.plan"
    assert main(["--profile", str(path), "--out", str(out), "--quiet"]) == 0
    assert main(["--profile", str(path), "--out", str(out), "--quiet", "--wake-us", "300"]) == 0
    assert seen[0] == DEFAULT_WAKE and not DEFAULT_WAKE.uniform  # by what the other threads do
    assert seen[1] == pytest.approx(300e-6)  # one latency, whatever they do


def test_the_reordering_problem_costs_each_task_on_its_slowest_rank() -> None:
    import dataclasses

    workload = torchrec_workloads()[0]
    fast = profile_of(workload).with_where(rank=0, world_size=2)
    slow = dataclasses.replace(
        fast,
        tasks=tuple(dataclasses.replace(s, median_s=3 * s.median_s) if s.task == "Forward" else s for s in fast.tasks),
    ).with_where(rank=1)
    problem = Problem.from_profiles([fast, slow], max_threads=2)
    assert problem.durations["Forward"] == slow.stats("Forward").median_s > fast.stats("Forward").median_s
    assert {t: d for t, d in problem.durations.items() if t != "Forward"} == {
        t: d for t, d in fast.durations().items() if t != "Forward"
    }
    assert problem.max_threads == 2
    other = profile_of(torchrec_workloads()[1])
    with pytest.raises(PlanError, match="the ranks profiled different plans"):
        Problem.from_profiles([fast, other])


def test_cli_reorders_on_request_and_refuses_old_or_missing_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "run.profile.json", tmp_path / "best.plan"
    sleep_profile().save(str(path))
    code = main(["--profile", str(path), "--out", str(out), "--quiet", "--reorder", "--exact", "--time-limit", "10"])
    assert code == 0
    text = capsys.readouterr().out
    assert "reordered (beam search, barrier model; each task at its slowest median of rank(s) [0])" in text
    assert "CP-SAT" in text
    assert "now bound by" in text or "no change is predicted to do better" in text
    workload = torchrec_workloads()[0]
    profile_of(workload).save(str(path))  # per-task statistics only: no measured iterations
    assert main(["--profile", str(path), "--out", str(out), "--quiet"]) == 2
    assert "has no measured iterations" in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "missing.json"), "--out", str(out), "--quiet"]) == 2


def test_the_search_inputs_take_costs_back_to_warm_with_the_machines_cold_rule() -> None:
    profile = sleep_profile()
    assert all(c.cold == DEFAULT_COLD for c in from_profiles([profile]).calibration.ranks)
    assert all(c.cold is None for c in from_profiles([profile], cold=None).calibration.ranks)
    ranks = from_profiles([profile]).calibration.simulation_ranks("mean")
    assert ranks[0].cold == DEFAULT_COLD  # the warm costs simulate with the rule they were taken back with
