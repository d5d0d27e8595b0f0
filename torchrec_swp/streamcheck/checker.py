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
  ``record_stream`` or by what the freeing thread knows of the allocation stream; if not, the
  free stays pending (``memory``) until the next allocation on the allocation stream, which
  must be ordered after those uses, else ``EarlyFree``.
* Backward ops run on their forward op's stream (``autograd``).

Findings are collected (the first occurrence of each signature, with a count) and ``check()``
raises ``StreamCheckError`` listing them; with ``fail_fast=True`` an unsynchronised access or a
host-order finding raises at once from the op (or wait) that found it. Frees never raise (they
run in weakref callbacks): they are only collected.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import FrameType
from typing import Any, Self

import torch

from torchrec_swp.streamcheck.autograd import NodeStreams
from torchrec_swp.streamcheck.dispatch import NONE, WRITE, AccessMode, OpPlan, Touch
from torchrec_swp.streamcheck.emulated import Event, EventRecord, Stream, installed_ops, set_installed
from torchrec_swp.streamcheck.findings import (
    EarlyFree,
    Finding,
    HostOrder,
    StreamCheckError,
    StreamCheckUsageError,
    UnsyncedAccess,
)
from torchrec_swp.streamcheck.lanes import CheckStats, Clock, Lane, TaskLabel, ThreadState, Use, join
from torchrec_swp.streamcheck.memory import PendingFree, StorageState, same_pool, unknown_uses

#: The name of the stream every thread is on unless it entered another (the plan's default).
DEFAULT_STREAM = "default"

__all__ = ["DEFAULT_STREAM", "CheckStats", "StreamChecker", "TaskLabel", "active_checker", "checking"]


def active_checker() -> StreamChecker | None:
    """The installed checker, if any."""
    checker = installed_ops()
    return checker if isinstance(checker, StreamChecker) else None


class StreamChecker:
    """Checks, on the CPU, the stream synchronisation a CUDA run of the same code would have.

    Lifecycle: ``install()`` (or ``with checker:``) patches torch's CPU stream APIs so library
    code talks to this checker; ops are recorded inside ``task(...)`` contexts, on any thread,
    whether or not it is installed. ``check()`` raises if anything was found.

    Not thread-confined: every method may be called from any thread; each acts for the calling
    thread (its current stream, its host clock).
    """

    def __init__(
        self,
        *,
        fail_fast: bool = False,
        max_findings: int = 1000,
        max_keys: int = 1 << 16,
        max_pending: int = 1 << 12,
        on_finding: Callable[[Finding, bool], None] | None = None,
    ) -> None:
        self.fail_fast = fail_fast
        #: called as ``on_finding(finding, new)`` for every finding (``new``: the first of its
        #: signature since the last ``clear()``), outside the checker's lock
        self._on_finding = on_finding
        self.max_findings = max_findings
        self.max_keys = max_keys
        self.max_pending = max_pending
        self.stats = CheckStats()
        #: ops recorded per stream name (``clear()`` resets it): which streams the tasks used
        self.ops_by_stream: dict[str, int] = {}
        self._lock = threading.RLock()
        self._local = threading.local()
        self._uids = itertools.count(1)
        self._lane_ids = itertools.count(1)
        self._stream_ids = itertools.count(0)
        self._named: dict[str, Stream] = {}
        self._adopted: dict[int, tuple[Any, Stream]] = {}  # id(foreign stream object) -> (it, emulated)
        self._storages: dict[int, StorageState] = {}  # StorageImpl address -> state
        self._pending: dict[Stream, list[PendingFree]] = {}  # allocation stream -> frees not yet safe
        self._keys: OrderedDict[Hashable, tuple[Clock, dict[Stream, Clock], Clock]] = OrderedDict()
        self._findings: list[Finding] = []
        self._counts: list[int] = []
        self._index: dict[tuple[str, ...], int] = {}
        self._dropped = 0
        self._patch: Any = None
        #: Mutation testing: called as ``skip_sync(kind, site)`` for every ``wait_stream``,
        #: ``wait_event`` and ``record_stream`` (kind), ``site`` the ``file:line`` that asked for it
        #: (the first frame outside this package); True ignores that one. None: nothing skipped.
        self.skip_sync: Callable[[str, str], bool] | None = None
        self.default_stream = self.stream(DEFAULT_STREAM)

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> Self:
        """Patch torch's CPU stream APIs to this checker (see ``patches.TorchPatch``); one
        checker at a time."""
        from torchrec_swp.streamcheck.patches import TorchPatch

        if installed_ops() is not None:
            raise StreamCheckUsageError("another StreamChecker is installed; uninstall it first")
        self._patch = TorchPatch(self)
        self._patch.install()
        set_installed(self)
        return self

    def uninstall(self) -> None:
        """Undo ``install`` (idempotent). Findings stay."""
        if self._patch is not None:
            self._patch.uninstall()
            self._patch = None
        if installed_ops() is self:
            set_installed(None)

    @property
    def installed(self) -> bool:
        return self._patch is not None

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ streams
    def next_stream_id(self) -> int:
        """A new stream's number (for its default name)."""
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

    def current_task(self) -> TaskLabel | None:
        """The calling thread's task label (None outside tasks)."""
        return self._thread().label

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

    def push_stream(self, stream: Stream) -> None:
        """Make ``stream`` the calling thread's current stream until ``pop_stream(stream)``."""
        self._thread().stack.append(stream)

    def pop_stream(self, stream: Stream) -> None:
        """Undo the calling thread's latest ``push_stream``, which must have been of ``stream``."""
        stack = self._thread().stack
        if not stack or stack[-1] is not stream:
            raise StreamCheckUsageError(f"leaving {stream!r}, but the current stream is {self.current_stream()!r}")
        stack.pop()

    def enter_stream(self, stream: Stream) -> None:
        """Make ``stream`` the calling thread's current stream until ``leave_stream(stream)``
        (for callbacks that cannot use a context, such as autograd hooks)."""
        self.push_stream(stream)

    def leave_stream(self, stream: Stream) -> None:
        """Undo the latest ``enter_stream(stream)`` of the calling thread, even if streams
        entered after it are still current (hooks of one node may interleave with others')."""
        stack = self._thread().stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is stream:
                del stack[i]
                return
        raise StreamCheckUsageError(f"leaving {stream!r}, which the calling thread did not enter")

    def event(self) -> Event:
        """A new emulated event of this checker."""
        return Event(checker=self)

    # ------------------------------------------------------------------ threads, tasks, host order
    def _thread(self) -> ThreadState:
        try:
            return self._local.ts
        except AttributeError:
            ts = self._local.ts = ThreadState(
                next(self._uids), threading.current_thread().name, AccessMode(self), NodeStreams(self)
            )
            return ts

    def thread_state(self) -> ThreadState:
        """The calling thread's state (made on first use)."""
        return self._thread()

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
                    join(merged_enq.setdefault(s, {}), c)
                merged_host, merged_done = dict(host), dict(done)
                join(merged_host, published[0])
                join(merged_done, published[2])
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
        join(ts.host, host)
        for s, c in enq.items():
            join(ts.enq.setdefault(s, {}), c)
        join(ts.done, done)

    # ------------------------------------------------------------------ stream and event operations
    def _capture(self, ts: ThreadState, stream: Stream) -> Clock:
        """What ``ts`` knows to be enqueued on ``stream``, with all it knows completed."""
        c = dict(ts.done)
        known = ts.enq.get(stream)
        if known:
            join(c, known)
        lane = ts.lanes.get(stream)
        if lane is not None and lane.seq > c.get(lane.id, 0):
            c[lane.id] = lane.seq
        return c

    def _skipped(self, kind: str) -> bool:
        skip = self.skip_sync
        return skip is not None and skip(kind, call_site())

    def wait_stream(self, stream: Stream, other: Any) -> None:
        """``stream.wait_stream(other)`` asked for by a call site (``skip_sync`` may skip it)."""
        if self._skipped("wait_stream"):
            return
        self.implicit_wait(stream, other)

    def implicit_wait(self, stream: Stream, other: Any) -> None:
        """``stream.wait_stream(other)`` made by the runtime itself (autograd's syncs between a
        node's stream and its neighbours'), not by a call site: ``skip_sync`` never skips it."""
        src = self.resolve(other)
        if src is None or src is stream:
            return
        ts = self._thread()
        join(ts.enq.setdefault(stream, {}), self._capture(ts, src))

    def record_event(self, stream: Any) -> EventRecord:
        """An event's record on ``stream`` (the current stream if None) by the calling thread."""
        ts = self._thread()
        s = self.resolve(stream) if stream is not None else self.current_stream()
        assert s is not None
        return EventRecord(self._capture(ts, s), ts.uid, ts.host[ts.uid], ts.where(), s, ts.task())

    def _host_ordered(self, ts: ThreadState, event: Event, action: str, report: bool) -> Clock | None:
        """The event's clock if its last record is host-ordered before the calling thread's
        present; else None, with a ``HostOrder`` finding if ``report``."""
        record = event.last_record
        if record is None:
            if report:
                self._report(HostOrder(action, repr(event), ts.where(), None, ts.task(), "-"), raising=True)
            return None
        if ts.host.get(record.thread, 0) >= record.epoch:
            return record.clock
        if report:
            recorder = f"on stream {record.stream.name!r} {record.where}"
            finding = HostOrder(
                action, repr(event), ts.where(), recorder, ts.task(), f"{record.stream.name}: {record.task}"
            )
            self._report(finding, raising=True)
        return None

    def wait_event(self, stream: Any, event: Event) -> None:
        """``stream`` (the current stream if None) waits on ``event``'s last record."""
        if self._skipped("wait_event"):
            return
        ts = self._thread()
        s = self.resolve(stream) if stream is not None else self.current_stream()
        assert s is not None
        clock = self._host_ordered(ts, event, f"stream {s.name!r} waits on", report=True)
        if clock is not None:
            join(ts.enq.setdefault(s, {}), clock)

    def sync_event(self, event: Event, report: bool) -> None:
        """The host waits for ``event``'s last record (a ``HostOrder`` finding if ``report`` and
        that record is not host-ordered before)."""
        ts = self._thread()
        clock = self._host_ordered(ts, event, "the host synchronises with", report=report)
        if clock is not None:
            join(ts.done, clock)

    def sync_stream(self, stream: Stream) -> None:
        """The host waits for ``stream``'s work as the calling thread knows it."""
        ts = self._thread()
        join(ts.done, self._capture(ts, stream))

    def synchronize(self) -> None:
        """Device synchronise: the calling thread knows all work it knows enqueued has completed."""
        ts = self._thread()
        for s in set(ts.enq) | set(ts.lanes):
            join(ts.done, self._capture(ts, s))

    def host_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor.to(device, non_blocking=True)`` where ``tensor`` is host memory (its storage
        was made outside every task) and the calling thread is in a task: a copy written on the
        current stream, as CUDA's H2D copy allocates and writes there; else ``tensor`` itself
        (on the CPU ``to`` returns it, as CUDA does for a tensor already on the device)."""
        ts = self._thread()
        if not ts.depth:
            return tensor
        st = self._storages.get(tensor.untyped_storage()._cdata)
        if st is not None and not st.host:
            return tensor
        return tensor.clone()

    def tag_backward(self, out: Any) -> None:
        """Inside a task on a non-default stream: the autograd nodes of ``out`` run their backward
        on that stream (``autograd.NodeStreams``); elsewhere nothing."""
        ts = self._thread()
        if ts.depth:
            ts.nodes.tag_outputs(out)

    # ------------------------------------------------------------------ tensors
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor.record_stream(stream)``: the storage's block is not reused before ``stream``'s
        work enqueued up to the free has run."""
        s = self.resolve(stream)
        if s is None:
            raise StreamCheckUsageError("record_stream needs a stream, got None")
        if self._skipped("record_stream"):
            return
        storage = tensor.untyped_storage()
        with self._lock:
            st = self._storages.get(storage._cdata) or self._track(storage, self.default_stream)
            st.recorded.add(s)

    def _track(self, storage: torch.UntypedStorage, alloc: Stream, host: bool = False) -> StorageState:
        key = storage._cdata
        st = StorageState(alloc, storage.nbytes(), host)

        def freed(_ref: Any, key: int = key, st: StorageState = st) -> None:
            self._freed(key, st)

        st.ref = weakref.ref(storage, freed)
        self._storages[key] = st
        self.stats.storages_tracked += 1
        return st

    def count_backward_node(self) -> None:
        """One more autograd node tagged to run its backward on a stream (``stats``)."""
        with self._lock:
            self.stats.backward_nodes += 1

    def on_op(self, plan: OpPlan, touches: list[Touch]) -> None:
        """One op ran on the calling thread's current stream, touching ``touches``."""
        ts = self._thread()
        label = ts.label
        stream = ts.stack[-1] if ts.stack else self.default_stream
        lane = ts.lanes.get(stream)
        if lane is None:
            lane = ts.lanes[stream] = Lane(next(self._lane_ids), stream, ts.name)
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
            self.ops_by_stream[stream.name] = self.ops_by_stream.get(stream.name, 0) + 1
            self.stats.touches += len(merged)
            for key, (storage, access, fresh, arg, shape) in merged.items():
                st = self._storages.get(key)
                if st is None:
                    host = not fresh or label is None
                    st = self._track(storage, stream if fresh else self.default_stream, host=host)
                    if not host and stream in self._pending:
                        found += self._reuse(ts, stream, st.nbytes, plan.name, arg, shape)
                if access == NONE:
                    continue
                use = Use(lane, seq, access == WRITE, label, plan.name, arg, shape)
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
        if plan.host_sync and ts.nodes.in_host_read:
            self.sync_stream(stream)
        for f in found:
            self._report(f, raising=True)

    def _freed(self, key: int, st: StorageState) -> None:
        """Weakref callback: the storage died (on the calling thread, at any point of its code:
        this only reads and appends). Uses on other streams the freeing thread does not know
        ordered before the allocation stream's next work keep the free pending."""
        with self._lock:
            if self._storages.get(key) is st:
                del self._storages[key]
            self.stats.storages_freed += 1
        uses = st.foreign_uses()
        if not uses:
            return
        ts = self._thread()
        before = uses
        uses = unknown_uses(uses, self._capture(ts, st.alloc))
        if not uses:
            # safe at the free: completed as far as the host knows, or waited for by the stream
            host = not unknown_uses(before, ts.done)
            with self._lock:
                if host:
                    self.stats.frees_after_host_sync += 1
                else:
                    self.stats.frees_after_wait += 1
            return
        with self._lock:
            pending = self._pending.setdefault(st.alloc, [])
            pending.append(PendingFree(st.alloc, st.nbytes, uses, ts.where()))
            self.stats.frees_pending += 1
            if len(pending) > self.max_pending:
                del pending[0]

    def _reuse(self, ts: ThreadState, stream: Stream, nbytes: int, op: str, arg: str, shape: Any) -> list[Finding]:
        """An allocation of ``nbytes`` on ``stream`` by the calling thread (lock held): the pending
        frees of its pool it could get the block of. Each is decided and dropped: safe if the
        thread knows its uses ordered before, else an ``EarlyFree`` per use."""
        pending = self._pending[stream]
        known = self._capture(ts, stream)
        found: list[Finding] = []
        keep: list[PendingFree] = []
        reused_by = f"{op} ({arg} {list(shape)}) {ts.where()}"
        for p in pending:
            if not same_pool(p.nbytes, nbytes):
                keep.append(p)
                continue
            late = unknown_uses(p.uses, known)
            if not late:
                self.stats.frees_after_wait += 1
            for u in late:
                found.append(EarlyFree(u.access(), stream.name, p.nbytes, p.freed_in, reused_by))
        if keep:
            self._pending[stream] = keep
        else:
            del self._pending[stream]
        return found

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
        if self._on_finding is not None:
            self._on_finding(finding, i is None)
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
        """Forget the findings and the pending frees (the clocks and storages stay)."""
        with self._lock:
            self._pending.clear()
            self.ops_by_stream = {}
            self._findings.clear()
            self._counts.clear()
            self._index.clear()
            self._dropped = 0


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def call_site() -> str:
    """``file:line`` of the innermost frame outside this package (who asked for a sync)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _StreamContext:
    __slots__ = ("checker", "stream")

    def __init__(self, checker: StreamChecker, stream: Stream) -> None:
        self.checker, self.stream = checker, stream

    def __enter__(self) -> Stream:
        self.checker.push_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self.checker.pop_stream(self.stream)


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
            ts.nodes.__enter__()
        ts.depth += 1
        self.checker.stats.tasks += 1

    def __exit__(self, *exc: object) -> None:
        ts = self.ts
        ts.depth -= 1
        if ts.depth == 0:
            ts.nodes.__exit__(None, None, None)
            ts.mode.__exit__(None, None, None)
        ts.label = self.prev


@contextmanager
def checking(**kwargs: Any) -> Iterator[StreamChecker]:
    """``with checking() as checker:`` installs a new checker and uninstalls it at the end (it
    does not call ``check()``: do that inside, or read ``checker.findings`` after)."""
    checker = StreamChecker(**kwargs)
    with checker:
        yield checker
