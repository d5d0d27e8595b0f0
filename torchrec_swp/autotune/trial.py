"""The trial: a search's best few plans and the running one, each measured a few steps at a time,
interleaved, until the measurements tell them apart (what the tuner does between a search and a
switch; ``tuner.py`` drives it call by call, this module holds what is pure).

* **order**: the candidates still in the race visit in turn, the running plan first
  (A, B, C, A, B, C ...), so that a load on the machine falls on all of them alike; each visit
  switches at a batch boundary (``Engine.switch_plan``: bit for bit, nothing lost or repeated),
  lets the plan settle (``settle_steps``) and measures ``Autotune.trial_steps`` steps (from one
  ``progress()`` call's start to the next's, as the caller lives them);
* **stopping rule** (``race``), after each cycle on rank 0 from every rank's visit means: each
  candidate against the measured best, paired by cycle (a load that comes and goes moves a
  cycle's visits together), a t interval of the mean log ratio at ``Autotune.confidence``: a
  candidate whose interval lies within the noise (``1/(1+noise)`` to ``1+noise``) is *equal* and
  leaves the race (the best stays, but where the running plan is the one equal to the best, it
  wins: no switch for a gain within the noise); one whose interval lies above 1 is *slower* and
  leaves it too; the race ends when only the best is left or after ``Autotune.trial_cycles``
  cycles, and the measured best wins;
* **bound**: at most ``trial_cycles`` cycles of ``len(candidates)`` visits each, each visit one
  switch and at most ``visit_steps`` calls (``trial_bound``).

Candidates (``pick``): the search's best; the plan moving the loads alone (the fewest tasks off
the calling thread) of each number of loads, its best's first; the best's layout running further
ahead; then the next distinct thread layouts, each running furthest ahead, in the model's order:
plans the model tells apart least well (loads that wait on one another, threads that contend, a
run-ahead that absorbs a loader's jitter) are those the trial measures.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torchrec_swp.plan import MAIN_THREAD, PipelinePlan

#: calls left out after a visit's switch beyond its catch-up, lookahead and loads (first wake-ups)
TRIAL_SETTLE = 1
#: steps the tuner leaves out after a switch beyond the new plan's fill and run-ahead: its threads'
#: first iterations (caches, first wake-ups) cost more than the steady ones a profile or a
#: verification measures
SETTLE = 3


@dataclass(frozen=True)
class Tried:
    """One candidate of a trial: its plan's text, what the model predicted, what it measured
    (geometric mean of its cycles' means, with the t interval of that mean on the logs: positive),
    its step against the measured best's (``ratio``, paired by cycle, with its interval; None for
    the best), the steps measured and visits made, and how it left the race (``verdict``:
    ``"best"``, ``"slower"``, ``"equal"``: within the noise of the best, ``"bound"``: still racing
    at the last cycle, ``"stopped"``: still racing where the tuning's budget stopped the trial)."""

    plan: str
    predicted_s: float | None
    measured_s: float | None = None
    low_s: float | None = None
    high_s: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    steps: int = 0
    visits: int = 0
    verdict: str = ""
    out_after: int | None = None  # the cycle after which it left the race
    processes: int = 0  # its draws fetched in this many worker processes (0: on its threads)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tried:
        return cls(**data)


@dataclass(frozen=True)
class Standing:
    """A candidate after a cycle: its step over the best's (geometric mean of the cycles' ratios)
    with the interval, and its state: ``best``, ``racing``, ``slower`` or ``equal``."""

    ratio: float
    low: float
    high: float
    state: str


def settle_steps(plan: PipelinePlan) -> int:
    """Calls after a switch to ``plan`` (once the threads that ran ahead caught up) before its
    steps are measured: its run-ahead fills (``lookahead``), its loads start, its threads wake."""
    return plan.lookahead + plan.loads + TRIAL_SETTLE


def measured_steps(plan: PipelinePlan, steps: int) -> int:
    """Steps a visit of ``plan`` measures: at least ``steps``, a whole number of its loads (with
    ``k`` loads, batches arrive ``k`` at a time: one long step, then ``k - 1`` short ones, and a
    visit that cut the pattern would be biased)."""
    return -(-steps // plan.loads) * plan.loads


def visit_steps(before: PipelinePlan, plan: PipelinePlan, steps: int) -> int:
    """Calls of one visit of ``plan`` after ``before`` ran: catching up (a switch waits until the
    threads ``before`` ran ahead stand at the caller's boundary, at most its lookahead), settling,
    measuring."""
    return before.lookahead + settle_steps(plan) + measured_steps(plan, steps)


def trial_bound(candidates: int, steps: int, cycles: int, lookahead: int, loads: int) -> tuple[int, int]:
    """The most calls and switches one trial takes: ``cycles`` cycles of ``candidates`` visits
    (each one switch, at most ``visit_steps`` calls with the largest ``lookahead`` and ``loads``
    the search may choose), and after each cycle a wait of at most ``lookahead + 1`` calls where
    the ranks agree (``needs_quiet``) and one switch to the winner."""
    visit = lookahead + lookahead + loads + TRIAL_SETTLE + steps + loads - 1
    per_cycle = candidates * visit + lookahead + 1
    return cycles * per_cycle, cycles * (candidates + 1) + 1


def needs_quiet(plan: PipelinePlan) -> bool:
    """Whether an engine thread of ``plan`` may issue a collective between two ``progress()``
    calls: a task in a comm group off the calling thread, in a plan that runs ahead. The tuner's
    own collectives (on the default group, from the calling thread) wait for a call where none
    can: the plan without lookahead, where between calls every thread stands at the same batch
    boundary."""
    return plan.lookahead > 0 and any(
        plan.task(t).comm_group is not None and plan.task(t).thread_group != MAIN_THREAD
        for t in plan.fire_order
        if plan.task(t).when.in_steady_state
    )


def pick(ranked: Sequence[PipelinePlan], running: PipelinePlan, count: int) -> list[PipelinePlan]:
    """Up to ``count`` plans to try beside ``running``, from ``ranked`` (the model's order, best
    first): the best; then, for each number of loads (the best's first, then in the model's
    order), the best layout moving the fewest tasks off the calling thread (at least one) with
    that many loads, running furthest ahead - where it is the best's own layout and number of
    loads, it is left for later; then the best's layout running furthest ahead; then the best
    layout of each other thread layout (threads, loads, comm groups) not yet picked, furthest
    ahead. The model, of mean costs, tells the number of loads apart least well (loads that wait
    on one another, bursts that a run-ahead absorbs or not) and within its tie prefers fewer
    batches in flight; it underrates what a thread of its own costs the tasks that share the
    cores with it (an input dist or a copy moved off the calling thread, on ranks that share two
    cores, measured slower than the plan moving the loads alone): the trial measures both, and a
    deeper run-ahead of one layout (measured within a few percent of its shallower one on this
    project's machines) only after. ``running`` and repeats are left out."""

    def layout(p: PipelinePlan) -> tuple[object, ...]:
        return (
            tuple(p.task(t).thread_group for t in p.fire_order),
            p.loads,
            tuple(p.task(t).comm_group for t in p.fire_order),
        )

    others = [p for p in dict.fromkeys(ranked) if p != running]
    if not others or count < 1:
        return []
    best = others[0]

    def deepest(p: PipelinePlan) -> PipelinePlan:
        return max((q for q in others if layout(q) == layout(p)), key=lambda q: q.lookahead)

    def moved(p: PipelinePlan) -> int:
        return sum(len(tasks) for tasks in off_main(p).values())

    wanted = []
    for loads in dict.fromkeys([best.loads] + [p.loads for p in others]):
        moving = [p for p in others if p.loads == loads and moved(p) > 0]
        least = min((moved(p) for p in moving), default=0)
        fewest = next((p for p in moving if moved(p) == least), None)
        if fewest is not None and layout(fewest) not in (layout(best), layout(running)):
            wanted.append(deepest(fewest))
    wanted.append(deepest(best))
    layouts_seen = {layout(best), layout(running)}
    for p in others:
        if layout(p) not in layouts_seen:
            layouts_seen.add(layout(p))
            wanted.append(deepest(p))
    picked = [best]
    for p in wanted:
        if len(picked) >= count:
            break
        if p not in picked:
            picked.append(p)
    return picked


@functools.lru_cache(maxsize=256)
def t_quantile(confidence: float, df: int) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` degrees of freedom
    (``P(|T| <= q) = confidence``), by bisection on its CDF (Simpson's rule on the density)."""
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1, got {df}")
    target = 0.5 + confidence / 2
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t: float) -> float:
        n = 400
        h = t / n
        total = 0.0
        for k in range(n + 1):
            x = k * h
            w = 1 if k in (0, n) else (4 if k % 2 else 2)
            total += w * (1 + x * x / df) ** (-(df + 1) / 2)
        return 0.5 + c * total * h / 3

    low, high = 0.0, 1.0
    while cdf(high) < target:
        low, high = high, high * 2
    for _ in range(50):
        mid = (low + high) / 2
        if cdf(mid) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def race(
    samples: Sequence[Sequence[float]],
    alive: Sequence[bool],
    noise: float,
    confidence: float,
    prefer: int | None = 0,
) -> tuple[int, list[Standing | None]]:
    """After a cycle: the measured best of the candidates still ``alive`` (lowest geometric mean of
    its cycles' means, the centre its log ratios are judged from; they all have the same cycles) and
    each alive candidate's standing against it (module docstring); None for those already out.
    ``samples[i][c]``: candidate ``i``'s mean step in cycle ``c`` (those out have fewer: the first
    ones are paired). ``prefer`` (the running plan) wins in place of the best where it is *equal* to
    it: within the noise, no switch."""
    live = [i for i, a in enumerate(alive) if a]
    if not live:
        raise ValueError("race: no candidate is left")
    best = min(live, key=lambda i: (statistics.geometric_mean(samples[i]), i))
    out = _against(best, samples, live, noise, confidence)
    if prefer is not None and prefer != best and (s := out[prefer]) is not None and s.state == "equal":
        best = prefer
        out = _against(best, samples, live, noise, confidence)
    return best, out


def _exp(x: float) -> float:
    """``math.exp(x)``, infinite where it would overflow: a few cycles that swing by 10x at a high
    confidence (t of 636.6 at 0.999 with one degree of freedom) put an interval's bound past it."""
    return math.inf if x > 709.0 else math.exp(x)


def _against(
    best: int, samples: Sequence[Sequence[float]], live: Sequence[int], noise: float, confidence: float
) -> list[Standing | None]:
    out: list[Standing | None] = [None] * len(samples)
    out[best] = Standing(1.0, 1.0, 1.0, "best")
    for i in live:
        if i == best:
            continue
        n = min(len(samples[i]), len(samples[best]))
        logs = [math.log(samples[i][c] / samples[best][c]) for c in range(n)]
        mean = statistics.fmean(logs)
        if n < 2:
            out[i] = Standing(math.exp(mean), 0.0, math.inf, "racing")
            continue
        half = t_quantile(confidence, n - 1) * statistics.stdev(logs) / math.sqrt(n)
        low, high = _exp(mean - half), _exp(mean + half)
        if high < 1 + noise and low > 1 / (1 + noise):
            state = "equal"  # whichever is faster, by less than the noise
        elif low > 1:
            state = "slower"
        else:
            state = "racing"
        out[i] = Standing(math.exp(mean), low, high, state)
    return out


def mean_interval(values: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """The geometric mean of step times ``values`` and its t interval, taken on their logs (the
    scale the race judges on): a step is positive and skewed, and a t interval of the plain mean of
    3 cycles with one slow one reached below zero ("90% interval -2.91-25.46" in CI); the mean
    itself twice for one value."""
    if any(v <= 0 for v in values):
        raise ValueError(f"mean_interval: step times must be positive, got {list(values)}")
    logs = [math.log(v) for v in values]
    m = statistics.fmean(logs)
    if len(values) < 2:
        return math.exp(m), math.exp(m), math.exp(m)
    half = t_quantile(confidence, len(values) - 1) * statistics.stdev(logs) / math.sqrt(len(values))
    return math.exp(m), math.exp(m - half), _exp(m + half)


@dataclass
class Visit:
    """One visit of a trial: candidate ``index`` measured in calls ``first`` to ``last``."""

    index: int
    first: int
    last: int
    periods: list[float] = field(default_factory=list)


class Trial:
    """A trial under way, its bookkeeping in ``progress()`` calls (the tuner switches the plans and
    makes the collectives): the candidates (the running plan first), what the model predicted for
    each, which are still in the race, this rank's mean step of each visit, the visits so far."""

    def __init__(
        self,
        plans: Sequence[PipelinePlan],
        predicted: Sequence[float | None],
        began: int,
        steps: int,
        cycles: int,
        processes: Sequence[int] | None = None,
    ) -> None:
        n = len(plans)
        self.plans, self.predicted, self.began = list(plans), list(predicted), began
        #: by candidate: the worker processes its draws are fetched in (0: its threads)
        self.processes = list(processes) if processes is not None else [0] * n
        self.steps_per_visit, self.cycles = steps, cycles
        self.alive = [True] * n
        self.samples: list[list[float]] = [[] for _ in range(n)]  # by candidate, one per visit
        self.steps = [0] * n  # steps measured, by candidate
        self.order: list[int] = []  # the visits so far
        self.cycle = 0  # cycles complete
        self.queue: list[int] = []  # this cycle's visits still to come
        self.visit: Visit | None = None
        self.standings: list[Standing | None] = [None] * n
        self.out_after: list[int | None] = [None] * n
        self._seeded: set[int] = set()  # visits of the first cycle measured before the trial began

    def seed(self, index: int, periods: Sequence[float]) -> None:
        """Candidate ``index``'s first visit, measured before the trial began (``periods``: the
        running plan's last steps, where the trial starts right after them): the first cycle
        leaves it out."""
        if not periods:
            raise ValueError(f"Trial.seed: no steps measured for candidate {index}")
        self.samples[index].append(statistics.fmean(periods))
        self.steps[index] += len(periods)
        self.order.append(index)
        self._seeded.add(index)

    def start_cycle(self) -> int:
        """The candidates still in the race, in order, are this cycle's visits (those seeded left
        out): the first."""
        self.queue = [i for i, a in enumerate(self.alive) if a and i not in self._seeded]
        self._seeded = set()
        return self.queue.pop(0)

    def next_in_cycle(self) -> int | None:
        """The next visit of this cycle, or None: the cycle is complete (counted)."""
        if self.queue:
            return self.queue.pop(0)
        self.cycle += 1
        return None

    def begin(self, index: int, first: int) -> None:
        """Visit candidate ``index``, measuring from call ``first`` (after its switch settled)."""
        self.visit = Visit(index, first, first + measured_steps(self.plans[index], self.steps_per_visit) - 1)
        self.order.append(index)

    def measure(self, call: int, period: float) -> None:
        """The period of call ``call``, if the visit measures it."""
        v = self.visit
        if v is not None and v.first <= call <= v.last:
            v.periods.append(period)

    def close(self, call: int) -> bool:
        """At call ``call``: whether the visit has measured all its calls (then recorded)."""
        v = self.visit
        if v is None or call <= v.last:
            return False
        self.samples[v.index].append(statistics.fmean(v.periods))
        self.steps[v.index] += len(v.periods)
        self.visit = None
        return True

    def restart(self, call: int) -> None:
        """The data ended at call ``call``: the visit's measurements are dropped, and it measures
        again once the pipeline has filled and the plan settled."""
        if self.visit is not None:
            plan = self.plans[self.visit.index]
            self.begin(self.visit.index, call + 1 + plan.pipeline_depth + settle_steps(plan))
            self.order.pop()

    @staticmethod
    def judge(
        gathered: Sequence[Sequence[Sequence[float]]], alive: Sequence[bool], noise: float, confidence: float
    ) -> dict[str, Any]:
        """Rank 0, after a cycle: every rank's visit means (``gathered[rank][candidate][cycle]``)
        averaged over the ranks, and the race (``race``) on them; a dict every rank takes."""
        n = len(gathered[0])
        combined = [[statistics.fmean(r[i][c] for r in gathered) for c in range(len(gathered[0][i]))] for i in range(n)]
        best, standings = race(combined, alive, noise, confidence)
        return {"combined": combined, "best": best, "standings": [None if s is None else asdict(s) for s in standings]}

    def take(self, verdict: Mapping[str, Any]) -> bool:
        """Every rank: the verdict of ``judge``; whether the race goes on (a candidate besides the
        best still racing, cycles left)."""
        for i, s in enumerate(verdict["standings"]):
            if s is not None:
                self.standings[i] = Standing(**s)
                if s["state"] in ("slower", "equal"):
                    self.alive[i], self.out_after[i] = False, self.cycle
        racing = [i for i, a in enumerate(self.alive) if a and i != verdict["best"]]
        return bool(racing) and self.cycle < self.cycles

    def keeps_running(self, best: int, noise: float) -> bool:
        """At the end: whether the running plan stays although another measured best: still racing
        (not told apart at the bound) and measured within ``noise`` of the best."""
        s0 = self.standings[0]
        return best != 0 and self.alive[0] and s0 is not None and s0.ratio < 1 + noise

    def winner(self, best: int, margin: float | None) -> int:
        """At the end, the running plan not kept (``keeps_running``): the plan to run. The
        measured best ``best``, unless candidates the trial could not tell from it (still racing
        at the bound, or left *equal*) measured at most ``margin`` (a share) slower run fewer
        engine threads (``engine_threads``): then the one of them running the fewest, the faster
        of those alike. On a machine whose cores the job shares, a thread more costs the other
        tasks CPU that a short visit shows only in part; where the measurements do not tell two
        plans apart, the cheaper is the safer bet. ``margin`` None: the measured best."""
        if margin is None:
            return best
        close = {best: 1.0}  # candidate -> its step over the best's
        for i in range(1, len(self.plans)):
            s = self.standings[i]
            if i == best or s is None or s.ratio > 1 + margin:
                continue
            if (self.alive[i] and s.state == "racing") or s.state == "equal":
                close[i] = s.ratio
        return min(close, key=lambda i: (engine_threads(self.plans[i]), close[i]))

    def results(
        self, best: int, combined: Sequence[Sequence[float]], confidence: float, stopped: bool = False
    ) -> list[Tried]:
        """Every candidate's record (``Tried``) at the end, against the measured best ``best``
        (``stopped``: before the bound, by the tuning's budget)."""
        racing = "stopped" if stopped else "bound"
        out = []
        for i, plan in enumerate(self.plans):
            s = None if i == best else self.standings[i]
            m, low, high = mean_interval(combined[i], confidence) if combined[i] else (None, None, None)
            verdict = "best" if i == best else (racing if self.alive[i] else (s.state if s is not None else ""))
            out.append(
                Tried(
                    plan=plan.to_text(),
                    predicted_s=self.predicted[i],
                    measured_s=m,
                    low_s=low,
                    high_s=high,
                    ratio=None if s is None else s.ratio,
                    ratio_low=None if s is None else s.low,
                    ratio_high=None if s is None else s.high,
                    steps=self.steps[i],
                    visits=self.order.count(i),
                    verdict=verdict,
                    out_after=self.out_after[i],
                    processes=self.processes[i],
                )
            )
        return out


def engine_threads(plan: PipelinePlan) -> int:
    """The threads ``plan`` runs besides the calling thread: its thread groups, one per load of
    its source."""
    return len((set(plan.thread_groups) | set(plan.source_lanes())) - {MAIN_THREAD})


def off_main(plan: PipelinePlan) -> dict[str, list[str]]:
    """The tasks off the calling thread, by thread, in fire order."""
    moved: dict[str, list[str]] = {}
    for t in plan.fire_order:
        thread = plan.task(t).thread_group
        if thread != MAIN_THREAD:
            moved.setdefault(thread, []).append(t)
    return moved


def describe(plan: PipelinePlan, processes: int = 0) -> str:
    """A plan's overlap choices in words: its threads with the tasks off the calling thread (two
    plans may share threads and differ in what runs there), lookahead and loads (and where the
    draws are fetched in worker processes, how many)."""
    where = "; ".join(f"{', '.join(tasks)} on {thread}" for thread, tasks in off_main(plan).items())
    return (
        f"threads {list(plan.thread_groups)}"
        + (f" ({where})" if where else "")
        + f", lookahead {plan.lookahead}, loads {plan.loads}"
        + (f" in {processes} worker processes" if processes else "")
    )


def tried_line(i: int, x: Tried, confidence: float) -> str:
    """The report's line of candidate ``i`` (0: the running plan) of a trial."""
    name = "the running plan" if i == 0 else describe(PipelinePlan.from_text(x.plan), x.processes)
    predicted = f"predicted {1e3 * x.predicted_s:.2f} ms" if x.predicted_s is not None else "no prediction"
    if x.measured_s is None or x.low_s is None or x.high_s is None:
        return f"tried {name}: {predicted}, not measured"
    measured = (
        f"measured {1e3 * x.measured_s:.2f} ms ({100 * confidence:.0f}% interval "
        f"{1e3 * x.low_s:.2f}-{1e3 * x.high_s:.2f}) over {x.steps} steps in {x.visits} visits"
    )
    if x.verdict == "best":
        end = "the measured best"
    elif x.ratio is not None and x.ratio_low is not None and x.ratio_high is not None:
        against = f"x{x.ratio:.2f} the best's step (interval x{x.ratio_low:.2f}-x{x.ratio_high:.2f})"
        end = {
            "slower": f"slower: {against}, out after cycle {x.out_after}",
            "equal": f"within the noise of the best: {against}, out after cycle {x.out_after}",
            "stopped": f"still racing where the budget stopped the trial: {against}",
        }.get(x.verdict, f"still racing at the bound: {against}")
    else:
        end = x.verdict
    return f"tried {name}: {predicted}, {measured}; {end}"


__all__ = [
    "SETTLE",
    "TRIAL_SETTLE",
    "Standing",
    "Trial",
    "Tried",
    "Visit",
    "describe",
    "engine_threads",
    "mean_interval",
    "measured_steps",
    "needs_quiet",
    "pick",
    "race",
    "settle_steps",
    "t_quantile",
    "trial_bound",
    "tried_line",
    "visit_steps",
]
