"""PhasedPlan: plans that take turns at given batch numbers (a schedule that changes mid-run).

TrainPipelineSemiSync trains its first ``start_batch`` batches synchronously and the rest
semi-synchronously; here that is two plans and the batch number where the second takes over,
as data. The engine picks, before each step, the phase of the batch that step delivers.

The phases' clock says how batches are numbered. ``clock="index"`` (the default): the source's
calls since the engine was built or reset(), the call that finds the data exhausted included (as
TorchRec's context index counts them), across epochs. ``clock="drawn"``: the batches drawn over
the pipeline's life, across epochs and reset(), the calls that find no batch left out (as
TrainPipelinePT2's ``_iter`` counts its forwards). ``clock="trained"``: the batches trained
(returned by ``progress()``) since the engine was built or reset(), across epochs (as TorchRec's
GradientAccumulationWrapper counts its steps); a step rolled back (``on_nonfinite``) does not count.

A ``cycle=(first, period)`` makes the phases from batch ``first`` on repeat every ``period``
batches: batch ``n >= first`` runs the plan of batch ``first + (n - first) % period`` (a window of
gradient accumulation: zero the gradients on its first batch, step on its last).

Plans of one PhasedPlan must agree on what the batches in flight hold, so the engine can
switch between steps: same source, output and highest stage; every task in two phases has the
same stage and reads/writes; a task in only some phases writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.names import Vocabulary
from torchrec_swp.plan.plan import PipelinePlan, ThreadMap
from torchrec_swp.plan.table import format_schedule
from torchrec_swp.plan.task import check_name
from torchrec_swp.plan.text_read import is_phased_text, phased_from_text
from torchrec_swp.plan.text_write import phased_to_text

#: How a PhasedPlan numbers batches (see the module docstring); the first is the default.
CLOCKS = ("index", "drawn", "trained")


def switch_problems(old: PipelinePlan, new: PipelinePlan) -> list[str]:
    """Why the engine could not switch from ``old`` to ``new`` between steps (empty: it can)."""
    problems = []
    if (old.source, old.output, old.max_stage) != (new.source, new.output, new.max_stage):
        problems.append("source, output and highest stage must stay the same")
    for task in dict.fromkeys([*old.fire_order, *new.fire_order]):
        if task in old.schedule and task in new.schedule:
            if old.task(task).stage != new.task(task).stage or old.tasks[task] != new.tasks[task]:
                problems.append(f"task {task} changes its stage, its reads/writes or its effects")
        elif (old.tasks.get(task) or new.tasks[task]).writes:
            problems.append(f"task {task}, in only one plan, writes data")
    return problems


class PhasedPlan:
    """``phases``: ``(start, plan)`` pairs; ``plan`` runs for batch numbers from ``start`` up to the
    next phase's start. The first start is 0. ``clock``: how batches are numbered, one of
    ``CLOCKS``. ``cycle``: ``(first, period)``, the phases from ``first`` (a phase's start) on
    repeat every ``period`` batches (every start is below ``first + period``); None: the last
    phase runs for good. Immutable; validated when built."""

    __slots__ = ("name", "phases", "clock", "cycle")

    def __init__(
        self,
        phases: Sequence[tuple[int, PipelinePlan]],
        name: str | None = None,
        clock: str = "index",
        cycle: tuple[int, int] | None = None,
    ) -> None:
        if clock not in CLOCKS:
            raise PlanError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}", culprit="clock")
        phases = tuple((start, plan) for start, plan in phases)
        if not phases:
            raise PlanError("a phased plan needs at least one phase", culprit="phases")
        for start, plan in phases:
            if not isinstance(plan, PipelinePlan):
                raise PlanError(
                    f"phase {start}: expected a PipelinePlan, got {type(plan).__name__}", culprit=str(start)
                )
            if isinstance(start, bool) or not isinstance(start, int):
                raise PlanError(f"phase start must be an int, got {start!r}", culprit=str(start))
        starts = [s for s, _ in phases]
        wrong = [(s, s) for s in starts[:1] if s != 0] + [(b, a) for a, b in zip(starts, starts[1:]) if b <= a]
        if wrong:
            raise PlanError(
                f"phase starts must begin at 0 and increase, got {starts}",
                culprit=str(wrong[0][0]),
                also=(str(wrong[0][1]),),
            )
        for (a, pa), (b, pb) in zip(phases, phases[1:]):
            problems = switch_problems(pa, pb)
            if problems:
                raise PlanError(
                    f"phases {a} ({pa.name}) and {b} ({pb.name}) cannot take turns: " + "; ".join(problems),
                    culprit=str(b),
                )
        if cycle is not None:
            cycle = _checked_cycle(cycle, phases)
        self.name = check_name(name if name is not None else phases[0][1].name, "plan")
        self.phases: tuple[tuple[int, PipelinePlan], ...] = phases
        self.clock = clock
        self.cycle = cycle

    def plan_for(self, batch_number: int) -> PipelinePlan:
        """The plan of the phase ``batch_number`` falls in."""
        if self.cycle is not None and batch_number >= self.cycle[0]:
            first, period = self.cycle
            batch_number = first + (batch_number - first) % period
        chosen = self.phases[0][1]
        for start, plan in self.phases:
            if batch_number < start:
                break
            chosen = plan
        return chosen

    @property
    def plans(self) -> tuple[PipelinePlan, ...]:
        return tuple(p for _, p in self.phases)

    @property
    def max_stage(self) -> int:
        """The highest stage, the same in every phase."""
        return self.phases[0][1].max_stage

    @property
    def pipeline_depth(self) -> int:
        return max(p.pipeline_depth for p in self.plans)

    def with_thread_map(self, thread_map: ThreadMap) -> PhasedPlan:
        return self.each(lambda p: p.with_thread_map(thread_map))

    def each(self, edit: Callable[[PipelinePlan], PipelinePlan]) -> PhasedPlan:
        """A new PhasedPlan, same starts, name and clock, with ``edit`` applied to every phase's plan."""
        return PhasedPlan([(s, edit(p)) for s, p in self.phases], name=self.name, clock=self.clock, cycle=self.cycle)

    # ------------------------------------------------------------- rendering
    def to_text(self) -> str:
        return phased_to_text(self)

    @classmethod
    def from_text(cls, text: str, vocabulary: Vocabulary | None = None) -> PhasedPlan:
        return phased_from_text(text, PipelinePlan, cls, vocabulary)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_text())

    def format_schedule(self, num_iterations: int, num_batches: int | None = None) -> str:
        blocks = []
        for k, (start, plan) in enumerate(self.phases):
            end = self.phases[k + 1][0] if k + 1 < len(self.phases) else None
            if self.cycle is not None and start >= self.cycle[0]:
                first, period = self.cycle
                end = first + period if end is None else end
                span = f"batches {start} to {end - 1}, then every {period} batches"
            else:
                span = f"batches {start} and on" if end is None else f"batches {start} to {end - 1}"
            if self.clock == "drawn":
                span += " drawn since the pipeline was built"
            elif self.clock == "trained":
                span += " trained since the pipeline was built or reset"
            blocks.append(f"phase {k} ({span}): {plan.name}\n" + format_schedule(plan, num_iterations, num_batches))
        return "\n\n".join(blocks)

    def print_schedule(self, num_iterations: int, num_batches: int | None = None) -> None:
        """Each phase's table, headed by the batches it covers."""
        print(self.format_schedule(num_iterations, num_batches))

    # --------------------------------------------------------------- identity
    def __eq__(self, other: object) -> bool:
        return isinstance(other, PhasedPlan) and (self.name, self.phases, self.clock, self.cycle) == (
            other.name,
            other.phases,
            other.clock,
            other.cycle,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.phases, self.clock, self.cycle))

    def __repr__(self) -> str:
        clock = "" if self.clock == CLOCKS[0] else f", clock={self.clock}"
        cycle = "" if self.cycle is None else f", cycle={self.cycle[0]}+{self.cycle[1]}k"
        return f"PhasedPlan({self.name}, " + ", ".join(f"{s}: {p.name}" for s, p in self.phases) + clock + cycle + ")"

    def __str__(self) -> str:
        return self.to_text()


def _checked_cycle(cycle: object, phases: tuple[tuple[int, PipelinePlan], ...]) -> tuple[int, int]:
    """``cycle`` as ``(first, period)`` once it fits ``phases``, else PlanError naming what is wrong."""
    if (
        not isinstance(cycle, tuple)
        or len(cycle) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in cycle)
    ):
        raise PlanError(f"cycle must be (first, period), two ints, got {cycle!r}", culprit="cycle")
    first, period = cycle
    starts = {s: p for s, p in phases}
    if period < 1 or first not in starts:
        raise PlanError(
            f"cycle {cycle}: period must be >= 1 and first a phase's start ({sorted(starts)})", culprit="cycle"
        )
    if max(starts) >= first + period:
        raise PlanError(
            f"cycle {cycle}: phase {max(starts)} starts past the cycle's end (batch {first + period - 1})",
            culprit="cycle",
        )
    last = phases[-1][1]
    problems = switch_problems(last, starts[first])
    if problems:
        raise PlanError(
            f"cycle {cycle}: phases {phases[-1][0]} ({last.name}) and {first} cannot take turns: "
            + "; ".join(problems),
            culprit="cycle",
        )
    return first, period


def load_plan(path: str, vocabulary: Vocabulary | None = None) -> PipelinePlan | PhasedPlan:
    """A plan file written by ``save()``: a PipelinePlan, or a PhasedPlan. ``vocabulary``: the names
    the pipeline it is for declares (``Vocabulary.of``; its tasks are then the only ones allowed)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if is_phased_text(text):
        return PhasedPlan.from_text(text, vocabulary)
    return PipelinePlan.from_text(text, vocabulary)
