"""The first move (``autotune.first_move``): where the profile shows the draw waiting, round 1
searches nothing and tries the draw on a thread of its own at once, its trial's first visit of
the running plan the profile's last steps; where the move loses, round 1 searches from the
profile it already took. A draw that computes is tried on threads and in worker processes, and
where neither wins nothing is searched. A draw between the two, a small one, one already off the
calling thread or options that leave no room are not moved. Bit for bit as untuned either way."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.unit.test_autotune import FAST, Computing, Parsing, Slow, tuned_like_plain
from torchrec_swp import Autotune, plans
from torchrec_swp.autotune.first_move import PROCESS_MIN_DRAW_S, WAITING_DRAW, WAITING_SHARE, FirstMove, first_move
from torchrec_swp.autotune.search import CPU_BOUND_DRAW
from torchrec_swp.autotune.trial import Trial
from torchrec_swp.catalog.transforms import with_parallel_loads
from torchrec_swp.plan import PipelinePlan
from torchrec_swp.profiler import Profile, TaskStats
from torchrec_swp.profiler.profile import Where

pytestmark = pytest.mark.serial  # the tuner decides from measured step times

#: the options of tests/unit/test_autotune.py, the first move on (its default)
MOVING = {**FAST, "first_move": True}
STEP_S = 0.020


def _profile(draw_s: float, cpu_s: float, *, split: bool = True, plan: PipelinePlan | None = None) -> dict[str, Any]:
    """A profile of TrainPipelineBase's starting plan (the tuner's: no lookahead) whose draw
    (LoadBatch) lasts ``draw_s`` on the wall and ``cpu_s`` on its thread's CPU, each other task 1 ms."""
    plan = plan or plans.with_lookahead(plans.default_plans()["TrainPipelineBase"], 0)
    tasks = []
    for t in plan.fire_order:
        task = plan.task(t)
        wall, cpu = (draw_s, cpu_s) if t == plan.source else (0.001, 0.001)
        tasks.append(TaskStats(t, task.thread_group, task.stream, task.stage, 20, wall, wall, wall, wall, cpu))
    profile = Profile(plan, tuple(tasks), 20, 0, STEP_S, STEP_S, 0.0, where=Where(split_draws=split))
    return {"profile": profile.to_json(), "trouble": ""}


def _move(gathered: list[dict[str, Any]], processes: bool = False, **options: Any) -> FirstMove | None:
    return first_move(gathered, STEP_S, Autotune(**options), processes)


def _searches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plans the search starts from, in order (the search itself unchanged)."""
    import torchrec_swp.autotune.search as search_module

    searched: list[str] = []
    real = search_module.search_overlap

    def search(profiled: Any, *args: Any, **kwargs: Any) -> Any:
        searched.append(profiled.to_text())
        return real(profiled, *args, **kwargs)

    monkeypatch.setattr(search_module, "search_overlap", search)
    return searched


def test_a_draw_that_waits_is_moved_to_a_thread_of_its_own_with_two_loads() -> None:
    found = _move([_profile(0.008, 0.0002), _profile(0.007, 0.0001)], processes=True)
    assert found is not None and found.then_search  # where it loses, round 1 searches
    (running, _, _, _), (moved, predicted, own, processes) = found.candidates  # never in processes: it waits
    start = plans.with_lookahead(plans.default_plans()["TrainPipelineBase"], 0)
    assert running == start.to_text() and predicted is None and not own and processes == 0
    assert PipelinePlan.from_text(moved) == with_parallel_loads(start, 2, lookahead=2, thread="load")
    assert found.why == (
        "the draw LoadBatch waits: its thread computes 2% of its 7.50 ms (38% of the 20.00 ms step), so it first "
        "tries the draw on a thread of its own, 2 loads at once, 2 ahead, against the running plan, before any search"
    )


def test_data_that_does_not_split_its_draws_gets_one_load_the_least_run_ahead_allowed() -> None:
    for lookahead, ahead in (((0, 1, 2, 3), 1), ((0, 2, 3), 2)):
        found = _move([_profile(0.008, 0.0, split=False)], lookahead=lookahead)
        assert found is not None and "one load, " in found.why
        moved = PipelinePlan.from_text(found.candidates[1][0])
        assert (moved.loads, moved.lookahead, moved.task("LoadBatch").thread_group) == (1, ahead, "load")
    found = _move([_profile(0.008, 0.0)], loads=(1, 3))  # 2 loads not among the choices: one
    assert found is not None and PipelinePlan.from_text(found.candidates[1][0]).loads == 1


@pytest.mark.parametrize(
    "draw_s, cpu_s, options, why",
    [
        (0.008, WAITING_DRAW * 0.008, {}, "computes a quarter of its time: between waiting and computing"),
        (0.008, CPU_BOUND_DRAW * 0.008 * 0.99, {}, "computes just under half its time: between"),
        (0.008, 0.008, {"candidates": 0}, "no trial: switch on the prediction alone"),
        (WAITING_SHARE * STEP_S * 0.9, 0.0, {}, "under a tenth of the step"),
        (0.008, 0.0, {"lookahead": (0,)}, "no run-ahead allowed"),
        (0.008, 0.0, {"max_threads": 1}, "no thread to spare"),
        (0.008, 0.0, {"max_in_flight": 2}, "no batch in flight to spare beyond the depth"),
        (0.008, 0.0, {"memory_cap_bytes": 1.0}, "over the memory cap"),
    ],
)
def test_no_first_move_where_the_draw_computes_is_small_or_the_options_leave_no_room(
    draw_s: float, cpu_s: float, options: dict[str, Any], why: str
) -> None:
    gathered = [_profile(draw_s, cpu_s)]
    if "memory_cap_bytes" in options:
        gathered[0]["profile"]["where"]["batch_bytes"] = 1000.0
    assert _move(gathered, **options) is None, why


def test_no_first_move_for_a_draw_already_off_the_calling_thread_or_a_rank_in_trouble() -> None:
    start = plans.with_lookahead(plans.default_plans()["TrainPipelineBase"], 0)
    io = start.replace(schedule={**start.schedule, "LoadBatch": start.schedule["LoadBatch"].replace(thread_group="io")})
    assert _move([_profile(0.008, 0.0, plan=io)]) is None
    assert _move([_profile(0.008, 0.0), {"profile": None, "trouble": "rank 1: no steps"}]) is None
    assert first_move([_profile(0.008, 0.0)], None, Autotune()) is None  # no measured step


def test_a_draw_that_computes_is_tried_on_threads_and_in_processes_and_kept_unsearched_where_both_lose() -> None:
    start = plans.with_lookahead(plans.default_plans()["TrainPipelineBase"], 0)
    moved = with_parallel_loads(start, 2, lookahead=2, thread="load").to_text()
    found = _move([_profile(0.008, 0.0079)], processes=True)
    assert found is not None and not found.then_search
    assert found.candidates == [[start.to_text(), None, False, 0], [moved, None, False, 2], [moved, None, False, 0]]
    assert found.why.startswith(
        "the draw LoadBatch computes: its thread computes 99% of its 8.00 ms (40% of the 20.00 ms step); a thread "
        "helps it only where its work releases the GIL"
    ) and "2 loads at once, 2 ahead, on threads and in 2 worker processes, against the running plan" in found.why
    threads_only = _move([_profile(0.008, 0.0079)], processes=False)  # data that cannot fetch in processes
    assert threads_only is not None and threads_only.candidates == found.candidates[:1] + found.candidates[2:]
    one = _move([_profile(0.008, 0.0079)], processes=True, candidates=1)  # room for one: processes first
    assert one is not None and one.candidates == found.candidates[:2]
    # a draw too short to pay a worker process's hand-off is tried on threads only
    short = PROCESS_MIN_DRAW_S * 0.9
    brief = first_move([_profile(short, short)], short / (2 * WAITING_SHARE), Autotune(), True)
    assert brief is not None and [c[3] for c in brief.candidates] == [0, 0] and "worker processes" not in brief.why
    enough = first_move([_profile(PROCESS_MIN_DRAW_S, PROCESS_MIN_DRAW_S)], STEP_S, Autotune(), True)
    assert enough is not None and [c[3] for c in enough.candidates] == [0, 2, 0]


def test_a_draw_that_computes_where_nothing_wins_is_not_searched_and_trains_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Python that holds the GIL, beside a forward that computes: the trial of threads and worker
    processes starts at the call after the profile; the search runs only from a plan that won."""
    searched = _searches(monkeypatch)
    lines: list[str] = []
    options = {**MOVING, "drift": None}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    tuning = Autotune(**options, report=lines.append)
    pipeline = tuned_like_plain(n, 0.0, tuning, model=Computing, dataset=lambda: Parsing(n, 3.0))
    d = pipeline.autotune_decision
    assert d is not None and d.decided, lines
    assert d.why[0].startswith("the draw LoadBatch computes: its thread computes"), d.why
    assert "autotune TrainPipelineBase: profiled 12 steps" in "\n".join(lines) and "tries 3 plans" in "\n".join(lines)
    round1 = [t for t in d.why if t.startswith("tried ") and " plans over " in t]
    assert round1 and round1[0].startswith("tried 3 plans over"), d.why
    if d.switched:  # the second round searched from the plan that won, once
        assert len(searched) == 1 and PipelinePlan.from_text(searched[0]).task("LoadBatch").thread_group == "load"
        assert pipeline.engine.draws.iterator.processes == d.processes
    else:  # kept: nothing searched, and it says so
        assert searched == [] and "keeps the plan" in d.why[-1], d.why


def test_a_seeded_visit_is_the_first_cycle_s_and_is_not_visited_again_in_it() -> None:
    start = plans.default_plans()["TrainPipelineBase"]
    trial = Trial([start, with_parallel_loads(start, 2)], [None, None], began=30, steps=4, cycles=3)
    trial.seed(0, [0.02, 0.022, 0.018, 0.02])
    assert trial.start_cycle() == 1 and trial.queue == []
    assert trial.samples[0] == [pytest.approx(0.02)] and trial.steps[0] == 4 and trial.order == [0]
    trial.begin(1, 31)
    assert trial.order == [0, 1]
    for call in range(31, 35):
        trial.measure(call, 0.01)
    assert trial.close(35) and trial.next_in_cycle() is None and trial.cycle == 1
    assert trial.start_cycle() == 0 and trial.queue == [1]  # the second cycle visits both
    with pytest.raises(ValueError, match="no steps measured for candidate 1"):
        trial.seed(1, [])


def test_first_move_must_be_a_bool_and_adds_its_trial_to_the_tuning_bound() -> None:
    with pytest.raises(ValueError, match="first_move must be a bool"):
        Autotune(first_move=1)  # type: ignore[arg-type]
    depth = plans.default_plans()["TrainPipelineBase"].pipeline_depth
    from torchrec_swp.autotune.trial import trial_bound

    o = Autotune(**FAST)
    extra = trial_bound(2, o.trial_steps, o.trial_cycles, max(o.lookahead), max(o.loads))[0]
    assert Autotune(**MOVING).tuning_bound(depth) == o.tuning_bound(depth) + extra
    assert Autotune(**MOVING, candidates=0).tuning_bound(depth) == Autotune(**FAST, candidates=0).tuning_bound(depth)


def test_a_waiting_draw_is_run_ahead_at_once_and_the_search_follows_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    searched = _searches(monkeypatch)
    lines: list[str] = []
    n = Autotune(**MOVING).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    pipeline = tuned_like_plain(n, 0.006, Autotune(**MOVING, report=lines.append))
    d = pipeline.autotune_decision
    assert d is not None and d.decided and d.switched, lines
    text = "\n".join(lines)
    # round 1: no search; the trial starts at the call after the profile, the running plan's
    # first visit the profile's last steps (seeded): the first switch is to the moved plan
    assert "so it first tries the draw on a thread of its own, 2 loads at once, 2 ahead" in text, text
    assert "autotune TrainPipelineBase: profiled 12 steps" in text and "tries 2 plans" in text
    first = next(line for line in lines if line.startswith("autotune TrainPipelineBase: tried 2 plans over"))
    assert "the measured best is threads" in first and "LoadBatch on load" in first, lines
    # the search ran once, in round 2, from the moved plan (the draw on its load thread)
    assert len(searched) == 1 and PipelinePlan.from_text(searched[0]).task("LoadBatch").thread_group == "load"
    assert any(line.startswith("autotune TrainPipelineBase: second round") for line in lines), text
    assert d.first_predicted_s is None and d.measured_start_s is not None
    assert pipeline.plan.task("LoadBatch").thread_group != "default" and pipeline.plan.lookahead >= 1
    assert pipeline.batch_ledger.trained == n and not pipeline.untrained_batches()


def no_ahead(gathered: Any, measured: Any, options: Autotune, processes: bool) -> Any:
    """``first_move``, its moved plan without run-ahead and with one load: a move that can lose."""
    found = first_move(gathered, measured, options, processes)
    assert found is not None
    plan = PipelinePlan.from_text(found.candidates[1][0])
    found.candidates[1][0] = plan.replace(lookahead=0, loads=1).to_text()
    return found


class SlowOnLoad(Slow):
    """Items that wait ``latency`` more on the engine's thread "load": ``no_ahead``'s move loses."""

    def __getitem__(self, i: int) -> torch.Tensor:
        import threading

        if threading.current_thread().name.endswith("-load"):  # the engine's thread "load"
            time.sleep(self.latency)
        return super().__getitem__(i)


def test_a_first_move_that_loses_is_said_and_round_1_searches_from_its_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move that cannot win (scripted: the draw on a thread of its own, no run-ahead, and a
    loader slower on that thread) leaves the running plan; round 1 then searches from the
    profile it took, once, and its decision says what the move measured first."""
    import torchrec_swp.autotune.tuner as tuner_module

    monkeypatch.setattr(tuner_module, "first_move", no_ahead)
    searched = _searches(monkeypatch)
    lines: list[str] = []
    options = {**MOVING, "rounds": 1, "drift": None}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    tuning = Autotune(**options, report=lines.append)
    pipeline = tuned_like_plain(n, 0.006, tuning, dataset=lambda: SlowOnLoad(n, 0.006))
    d = pipeline.autotune_decision
    assert d is not None and d.decided, lines
    lost = [line for line in lines if line.startswith("autotune TrainPipelineBase: first move: tried 2 plans")]
    assert len(lost) == 1 and lost[0].endswith("; searches from the running plan"), lines
    assert "the measured best is the running plan" in lost[0], lost
    start = plans.with_lookahead(plans.default_plans()["TrainPipelineBase"], 0)
    assert searched == [start.to_text()]  # round 1's search, from the starting plan's profile
    assert d.why[0].startswith("first move: tried 2 plans over"), d.why
    assert any(w.startswith("first move: tried threads") for w in d.why), d.why
    assert d.switches >= 2 and d.trial_steps > 0  # to the move and back, at least
