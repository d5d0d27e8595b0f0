"""The stream checker: happens-before over emulated streams, CPU threads and tensor storages.

Model (the vector clocks of ``torch.cuda._sanitizer``, with CPU threads added):

* A *lane* is one stream as one CPU thread enqueues on it. Every aten op run inside a task is
  one step of the lane (current stream, calling thread); steps of one lane are ordered.
* Each thread keeps, per stream, the clock of the work it knows to be enqueued on that stream
  (``enq``): its own steps, and other threads' steps up to their last ``cpu_release`` that this
  thread acquired. ``wait_stream``, ``Event.record`` and ``stream.synchronize`` see exactly that
  much of a stream: what another thread enqueued without a CPU-side edge to the caller may come
  later in another interleaving, so it is not counted.
* ``B.wait_stream(A)`` / ``B.wait_event(e)`` join A's (e's) clock into the thread's clock of B;
  host synchronisations (``Stream.synchronize``, ``Event.synchronize``, device synchronise, and
  ``.item()``'s device-to-host copy) join into the thread's ``done`` clock, which orders the
  work before every later step of that thread on any stream.
* CPU side: each thread has a host clock; ``cpu_release(key)`` publishes everything the thread
  knows under ``key``, ``cpu_acquire(key)`` joins it. An event whose last record is not in the
  waiting thread's host clock is a ``HostOrder`` finding, and such a wait orders nothing.
* Per storage: the last write and, per lane, the last read since; a new access not ordered
  after them is an ``UnsyncedAccess``. On the storage's deallocation (a weakref on its Python
  object: torch keeps one Python object per live storage, so the callback runs exactly when
  the storage dies) each use on a stream other than the allocation stream must be covered by
  ``record_stream`` or by what the freeing thread knows of the allocation stream, else
  ``EarlyFree``.

Findings are collected (the first occurrence of each signature, with a count) and ``check()``
raises ``StreamCheckError`` listing them; with ``fail_fast=True`` an unsynchronised access or a
host-order finding raises at once from the op (or wait) that found it. Frees never raise (they
run in weakref callbacks): they are only collected.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import Self

from torchrec_swp.streamcheck.dispatch import NONE, WRITE, AccessMode, OpPlan, Touch
from torchrec_swp.streamcheck.findings import (
    Access,
    EarlyFree,
    Finding,
    HostOrder,
    StreamCheckError,
    StreamCheckUsageError,
    UnsyncedAccess,
)
from torchrec_swp.streamcheck.streams import Event, Stream, active_checker, set_active

#: The name of the stream every thread is on unless it entered another (the plan's default).
DEFAULT_STREAM = "default"

Clock = dict[int, int]


@dataclass(frozen=True, slots=True)
class TaskLabel:
    """Where an op ran: task, batch and the engine's thread name."""

    task: str
    batch: int | None
    thread: str

    def __str__(self) -> str:
        batch = "" if self.batch is None else f" batch {self.batch}"
        return f"task {self.task}{batch} (thread {self.thread})"


class _Lane:
    __slots__ = ("id", "seq", "stream", "thread")

    def __init__(self, lane_id: int, stream: Stream, thread: str) -> None:
        self.id, self.stream, self.thread, self.seq = lane_id, stream, thread, 0


class _Use:
    """One access, kept per storage until superseded: enough to order it and to report it."""

    __slots__ = ("arg", "label", "lane", "op", "seq", "shape", "write")

    def __init__(
        self, lane: _Lane, seq: int, write: bool, label: TaskLabel | None, op: str, arg: str, shape: Any
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


class _StorageState:
    __slots__ = ("alloc", "host", "nbytes", "reads", "recorded", "ref", "write")

    def __init__(self, alloc: Stream, nbytes: int, host: bool = False) -> None:
        self.alloc = alloc
        # made outside every task (the loader's batches, tensors that existed before): host memory
        # in a CUDA run, whose caching host allocator records its uses itself - no early free
        self.host = host
        self.nbytes = nbytes
        self.write: _Use | None = None
        self.reads: dict[int, _Use] = {}  # lane id -> last read on that lane since the last write
        self.recorded: set[Stream] = set()  # streams given to record_stream
        self.ref: weakref.ref[Any] | None = None


class _ThreadState:
    __slots__ = ("depth", "done", "enq", "host", "label", "lanes", "mode", "name", "stack", "uid")

    def __init__(self, uid: int, name: str, checker: StreamChecker) -> None:
        self.uid = uid
        self.name = name
        self.host: Clock = {uid: 1}  # thread uid -> host epoch known
        self.enq: dict[Stream, Clock] = {}  # stream -> clock of its work this thread knows enqueued
        self.done: Clock = {}  # lane steps this thread knows completed (host syncs)
        self.lanes: dict[Stream, _Lane] = {}
        self.stack: list[Stream] = []  # entered streams; empty: the default stream
        self.label: TaskLabel | None = None
        self.mode = AccessMode(checker)
        self.depth = 0  # nesting of tasks (the mode is pushed at depth 0 -> 1)

    def where(self) -> str:
        return f"outside tasks (thread {self.name})" if self.label is None else f"in {self.label}"


def _task_of(ts: _ThreadState) -> str:
    label = ts.label
    return f"- ({ts.name})" if label is None else f"{label.task} ({label.thread})"


def _join(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


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


class StreamChecker:
    """Checks, on the CPU, the stream synchronisation a CUDA run of the same code would have.

    Lifecycle: ``install()`` (or ``with checker:``) patches torch's CPU stream APIs so library
    code talks to this checker; ops are recorded inside ``task(...)`` contexts, on any thread,
    whether or not it is installed. ``check()`` raises if anything was found.

    Not thread-confined: every method may be called from any thread; each acts for the calling
    thread (its current stream, its host clock).
    """

    def __init__(self, *, fail_fast: bool = False, max_findings: int = 1000, max_keys: int = 1 << 16) -> None:
        self.fail_fast = fail_fast
        self.max_findings = max_findings
        self.max_keys = max_keys
        self.stats = CheckStats()
        self._lock = threading.RLock()
        self._local = threading.local()
        self._uids = itertools.count(1)
        self._lane_ids = itertools.count(1)
        self._stream_ids = itertools.count(0)
        self._named: dict[str, Stream] = {}
        self._adopted: dict[int, tuple[Any, Stream]] = {}  # id(foreign stream object) -> (it, emulated)
        self._storages: dict[int, _StorageState] = {}  # StorageImpl address -> state
        self._keys: OrderedDict[Hashable, tuple[Clock, dict[Stream, Clock], Clock]] = OrderedDict()
        self._findings: list[Finding] = []
        self._counts: list[int] = []
        self._index: dict[tuple[str, ...], int] = {}
        self._dropped = 0
        self._patch: Any = None
        self.default_stream = self.stream(DEFAULT_STREAM)

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> Self:
        """Patch torch's CPU stream APIs to this checker (see ``patches.TorchPatch``); one
        checker at a time."""
        from torchrec_swp.streamcheck.patches import TorchPatch

        other = active_checker()
        if other is not None:
            raise StreamCheckUsageError("another StreamChecker is installed; uninstall it first")
        self._patch = TorchPatch(self)
        self._patch.install()
        set_active(self)
        return self

    def uninstall(self) -> None:
        """Undo ``install`` (idempotent). Findings stay."""
        if self._patch is not None:
            self._patch.uninstall()
            self._patch = None
        if active_checker() is self:
            set_active(None)

    @property
    def installed(self) -> bool:
        return self._patch is not None

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ streams
    def _next_stream_id(self) -> int:
        return next(self._stream_ids)

    def stream(self, name: str) -> Stream:
        """The emulated stream called ``name`` (made on first use); ``"default"`` is
        ``default_stream``, every thread's current stream unless it entered another."""
        with self._lock:
            s = self._named.get(name)
            if s is None:
                s = self._named[name] = Stream(name=name, checker=self)
            return s

    def adopt(self, obj: Any, name: str | None = None) -> Stream:
        """The emulated stream standing for a foreign stream object (a user's ``torch.cpu.Stream``,
        ``torch.Stream``, ...): the named one if ``name`` is given, else a new one. Later
        ``resolve(obj)`` (so ``torch.cpu.stream(obj)``, ``t.record_stream(obj)``) gives it."""
        resolved = self._resolve_known(obj)
        if resolved is not None:
            return resolved
        with self._lock:
            if name is not None:
                s = self.stream(name)
            else:
                s = Stream(name=f"{type(obj).__name__}#{len(self._adopted)}", checker=self)
            self._adopted[id(obj)] = (obj, s)  # keeps obj alive: its id is never reused
            return s

    def _resolve_known(self, obj: Any) -> Stream | None:
        if isinstance(obj, Stream):
            if obj.checker is not self:
                raise StreamCheckUsageError(f"{obj!r} belongs to another StreamChecker")
            return obj
        hit = self._adopted.get(id(obj))
        return None if hit is None else hit[1]

    def knows(self, obj: Any) -> bool:
        """Whether ``obj`` is one of this checker's streams or an adopted stream object."""
        return isinstance(obj, Stream) and obj.checker is self or id(obj) in self._adopted

    def resolve(self, obj: Any) -> Stream | None:
        """The emulated stream for ``obj``: None for None, itself for this checker's streams, the
        adopted one for a foreign stream object (adopting unknown ones)."""
        if obj is None:
            return None
        known = self._resolve_known(obj)
        return known if known is not None else self.adopt(obj)

    def current_stream(self) -> Stream:
        """The calling thread's current stream."""
        stack = self._thread().stack
        return stack[-1] if stack else self.default_stream

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream inside the context (no-op for None)."""
        s = self.resolve(stream)
        if s is None:
            return nullcontext()
        return _StreamContext(self, s)

    def _push_stream(self, stream: Stream) -> None:
        self._thread().stack.append(stream)

    def _pop_stream(self, stream: Stream) -> None:
        stack = self._thread().stack
        if not stack or stack[-1] is not stream:
            raise StreamCheckUsageError(f"leaving {stream!r}, but the current stream is {self.current_stream()!r}")
        stack.pop()

    def event(self) -> Event:
        """A new emulated event of this checker."""
        return Event(checker=self)

    # ------------------------------------------------------------------ threads, tasks, host order
    def _thread(self) -> _ThreadState:
        try:
            return self._local.ts
        except AttributeError:
            ts = self._local.ts = _ThreadState(next(self._uids), threading.current_thread().name, self)
            return ts

    def thread_init(self, name: str | None = None) -> None:
        """Register the calling thread (optional; ``name`` replaces the thread's name in reports)."""
        ts = self._thread()
        if name is not None:
            ts.name = name

    def task(self, name: str, batch: int | None = None, thread: str | None = None) -> AbstractContextManager[None]:
        """Label the ops run inside as task ``name`` of ``batch`` on engine thread ``thread`` (the
        calling thread's name if None), and record them. Nests (the innermost label wins)."""
        return _TaskContext(self, name, batch, thread)

    def cpu_release(self, key: Hashable) -> None:
        """The calling thread publishes what it knows under ``key`` (call it before the CPU-side
        signal: a latch set, a queue put, a ticket release). Several releases of one key join;
        keys must name one synchronisation instance (e.g. include the iteration), since an
        acquire gets every release made so far. At most ``max_keys`` are kept (oldest dropped)."""
        ts = self._thread()
        streams = set(ts.enq) | set(ts.lanes)
        published = (dict(ts.host), {s: self._capture(ts, s) for s in streams}, dict(ts.done))
        with self._lock:
            prev = self._keys.get(key)
            if prev is None:
                self._keys[key] = published
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
                    self.stats.keys_evicted += 1
            else:
                host, enq, done = prev
                merged_enq = {s: dict(c) for s, c in enq.items()}
                for s, c in published[1].items():
                    _join(merged_enq.setdefault(s, {}), c)
                merged_host, merged_done = dict(host), dict(done)
                _join(merged_host, published[0])
                _join(merged_done, published[2])
                self._keys[key] = (merged_host, merged_enq, merged_done)
        ts.host[ts.uid] += 1

    def cpu_acquire(self, key: Hashable) -> None:
        """The calling thread learns what was published under ``key`` (call it after the CPU-side
        wait returned). An unknown key (never released, or dropped) adds nothing and is counted
        in ``stats.unknown_acquires``."""
        with self._lock:
            published = self._keys.get(key)
            if published is None:
                self.stats.unknown_acquires += 1
                return
        ts = self._thread()
        host, enq, done = published
        _join(ts.host, host)
        for s, c in enq.items():
            _join(ts.enq.setdefault(s, {}), c)
        _join(ts.done, done)

    # ------------------------------------------------------------------ stream and event operations
    def _capture(self, ts: _ThreadState, stream: Stream) -> Clock:
        """What ``ts`` knows to be enqueued on ``stream``, with all it knows completed."""
        c = dict(ts.done)
        known = ts.enq.get(stream)
        if known:
            _join(c, known)
        lane = ts.lanes.get(stream)
        if lane is not None and lane.seq > c.get(lane.id, 0):
            c[lane.id] = lane.seq
        return c

    def _wait_stream(self, stream: Stream, other: Any) -> None:
        src = self.resolve(other)
        if src is None or src is stream:
            return
        ts = self._thread()
        _join(ts.enq.setdefault(stream, {}), self._capture(ts, src))

    def _record_event(self, event: Event, stream: Any) -> None:
        ts = self._thread()
        s = self.resolve(stream) if stream is not None else self.current_stream()
        assert s is not None
        event._state = (self._capture(ts, s), ts.uid, ts.host[ts.uid], ts.where(), s, _task_of(ts))

    def _host_ordered(self, ts: _ThreadState, event: Event, action: str, report: bool) -> Clock | None:
        """The event's clock if its last record is host-ordered before the calling thread's
        present; else None, with a ``HostOrder`` finding if ``report``."""
        state = event._state
        if state is None:
            if report:
                self._report(HostOrder(action, repr(event), ts.where(), None, _task_of(ts), "-"), raising=True)
            return None
        clock, uid, epoch, where, stream, recorder_task = state
        if ts.host.get(uid, 0) >= epoch:
            return clock
        if report:
            recorder = f"on stream {stream.name!r} {where}"
            finding = HostOrder(
                action, repr(event), ts.where(), recorder, _task_of(ts), f"{stream.name}: {recorder_task}"
            )
            self._report(finding, raising=True)
        return None

    def _wait_event(self, stream: Any, event: Event) -> None:
        ts = self._thread()
        s = self.resolve(stream) if stream is not None else self.current_stream()
        assert s is not None
        clock = self._host_ordered(ts, event, f"stream {s.name!r} waits on", report=True)
        if clock is not None:
            _join(ts.enq.setdefault(s, {}), clock)

    def _sync_event(self, event: Event, report: bool) -> None:
        ts = self._thread()
        clock = self._host_ordered(ts, event, "the host synchronises with", report=report)
        if clock is not None:
            _join(ts.done, clock)

    def _sync_stream(self, stream: Stream) -> None:
        ts = self._thread()
        _join(ts.done, self._capture(ts, stream))

    def synchronize(self) -> None:
        """Device synchronise: the calling thread knows all work it knows enqueued has completed."""
        ts = self._thread()
        for s in set(ts.enq) | set(ts.lanes):
            _join(ts.done, self._capture(ts, s))

    # ------------------------------------------------------------------ tensors
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor.record_stream(stream)``: the storage's block is not reused before ``stream``'s
        work enqueued up to the free has run."""
        s = self.resolve(stream)
        if s is None:
            raise StreamCheckUsageError("record_stream needs a stream, got None")
        storage = tensor.untyped_storage()
        with self._lock:
            st = self._storages.get(storage._cdata) or self._track(storage, self.default_stream)
            st.recorded.add(s)

    def _track(self, storage: torch.UntypedStorage, alloc: Stream, host: bool = False) -> _StorageState:
        key = storage._cdata
        st = _StorageState(alloc, storage.nbytes(), host)

        def freed(_ref: Any, key: int = key, st: _StorageState = st) -> None:
            self._freed(key, st)

        st.ref = weakref.ref(storage, freed)
        self._storages[key] = st
        self.stats.storages_tracked += 1
        return st

    def _on_op(self, plan: OpPlan, touches: list[Touch]) -> None:
        """One op ran on the calling thread's current stream, touching ``touches``."""
        ts = self._thread()
        label = ts.label
        stream = ts.stack[-1] if ts.stack else self.default_stream
        lane = ts.lanes.get(stream)
        if lane is None:
            lane = ts.lanes[stream] = _Lane(next(self._lane_ids), stream, ts.name)
        lane.seq += 1
        seq = lane.seq
        enq = ts.enq.get(stream) or {}
        done = ts.done
        # one entry per storage: a write wins over a read
        merged: dict[int, list[Any]] = {}
        for storage, access, fresh, arg, shape in touches:
            key = storage._cdata
            m = merged.get(key)
            if m is None:
                merged[key] = [storage, access, fresh, arg, shape]
            else:
                if access > m[1]:
                    m[1], m[3], m[4] = access, arg, shape
                m[2] = m[2] or fresh
        found: list[Finding] = []
        with self._lock:
            self.stats.ops += 1
            self.stats.touches += len(merged)
            for key, (storage, access, fresh, arg, shape) in merged.items():
                st = self._storages.get(key)
                if st is None:
                    st = self._track(storage, stream if fresh else self.default_stream, host=not fresh or label is None)
                if access == NONE:
                    continue
                use = _Use(lane, seq, access == WRITE, label, plan.name, arg, shape)
                if access == WRITE:
                    previous = list(st.reads.values()) if st.reads else ([st.write] if st.write is not None else [])
                    for p in previous:
                        if p.lane is not lane and enq.get(p.lane.id, 0) < p.seq and done.get(p.lane.id, 0) < p.seq:
                            found.append(UnsyncedAccess(p.access(), use.access()))
                    st.write = use
                    st.reads = {}
                else:
                    w = st.write
                    if (
                        w is not None
                        and w.lane is not lane
                        and enq.get(w.lane.id, 0) < w.seq
                        and done.get(w.lane.id, 0) < w.seq
                    ):
                        found.append(UnsyncedAccess(w.access(), use.access()))
                    st.reads[lane.id] = use
        if plan.host_sync:
            self._sync_stream(stream)
        for f in found:
            self._report(f, raising=True)

    def _freed(self, key: int, st: _StorageState) -> None:
        """Weakref callback: the storage died (on the calling thread, at any point of its code:
        this only reads and appends)."""
        with self._lock:
            if self._storages.get(key) is st:
                del self._storages[key]
            self.stats.storages_freed += 1
        if st.host:
            return
        uses = [u for u in (st.write, *st.reads.values()) if u is not None and u.lane.stream is not st.alloc]
        uses = [u for u in uses if u.lane.stream not in st.recorded]
        if not uses:
            return
        ts = self._thread()
        known = self._capture(ts, st.alloc)
        for u in uses:
            if known.get(u.lane.id, 0) < u.seq:
                self._report(EarlyFree(u.access(), st.alloc.name, st.nbytes, ts.where()), raising=False)

    # ------------------------------------------------------------------ results
    def _report(self, finding: Finding, *, raising: bool) -> None:
        sig = finding.signature()
        with self._lock:
            i = self._index.get(sig)
            if i is not None:
                self._counts[i] += 1
            elif len(self._findings) < self.max_findings:
                self._index[sig] = len(self._findings)
                self._findings.append(finding)
                self._counts.append(1)
            else:
                self._dropped += 1
        if raising and self.fail_fast:
            raise StreamCheckError([finding], [1])

    @property
    def findings(self) -> list[Finding]:
        """The distinct findings so far, in the order first seen."""
        with self._lock:
            return list(self._findings)

    @property
    def counts(self) -> list[int]:
        """How often each of ``findings`` happened."""
        with self._lock:
            return list(self._counts)

    def check(self) -> None:
        """Raise ``StreamCheckError`` listing the findings, if any."""
        with self._lock:
            if self._findings:
                raise StreamCheckError(self._findings, self._counts, self._dropped)

    def clear(self) -> None:
        """Forget the findings (the clocks and storages stay)."""
        with self._lock:
            self._findings.clear()
            self._counts.clear()
            self._index.clear()
            self._dropped = 0


class _StreamContext:
    __slots__ = ("checker", "stream")

    def __init__(self, checker: StreamChecker, stream: Stream) -> None:
        self.checker, self.stream = checker, stream

    def __enter__(self) -> Stream:
        self.checker._push_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self.checker._pop_stream(self.stream)


class _TaskContext:
    __slots__ = ("checker", "label", "prev", "ts")

    def __init__(self, checker: StreamChecker, name: str, batch: int | None, thread: str | None) -> None:
        self.checker = checker
        self.label: Any = (name, batch, thread)

    def __enter__(self) -> None:
        ts = self.ts = self.checker._thread()
        name, batch, thread = self.label
        self.prev = ts.label
        ts.label = TaskLabel(name, batch, thread if thread is not None else ts.name)
        if ts.depth == 0:
            ts.mode.__enter__()
        ts.depth += 1
        self.checker.stats.tasks += 1

    def __exit__(self, *exc: object) -> None:
        ts = self.ts
        ts.depth -= 1
        if ts.depth == 0:
            ts.mode.__exit__(None, None, None)
        ts.label = self.prev


@contextmanager
def checking(**kwargs: Any) -> Iterator[StreamChecker]:
    """``with checking() as checker:`` installs a new checker and uninstalls it at the end (it
    does not call ``check()``: do that inside, or read ``checker.findings`` after)."""
    checker = StreamChecker(**kwargs)
    with checker:
        yield checker
