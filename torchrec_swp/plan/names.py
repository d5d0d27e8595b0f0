"""The names a plan's text may use, and how close two names are (for "did you mean").

A plan's text names tasks (its rows, the ends of its deps, its source), data (reads, writes, its
output), streams, threads and comm groups. Task rows declare the tasks and writes declare the data;
the ``streams``, ``threads`` and ``comm_groups`` lines declare the others (``plan_to_text`` writes
them, listing exactly the names the rows use). A text without such a line (written by hand, or
before these lines existed) may use only the names of its ``Vocabulary`` for that kind: for
streams and comm groups, TorchRec's (``KNOWN_STREAMS``, ``KNOWN_COMM_GROUPS``); threads are then
not checked (a thread only says which CPU thread calls a task: the results are the same).

A ``Vocabulary`` is also what a pipeline declares: ``Vocabulary.of(plan, tasks=...)`` holds the
names of its default plan and its task functions. With ``tasks`` set, every task row must name one
of them. Where a mistake could be in either of two lines (a task row names ``Dequeu`` and a dep
``Dequeue``, or the other way round), the name the vocabulary holds is taken as the right one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchrec_swp.plan.calls import TaskCall
from torchrec_swp.plan.task import DEFAULT_COMM_GROUP, DEFAULT_STREAM, MAIN_THREAD, PipelineTask, parse_read

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PlanView

#: The streams of TorchRec's pipelines: what a plan text without a ``streams`` line may use.
KNOWN_STREAMS = frozenset({DEFAULT_STREAM, "memcpy", "data_dist", "prefetch", "emb_lookup", "postproc", "d2h"})
#: The comm groups of TorchRec's pipelines (the model's, and the input dist's of its own).
KNOWN_COMM_GROUPS = frozenset({DEFAULT_COMM_GROUP, "input_dist"})
#: The thread groups the thread maps name without being told (the caller's, ``io``, ``load``).
KNOWN_THREADS = frozenset({MAIN_THREAD, "io", "load"})


@dataclass(frozen=True)
class Vocabulary:
    """Names a plan's text may use besides those it declares (see the module docstring).

    ``tasks``: the tasks a pipeline can run (None: any name; a plan not yet bound to a pipeline).
    ``data``: names its tasks exchange; ``io``: what its tasks read and write (where two phases of
    a text disagree on a task, the one that agrees with ``io`` is right). ``streams``,
    ``comm_groups``: what a text without a ``streams`` or ``comm_groups`` line may use.
    ``threads``: only to tell which of two near names is right. ``calls``: what its task
    functions can be called with (``TaskCall``): each row's reads and writes are checked against
    its task's (``calls.check_call``)."""

    tasks: frozenset[str] | None = None
    data: frozenset[str] = frozenset()
    streams: frozenset[str] = KNOWN_STREAMS
    threads: frozenset[str] = KNOWN_THREADS
    comm_groups: frozenset[str] = KNOWN_COMM_GROUPS
    io: tuple[PipelineTask, ...] = ()
    calls: tuple[TaskCall, ...] = ()

    def call_of(self, task: str) -> TaskCall | None:
        """What the pipeline's function of ``task`` can be called with, where it says."""
        return next((c for c in self.calls if c.task == task), None)

    def io_of(self, task: str) -> PipelineTask | None:
        """What the pipeline's task ``task`` reads and writes, where it says."""
        return next((t for t in self.io if t.name == task), None)

    @classmethod
    def of(
        cls, *plans: PlanView, tasks: Iterable[str] | None = None, calls: Iterable[TaskCall | None] = ()
    ) -> Vocabulary:
        """What a pipeline declares: the names of its ``plans`` (its default plan, each phase's)
        and ``tasks`` (its task functions; None: the plans' tasks), with TorchRec's streams and
        comm groups; ``calls``: what its task functions can be called with (None: not known)."""
        scheduled = [t for p in plans for t in p.scheduled()]
        names = {t.name for t in scheduled} if tasks is None else set(tasks)
        data = {parse_read(d)[0] for t in scheduled for d in (*t.io.reads, *t.io.writes)}
        data |= {p.output for p in plans if p.output is not None}
        return cls(
            tasks=frozenset(names),
            data=frozenset(data),
            streams=KNOWN_STREAMS | {t.stream for t in scheduled},
            threads=KNOWN_THREADS | {t.thread_group for t in scheduled},
            comm_groups=KNOWN_COMM_GROUPS | {t.comm_group for t in scheduled if t.comm_group is not None},
            io=tuple({t.name: t.io for t in scheduled}.values()),
            calls=tuple(c for c in calls if c is not None),
        )

    def of_kind(self, kind: str) -> frozenset[str]:
        """The names of one kind: ``streams``, ``threads``, ``comm_groups``, ``tasks`` or ``data``."""
        if kind == "tasks":
            return self.tasks or frozenset()
        return getattr(self, kind)


def distance(a: str, b: str) -> int:
    """Edits (insert, delete, change a character, swap two neighbours) that make ``a`` into ``b``."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def is_near(a: str, b: str) -> bool:
    """Whether ``a`` looks like a slip of ``b``: the same but for case, or one edit away (where one
    has 3 characters or more: any change of a shorter name makes another name), two for names of 6
    or more."""
    if a == b:
        return False
    if a.lower() == b.lower():
        return True
    d = distance(a, b)
    return (d <= 1 and max(len(a), len(b)) >= 3) or (d <= 2 and min(len(a), len(b)) >= 6)


def nearest(word: str, names: Iterable[str]) -> str | None:
    """The name of ``names`` nearest ``word`` where it ``is_near``, else None (ties: the first)."""
    close = [n for n in names if is_near(word, n)]
    return min(close, key=lambda n: distance(word.lower(), n.lower()), default=None)


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the name of ``names`` nearest ``word``, else ``""``."""
    near = nearest(word, names)
    return f"; did you mean {near!r}?" if near is not None else ""
