"""The tuner of one pipeline: warm up, profile, decide with every rank, try, switch, verify, watch.

A ``Tuner`` lives beside a pipeline's engine and sees each ``progress()`` call begin
(``before_step``). Its life, in calls (``Autotune`` has the counts):

1. **warm-up**: the starting plan runs, nothing measured;
2. **profiling**: a ``TaskProfiler`` rides along the engine's observer (any observer already
   attached keeps receiving everything); each call's period (from one call's start to the
   next's: the step as the caller lives it) is kept;
3. **decision**, at the start of the next call: this rank's profile (with its rank, machine, the
   data's split draws and one batch's size) goes to rank 0, which searches
   (``autosched.overlap``) and sends every rank the plans to try, or the reason to keep the
   starting one; a plan giving the input dist its own comm group first gets its process group
   (the pipeline's ``enable`` hook, a collective every rank makes at the same call). In round
   1, where the profile shows the draw waiting or computing (``first_move.py``: its thread mostly
   off the CPU, or mostly on it, the draw a tenth of the step or more), nothing is searched
   first: the trial below starts at once with the running plan (its first visit the profile's
   last steps) and the draw on a thread of its own (for one that computes, also in worker
   processes); the search follows from a plan that won (round 2), or, where the running plan
   stays, from the profile already taken for a draw that waits, not at all for one that computes
   (the model would propose the same plans);
4. **trial** (``trial.py``): the running plan and the search's best few run in turn for a few
   steps each (A, B, C, A, B, C ...), every switch at a batch boundary (``Engine.switch_plan``:
   nothing lost, nothing repeated, the same numerics); after each cycle rank 0 judges every rank's
   measurements (``trial.race``) and tells every rank which plans stay in the race; the measured
   best wins and runs from there on. Every switch and every step of it is counted
   (``Decision.switches``, ``trial_steps``) and bounded (``Autotune.trial_bound``);
5. **second round** (``rounds`` 2): once the switch has settled, the running plan is profiled
   again and searched from, its costs now those it runs with; a plan predicted to win is tried
   against it; the prediction of the plan kept, made from its own profile, is the one reported;
6. **verification**: after the run-ahead has settled, ``verify`` periods are measured and
   reported beside the prediction;
7. **watching** (``drift``): every ``drift_every`` steps, the mean of the last ``verify``
   periods (``step_of``: the time per batch; their median misses loads that deliver in bursts)
   against the one measured when the plan was chosen; past ``drift`` at two checks in a
   row (``DRIFT_CHECKS``) every rank profiles the running plan again, searches and tries (a
   re-tune: at most ``retunes``).

The ranks agree by collectives of the calling thread (``agreement.py``) at the same call on every
rank: every count above is in calls, the same on every rank. Such a collective waits for a call
where no engine thread can issue one (``trial.needs_quiet``: a plan that runs ahead with a
collective off the calling thread first switches to itself without lookahead for the few calls
until every thread stands at the caller's boundary, then back).

Where the data ends (``progress()`` raises StopIteration) before a step of this life, the tuner
says so in one line: before the decision, ``decision`` becomes a ``Decision`` with ``decided``
False whose ``why`` says after how many steps and how many of the profiled ones it had (the
starting plan runs on); a later decision, if ``progress()`` gets more data, replaces it. In a
trial the plan running stays (every candidate trains alike), the visit's measurements are dropped
and, with more data, the visit starts again. In the second round or the verification, the
decision stands and the line says what was not done.

Each state (``TunerState``) has one handler (``HANDLERS``: ``Tuner._on_<state>``), which
``before_step`` calls after giving the step that ended to what the state measures; what the tuner
says, and where it goes, is ``report.py``; its record, ``decision.py``.

The starting plan does not run ahead (lookahead 0): between two calls every thread stands at the
same batch boundary and the first switch happens at once. A switch from a plan that runs ahead
waits until the calling thread has caught up with the threads ahead (``Engine.switch_plan``), at
most its lookahead in calls; nothing is drained either way. ``state_dict()`` carries the decision,
so a resumed pipeline applies it at once instead of tuning (or trying) again.

What tuning costs is counted from each round's profile to its decision (``budget.Ledger``:
every step against the running plan's measured step, the tuner's own time whole); where it
reaches ``Autotune.budget_steps`` / ``budget_s``, rank 0 says so at the next agreement (a
trial's judgement, a search's poll): the trial gives way to the plan it started from, the search
stops, and the tuner ends there (``_spent``: no later round, no drift watch, across a resume).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

from torchrec_swp.autosched.overlap import apply_candidate
from torchrec_swp.autotune import report
from torchrec_swp.autotune.agreement import code_from_rank0, from_rank0, gather_to_all, machine, world
from torchrec_swp.autotune.budget import Ledger
from torchrec_swp.autotune.decision import Decision
from torchrec_swp.autotune.first_move import FirstMove, first_move
from torchrec_swp.autotune.options import Autotune
from torchrec_swp.autotune.search import BackgroundSearch, Found, Request, SearchedHere, search, start
from torchrec_swp.autotune.sizes import batch_bytes
from torchrec_swp.autotune.tee import Tee
from torchrec_swp.autotune.trial import (
    SETTLE,
    Trial,
    describe,
    engine_threads,
    measured_steps,
    needs_quiet,
    settle_steps,
    trial_bound,
    tried_line,
)
from torchrec_swp.plan import PhasedPlan, PipelinePlan
from torchrec_swp.profiler import Profile, ProfileError, TaskProfiler

#: consecutive checks past ``Autotune.drift`` that make a drift (a tuning costs a search of seconds)
DRIFT_CHECKS = 2
#: the calls between two polls of a search in the background (each a broadcast that every rank
#: waits for: the search takes seconds, its result can wait a few steps)
POLL_EVERY = 4
#: what rank 0 says at a poll of the search in the background (``code_from_rank0``)
RUNS, ENDED, SPENT = 0, 1, 2


def step_of(periods: Sequence[float]) -> float:
    """The step that consecutive calls' ``periods`` say: their mean, the time per batch. Not
    their median: a plan with parallel loads delivers in bursts (one call waits for the loads,
    the next ``loads - 1`` find their batches ready), and the median of such calls is the short
    one's, however slow the loads."""
    return statistics.fmean(periods)


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
class Hooks:
    """What the pipeline lets the tuner change beyond the plan: the tasks that may move to a comm
    group of their own, and ``enable()`` giving them their process group (a collective)."""

    own_group: tuple[str, ...] = ()
    enable: Callable[[], None] | None = None
    #: a process group of the tuner's own (gloo), made on first use and torn down by the pipeline:
    #: its polls while the search runs in the background (None: in a world of several ranks, the
    #: search runs on the training thread)
    group: Callable[[], Any] | None = None


class TunerState(Enum):
    """Where a tuner stands (``Tuner.state``; not a plan's phase, ``PhasedPlan``): warm-up calls,
    settling after a switch, profiling, quieting the threads before a collective, trying the
    candidates, verifying the decision, watching for drift, done; searching: the search runs in a
    process of its own while the pipeline trains on."""

    WARMUP = "warmup"
    SETTLING = "settling"
    PROFILING = "profiling"
    QUIETING = "quieting"
    SEARCHING = "searching"
    TRYING = "trying"
    VERIFYING = "verifying"
    WATCHING = "watching"
    DONE = "done"


class Tuner:
    """One pipeline's tuner (module docstring)."""

    def __init__(self, options: Autotune, engine: TunedEngine, hooks: Hooks, owner: str) -> None:
        self.options = options
        self.engine = engine
        self.hooks = hooks
        self.owner = owner
        self.calls = 0
        self.state = TunerState.WARMUP
        self.round = 1
        self._until = 0  # the last call of the current profiling or settling
        self.decision: Decision | None = None
        self._profiler: TaskProfiler | None = None
        self._previous: Any = None  # the observer attached before the tuner's
        self._last_start: float | None = None
        self._starting: str | None = None  # the plan round 1 profiled (a contender in later rounds)
        self._periods: list[float] = []
        self._settle = 0
        self._state_call = 0  # the call whose step began the current profiling or verification
        self._ended_call = -1  # the last call whose step found the data ended
        self._trial: Trial | None = None
        self._proposal: Decision | None = None  # the search's decision a trial started from
        self._own_groups: list[bool] = []  # whether each candidate of the trial has the own comm group
        self._on: int | None = None  # the trial's candidate running (None: another plan)
        self._quiet: tuple[int, Callable[[], None], TunerState] | None = None  # (call, action, state after)
        self._quiet_back: PipelinePlan | None = None  # the plan to go back to after a quiet call
        self._group_enabled = False
        self._switches = 0
        self._trial_steps = 0
        self._retunes = 0
        self._drift_round = False
        self._reference: float | None = None  # the step the drift is measured against (step_of)
        self._window: deque[float] = deque(maxlen=options.verify)
        self._watch_from = 0
        self._drifting = 0  # consecutive checks past the drift
        self._search: BackgroundSearch | SearchedHere | None = None  # rank 0's search in the background
        self._searched_from = 0  # the call the search began at
        self._group: Any = None  # the tuner's own process group (Hooks.group), made on first use
        self._processes = 0  # the worker processes the running candidate or decision fetches in
        self._applied: tuple[weakref.ref[Any], int] | None = None  # the data they were last set on, and to
        self._first_tried = False  # whether round 1 has looked for a first move (first_move.py)
        self._move: FirstMove | None = None  # the first move under trial
        self._held: Request | None = None  # rank 0's request round 1 searches where the first move lost
        self._first_lines: tuple[str, ...] = ()  # what the first move's trial said, where it lost
        self._ledger = Ledger(options.budget_steps, options.budget_s)  # what tuning has cost (budget.py)
        self._spent: str | None = None  # rank 0's line where the budget is spent (the same on every rank)
        short = options.too_short(engine.plan.pipeline_depth)
        if short is not None:  # the pipeline runs its own plan (``start_for_tuning`` not applied)
            self.decision, self.state = Decision(None, why=(short,)), TunerState.DONE
            self._report(f"autotune {owner}: {short}", headline=True)
            return
        self._report(report.opening(owner, options, engine.plan.pipeline_depth), headline=True)

    def before_step(self) -> None:
        """A ``progress()`` call begins (before the engine steps): the step that just ended goes
        to what the state measures (``_measure``), then the state's handler (``HANDLERS``) acts."""
        now = time.perf_counter()
        if self._last_start is not None:
            self._measure(now - self._last_start)
            self._ledger.charge_step(now - self._last_start)
        self._last_start = now
        self.calls += 1
        self._follow_data()
        was_open, opened = self._ledger.is_open, self._ledger.opened
        HANDLERS[self.state](self)
        self._last_start = time.perf_counter()  # the tuner's own time (a search, a switch) is not a step
        if was_open or self._ledger.is_open or self._ledger.opened != opened:  # but it is a cost
            self._ledger.charge_own(self._last_start - now)

    def _measure(self, period: float) -> None:
        """Where the step that just ended (``period``, from one call's start to the next's) goes:
        the profile's or the verification's periods, the drift watch's window, the trial's visit."""
        if self.state in (TunerState.PROFILING, TunerState.VERIFYING):
            self._periods.append(period)
        elif self.state == TunerState.WATCHING:
            self._window.append(period)
        elif self.state == TunerState.TRYING and self._trial is not None:
            self._trial.measure(self.calls, period)  # self.calls: the call before this one

    # ------------------------------------------------------------------ one handler per state
    def _on_warmup(self) -> None:
        if self.calls > self.options.warmup:
            self._profile_for(self.options.steps)

    def _on_settling(self) -> None:
        if self.calls > self._until and not self.engine.switch_pending:
            self._profile_for(self.options.steps)

    def _on_profiling(self) -> None:
        if self.calls > self._until:
            self._detach()
            self._when_quiet(self._decide)

    def _on_quieting(self) -> None:
        assert self._quiet is not None
        at, action, after = self._quiet
        if self.calls >= at:
            self._quiet, self.state = None, after
            action()
            if self._quiet_back is not None:  # the action switched nowhere: back to the plan
                back, self._quiet_back = self._quiet_back, None
                self._switch(back)

    def _on_verifying(self) -> None:
        if len(self._periods) >= self._settle + self.options.verify:
            self._verified()

    def _on_watching(self) -> None:
        o = self.options
        if o.drift is not None:
            since = self.calls - self._watch_from
            if since > 0 and since % o.drift_every == 0 and len(self._window) == self._window.maxlen:
                self._when_quiet(self._check_drift)

    def _on_done(self) -> None:
        pass

    def _profile_for(self, steps: int) -> None:
        self._attach()
        self.state, self._until = TunerState.PROFILING, self.calls + steps - 1
        self._state_call = self.calls
        self._periods = []

    def _when_quiet(self, action: Callable[[], None]) -> None:
        """Run ``action`` (collectives of every rank) now, or, where an engine thread of the
        running plan may issue a collective between calls (``needs_quiet``), at the call by which
        that plan without lookahead stands at the caller's boundary (every rank at the same call)."""
        plan = self.engine.plan
        if world()[1] == 1 or not needs_quiet(plan):
            action()
            return
        self._switch(plan.replace(lookahead=0))
        self._quiet_back = plan
        self._on = None
        self._quiet = (self.calls + plan.lookahead + 1, action, self.state)
        self.state = TunerState.QUIETING

    def _switch(self, plan: PipelinePlan) -> None:
        """Run ``plan`` (of the profiled phase; every phase edited alike) from the next boundary."""
        self._quiet_back = None
        running = self.engine.phased if len(self.engine.phased.phases) > 1 else self.engine.plan
        self.engine.switch_plan(apply_candidate(running, plan))
        self._switches += 1

    def data_ended(self) -> None:
        """The ``progress()`` call that began last found the data ended (it raises StopIteration):
        say what that leaves undone, once for consecutive calls that find it ended."""
        ended_before, self._ended_call = self._ended_call == self.calls - 1, self.calls
        if self.state == TunerState.TRYING:
            self._trial_data_ended(ended_before)
            return
        if ended_before or self.state in (TunerState.DONE, TunerState.WATCHING, TunerState.QUIETING):
            return
        o, who = self.options, f"autotune {self.owner}"
        steps = self.calls - 1  # the calls before this one trained their batches
        profiled = self.calls - self._state_call if self.state == TunerState.PROFILING else 0
        if self.state == TunerState.SEARCHING:
            running = self._search.elapsed_s if self._search is not None else None
            took = f" ({running:.1f} s so far)" if running is not None else ""
            into = f"the data ended after {steps} steps, {self.calls - self._searched_from} steps into the search"
            stays = "; the running plan stays (with more data the search's result is taken)"
            if self.round == 1:  # (the same record on every rank: the search's time is rank 0's)
                self.decision = Decision(None, why=(f"not decided: {into}{stays}",), decided=False)
                self._report(f"{who}: not decided: {into}{took}{stays}", headline=True)
            else:
                self._report(f"{who}: {self._round_name()} not done: {into}{took}{stays}", headline=True)
            return
        if self.round == 1 and self.state in (TunerState.WARMUP, TunerState.PROFILING):
            warmup = f" after {o.warmup} warm-up steps" if o.warmup else ""
            why = (
                f"not decided: the data ended after {steps} steps, having profiled {profiled} of the {o.steps} steps "
                f"it needs{warmup}"
            )
            self.decision = Decision(None, why=(why,), decided=False)
            self._report(f"{who}: {why}; the starting plan stays", headline=True)
        elif self.state == TunerState.VERIFYING:
            after = self.calls - self._state_call
            self._report(
                f"{who}: not verified: the data ended {after} steps after the switch, before the "
                f"{self._settle + o.verify} steps it measures ({self._settle} to settle, then {o.verify}); "
                "the chosen plan stays",
                headline=True,
            )
        else:  # a later round, settling or profiling
            self._report(
                f"{who}: {self._round_name()} not done: the data ended after {steps} steps, having profiled "
                f"{profiled} of the {o.steps} steps it needs; the chosen plan stays",
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
        """Every rank: the profiles to rank 0, which searches (``_search_from``), or, in round 1
        where the draw waits or computes, first tries it on a thread of its own (``first_move``) in
        a trial that starts at once, its first visit of the running plan the profile's last steps."""
        measured = step_of(self._periods) if self._periods else None
        last = self._periods[-measured_steps(self.engine.plan, self.options.trial_steps) :]
        self._periods = []
        self._ledger.open(measured)  # from here the round's steps cost what they lose against this one
        if self._starting is None:  # round 1 profiled the plan the tuning starts from
            self._starting = self.engine.plan.to_text()
        try:
            mine: dict[str, Any] | None = self._profile().to_json()
            trouble = ""
        except ProfileError as e:
            mine, trouble = None, f"rank {world()[0]}: {e}"
        profiles = gather_to_all({"profile": mine, "trouble": trouble})
        request = None
        if world()[0] == 0:
            request = Request(
                options=self.options,
                round=self.round,
                gathered=profiles,
                measured=measured,
                own_group=self.hooks.own_group if self.hooks.enable is not None and self.round == 1 else (),
                drift_round=self._drift_round,
                processes=self._data_processes() is not None,
                starting=self._starting if self.round > 1 else None,
            )
        o = self.options
        if self.round == 1 and not self._first_tried and o.first_move and o.candidates and not self._drift_round:
            self._first_tried = True
            processes = self._data_processes() is not None
            move = from_rank0(first_move(profiles, measured, o, processes) if request is not None else None)
            if move is not None:
                self._held, self._move = request, move
                proposal = Decision(None, measured_start_s=measured, why=(move.why,))
                self._start_trial(proposal, move.candidates, seed=last)
                return
        self._search_from(request)

    def _search_from(self, request: Request | None) -> None:
        """Every rank (``request``: rank 0's): the search, in the background (the pipeline trains
        on until it has ended, ``_on_searching``) or here, every rank waiting."""
        self._searched_from = self.calls
        if self._in_background():
            if world()[1] > 1 and self._group is None:
                assert self.hooks.group is not None
                self._group = self.hooks.group()  # a collective: here, where every rank stands alike
            if request is not None:
                self._search = start(request, self.options.search_s)
            self.state = TunerState.SEARCHING
            return
        found = {**search(request).to_dict(), "spent": self._spent_line()} if request is not None else None
        self._found(from_rank0(found), background=False)

    def _in_background(self) -> bool:
        return self.options.background and (world()[1] == 1 or self.hooks.group is not None)

    def _on_searching(self) -> None:
        """Every ``POLL_EVERY`` calls while the search runs: rank 0 says whether it has ended (one
        small broadcast on the tuner's group); once it has, every rank takes what it found."""
        if (self.calls - self._searched_from) % POLL_EVERY:
            return
        code = RUNS
        if self._search is not None:  # rank 0 (a search that ended is taken: its cost is paid)
            code = ENDED if self._search.ended else SPENT if self._ledger.spent() else RUNS
        if world()[1] > 1:
            code = code_from_rank0(code, self._group)
        if code == SPENT:
            line = self._spent_line() if world()[0] == 0 else None
            self._spent = from_rank0(line, self._group) if world()[1] > 1 else line
            self.close()  # rank 0's search, stopped
            steps = self.calls - self._searched_from
            why = (f"keeps the plan: {self._stop_line(steps)}",)
            self._conclude(Decision(None, measured_start_s=self._ledger.reference_s, why=why))
            return
        if code == RUNS:
            return
        found = None
        if self._search is not None:
            here = isinstance(self._search, SearchedHere)
            found, self._search = {**self._search.result().to_dict(), "here": here, "spent": self._spent_line()}, None
        if world()[1] > 1:
            found = from_rank0(found, self._group)
        assert found is not None  # (rank 0's, on every rank)
        result: dict[str, Any] = found
        self._when_quiet(lambda: self._found(result, background=not result["here"]))

    def _found(self, found: dict[str, Any], background: bool = True) -> None:
        """Every rank: the search's result (``search.Found`` as a dict): try its candidates, or
        take its decision."""
        f = Found.from_dict(found)
        steps = self.calls - self._searched_from
        where = (
            f"in a process of its own while {steps} steps trained"
            if background
            else "on the training thread (every rank waited)"
        )
        decision = replace(f.decision, why=(*f.decision.why, f"the search took {f.seconds:.1f} s {where}"))
        self._spent = self._spent or found.get("spent")
        if f.candidates and self._spent is not None:  # the search's plans are not tried: the running plan stays
            why = tuple(line for line in decision.why if not line.startswith("keeps the plan"))
            untried = f"the search's {len(f.candidates) - 1} plan(s) are not tried"
            kept = f"keeps the plan: {self._stop_line(what=untried)}"
            self._conclude(replace(decision, plan=None, own_group=False, why=(*why, kept)))
        elif f.candidates:  # (plan text, predicted step, own group): the running plan first
            self._start_trial(decision, f.candidates)
        else:
            self._conclude(decision)

    def _data_processes(self) -> Callable[[int], None] | None:
        """The data's ``use_processes`` (``torchrec_swp.data.MapSource``), or None where it has none."""
        draws = self.engine.draws
        use = getattr(getattr(draws, "iterator", None), "use_processes", None)
        return use if callable(use) and draws is not None and draws.splits else None

    def _use_processes(self, processes: int) -> None:
        """The draws fetched in ``processes`` worker processes from now on (0: on their threads),
        by this data and by the data of later calls (``_follow_data``: a new epoch's source)."""
        self._processes = processes
        self._follow_data()

    def _follow_data(self) -> None:
        """The data of this call fetches in the processes chosen (a resumed decision, a new
        epoch's source): set where it differs, never on data that has only ever used threads."""
        if self._processes == 0 and self._applied is None:  # every call of a tuner that never chose processes
            return
        use = self._data_processes()
        if use is None:
            return
        draws = self.engine.draws
        assert draws is not None  # (use is not None: there are draws)
        source = draws.iterator
        if self._applied is not None and self._applied[0]() is source and self._applied[1] == self._processes:
            return
        use(self._processes)
        self._applied = (weakref.ref(source), self._processes)

    def close(self) -> None:
        """Stop a search running in the background (the pipeline's teardown calls it)."""
        if self._search is not None:
            self._search.cancel()
            self._search = None

    def _conclude(self, decision: Decision, applied: bool = False, before: PipelinePlan | None = None) -> None:
        """Take ``decision`` (this round's; ``applied``: the trial already runs its plan, switched
        from ``before``): switch, merge with the earlier rounds', report, and go on."""
        earlier = self.decision if self.round > 1 else None
        running = before if before is not None else self.engine.plan
        self._ledger.close()
        last: tuple[str, ...]
        if self._spent is not None and not any(self._spent in line for line in decision.why):
            # (a round that ended as the budget ran out: said before a plan kept's last reason)
            why, last = decision.why, ()
            if why and why[-1].startswith("keeps the plan"):
                why, last = why[:-1], why[-1:]
            decision = replace(decision, why=(*why, f"stops here: {self._spent}", *last))
        if decision.switched and not applied:
            self._apply(decision)
        if earlier is None:  # (after a first move that lost, its trial's lines first)
            merged = replace(decision, why=(*self._first_lines, *decision.why))
        else:  # the running plan re-profiled: switched again, or kept with its own prediction
            merged = replace(
                decision if decision.switched else earlier,
                plan=decision.plan if decision.switched else earlier.plan,
                own_group=earlier.own_group or decision.own_group,
                predicted_s=(  # (a round stopped before its search predicted anything: the earlier prediction)
                    decision.predicted_s
                    if decision.switched
                    else decision.baseline_s
                    if decision.baseline_s is not None
                    else earlier.predicted_s
                ),
                first_predicted_s=earlier.predicted_s,
                baseline_s=earlier.baseline_s,
                measured_start_s=earlier.measured_start_s,
                why=(*earlier.why, *(f"{self._round_name()}: {line}" for line in decision.why)),
                tried=decision.tried or earlier.tried,
                visits=decision.visits or earlier.visits,
            )
        self.decision = replace(
            merged,
            trial_steps=self._trial_steps,
            switches=self._switches,
            tuning_steps=self.calls - 1,
            retunes=self._retunes,
            lost_s=self._ledger.lost_s,
        )
        head, reasons = report.decision_lines(self.owner, decision, self.round, self._round_name(), self.options.steps)
        self._report(head, headline=True)
        for line in reasons:
            self._report(line)
        # until the new plan runs steadily: the threads that ran ahead catch up (a switch from a
        # plan with lookahead waits for that), then the new plan fills its run-ahead
        # (the ignore below: a decision that switches has a plan text)
        plan = PipelinePlan.from_text(decision.plan) if decision.switched else running  # type: ignore[arg-type]
        self._settle = running.lookahead + plan.pipeline_depth + plan.lookahead + plan.loads + SETTLE
        if not self.decision.switched or (self._drift_round and not decision.switched):
            self._watch()
        elif decision.switched and self.round < self.options.rounds and not self._drift_round and not self._spent:
            self.round += 1
            self.state, self._until = TunerState.SETTLING, self.calls + self._settle
        else:
            self.state, self._state_call = TunerState.VERIFYING, self.calls
            self._periods = []

    def _apply(self, decision: Decision) -> None:
        """Switch the engine to the decided plan (every phase edited alike)."""
        assert decision.plan is not None
        if decision.own_group:
            self._enable_group()
        self._switch(PipelinePlan.from_text(decision.plan))

    def _enable_group(self) -> None:
        if not self._group_enabled and self.hooks.enable is not None:
            self.hooks.enable()
            self._group_enabled = True

    def _verified(self) -> None:
        assert self.decision is not None
        periods = self._periods[self._settle :]
        self.decision = replace(self.decision, measured_s=step_of(periods))
        d = self.decision
        assert d.measured_s is not None
        self._report(report.verified_line(self.owner, d, len(periods)), headline=True)
        self._watch(step_of(periods))

    # ------------------------------------------------------------------ the trial
    def _start_trial(self, proposal: Decision, candidates: list[Any], seed: Sequence[float] = ()) -> None:
        """Every rank: try ``candidates`` (module docstring, 4), the running plan first; ``seed``:
        the running plan's steps just measured, its first visit (the trial starts right after)."""
        o = self.options
        plans = [PipelinePlan.from_text(c[0]) for c in candidates]
        processes = [int(c[3]) if len(c) > 3 else 0 for c in candidates]
        if self._processes:  # the draws already fetch in processes: every plan tried does, one per load
            processes = [k or plan.loads for k, plan in zip(processes, plans, strict=True)]
        self._trial = Trial(
            plans, [c[1] for c in candidates], self.calls, o.trial_steps, o.trial_cycles, processes=processes
        )
        self._proposal, self._own_groups = proposal, [bool(c[2]) for c in candidates]
        if any(self._own_groups):
            self._enable_group()  # a collective: here, where every rank decided alike
        self._on = 0 if self._quiet_back is None else None
        self._quiet_back = None  # the trial's first visit switches back from the quiet plan
        if seed and self._on == 0:
            self._trial.seed(0, seed)
        steps, switches = trial_bound(len(candidates), o.trial_steps, o.trial_cycles, max(o.lookahead), max(o.loads))
        measured = f" ({1e3 * proposal.measured_start_s:.2f} ms per step measured)" if proposal.measured_start_s else ""
        head = "profiled" if self.round == 1 else f"{self._round_name()}: profiled the running plan"
        self._report(
            f"autotune {self.owner}: {head} {o.steps} steps{measured}; tries {len(candidates)} plans, "
            f"{o.trial_steps} steps a visit, at most {o.trial_cycles} cycles ({steps} steps, {switches} switches)",
            headline=True,
        )
        for line in proposal.why:
            self._report(f"autotune {self.owner}: {line}")
        self.state = TunerState.TRYING
        self._visit(self._trial.start_cycle())

    def _visit(self, index: int) -> None:
        """Run candidate ``index`` (switching to it unless it runs) and measure it once settled."""
        t = self._trial
        assert t is not None
        catch = settle = 0
        if self._on != index:
            catch, settle = self.engine.plan.lookahead, settle_steps(t.plans[index])
            self._switch(t.plans[index])
            self._use_processes(t.processes[index])
            self._on = index
        t.begin(index, self.calls + catch + settle)

    def _on_trying(self) -> None:
        """The trial's state: at the end of a visit the next candidate of the cycle, or after the
        cycle the judgement."""
        t = self._trial
        assert t is not None
        if not t.close(self.calls):
            return
        index = t.next_in_cycle()
        if index is not None:
            self._visit(index)
        else:
            self._when_quiet(self._judge)

    def _judge(self) -> None:
        """Every rank, after a cycle: rank 0 judges every rank's visits (``Trial.judge``) and
        tells every rank which plans stay, or which wins."""
        t = self._trial
        assert t is not None
        gathered = gather_to_all(t.samples)
        o = self.options
        verdict = None
        if world()[0] == 0:
            verdict = Trial.judge(gathered, t.alive, o.noise, o.confidence)
            verdict["spent"] = self._spent_line()
        verdict = from_rank0(verdict)
        self._spent = self._spent or verdict["spent"]
        goes_on = t.take(verdict)
        if goes_on and self._spent is None:
            self._visit(t.start_cycle())
        else:  # (a race that would go on where the budget is spent stops: the plan it started from)
            self._end_trial(verdict["best"], verdict["combined"], stopped=goes_on)

    def _end_trial(self, best: int, combined: list[list[float]], stopped: bool = False) -> None:
        """Every rank: run the winner (the measured best, or the running plan where the trial
        cannot tell them apart, or where it ``stopped`` before it could: the budget spent) and take
        the decision with the trial's record."""
        t = self._trial
        assert t is not None
        o = self.options
        before = self.engine.plan
        keep = stopped or t.keeps_running(best, o.noise)
        won = 0 if keep else t.winner(best, o.thread_margin)
        if self._on != won:
            self._switch(t.plans[won])
            self._use_processes(t.processes[won])
            self._on = won
        self._trial_steps += self.calls - t.began
        tried = t.results(best, combined, o.confidence, stopped)
        clear = all(x.verdict in ("slower", "equal", "best") for x in tried)
        how = "told apart" if clear else f"not all told apart after {t.cycle} cycles (the bound)"
        if stopped:
            how = f"not all told apart after {t.cycle} cycles: stopped, the budget spent"
        line = (
            f"tried {len(tried)} plans over {self.calls - t.began} steps ({t.cycle} cycles, "
            f"{len(t.order)} visits; {how}): the measured best is "
            + ("the running plan" if best == 0 else describe(t.plans[best], t.processes[best]))
        )
        if stopped:
            kept = self._stop_line(self.calls - t.began, "trial")  # (the budget spent)
        elif keep:
            kept = f"the measured best was not told apart from it in {t.cycle} cycles, nor faster by the noise"
        elif won != best:
            s = t.standings[won]
            assert s is not None
            kept = (
                f"runs {describe(t.plans[won], t.processes[won])}: not told apart from the measured best "
                f"(x{s.ratio:.2f} its step, "
                f"interval x{s.low:.2f}-x{s.high:.2f}, within the margin {100 * (o.thread_margin or 0):.0f}%), on "
                f"{engine_threads(t.plans[won])} engine thread(s) against {engine_threads(t.plans[best])}"
            )
        elif any(x.verdict == "equal" and x.ratio is not None and x.ratio < 1 for x in tried):
            kept = f"the measured best is within the noise ({100 * o.noise:.0f}%) of it"
        else:
            kept = "it measured best of the plans tried"
        p = self._proposal
        assert p is not None  # (a trial runs a proposal)
        self._trial = None
        if self._move is not None:  # the first move's trial
            move, self._move = self._move, None
            if won == 0 and move.then_search:  # the move lost: round 1 searches from the running plan's profile
                lines = [tried_line(i, x, o.confidence) for i, x in enumerate(tried)]
                self._first_lost(line, lines, kept if stopped else None)
                return
            self._held = None  # won (the search is round 2's), or kept unsearched: a draw that computes
        decision = replace(
            p,
            plan=None if won == 0 else tried[won].plan,
            own_group=self._own_groups[won] if won else False,
            processes=t.processes[won],
            predicted_s=t.predicted[won] if won else p.predicted_s,
            why=(
                *(w for w in p.why if not w.startswith("keeps the plan")),
                line,
                *(tried_line(i, x, o.confidence) for i, x in enumerate(tried)),
                *((f"keeps the plan: {kept}",) if won == 0 else (f"fewer threads: {kept}",) if won != best else ()),
            ),
            tried=tuple(tried),
            visits=tuple(t.order),
        )
        self._conclude(decision, applied=True, before=before)

    def _first_lost(self, line: str, tried: list[str], stopped: str | None = None) -> None:
        """Every rank: the first move measured no better than the running plan, which runs again;
        say so, and search from the running plan's profile (rank 0's held request); where the
        budget is spent (the trial ``stopped`` by it, or after it), the running plan is kept."""
        who = f"autotune {self.owner}"
        self._first_lines = (f"first move: {line}", *(f"first move: {t}" for t in tried))
        request, self._held = self._held, None
        if self._spent is not None:  # nothing more is searched: the running plan stays
            for said in self._first_lines:
                self._report(f"{who}: {said}")
            kept = stopped or self._stop_line(what="no search begins")
            self._conclude(Decision(None, measured_start_s=self._ledger.reference_s, why=(f"keeps the plan: {kept}",)))
            return
        self._report(f"{who}: first move: {line}; searches from the running plan", headline=True)
        for t in tried:
            self._report(f"{who}: first move: {t}")
        self._search_from(request)

    def _spent_line(self) -> str | None:
        """Rank 0: why the budget is spent (``budget.Ledger.line``), or None while it is not."""
        return self._ledger.line() if self._ledger.spent() else None

    def _stop_line(self, steps: int | None = None, what: str = "search") -> str:
        """Why a round keeps its plan where the budget is spent (``self._spent``, rank 0's ledger):
        its ``what`` stopped after ``steps`` (None: ``what`` says what was not done)."""
        assert self._spent is not None
        stopped = f"the {what} stopped after {steps} steps" if steps is not None else what
        return f"{self._spent}; {stopped}, nothing more is searched or tried"

    def _trial_data_ended(self, said: bool) -> None:
        """The data ended in a trial: the plan running stays; with more data the visit starts
        again (its measurements dropped, the pipeline filled again)."""
        t = self._trial
        assert t is not None
        t.restart(self.calls)
        if said:
            return
        running = "the running plan" if self._on in (0, None) else describe(t.plans[self._on], t.processes[self._on])
        why = (
            f"the data ended after {self.calls - 1} steps, in the trial's cycle {t.cycle + 1} of at most "
            f"{self.options.trial_cycles}; {running} stays (with more data the trial goes on)"
        )
        if self.round == 1:
            plan = None if self._on in (0, None) else t.plans[self._on].to_text()
            self.decision = Decision(plan, why=(f"not decided: {why}",), decided=False)
            self._report(f"autotune {self.owner}: not decided: {why}", headline=True)
        else:  # the decision of an earlier round stands
            self._report(f"autotune {self.owner}: {self._round_name()}: trial not finished: {why}", headline=True)

    # ------------------------------------------------------------------ drift
    def _watch(self, reference: float | None = None) -> None:
        """The plan is chosen: watch its step for a drift (or, without ``drift``, done)."""
        self._drift_round = False
        if self.options.drift is None or self._spent is not None:  # (no re-tune once the budget is spent)
            self.state = TunerState.DONE
            return
        self.state, self._watch_from, self._reference, self._drifting = TunerState.WATCHING, self.calls, reference, 0
        self._window.clear()

    def _check_drift(self) -> None:
        """Every rank: rank 0 compares every rank's step of the window (``step_of``) with the reference
        and tells every rank whether to tune again."""
        o = self.options
        assert o.drift is not None
        gathered = gather_to_all(step_of(self._window))
        verdict = None
        if world()[0] == 0:
            now = statistics.fmean(gathered)
            ref = self._reference
            drifted = ref is not None and abs(now / ref - 1) > o.drift
            verdict = {"now": now, "drifted": drifted}
        verdict = from_rank0(verdict)
        now, ref = verdict["now"], self._reference
        if ref is None:
            self._reference = now
            return
        if not verdict["drifted"]:
            self._drifting = 0
            return
        self._drifting += 1
        if self._drifting < DRIFT_CHECKS:  # a load that passes within one check is not a drift
            return
        who, off = f"autotune {self.owner}", 100 * (now / ref - 1)
        what = (
            f"{who}: the step drifted: {1e3 * now:.2f} ms against {1e3 * ref:.2f} ms when the plan was chosen "
            f"({off:+.0f}%, past {100 * o.drift:.0f}%)"
        )
        if self._retunes >= o.retunes:  # said once; nothing left to do: the watch ends
            self._report(f"{what}; the plan stays: {o.retunes} re-tunes were the bound", headline=True)
            self.state = TunerState.DONE
            return
        self._retunes += 1
        self._report(
            f"{what}; profiles, searches and tries again (re-tune {self._retunes} of {o.retunes})", headline=True
        )
        self.round += 1
        self._drift_round = True
        plan = self._quiet_back or self.engine.plan  # the running plan (back after a quiet call)
        self.state, self._until = TunerState.SETTLING, self.calls + plan.lookahead + plan.loads + SETTLE

    # ------------------------------------------------------------------ reports
    def _round_name(self) -> str:
        return f"re-tune {self._retunes}" if self._drift_round else "second round"

    def _report(self, line: str, headline: bool = False) -> None:
        report.send(self.options, line, headline)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The decision (None while still tuning or when the data ended before it decided: a
        resume then tunes again), and whether the budget was spent (the same on every rank)."""
        d = self.decision
        if d is None or not d.decided:
            return {"decision": None}  # (a budget spent ends in a decision)
        return {"decision": d.to_dict(), "spent": self._spent}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Apply a saved decision at once (before the first step): no tuning or trial again; the
        budget goes on from what the tuning had lost (spent: no re-tune either)."""
        saved = state.get("decision")
        if saved is None:
            return
        self.decision = Decision.from_dict(saved)
        self._ledger.unit_s = self.decision.measured_start_s
        self._ledger.lost_s = self.decision.lost_s
        self._spent = state.get("spent")
        if self.decision.switched:
            self._apply(self.decision)
            self._use_processes(self.decision.processes)
        self._watch()


#: What each state does at the start of a call (``Tuner.before_step``): one handler per state.
HANDLERS: dict[TunerState, Callable[[Tuner], None]] = {
    TunerState.WARMUP: Tuner._on_warmup,
    TunerState.SETTLING: Tuner._on_settling,
    TunerState.PROFILING: Tuner._on_profiling,
    TunerState.SEARCHING: Tuner._on_searching,
    TunerState.QUIETING: Tuner._on_quieting,
    TunerState.TRYING: Tuner._on_trying,
    TunerState.VERIFYING: Tuner._on_verifying,
    TunerState.WATCHING: Tuner._on_watching,
    TunerState.DONE: Tuner._on_done,
}
