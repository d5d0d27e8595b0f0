"""Race detection: does the program enforce every dependency of the plan?

For every dependency instance ``consumer(b) after producer(b - k)`` of ``plan.deps`` (explicit
and inferred) where both instances run:

1. ``cpu-order``: the producer's run happens before the consumer's run in the program:
   earlier on the same thread, or linked by a chain of program order, iteration barriers,
   ``signal -> wait`` pairs and collective tickets (ticket ``k`` is taken after ticket
   ``k - 1`` is released). Timing never counts: a dependency that holds only because the
   producer happened to be fast is a race.
2. ``cpu-time``: in the simulated timeline the producer ended before the consumer started.
3. ``device-order`` (only when device streams are modelled, for producer and consumer on
   different streams): some ``stream S <- producer`` naming the producer instance, on the
   consumer's stream ``S``, happens before the consumer's run, and the producer's
   ``record`` on its own stream happens after its run and before that wait. (Same-stream
   dependencies need nothing more than rule 1: a stream runs its work in submission order.)
4. ``device-time``: when both submitted device work, the producer's ended before the
   consumer's started.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchrec_swp.compile import IterationProgram, RecordEvent, Run, WaitStream
from torchrec_swp.plan import Dep, PipelinePlan
from torchrec_swp.plan.table import format_schedule
from torchrec_swp.sim.errors import Race, SimRace
from torchrec_swp.sim.result import Interval, SimResult, Step
from torchrec_swp.sim.simulator import simulate_programs

Programs = Sequence[tuple[int, IterationProgram]]


def find_races(
    result_or_programs: SimResult | Programs,
    plan: PipelinePlan,
    *,
    iteration_barrier: bool = True,
    device_streams: bool = False,
) -> list[Race]:
    """Every violation of the rules above, in execution order of the consumers.

    A SimResult is checked as it was simulated (the keyword flags are ignored; device rules
    apply iff it was simulated with device durations). Bare ``(iteration, program)`` pairs are
    first replayed with zero durations under ``iteration_barrier``; device rules apply iff
    ``device_streams``. Raises SimDeadlock if the programs deadlock.
    """
    result, device = _replayed(result_or_programs, plan, iteration_barrier, device_streams)
    return _Checker(result, plan, device).races()


def check_happens_before(
    result_or_programs: SimResult | Programs,
    plan: PipelinePlan,
    *,
    iteration_barrier: bool = True,
    device_streams: bool = False,
) -> None:
    """Raise SimRace listing every race ``find_races`` finds, with the schedule grid marking
    the first racing consumer; return None when every dependency is enforced."""
    result, device = _replayed(result_or_programs, plan, iteration_barrier, device_streams)
    races = _Checker(result, plan, device).races()
    if not races:
        return
    message = "\n".join(
        [
            f"{len(races)} dependenc{'y is' if len(races) == 1 else 'ies are'} not enforced in plan {plan.name}:",
            *(f"  {r}" for r in races),
            format_schedule(
                result.plan, len(result.phases), result.num_batches, mark=(races[0].consumer, races[0].iteration)
            ),
        ]
    )
    raise SimRace(message, tuple(races))


def _replayed(
    result_or_programs: SimResult | Programs, plan: PipelinePlan, iteration_barrier: bool, device_streams: bool
) -> tuple[SimResult, bool]:
    """The result to check and whether device rules apply (see ``find_races``)."""
    if isinstance(result_or_programs, SimResult):
        return result_or_programs, result_or_programs.device_modelled
    return simulate_programs(plan, result_or_programs, _zero, iteration_barrier=iteration_barrier), device_streams


def _zero(task: str, batch: int) -> float:
    return 0.0


class _Checker:
    """Indexes the steps of a result once, then checks every dependency instance."""

    def __init__(self, result: SimResult, plan: PipelinePlan, device: bool) -> None:
        self.result = result
        self.device = device
        self.lane = {t: k for k, t in enumerate(result.threads)}
        self.stream = {t: s.stream for t, s in plan.schedule.items()}
        self.runs: dict[tuple[str, int], Step] = {}
        self.records: dict[tuple[str, int], list[Step]] = {}
        self.waits: dict[tuple[str, str, int], list[Step]] = {}
        for s in result.steps:
            match s.instr:
                case Run(task=task):
                    self.runs[(task, s.batch)] = s
                case RecordEvent(task=task):
                    self.records.setdefault((task, s.batch), []).append(s)
                case WaitStream(stream=stream, task=task):
                    self.waits.setdefault((stream, task, s.batch), []).append(s)
        self.work: dict[tuple[str, int], Interval] = {
            (i.task, i.batch): i for i in result.timeline if not i.lane.startswith("cpu:")
        }
        self.deps: dict[str, list[Dep]] = {}
        for d in plan.deps:
            self.deps.setdefault(d.consumer, []).append(d)

    def races(self) -> list[Race]:
        out = []
        for c in self.result.steps:
            if not isinstance(c.instr, Run):
                continue
            for d in self.deps.get(c.instr.task, ()):
                p = self.runs.get((d.producer, c.batch - d.distance))
                if p is not None:
                    out.extend(self._check(d, c, p))
        return out

    def _before(self, a: Step, b: Step) -> bool:
        """``a`` happens before ``b`` (vector clocks: ``b`` has seen ``a``'s thread up to ``a``)."""
        return (a.thread, a.seq) != (b.thread, b.seq) and a.seq <= b.clock[self.lane[a.thread]]

    def _check(self, d: Dep, c: Step, p: Step) -> list[Race]:
        def race(kind: str, detail: str) -> Race:
            return Race(kind, d.consumer, c.batch, d.producer, p.batch, c.thread, c.iteration, f"dep {d}: {detail}")

        out = []
        if not self._before(p, c):
            out.append(
                race(
                    "cpu-order",
                    f"no happens-before edge from {d.producer} on thread {p.thread!r} "
                    f"(internal iteration {p.iteration}) in the program",
                )
            )
        if p.end > c.start:
            out.append(race("cpu-time", f"{d.producer} ends at {p.end:g}, {d.consumer} starts at {c.start:g}"))
        producer_stream, consumer_stream = self.stream[d.producer], self.stream[d.consumer]
        if (
            self.device
            and producer_stream != consumer_stream
            and not self._stream_synced(d.producer, p, c, producer_stream, consumer_stream)
        ):
            out.append(
                race(
                    "device-order",
                    f"no `stream {consumer_stream} <- {d.producer}` on an event recorded "
                    f"after {d.producer}({p.batch}) happens before {d.consumer}",
                )
            )
        pw, cw = self.work.get((d.producer, p.batch)), self.work.get((d.consumer, c.batch))
        if pw is not None and cw is not None and pw.end > cw.start:
            out.append(
                race(
                    "device-time",
                    f"{d.producer} ends on {pw.lane} at {pw.end:g}, {d.consumer} starts on {cw.lane} at {cw.start:g}",
                )
            )
        return out

    def _stream_synced(self, producer: str, p: Step, c: Step, producer_stream: str, consumer_stream: str) -> bool:
        """Whether ``p``, the run of ``producer`` that ``c`` depends on, is synced to ``c``'s stream."""
        records = [
            r
            for r in self.records.get((producer, p.batch), ())
            if isinstance(r.instr, RecordEvent) and r.instr.stream == producer_stream and self._before(p, r)
        ]
        return any(
            self._before(w, c) and any(self._before(r, w) for r in records)
            for w in self.waits.get((consumer_stream, producer, p.batch), ())
        )
