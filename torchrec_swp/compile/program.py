"""The program IR: per-thread instruction lists for one internal iteration.

Instructions are frozen, slotted and print compactly; ``format_program`` gives the text used
in golden tests, error messages and logs.

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

from dataclasses import dataclass, field

from torchrec_swp.plan import MAIN_THREAD, When


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
