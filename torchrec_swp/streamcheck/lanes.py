"""The checker's records: lanes (one stream as one CPU thread enqueues on it), the accesses kept
per storage, each thread's clocks, and the labels that say where an op ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchrec_swp.streamcheck.findings import Access

if TYPE_CHECKING:
    from torchrec_swp.streamcheck.autograd import NodeStreams
    from torchrec_swp.streamcheck.dispatch import AccessMode
    from torchrec_swp.streamcheck.emulated import Stream

#: lane id -> the last step of that lane known (enqueued before, or completed)
Clock = dict[int, int]


def join(into: Clock, other: Clock) -> None:
    """``into`` becomes the pointwise maximum of both clocks."""
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass(frozen=True, slots=True)
class TaskLabel:
    """Where an op ran: task, batch and the engine's thread name."""

    task: str
    batch: int | None
    thread: str

    def __str__(self) -> str:
        batch = "" if self.batch is None else f" batch {self.batch}"
        return f"task {self.task}{batch} (thread {self.thread})"


class Lane:
    """One stream as one CPU thread enqueues on it; ``seq`` counts its steps (ops)."""

    __slots__ = ("id", "seq", "stream", "thread")

    def __init__(self, lane_id: int, stream: Stream, thread: str) -> None:
        self.id, self.stream, self.thread, self.seq = lane_id, stream, thread, 0


class Use:
    """One access, kept per storage until superseded: enough to order it and to report it."""

    __slots__ = ("arg", "label", "lane", "op", "seq", "shape", "write")

    def __init__(
        self, lane: Lane, seq: int, write: bool, label: TaskLabel | None, op: str, arg: str, shape: Any
    ) -> None:
        self.lane, self.seq, self.write, self.label = lane, seq, write, label
        self.op, self.arg, self.shape = op, arg, shape

    def access(self) -> Access:
        label = self.label
        return Access(
            kind="write" if self.write else "read",
            task=None if label is None else label.task,
            batch=None if label is None else label.batch,
            thread=self.lane.thread if label is None else label.thread,
            stream=self.lane.stream.name,
            op=self.op,
            arg=self.arg,
            shape=tuple(self.shape),
        )


class ThreadState:
    """What one CPU thread knows: its host clock, per stream the work it knows enqueued, the work
    it knows completed, its lanes, its entered streams and its task label; ``mode`` and ``nodes``
    are its access mode and backward tagger, pushed while it runs a task."""

    __slots__ = ("depth", "done", "enq", "host", "label", "lanes", "mode", "name", "nodes", "stack", "uid")

    def __init__(self, uid: int, name: str, mode: AccessMode, nodes: NodeStreams) -> None:
        self.uid = uid
        self.name = name
        self.host: Clock = {uid: 1}  # thread uid -> host epoch known
        self.enq: dict[Stream, Clock] = {}  # stream -> clock of its work this thread knows enqueued
        self.done: Clock = {}  # lane steps this thread knows completed (host syncs)
        self.lanes: dict[Stream, Lane] = {}
        self.stack: list[Stream] = []  # entered streams; empty: the default stream
        self.label: TaskLabel | None = None
        self.mode = mode
        self.nodes = nodes
        self.depth = 0  # nesting of tasks (the mode is pushed at depth 0 -> 1)

    def where(self) -> str:
        return f"outside tasks (thread {self.name})" if self.label is None else f"in {self.label}"

    def task(self) -> str:
        """The thread's task and engine thread, without the batch (for signatures)."""
        label = self.label
        return f"- ({self.name})" if label is None else f"{label.task} ({label.thread})"


@dataclass
class CheckStats:
    """Counters (approximate under concurrency only in ``tasks``)."""

    ops: int = 0
    touches: int = 0
    tasks: int = 0
    storages_tracked: int = 0
    storages_freed: int = 0
    unknown_acquires: int = 0
    keys_evicted: int = 0
    frees_pending: int = 0
    # frees with uses on other streams found safe: by a host sync (``.item()``, synchronize) or by
    # a wait of the allocation stream (at the free or before the next allocation there)
    frees_after_host_sync: int = 0
    frees_after_wait: int = 0
    backward_nodes: int = 0
