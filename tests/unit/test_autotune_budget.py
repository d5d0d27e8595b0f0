"""What tuning may cost a job (``Autotune.budget_steps``, ``budget_s``; ``autotune.budget``): the
ledger charges every step of a round its period less the running plan's measured step (a faster
candidate earning back what a slower one lost) and the tuner's own time whole; where it reaches
the budget the tuning stops where the ranks next agree: a trial gives way to the plan it started
from, a search in the background is stopped, nothing more is searched, tried or re-tuned, and
the decision says so. Bit for bit as untuned either way."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.unit.test_autotune import FAST, Slow, opening, train, tuned_like_plain
from tests.unit.test_autotune_first_move import SlowOnLoad, no_ahead
from torchrec_swp import Autotune, plans
from torchrec_swp.autotune.budget import Ledger
from torchrec_swp.autotune.tuner import TunerState

pytestmark = pytest.mark.serial  # the tuner decides from measured step times


def test_the_ledger_charges_an_open_round_s_steps_against_its_running_plan_and_gains_count() -> None:
    ledger = Ledger(budget_steps=10, budget_s=None)
    ledger.charge_step(1.0)  # no round open: nothing charged
    assert ledger.lost_s == 0 and ledger.limit_s is None and not ledger.spent()
    ledger.open(0.020)  # round 1: the starting plan's step is the unit
    assert ledger.limit_s == pytest.approx(0.200) and ledger.is_open and ledger.opened == 1
    for period in (0.030, 0.030, 0.010):  # two slower steps, one faster
        ledger.charge_step(period)
    assert ledger.lost_s == pytest.approx(0.010) and ledger.charged == 3
    ledger.close()
    ledger.charge_step(0.500)  # the decided plan runs: not charged
    assert ledger.lost_s == pytest.approx(0.010) and not ledger.is_open
    ledger.open(0.010)  # a later round: charged against its own plan, the unit unchanged
    ledger.charge_step(0.015)
    ledger.charge_own(0.180)  # a search on the training thread, whole
    assert ledger.lost_s == pytest.approx(0.195) and ledger.limit_s == pytest.approx(0.200) and not ledger.spent()
    ledger.charge_step(0.016)
    assert ledger.spent()
    assert ledger.line() == (
        "the tuning's budget is spent: its 5 steps of searching and trying lost 0.20 s against the plans they "
        "started from, the budget 0.20 s (10 steps of the starting plan's 20.00 ms (Autotune.budget_steps))"
    )


def test_the_smaller_budget_binds_and_a_round_without_a_measured_step_charges_nothing() -> None:
    both = Ledger(budget_steps=100, budget_s=0.5)
    assert both.limit_s == 0.5  # before any profile, the seconds alone
    both.open(0.002)
    assert both.limit_s == pytest.approx(0.2)
    both.open(0.050)
    assert both.limit_s == pytest.approx(0.2)  # the unit is the first round's
    assert "100 steps of the starting plan's 2.00 ms (Autotune.budget_steps) or 0.5 s (Autotune.budget_s)" in (
        Ledger(100, 0.5, lost_s=1.0, unit_s=0.002).line()
    )
    unmeasured = Ledger(budget_steps=1, budget_s=None)
    unmeasured.open(None)
    unmeasured.charge_step(5.0)
    assert not unmeasured.is_open and unmeasured.lost_s == 0 and not unmeasured.spent()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"budget_steps": 0}, "budget_steps must be an int >= 1 or None"),
        ({"budget_steps": 2.5}, "budget_steps must be an int >= 1 or None"),
        ({"budget_steps": True}, "budget_steps must be an int >= 1 or None"),
        ({"budget_s": 0}, "budget_s must be a number of seconds > 0 or None"),
        ({"budget_s": "1"}, "budget_s must be a number of seconds > 0 or None"),
    ],
)
def test_a_bad_budget_is_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Autotune(**options)


def test_the_first_line_says_the_budget() -> None:
    assert Autotune().budget_steps == 50 and Autotune().budget_s is None
    assert opening(budget_steps=50).endswith(
        "with the same results; it stops once it has cost the job as much as 50 of that plan's steps "
        "(Autotune.budget_steps)"
    )
    from torchrec_swp.autotune.report import opening as said

    both = said("TrainPipelineBase", Autotune(**{**FAST, "budget_steps": 20, "budget_s": 1.5}), 1)
    assert both.endswith("as much as 20 of that plan's steps (Autotune.budget_steps) or 1.5 s (Autotune.budget_s)")
    assert not said("TrainPipelineBase", Autotune(**FAST), 1).endswith(")")  # FAST: no budget, nothing said


def test_a_trial_that_spends_the_budget_stops_and_keeps_the_plan_it_started_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first move (scripted to lose: the draw on its own thread, no run-ahead, slower
    there) costs 6 ms a step on its visits; a budget of one step is spent by the first cycle's
    judgement, where the race still goes on: the running plan stays, nothing is searched, no
    second round or re-tune follows."""
    import torchrec_swp.autotune.search as search_module
    import torchrec_swp.autotune.tuner as tuner_module

    def no_search(*_: Any, **__: Any) -> Any:
        raise AssertionError("searched after the budget was spent")

    monkeypatch.setattr(tuner_module, "first_move", no_ahead)
    monkeypatch.setattr(search_module, "search_overlap", no_search)
    lines: list[str] = []
    options = {**FAST, "first_move": True, "budget_steps": 1, "drift_every": 5}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    tuning = Autotune(**options, report=lines.append)
    pipeline = tuned_like_plain(n, 0.006, tuning, dataset=lambda: SlowOnLoad(n, 0.006))
    d = pipeline.autotune_decision
    assert d is not None and d.decided and not d.switched, lines
    assert pipeline._swp_tuner.state == TunerState.DONE  # no re-tune: the watch never began
    assert d.why[0].startswith("first move: tried 2 plans over") and "stopped, the budget spent" in d.why[0], d.why
    assert d.why[-1].startswith("keeps the plan: the tuning's budget is spent: its ")
    assert "; the trial stopped after " in d.why[-1] and d.why[-1].endswith(", nothing more is searched or tried")
    assert d.lost_s >= 0.006 and d.switches == 2  # to the move and back
    assert d.why[2].startswith("first move: tried threads") and "still racing where the budget stopped" in d.why[2]
    heads = [line for line in lines if "keeps the plan: the tuning's budget is spent" in line]
    assert len(heads) == 1 and heads[0].startswith("autotune TrainPipelineBase: profiled 12 steps"), lines
    assert not any("searches from the running plan" in line for line in lines), lines


class NeverEnds:
    """A search in the background that runs until cancelled (scripted), and while it runs takes
    ``slow_s`` more of every item's time (its CPU taken from the ranks)."""

    started: list[NeverEnds] = []
    slow_s = 0.004

    def __init__(self, *_: Any) -> None:
        self.cancelled = False
        self.elapsed_s = 0.0
        NeverEnds.started.append(self)

    @property
    def ended(self) -> bool:
        return False

    def result(self) -> Any:
        raise AssertionError("a search that never ends has no result")

    def cancel(self) -> None:
        self.cancelled = True


class Busy(Slow):
    """Items that wait ``NeverEnds.slow_s`` more while a (scripted) search runs."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if any(not s.cancelled for s in NeverEnds.started):
            time.sleep(NeverEnds.slow_s)
        return super().__getitem__(i)


def _stopped_after(why: str) -> int:
    return int(why.split("; the search stopped after ")[1].split(" steps")[0])


def test_a_search_in_the_background_that_spends_the_budget_is_stopped_at_a_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps 4 ms slower than the profile measured while the search runs: a budget of 2 of the
    profile's steps is spent within 2 steps, the search stopped at the next poll (every 4 calls),
    the starting plan kept, and the data trains on as without tuning."""
    import torchrec_swp.autotune.tuner as tuner_module

    NeverEnds.started.clear()
    monkeypatch.setattr(tuner_module, "start", NeverEnds)
    lines: list[str] = []
    options = {**FAST, "background": True, "budget_steps": 2, "rounds": 1}
    n = 60
    tuning = Autotune(**options, report=lines.append)
    pipeline = tuned_like_plain(n, 0.002, tuning, dataset=lambda: Busy(n, 0.002))
    d = pipeline.autotune_decision
    assert d is not None and d.decided and not d.switched, lines
    assert len(NeverEnds.started) == 1 and NeverEnds.started[0].cancelled
    (why,) = d.why
    assert why.startswith("keeps the plan: the tuning's budget is spent: its "), why
    stopped = _stopped_after(why)
    assert stopped % tuner_module.POLL_EVERY == 0 and stopped <= 3 * tuner_module.POLL_EVERY, why
    assert d.measured_start_s is not None and d.lost_s >= 2 * d.measured_start_s
    assert d.tuning_steps is not None and d.tuning_steps < n - 20
    assert pipeline._swp_tuner.state == TunerState.DONE
    # a resume keeps what was spent: no re-tune after it either (the account goes on from lost_s)
    state = pipeline.state_dict()
    assert state["autotune"]["spent"] is not None and state["autotune"]["spent"] in why
    resumed: list[str] = []
    _, again, _ = train(40, 0.002, state=state, autotune=Autotune(**options, drift_every=5, report=resumed.append))
    tuner = again._swp_tuner
    assert again.autotune_decision == d and tuner.state == TunerState.DONE and resumed[1:] == [], resumed
    assert tuner._ledger.lost_s == d.lost_s and tuner._ledger.spent()


def test_a_second_round_stopped_by_the_budget_keeps_the_first_round_s_plan_and_verifies_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first move wins (a loader that waits, run ahead); the second round's search (scripted,
    never ending, slowing every step 4 ms) spends a budget of 2 steps: stopped at a poll, the
    moved plan stays, with no prediction (its trial measured it best), and is verified."""
    import torchrec_swp.autotune.tuner as tuner_module

    NeverEnds.started.clear()
    monkeypatch.setattr(tuner_module, "start", NeverEnds)
    lines: list[str] = []
    options = {**FAST, "first_move": True, "background": True, "budget_steps": 2}
    n = Autotune(**options).tuning_bound(plans.default_plans()["TrainPipelineBase"].pipeline_depth)
    tuning = Autotune(**options, report=lines.append)
    pipeline = tuned_like_plain(n, 0.006, tuning, dataset=lambda: Busy(n, 0.006))
    d = pipeline.autotune_decision
    assert d is not None and d.decided and d.switched, lines
    assert pipeline.plan.task("LoadBatch").thread_group == "load"  # the first move's plan
    assert len(NeverEnds.started) == 1 and NeverEnds.started[0].cancelled  # round 2's search, stopped
    stop = [w for w in d.why if w.startswith("second round: keeps the plan: the tuning's budget is spent")]
    assert len(stop) == 1 and _stopped_after(stop[0]) % tuner_module.POLL_EVERY == 0, d.why
    assert d.predicted_s is None and d.measured_s is not None  # verified; no prediction was made
    verified = [line for line in lines if " per step over " in line and "with the chosen plan" in line]
    assert len(verified) == 1 and "no prediction: the trial measured it best" in verified[0], lines
    assert pipeline._swp_tuner.state == TunerState.DONE  # no re-tune once the budget is spent
