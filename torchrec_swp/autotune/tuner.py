"""The tuner of one pipeline: warm up, profile, decide with every rank, switch, verify.

A ``Tuner`` lives beside a pipeline's engine and sees each ``progress()`` call begin
(``before_step``). Its life, in calls (``Autotune`` has the counts):

1. **warm-up**: the starting plan runs, nothing measured;
2. **profiling**: a ``TaskProfiler`` rides along the engine's observer (any observer already
   attached keeps receiving everything); each call's period (from one call's start to the
   next's: the step as the caller lives it) is kept;
3. **decision**, at the start of the next call: this rank's profile (with its rank, machine, the
   data's split draws and one batch's size) goes to rank 0, which searches
   (``autosched.overlap``) and sends every rank the plan, or the reason to keep the starting one;
   every rank then switches its engine (``Engine.switch_plan``) before the call walks on, so the
   new plan runs from that call's batch on: nothing lost, nothing repeated, the same numerics;
   a plan giving the input dist its own comm group first gets its process group (the pipeline's
   ``enable`` hook, a collective every rank makes at the same call);
4. **second round** (``rounds`` 2): once the switch has settled, the running plan is profiled
   again and searched from, its costs now those it runs with; the ranks may switch once more, and
   the prediction of the plan they keep, made from its own profile, is the one reported;
5. **verification**: after the run-ahead has settled, ``verify`` periods are measured and
   reported beside the prediction.

Where the data ends (``progress()`` raises StopIteration) before a step of this life, the tuner
says so in one line: before the decision, ``decision`` becomes a ``Decision`` with ``decided``
False whose ``why`` says after how many steps and how many of the profiled ones it had (the
starting plan runs on); a later decision, if ``progress()`` gets more data, replaces it. In the
second round or the verification, the decision stands and the line says what was not done.

The starting plan does not run ahead (lookahead 0): between two calls every thread stands at the
same batch boundary and the first switch happens at once. A second switch, from a plan that runs
ahead, waits until the calling thread has caught up with the threads ahead
(``Engine.switch_plan``); nothing is drained either way. ``state_dict()`` carries the decision,
so a resumed pipeline applies it at once instead of tuning again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from torchrec_swp.autosched.inputs import from_profiles
from torchrec_swp.autosched.overlap import Space, apply_candidate, search_overlap
from torchrec_swp.autotune.agreement import from_rank0, gather_to_all, machine, world
from torchrec_swp.autotune.options import Autotune, PrintedReport
from torchrec_swp.autotune.sizes import batch_bytes
from torchrec_swp.autotune.tee import Tee
from torchrec_swp.catalog.torchrec import DRAW_TASKS
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.profiler import Profile, ProfileError, TaskProfiler

#: steps left out after a switch beyond the new plan's fill and run-ahead: its threads' first
#: iterations (caches, first wake-ups) cost more than the steady ones a profile or a verification measures
SETTLE = 3


class TunedEngine(Protocol):
    """What the tuner needs of the engine (``torchrec_swp.engine.Engine``)."""

    plan: PipelinePlan
    phased: PhasedPlan

    @property
    def observer(self) -> Any: ...

    def slot(self, b: int) -> Mapping[str, Any]: ...

    @property
    def draws(self) -> Any: ...

    def instrument(self, observer: Any = None, *, labels: bool = False) -> None: ...

    def in_flight(self) -> list[int]: ...

    def switch_plan(self, plan: PipelinePlan | PhasedPlan) -> bool: ...

    @property
    def switch_pending(self) -> bool: ...


@dataclass(frozen=True)
class Decision:
    """What the ranks decided: ``plan`` the found plan's text (of the profiled phase; None: keep
    the starting plan), whether it gives the input dist its own comm group, the predicted step of
    it (from its own profile after a second round; ``first_predicted_s``: from the starting plan's)
    and of the starting plan, the starting plan's measured step, the lines saying why, and (once
    verified) the measured step with the chosen plan.

    ``decided`` False: no decision was taken, the data ended first (``why``: ``not decided: the
    data ended after N steps, having profiled P of the S steps it needs ...``; ``plan`` None: the
    starting plan runs). Such a record is not checkpointed: a resume tunes again."""

    plan: str | None
    own_group: bool = False
    predicted_s: float | None = None
    baseline_s: float | None = None
    measured_start_s: float | None = None
    why: tuple[str, ...] = ()
    measured_s: float | None = None
    first_predicted_s: float | None = None
    decided: bool = True

    @property
    def switched(self) -> bool:
        return self.plan is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        return cls(**{**data, "why": tuple(data.get("why", ()))})


@dataclass(frozen=True)
class Hooks:
    """What the pipeline lets the tuner change beyond the plan: the tasks that may move to a comm
    group of their own, and ``enable()`` giving them their process group (a collective)."""

    own_group: tuple[str, ...] = ()
    enable: Callable[[], None] | None = None


class Tuner:
    """One pipeline's tuner (module docstring)."""

    def __init__(self, options: Autotune, engine: TunedEngine, hooks: Hooks, owner: str) -> None:
        self.options = options
        self.engine = engine
        self.hooks = hooks
        self.owner = owner
        self.calls = 0
        self.phase = "warmup"
        self.round = 1
        self._until = 0  # the last call of the current profiling or settling
        self.decision: Decision | None = None
        self._profiler: TaskProfiler | None = None
        self._previous: Any = None  # the observer attached before the tuner's
        self._last_start: float | None = None
        self._periods: list[float] = []
        self._settle = 0
        self._phase_call = 0  # the call whose step began the current profiling or verification
        self._ended_call = -1  # the last call whose step found the data ended

    # ------------------------------------------------------------------ the calls
    def before_step(self) -> None:
        """A ``progress()`` call begins (before the engine steps)."""
        now = time.perf_counter()
        if self._last_start is not None and self.phase in ("profiling", "verifying"):
            self._periods.append(now - self._last_start)
        self._last_start = now
        self.calls += 1
        o = self.options
        if self.phase == "warmup" and self.calls > o.warmup:
            self._profile_for(o.steps)
        elif self.phase == "settling" and self.calls > self._until and not self.engine.switch_pending:
            self._profile_for(o.steps)
        elif self.phase == "profiling" and self.calls > self._until:
            self._detach()
            self._decide()
            self._last_start = time.perf_counter()  # the decision's own time is not a step
        elif self.phase == "verifying" and len(self._periods) >= self._settle + o.verify:
            self._verified()

    def _profile_for(self, steps: int) -> None:
        self._attach()
        self.phase, self._until = "profiling", self.calls + steps - 1
        self._phase_call = self.calls
        self._periods = []

    def data_ended(self) -> None:
        """The ``progress()`` call that began last found the data ended (it raises StopIteration):
        say what that leaves undone, once for consecutive calls that find it ended."""
        ended_before, self._ended_call = self._ended_call == self.calls - 1, self.calls
        if ended_before or self.phase == "done":
            return
        o, who = self.options, f"autotune {self.owner}"
        steps = self.calls - 1  # the calls before this one trained their batches
        profiled = self.calls - self._phase_call if self.phase == "profiling" else 0
        if self.round == 1 and self.phase in ("warmup", "profiling"):
            warmup = f" after {o.warmup} warm-up steps" if o.warmup else ""
            why = (
                f"not decided: the data ended after {steps} steps, having profiled {profiled} of the {o.steps} steps "
                f"it needs{warmup}"
            )
            self.decision = Decision(None, why=(why,), decided=False)
            self._report(f"{who}: {why}; the starting plan stays", headline=True)
        elif self.phase == "verifying":
            after = self.calls - self._phase_call
            self._report(
                f"{who}: not verified: the data ended {after} steps after the switch, before the "
                f"{self._settle + o.verify} steps it measures ({self._settle} to settle, then {o.verify}); "
                "the chosen plan stays",
                headline=True,
            )
        else:  # the second round, settling or profiling
            self._report(
                f"{who}: second round not done: the data ended after {steps} steps, having profiled {profiled} of the "
                f"{o.steps} steps it needs; the chosen plan stays",
                headline=True,
            )

    # ------------------------------------------------------------------ profiling
    def _attach(self) -> None:
        self._profiler = TaskProfiler(warmup=0)
        self._previous = self.engine.observer
        self.engine.instrument(self._profiler if self._previous is None else Tee(self._previous, self._profiler))

    def _detach(self) -> None:
        if self._previous is None:
            self.engine.instrument()
        else:
            self.engine.instrument(self._previous)

    def _profile(self) -> Profile:
        assert self._profiler is not None
        rank, size = world()
        host, cores = machine()
        draws = self.engine.draws
        newest = max(self.engine.in_flight(), default=None)
        size_of = batch_bytes(dict(self.engine.slot(newest))) if newest is not None else 0
        return self._profiler.profile(self.engine.plan).with_where(
            rank=rank,
            world_size=size,
            host=host,
            cores=cores,
            split_draws=bool(draws is not None and draws.splits),
            batch_bytes=float(size_of),
        )

    # ------------------------------------------------------------------ the decision
    def _decide(self) -> None:
        measured = statistics.fmean(self._periods) if self._periods else None
        self._periods = []
        try:
            mine: dict[str, Any] | None = self._profile().to_json()
            trouble = ""
        except ProfileError as e:
            mine, trouble = None, f"rank {world()[0]}: {e}"
        profiles = gather_to_all({"profile": mine, "trouble": trouble})
        found = None
        if world()[0] == 0:
            found = self._search(profiles, measured).to_dict()
        decision = Decision.from_dict(from_rank0(found))
        before = self.decision
        running = self.engine.plan
        if self.round == 1:
            self.decision = decision
            if decision.switched:
                self._apply(decision)
        else:  # the running plan re-profiled: switch again, or keep it with its own prediction
            assert before is not None
            if decision.switched:
                self._apply(decision)
            self.decision = replace(
                decision if decision.switched else before,
                plan=decision.plan if decision.switched else before.plan,
                own_group=before.own_group or decision.own_group,
                predicted_s=decision.predicted_s if decision.switched else decision.baseline_s,
                first_predicted_s=before.predicted_s,
                baseline_s=before.baseline_s,
                measured_start_s=before.measured_start_s,
                why=(*before.why, *(f"second round: {line}" for line in decision.why)),
            )
        head, reasons = self._lines(decision, self.round)
        self._report(head, headline=True)
        for line in reasons:
            self._report(line)
        # until the new plan runs steadily: the threads that ran ahead catch up (a switch from a
        # plan with lookahead waits for that), then the new plan fills its run-ahead
        plan = PipelinePlan.from_text(decision.plan) if decision.switched else running  # type: ignore[arg-type]
        self._settle = running.lookahead + plan.pipeline_depth + plan.lookahead + plan.loads + SETTLE
        if not self.decision.switched:
            self.phase = "done"
        elif self.round < self.options.rounds:
            self.round += 1
            self.phase, self._until = "settling", self.calls + self._settle
        else:
            self.phase, self._phase_call = "verifying", self.calls

    def _search(self, gathered: list[dict[str, Any]], measured: float | None) -> Decision:
        """Rank 0: every rank's profile -> the decision (the profiled plan kept, with the reason,
        when anything is amiss or nothing wins by more than the noise)."""
        o = self.options
        trouble = [g["trouble"] for g in gathered if g["trouble"]]
        if trouble:
            return Decision(None, measured_start_s=measured, why=(f"keeps the plan: cannot profile ({trouble[0]})",))
        try:
            profiles = [Profile.from_json(g["profile"]) for g in gathered]
            inputs = from_profiles(profiles, wake=o.wake_s, gil=o.gil)
            profiled = profiles[0].plan
            loads = o.loads if profiled.source in DRAW_TASKS and inputs.split_draws else (1,)
            space = Space(
                lookahead=o.lookahead,
                loads=loads,
                own_group=self.hooks.own_group if self.hooks.enable is not None and self.round == 1 else (),
                max_threads=o.max_threads,
                max_in_flight=o.max_in_flight,
                batch_bytes=inputs.batch_bytes,
                memory_cap_bytes=o.memory_cap_bytes,
                split_draws=inputs.split_draws,
                # the first round predicts plans it has not seen: every task at its mean cost (the
                # closer on other plans, benchmarks/sim_vs_real.py); a later one the plan it
                # profiled and its neighbours: the measured iterations in turn (the closer there)
                mode="mean" if self.round == 1 else "replay",
            )
            result = search_overlap(profiled, inputs.calibration, inputs.machine, space)
        except (PlanError, ProfileError, ValueError) as e:
            return Decision(None, measured_start_s=measured, why=(f"keeps the plan: {e}",))
        why = tuple(result.why(start="the starting plan" if self.round == 1 else "the chosen plan"))
        margin = o.noise
        if result.speedup < 1 + margin:
            return Decision(
                None,
                predicted_s=result.predicted,
                baseline_s=result.baseline,
                measured_start_s=measured,
                why=(
                    *why,
                    f"keeps the plan: the best change is predicted x{result.speedup:.2f}, "
                    f"within the noise ({100 * margin:.0f}%)",
                ),
            )
        return Decision(
            result.plan.to_text(),
            own_group=result.best.candidate.own_group,
            predicted_s=result.predicted,
            baseline_s=result.baseline,
            measured_start_s=measured,
            why=why,
        )

    def _apply(self, decision: Decision) -> None:
        """Switch the engine to the decided plan (every phase edited alike)."""
        assert decision.plan is not None
        found = PipelinePlan.from_text(decision.plan)
        if decision.own_group and self.hooks.enable is not None:
            self.hooks.enable()
        running = self.engine.phased if len(self.engine.phased.phases) > 1 else self.engine.plan
        self.engine.switch_plan(apply_candidate(running, found))

    def _verified(self) -> None:
        assert self.decision is not None
        periods = self._periods[self._settle :]
        self.decision = replace(self.decision, measured_s=statistics.fmean(periods))
        self.phase = "done"
        d = self.decision
        assert d.measured_s is not None and d.predicted_s is not None
        off = 100 * (d.predicted_s / d.measured_s - 1)
        side = "under" if off < 0 else "over"
        self._report(
            f"autotune {self.owner}: measured {1e3 * d.measured_s:.2f} ms per step over {len(periods)} steps "
            f"with the chosen plan (predicted {1e3 * d.predicted_s:.2f} ms, {abs(off):.0f}% {side})",
            headline=True,
        )

    # ------------------------------------------------------------------ reports
    def _lines(self, d: Decision, round_: int) -> tuple[str, list[str]]:
        """What one round's decision ``d`` says: the headline (what it does, and for a plan kept
        in the first round, why), then the reasons."""
        who = f"autotune {self.owner}"
        reasons = list(d.why)
        measured = f" ({1e3 * d.measured_start_s:.2f} ms per step measured)" if d.measured_start_s is not None else ""
        if round_ == 1:
            head = f"{who}: profiled {self.options.steps} steps{measured}"
        else:
            head = f"{who}: second round: profiled the chosen plan as it runs{measured}"
        if d.switched:
            found = PipelinePlan.from_text(d.plan)  # type: ignore[arg-type]
            head += (
                f"; switches to threads {list(found.thread_groups)}, lookahead {found.lookahead}, loads {found.loads}"
                + (", the input dist in its own comm group" if d.own_group else "")
            )
            if d.predicted_s is not None and d.baseline_s is not None and d.predicted_s > 0:
                head += f": predicted {1e3 * d.predicted_s:.2f} ms per step (x{d.baseline_s / d.predicted_s:.2f})"
        elif round_ > 1 and d.baseline_s is not None:
            head += f"; keeps it: predicted {1e3 * d.baseline_s:.2f} ms per step from its own profile"
        elif reasons and reasons[-1].startswith("keeps the plan"):
            head += f"; {reasons.pop()}"
        prefix = "" if round_ == 1 else "second round: "
        return head, [f"{who}: {prefix}{line}" for line in reasons]

    def _report(self, line: str, headline: bool = False) -> None:
        """One line to ``Autotune.report``, on rank 0 only; a headline to the default report's
        ``headline`` (stdout too)."""
        report = self.options.report
        if report is None or world()[0] != 0:
            return
        if headline and isinstance(report, PrintedReport):
            report.headline(line)
        else:
            report(line)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The decision (None while still tuning or when the data ended before it decided: a
        resume then tunes again)."""
        d = self.decision
        return {"decision": None if d is None or not d.decided else d.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Apply a saved decision at once (before the first step): no tuning again."""
        saved = state.get("decision")
        if saved is None:
            return
        self.decision = Decision.from_dict(saved)
        if self.decision.switched:
            self._apply(self.decision)
        self.phase = "done"
