"""The program IR: per-thread instruction lists for one internal iteration.

Instructions are frozen, slotted and print compactly; ``format_program`` gives the text used
in golden tests, error messages and logs, and ``parse_program`` reads it back (given the plan,
which holds each task's stage and stream): ``parse_program(format_program(p), plan) == p``.

Roughly:
  ``run T``             call task T for batch ``P - stage(T)`` (``run T #k@g`` holds collective
                        ticket k of comm group g; ``run? T`` is skipped when its batch was not
                        loaded; ``run! T`` is the source, which may find the data exhausted,
                        ``run! T x2`` with 2 loads in flight, one per lane thread;
                        ``run T if first`` runs only for the batches its ``When`` admits)
  ``wait T``            block this CPU thread until T's instance of this iteration (on another
                        thread) finished; ``wait T@P-k`` T's instance of iteration ``P - k``
                        (an instance whose batch does not exist counts as finished)
  ``signal T``          tell waiting threads that T's instance finished (or was skipped)
  ``stream S <- T@k``   device: stream S waits for the event recorded after T(b - k)
  ``record T``          device: record an event on T's stream after T ran
  ``alias T x=y``       T is a no-op on this device: its batch's slot gets x = y, no call
  ``run 0F3``           pipeline parallelism: call the binding of the action's kind (``F``) with
                        its stage and microbatch (0, 3); the action's text is its completion key
                        (``wait 0F3`` / ``signal 0F3``); ``run 0G #0@dp`` holds a collective ticket.
                        Programs of actions are straight-line: one runs once (one optimizer step)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, PlanError, When


@dataclass(frozen=True, slots=True)
class Run:
    task: str
    stage: int
    ticket: int | None = None
    comm_group: str | None = None
    guarded: bool = False
    source: bool = False
    when: When = When.ALWAYS
    lanes: int = 1

    def __str__(self) -> str:
        mark = "!" if self.source else "?" if self.guarded else ""
        lanes = f" x{self.lanes}" if self.lanes > 1 else ""
        ticket = f" #{self.ticket}@{self.comm_group}" if self.ticket is not None else ""
        guard = f" if {self.when.value}" if self.when is not When.ALWAYS else ""
        return f"run{mark} {self.task}{lanes}{ticket}{guard}"


@dataclass(frozen=True, slots=True)
class WaitTask:
    """Wait for ``task``'s instance of iteration ``P - lag`` (``lag`` 0: this iteration)."""

    task: str
    lag: int = 0

    def __str__(self) -> str:
        return f"wait {self.task}" if self.lag == 0 else f"wait {self.task}@P-{self.lag}"


@dataclass(frozen=True, slots=True)
class Signal:
    task: str

    def __str__(self) -> str:
        return f"signal {self.task}"


@dataclass(frozen=True, slots=True)
class WaitStream:
    stream: str
    task: str
    distance: int = 0
    producer_stage: int = 0
    consumer_stage: int = 0

    def __str__(self) -> str:
        return f"stream {self.stream} <- {self.task}@{self.distance}"


@dataclass(frozen=True, slots=True)
class RecordEvent:
    task: str
    stream: str
    stage: int

    def __str__(self) -> str:
        return f"record {self.task}"


@dataclass(frozen=True, slots=True)
class Alias:
    task: str
    stage: int
    pairs: tuple[tuple[str, str], ...]  # (write, read)

    def __str__(self) -> str:
        return f"alias {self.task} " + " ".join(f"{w}={r}" for w, r in self.pairs)


@dataclass(frozen=True, slots=True)
class RunAction:
    """One action of a pipeline-parallel rank program (``torchrec_swp.pp``), e.g. ``0F3``.

    Kept to plain values so that this layer stays independent of ``pp``: ``action`` is the
    action's text (its completion key), ``kind`` its kind text (``F``, ``SF``, ``G`` ...) which
    selects the binding, called with ``(stage, microbatch)`` (``microbatch`` None for ``G``/``O``).
    """

    action: str
    kind: str
    stage: int
    microbatch: int | None = None
    ticket: int | None = None
    comm_group: str | None = None

    def __str__(self) -> str:
        ticket = f" #{self.ticket}@{self.comm_group}" if self.ticket is not None else ""
        return f"run {self.action}{ticket}"


Instr = Run | Alias | WaitTask | Signal | WaitStream | RecordEvent | RunAction


@dataclass(frozen=True, slots=True)
class IterationProgram:
    """What every thread does in one internal iteration with the given active stages.

    ``threads``: ``(thread_group, instructions)`` pairs, the calling thread first.
    ``tickets``: number of collective tickets per comm group handed out in this iteration.
    """

    active_stages: tuple[int, ...]
    threads: tuple[tuple[str, tuple[Instr, ...]], ...]
    tickets: tuple[tuple[str, int], ...] = ()
    #: Only one thread has instructions.
    single_thread: bool = field(init=False, compare=False)
    #: Only the calling thread works, and only plain runs (and aliases): no waits, signals,
    #: tickets or device events: the calls have nothing to synchronise (the engine still runs
    #: it through its one interpreter; compare.py reports whether removing no-ops made it so).
    flat: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # computed once: the engine asks on every iteration
        object.__setattr__(self, "single_thread", sum(1 for _, instrs in self.threads if instrs) <= 1)
        object.__setattr__(
            self,
            "flat",
            all(
                not instrs
                if thread != MAIN_THREAD
                else all((isinstance(i, Run) and i.ticket is None) or isinstance(i, Alias) for i in instrs)
                for thread, instrs in self.threads
            ),
        )

    def instructions(self, thread: str) -> tuple[Instr, ...]:
        for name, instrs in self.threads:
            if name == thread:
                return instrs
        return ()

    def runs(self) -> list[Run]:
        return [i for _, instrs in self.threads for i in instrs if isinstance(i, Run)]


def format_program(program: IterationProgram) -> str:
    """Readable text: one block per thread, one instruction per line."""
    lines = [f"stages {','.join(map(str, program.active_stages)) or '-'}"]
    for group, count in program.tickets:
        lines.append(f"tickets {group}={count}")
    for thread, instrs in program.threads:
        lines.append(f"thread {thread}:")
        lines.extend(f"  {i}" for i in instrs)
    return "\n".join(lines)


#: ``0F3``, ``1SB2``, ``0G``: a pipeline-parallel action's text (stage, kind, microbatch)
_ACTION = re.compile(r"(\d+)([A-Z]+)(\d+)?")
_RUN = re.compile(
    r"run(?P<mark>[!?]?) (?P<task>\S+)(?: x(?P<lanes>\d+))?(?: #(?P<ticket>\d+)@(?P<group>\S+))?(?: if (?P<when>\S+))?"
)


def parse_program(text: str, plan: PipelinePlan | None = None) -> IterationProgram:
    """The inverse of ``format_program``: ``parse_program(format_program(p), plan) == p``.

    The text leaves out what the plan says of each task (its stage, its stream), so a program of
    a plan is parsed with that plan; a pipeline-parallel program (``run 0F3``) needs none. A line
    that is not an instruction, or names a task the plan does not have, raises PlanError naming
    the line."""
    stages: tuple[int, ...] | None = None
    tickets: list[tuple[str, int]] = []
    threads: list[tuple[str, list[Instr]]] = []
    lines = text.splitlines()
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        try:
            if stages is None:
                word, _, rest = line.partition(" ")
                if word != "stages":
                    raise PlanError("a program starts with 'stages S0,S1,...' (or 'stages -')")
                stages = () if rest == "-" else tuple(int(x) for x in rest.split(","))
            elif line.startswith("tickets ") and not threads:
                group, sep, count = line[len("tickets ") :].partition("=")
                if not sep:
                    raise PlanError("a tickets line reads 'tickets GROUP=N'")
                tickets.append((group, int(count)))
            elif line.startswith("thread ") and line.endswith(":"):
                threads.append((line[len("thread ") : -1], []))
            elif not threads:
                raise PlanError("an instruction before the first 'thread NAME:' line")
            else:
                after = _consumer(lines[lineno:])
                threads[-1][1].append(_instruction(line, plan, after))
        except ValueError as e:  # PlanError included: a bad number, a bad word
            message = str(e) if isinstance(e, PlanError) else f"bad number ({e})"
            raise PlanError(f"program text, line {lineno}: {message} (in {raw.strip()!r})") from None
    if stages is None:
        raise PlanError("program text: empty (it starts with 'stages ...')")
    return IterationProgram(stages, tuple((t, tuple(i)) for t, i in threads), tuple(tickets))


def _consumer(rest: list[str]) -> str | None:
    """The task a stream wait orders: the next run (or alias, its no-op form) of its thread."""
    for raw in rest:
        line = raw.strip()
        if line.startswith("thread "):
            return None
        m = _RUN.fullmatch(line)
        if m is not None:
            return m["task"]
        if line.startswith("alias "):
            return line.split()[1]
    return None


def _instruction(line: str, plan: PipelinePlan | None, after: str | None) -> Instr:
    word, _, rest = line.partition(" ")

    def stage(task: str) -> int:
        if plan is None:
            raise PlanError(f"task {task!r}: a program of a plan is parsed with its plan")
        return plan.task(task).stage

    if word.startswith("run"):
        m = _RUN.fullmatch(line)
        if m is None:
            raise PlanError("a run reads 'run[!?] TASK [xN] [#K@GROUP] [if WHEN]'")
        task, ticket = m["task"], None if m["ticket"] is None else int(m["ticket"])
        action = _ACTION.fullmatch(task)
        if plan is None and action is not None:
            if m["mark"] or m["lanes"] or m["when"]:
                raise PlanError("an action's run reads 'run ACTION [#K@GROUP]'")
            mb = action[3]
            return RunAction(task, action[2], int(action[1]), None if mb is None else int(mb), ticket, m["group"])
        when = When.ALWAYS if m["when"] is None else _when(m["when"])
        lanes = 1 if m["lanes"] is None else int(m["lanes"])
        if lanes < 2 and m["lanes"] is not None:
            raise PlanError("lanes are written 'xN' only for N >= 2")
        return Run(task, stage(task), ticket, m["group"], m["mark"] == "?", m["mark"] == "!", when, lanes)
    if word == "wait":
        task, sep, lag = rest.partition("@P-")
        if not task or " " in task:
            raise PlanError("a wait reads 'wait TASK' or 'wait TASK@P-K'")
        if plan is not None:
            stage(task)
        return WaitTask(task, int(lag) if sep else 0)
    if word == "signal":
        if not rest or " " in rest:
            raise PlanError("a signal reads 'signal TASK'")
        if plan is not None:
            stage(rest)
        return Signal(rest)
    if word == "stream":
        m = re.fullmatch(r"(\S+) <- (\S+)@(-?\d+)", rest)
        if m is None:
            raise PlanError("a stream wait reads 'stream STREAM <- TASK@K'")
        if after is None:
            raise PlanError("a stream wait is followed by the run (or alias) it orders")
        return WaitStream(m[1], m[2], int(m[3]), stage(m[2]), stage(after))
    if word == "record":
        if not rest or " " in rest:
            raise PlanError("a record reads 'record TASK'")
        s = stage(rest)
        assert plan is not None  # stage() checked it
        return RecordEvent(rest, plan.task(rest).stream, s)
    if word == "alias":
        task, _, pairs = rest.partition(" ")
        parsed = tuple(tuple(p.split("=", 1)) for p in pairs.split())
        if not parsed or any(len(p) != 2 or not all(p) for p in parsed):
            raise PlanError("an alias reads 'alias TASK WRITE=READ ...'")
        return Alias(task, stage(task), parsed)  # type: ignore[arg-type]  # pairs of two, checked just above
    raise PlanError(f"unknown instruction {word!r} (run, wait, signal, stream, record, alias)")


def _when(text: str) -> When:
    guards = [w.value for w in When if w is not When.ALWAYS]  # no guard is written for ALWAYS
    if text not in guards:
        raise PlanError(f"unknown guard {text!r} (one of {', '.join(guards)})")
    return When(text)
