"""TaskProfiler: exposed-time attribution by hand, real runs on a bare Engine and on a pipeline,
the profile file, warm-up and fill/drain exclusion, and the profiler's overhead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.profiler_overhead import measure_overhead
from harness.sleep import SleepWorkload
from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.profiler import (
    IterationRecord,
    Profile,
    ProfileError,
    RunEvent,
    TaskProfiler,
    WaitEvent,
    exposed_times,
)

S = TaskSchedule


def record(
    runs: list[tuple[str, str, float, float]], waits: list[tuple[str, str, float, float]], end: float
) -> IterationRecord:
    return IterationRecord(
        0,
        0.0,
        end,
        tuple(RunEvent(t, 0, th, s, e) for t, th, s, e in runs),
        tuple(WaitEvent(p, th, s, e) for p, th, s, e in waits),
    )


def test_one_thread_exposes_every_run_in_full() -> None:
    shares, rest = exposed_times(record([("A", "default", 0, 2), ("B", "default", 2, 5)], [], 5.5), {})
    assert shares == {"A": 2, "B": 3}
    assert rest == pytest.approx(0.5)


def test_a_wait_hands_the_walk_to_the_producer_and_the_barrier_to_the_last_worker() -> None:
    # main: A [0,1], waits for P (worker, [0,3]) until 3.1, then B [3.1,4]; worker: P then Q [3,6]
    rec = record(
        [("A", "default", 0, 1), ("B", "default", 3.1, 4), ("P", "w", 0, 3), ("Q", "w", 3, 6)],
        [("P", "default", 1, 3.1)],
        6.2,
    )
    shares, rest = exposed_times(rec, {})
    assert shares == {"Q": 3, "P": 3}  # the iteration ended waiting for Q, which followed P
    assert rest == pytest.approx(0.2)
    # without Q, the end is main's B, which waited for P: A is hidden behind P
    rec = record([("A", "default", 0, 1), ("B", "default", 3.1, 4), ("P", "w", 0, 3)], [("P", "default", 1, 3.1)], 4.0)
    shares, rest = exposed_times(rec, {})
    assert shares == pytest.approx({"B": 0.9, "P": 3.0})
    assert sum(shares.values()) + rest == pytest.approx(4.0)


def test_a_collective_waiting_for_its_ticket_hands_the_walk_to_the_previous_collective() -> None:
    # C1 on worker [0,4]; C2 on main waits for its ticket (idle 0..4), runs [4,6]
    rec = record([("C1", "w", 0, 4), ("C2", "default", 4.05, 6)], [], 6.0)
    shares, _ = exposed_times(rec, {"C1": "world", "C2": "world"})
    assert shares == pytest.approx({"C2": 1.95, "C1": 4.0})
    shares, _ = exposed_times(rec, {})  # not collectives: nothing links them
    assert shares == pytest.approx({"C2": 1.95})


def two_thread_plan() -> PipelinePlan:
    """Load (source, worker io, stage 0) -> Prep (main, stage 0, waits for Load) -> Fwd (main, stage 1);
    Side (worker side, stage 1) runs beside them."""
    return PipelinePlan(
        schedule={"Load": S(0, thread_group="io"), "Prep": S(0), "Fwd": S(1), "Side": S(1, thread_group="side")},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Prep", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",), writes=("out",)),
        ],
        source="Load",
        output="out",
        name="two_threads",
    )


def test_sleeping_tasks_on_an_engine_give_their_durations_and_exposure() -> None:
    plan = two_thread_plan()
    durations = {"Load": 0.004, "Prep": 0.002, "Fwd": 0.003, "Side": 0.001}
    profile = SleepWorkload(plan, durations).profile(num_batches=12, warmup=2)
    # iterations 0..12: 0 is fill (stage 0 only), 12 drain (stage 1 only), 11 complete, 2 of them warm-up
    assert profile.iterations == 12 - 1 - 2
    for s in profile.tasks:
        assert s.count == profile.iterations
        assert durations[s.task] <= s.median_s < durations[s.task] + 0.004, s
    by = {s.task: s for s in profile.tasks}
    # main waits for Load, then runs Prep; Fwd runs before that; Side (1 ms) hides behind Load
    assert by["Side"].exposed_s < 0.0005
    assert by["Load"].exposed_s > 0.003 and by["Prep"].exposed_s > 0.0015
    total = sum(s.exposed_s for s in profile.tasks) + profile.unattributed_s
    assert total == pytest.approx(profile.iteration_mean_s, rel=1e-6)
    print(profile.format_table())


def test_attach_detach_and_warmup_and_incomplete_iterations() -> None:
    plan = two_thread_plan()
    data = iter(range(6))
    engine = Engine(
        plan, {"Load": lambda b: next(data), "Prep": lambda b, x: x, "Fwd": lambda b, y: y, "Side": lambda b: None}
    )
    profiler = TaskProfiler(warmup=1).attach(engine)
    outs = []
    while True:
        try:
            outs.append(engine.step())
        except StopIteration:
            break
    engine.close()
    assert outs == list(range(6))
    assert len(profiler.records) == 7  # iterations 0..6 (fill and drain included)
    assert len(profiler.complete(plan)) == 5 and len(profiler.measured(plan)) == 4
    assert profiler.profile().iterations == 4  # defaults to the attached engine's plan
    profiler.detach()
    assert engine.observer is None
    with pytest.raises(ProfileError, match="warm-up"):
        TaskProfiler(warmup=9).profile(plan)
    with pytest.raises(ProfileError, match="attach"):
        TaskProfiler().profile()
    with pytest.raises(ValueError, match="warmup"):
        TaskProfiler(warmup=-1)


def test_profile_file_round_trips_and_rejects_other_files(tmp_path: Path) -> None:
    plan = two_thread_plan()
    profile = SleepWorkload(plan, {"Load": 0.001, "Prep": 0.001, "Fwd": 0.001, "Side": 0.001}).profile(
        num_batches=6, warmup=1
    )
    path = tmp_path / "run.profile.json"
    profile.save(str(path))
    assert Profile.load(str(path)) == profile
    data = json.loads(path.read_text())
    assert data["format"] == "torchrec_swp.profile/2" and PipelinePlan.from_text(data["plan"]) == plan
    assert [t["task"] for t in data["tasks"]] == list(plan.fire_order)
    assert profile.durations() == {s.task: s.median_s for s in profile.tasks}
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ProfileError, match="something else"):
        Profile.load(str(tmp_path / "bad.json"))
    with pytest.raises(ProfileError, match="no task 'Nope'"):
        profile.stats("Nope")


def test_profiler_attaches_to_a_pipeline_engine() -> None:
    import torchrec_swp

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.linear(batch)
            return out.sum(), out

    model = Model()
    pipeline = torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    profiler = TaskProfiler(warmup=1)
    pipeline.engine.instrument(profiler)
    it = iter([torch.randn(8, 4) for _ in range(8)])
    steps = 0
    while True:
        try:
            pipeline.progress(it)
            steps += 1
        except StopIteration:
            break
    pipeline.close()
    profile = profiler.profile(pipeline.plan)
    assert steps == 8 and profile.iterations == 8 - 1 - 1  # 7 complete iterations, 1 warm-up
    assert {s.task for s in profile.tasks} == set(pipeline.plan.fire_order)
    assert all(s.median_s > 0 for s in profile.tasks)


def test_overhead_is_small_off_and_on() -> None:
    overhead = measure_overhead(tasks=6, iterations=400, repeats=3)
    print(overhead.format())
    assert overhead.profiler_us < 20.0  # microseconds added per task call (measured ~0.6 us)
    assert overhead.off_us < 50.0


def test_tasks_that_run_once_per_epoch_do_not_keep_iterations_from_being_measured() -> None:
    plan = PipelinePlan(
        schedule={"Load": TaskSchedule(0), "Init": TaskSchedule(1, when="first"), "Work": TaskSchedule(1)},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Work", reads=("x",), writes=("out",))],
        source="Load",
        output="out",
    )
    data = iter(range(8))
    engine = Engine(plan, {"Load": lambda b: next(data), "Init": lambda b: None, "Work": lambda b, x: x})
    profiler = TaskProfiler(warmup=1).attach(engine)
    engine.run_to_end()
    profile = profiler.profile()
    assert profile.iterations == 6  # iterations 2..7 are steady (1 has Init), minus one warm-up
    assert profile.stats("Init").count == 1 and profile.stats("Work").count == 6
