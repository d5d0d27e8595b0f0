"""The engine as it runs, for the multi-rank replay: walkers, the caller's calls, credit, loads.

``simulate_ranks(..., model="engine")`` replays a rank's compiled programs the way
``torchrec_swp.engine`` walks them (``engine/engine.py``, ``engine/ops.py``, ``engine/source.py``), not with
an iteration barrier:

* **Walkers.** The calling thread, every other thread group of the plan, and for a source with
  ``loads`` k its k lanes (``G``, ``G.1`` ... ``G.{k-1}``; batch ``b`` is drawn on lane
  ``b % k``) each walk their program, iteration after iteration, with no barrier between
  iterations: only the waits, signals and tickets of the programs order them.
* **The caller.** ``step()`` for batch ``d``: the caller's own work between calls (``Rank.overhead``,
  CPU on the calling thread), then the call asks for ``d`` (``requested = d + 1``), walks the
  calling thread's program through internal iteration ``d + top``, waits until every other
  walker is done with ``d`` (a walker that may run ahead: its iteration ``d + its top stage``;
  the others, with lookahead 0 every one: iteration ``d + top``) and returns it
  (``returned = d + 1``). The step's time is the time between two returns.
* **Gates.** A walker other than the caller starts internal iteration ``P`` only when
  ``P <= requested - 1 + top + ahead``, ``ahead`` being the plan's ``lookahead``, or 0 for a
  thread that issues collectives (those are issued only while ``step()`` runs); it runs a task
  of the highest stage only for a batch ``step()`` asked for.
* **The source.** Batch ``b`` is drawn only within the credit: ``b < returned + depth +
  lookahead`` and ``b < requested + top + lookahead``. Draws take turns in batch order: with a
  data source that splits a draw (``Rank.split_draws``: ``claim()`` then ``fetch()``, as
  ``torchrec_swp.data.MapSource``) batch ``b``'s load starts after batch ``b - 1``'s started
  (the fetches overlap); otherwise after it ended.
* **Waking.** A thread that had to wait for another (a wait, a gate, the credit, a ticket, the
  caller waiting for its walkers) resumes the rank's wake-up latency after what it waited for
  happened, off the CPU: ``Rank.wake``, one number or a ``sim.Wake`` by whether another thread
  of the rank computes then, or just ended its walk (``torchrec_swp.sim.wake``).

Cores and each process's GIL are shared as ``torchrec_swp.sim.cores`` says. With lookahead 0
and one load the steady state is the barrier model's (every walker finishes iteration ``P``
before any starts ``P + 1``); the fill differs (its iterations are not separated).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.compile import Instr, IterationProgram, RecordEvent, Run, Signal
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan


# The caller's and the walkers' moves, in the lanes' instruction lists beside the programs'.
@dataclass(frozen=True, slots=True)
class Call:
    """``step()`` asks for batch ``d``."""

    d: int

    def __str__(self) -> str:
        return f"step() asks for batch {self.d}"


@dataclass(frozen=True, slots=True)
class Await:
    """The caller waits until every walker is done with batch ``d``."""

    d: int

    def __str__(self) -> str:
        return f"step() waits for batch {self.d}"


@dataclass(frozen=True, slots=True)
class Retire:
    """``step()`` returns batch ``d``: one more batch of credit."""

    d: int

    def __str__(self) -> str:
        return f"step() returns batch {self.d}"


@dataclass(frozen=True, slots=True)
class Gate:
    """A walker other than the caller starts internal iteration ``P``."""

    P: int

    def __str__(self) -> str:
        return f"start internal iteration {self.P}"


@dataclass(frozen=True, slots=True)
class Done:
    """A walker finished its part of internal iteration ``P``."""

    P: int

    def __str__(self) -> str:
        return f"end internal iteration {self.P}"


Move = Call | Await | Retire | Gate | Done
MOVES = (Call, Await, Retire, Gate, Done)
Todo = tuple[int, int, Instr | Move | None]  # (iteration or batch, index, what): None is the caller's own work


@dataclass(frozen=True, slots=True)
class WalkerSpec:
    """One walker of a rank: its lane name, the program (thread group) it walks, its lane index
    among a source's loads, the highest stage of its tasks and how far it may run ahead."""

    name: str
    thread: str
    lane: int
    top: int
    ahead: int


class EngineModel:
    """The walkers of one rank's plan and the engine's counters and gates (module docstring).

    ``blocker`` says why a lane's next move or run cannot go now; ``moved`` / ``started`` /
    ``finished`` update the counters when it went. Times are kept by the replay. ``split_draws``:
    the data splits a draw in claim and fetch (``Rank.split_draws``)."""

    def __init__(
        self, plan: PipelinePlan, phases: tuple[tuple[int, IterationProgram], ...], split_draws: bool = False
    ) -> None:
        self.plan = plan
        self.top = plan.max_stage
        self.depth = plan.pipeline_depth
        self.lookahead = plan.lookahead
        self.loads = plan.loads
        self.source = plan.source
        self.source_stage = plan.task(plan.source).stage if plan.source is not None else 0
        self.split = split_draws
        self.phases = phases
        stage = {t: s.stage for t, s in plan.schedule.items()}
        threads = dict.fromkeys([MAIN_THREAD, *(t for _, prog in phases for t, _ in prog.threads)])
        collective = {
            t
            for _, prog in phases
            for t, instrs in prog.threads
            for i in instrs
            if isinstance(i, Run) and i.comm_group is not None
        }
        top_of = {
            t: max(
                (stage[i.task] for _, prog in phases for i in prog.instructions(t) if isinstance(i, Run)), default=-1
            )
            for t in threads
        }
        source_thread = plan.task(plan.source).thread_group if plan.source is not None else None
        walkers: list[WalkerSpec] = []
        for t in threads:
            ahead = 0 if t in collective else self.lookahead
            lanes = self.loads if t == source_thread and t != MAIN_THREAD else 1
            walkers += [WalkerSpec(t if k == 0 else f"{t}.{k}", t, k, top_of[t], ahead) for k in range(lanes)]
        self.walkers = {w.name: w for w in walkers}
        self.names = tuple(self.walkers)
        self.requested = 0
        self.returned = 0
        self.claimed = 0  # batches whose draw took its turn (the next one may go)
        self.loaded: set[int] = set()  # batches drawn
        self.done = dict.fromkeys(self.names, -1)  # walker -> last iteration it finished
        self.returns: list[float] = []  # when each step() returned

    # ------------------------------------------------------------------ programs
    def todo(self, num_batches: int, overhead: bool) -> dict[str, list[Todo]]:
        """Every walker's instruction list, the engine's moves included."""
        programs = dict(self.phases)
        out: dict[str, list[Todo]] = {name: [] for name in self.names}
        caller = out[MAIN_THREAD]
        P = 0
        for d in range(num_batches):
            if overhead:
                caller.append((d, -1, None))
            caller.append((d, -1, Call(d)))
            while P <= d + self.top:
                if P in programs:
                    caller += [(P, i, x) for i, x in enumerate(programs[P].instructions(MAIN_THREAD))]
                P += 1
            caller += [(d, -1, Await(d)), (d, -1, Retire(d))]
        for w in self.walkers.values():
            if w.name == MAIN_THREAD:
                continue
            lane = out[w.name]
            for P, prog in self.phases:
                lane.append((P, -1, Gate(P)))
                lane += [(P, i, x) for i, x in enumerate(prog.instructions(w.thread)) if self._on_lane(w, P, x)]
                lane.append((P, -1, Done(P)))
        return out

    def _on_lane(self, w: WalkerSpec, P: int, instr: Instr) -> bool:
        """A source's run and signal belong to the lane of their batch; everything else to every lane."""
        if self.loads > 1 and isinstance(instr, (Run, Signal, RecordEvent)) and instr.task == self.source:
            return (P - self.source_stage) % self.loads == w.lane
        return True

    # ------------------------------------------------------------------ gates
    def blocker(self, lane: str, p: int, what: Instr | Move | None, num_batches: int) -> str | None:
        """Why ``what`` (of iteration or batch ``p``) cannot go on ``lane`` now, or None."""
        w = self.walkers[lane]
        match what:
            case Gate(P=P):
                if P > self.requested - 1 + self.top + w.ahead:
                    return f"step() to be called for batch {P - self.top - w.ahead} (internal iteration {P})"
            case Await(d=d):
                for other in self.walkers.values():
                    if other.name != MAIN_THREAD and other.top >= 0:
                        need = min(d + (other.top if other.ahead else self.top), num_batches - 1 + self.top)
                        if self.done[other.name] < need:
                            return f"{other.name} to finish internal iteration {need}"
            case Run(task=task, stage=stage) if task == self.source:
                b = p - stage
                if not (
                    b < self.returned + self.depth + self.lookahead
                    and b < self.requested + self.top + self.lookahead
                ):
                    return f"credit to draw batch {b} (depth {self.depth}, lookahead {self.lookahead})"
                if self.claimed < b:
                    return f"batch {b - 1} to be drawn first"
            case Run(stage=stage):
                b = p - stage
                if self.source is not None and b not in self.loaded:
                    return f"batch {b} to be drawn"
                if stage == self.top and lane != MAIN_THREAD and b >= self.requested:
                    return f"step() to be called for batch {b}"
        return None

    def moved(self, lane: str, what: Move, now: float) -> None:
        """The caller's or a walker's move went at ``now``."""
        match what:
            case Call(d=d):
                self.requested = max(self.requested, d + 1)
            case Retire(d=d):
                self.returned = d + 1
                self.returns.append(now)
            case Done(P=P):
                self.done[lane] = P
            case Gate() | Await():
                pass

    def started(self, run: Run, p: int) -> None:
        """A run started: a split draw took its turn."""
        if run.task == self.source and self.split:
            self.claimed = max(self.claimed, p - run.stage + 1)

    def finished(self, run: Run, p: int) -> None:
        """A run ended: a draw loaded its batch (and, not split, took its turn)."""
        if run.task == self.source:
            self.loaded.add(p - run.stage)
            if not self.split:
                self.claimed = max(self.claimed, p - run.stage + 1)
