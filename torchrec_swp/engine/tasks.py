"""Task bindings: from a plan's task to a call ``invoke(b)`` that reads and writes batch slots.

A binding is ``fn(b, **reads)``: called with the index of the batch it works on and the values
its PipelineTask declares it reads - from that batch's slot, or for ``x@k`` from batch
``b - k``'s (None when that batch is not in flight), as keyword ``PipelineTask.arguments``. It
returns None (no writes), the value (one write) or a tuple in declared order (several). The
source's binding also gets ``data=`` (``torchrec_swp.engine.source.Draws``) when ``step()`` was
given an iterator; it raises StopIteration at the end of data.

``Observer``: what ``Engine.instrument`` attaches (the profiler is one).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from torchrec_swp.engine.errors import EngineError
from torchrec_swp.plan import PipelineTask
from torchrec_swp.plan.task import parse_read, read_argument

Binding = Callable[..., Any]
Invoker = Callable[[int], Any]
Slots = dict[int, dict[str, Any]]


class Observer(Protocol):
    """Receives timings (``time.perf_counter()`` seconds) while attached with ``Engine.instrument``.

    ``on_run``: one task instance ran; ``on_wait``: a thread waited for another thread's task
    instance (``producer``), in its ``iteration``; ``on_iteration``: the calling thread finished
    its part of internal ``iteration`` (other threads' parts may run before or after it).

    An observer whose ``wants_cpu`` attribute is true also gets, as ``on_run``'s keyword ``cpu``,
    the CPU time the running thread spent in the task (``time.thread_time()``: what it computed,
    not what it waited; about 1 us more per task call).
    """

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None: ...

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None: ...

    def on_iteration(self, iteration: int, start: float, end: float) -> None: ...


def make_invoker(
    io: PipelineTask,
    fn: Binding,
    slots: Slots,
    extra: Callable[[int], dict[str, Any]] | None = None,
    around: Around | None = None,
    timed: TaskTimer | None = None,
) -> Invoker:
    """``invoke(b)``: call ``fn`` with batch ``b``'s reads and store what it returns as ``b``'s writes.
    ``extra(b)`` gives keyword arguments of its own (the source's ``data``); ``around(b)`` is a
    context manager the reads and the call run in (``task_context``); ``timed`` times each
    instance for an observer (``task_timer``).

    One frame between the engine and ``fn``, named ``<task T>`` in tracebacks."""
    task, writes = io.name, io.writes
    arguments = _arguments(io, slots, extra)
    count, first = len(writes), writes[0] if writes else ""

    def invoke(b: int) -> None:
        mark = timed.start() if timed is not None else None
        try:
            if around is None:
                values = fn(b) if arguments is None else fn(b, **arguments(b))
            else:
                with around(b):
                    values = fn(b) if arguments is None else fn(b, **arguments(b))
            if count == 1:
                slots[b][first] = values
            elif count:
                _store(task, writes, slots[b], values)
        finally:
            if timed is not None:
                timed.stop(b, mark)

    return _named(invoke, task)


def _arguments(
    io: PipelineTask, slots: Slots, extra: Callable[[int], dict[str, Any]] | None
) -> Callable[[int], dict[str, Any]] | None:
    """``arguments(b)``: the keyword arguments of ``io``'s call for batch ``b`` (None: it takes none)."""
    task = io.name
    reads = tuple((read_argument(r), *parse_read(r)) for r in io.reads)  # (keyword, data name, batches back)
    if not reads:
        return extra
    if len(reads) == 1 and reads[0][2] == 0 and extra is None:  # the common case, without a loop
        ((arg, data, _),) = reads

        def one(b: int) -> dict[str, Any]:
            try:
                return {arg: slots[b][data]}
            except KeyError as e:
                raise EngineError(f"task {task} reads {e.args[0]!r} of batch {b}, which was never written") from None

        return one

    def many(b: int) -> dict[str, Any]:
        args = {}
        try:
            for arg, data, k in reads:
                args[arg] = slots[b][data] if k == 0 else previous(slots, b - k, data)
        except KeyError as e:
            raise EngineError(f"task {task} reads {e.args[0]!r} of batch {b}, which was never written") from None
        if extra is not None:
            args.update(extra(b))
        return args

    return many


def _store(task: str, writes: tuple[str, ...], slot: dict[str, Any], values: Any) -> None:
    if not isinstance(values, tuple) or len(values) != len(writes):
        raise EngineError(f"task {task} must return a tuple of {len(writes)} values for {writes}, got {values!r}")
    for k, v in zip(writes, values):
        slot[k] = v


def _named(invoke: Invoker, task: str) -> Invoker:
    """``invoke`` with its frame named ``<task T>``: a traceback through it says which task it is."""
    name = f"<task {task}>"
    code = invoke.__code__
    invoke.__code__ = code.replace(co_name=name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {}))
    invoke.__name__ = invoke.__qualname__ = name
    return invoke


def make_alias(
    pairs: tuple[tuple[str, str], ...], slots: Slots, around: Around | None = None, timed: TaskTimer | None = None
) -> Invoker:
    """The call-free stand-in of a task that is a no-op on this device: ``write = read``."""

    def alias(b: int) -> None:
        mark = timed.start() if timed is not None else None
        try:
            if around is None:
                _copy(pairs, slots[b])
            else:
                with around(b):
                    _copy(pairs, slots[b])
        finally:
            if timed is not None:
                timed.stop(b, mark)

    return alias


def _copy(pairs: tuple[tuple[str, str], ...], slot: dict[str, Any]) -> None:
    for write, read in pairs:
        slot[write] = slot[read]


#: ``around(b)``: the context manager a task instance for batch ``b`` runs in.
Around = Callable[[int], contextlib.AbstractContextManager[Any]]


def task_context(
    task: str, labels: bool, stream: Callable[[], contextlib.AbstractContextManager[Any]] | None
) -> Around | None:
    """What a task's calls run in: ``stream()`` (its device stream), inside
    ``record_function("## task b ##")`` with ``labels`` (for profiler traces); None for nothing."""
    if not labels:
        return None if stream is None else lambda b: stream()
    record_function = torch.profiler.record_function
    if stream is None:
        return lambda b: record_function(f"## {task} {b} ##")

    @contextlib.contextmanager
    def labelled_in_stream(b: int) -> Iterator[None]:
        with record_function(f"## {task} {b} ##"), stream():
            yield

    return labelled_in_stream


def task_timer(task: str, thread: str, iteration: Callable[[int], int], observer: Observer | None) -> TaskTimer | None:
    """The timer of ``task``'s calls for ``observer`` (``iteration(b)``: the instance's iteration);
    None without an observer."""
    return None if observer is None else TaskTimer(task, thread, iteration, observer)


class TaskTimer:
    """Tells an observer of every run of one task: ``mark = start()`` before the call,
    ``stop(b, mark)`` after it (with the thread's CPU time in the task when the observer
    ``wants_cpu``)."""

    __slots__ = ("cpu", "iteration", "observer", "task", "thread")

    def __init__(self, task: str, thread: str, iteration: Callable[[int], int], observer: Observer) -> None:
        self.task, self.thread, self.iteration, self.observer = task, thread, iteration, observer
        self.cpu = bool(getattr(observer, "wants_cpu", False))

    def start(self) -> Any:
        if not self.cpu:
            return time.perf_counter()
        start = time.perf_counter()
        return start, time.thread_time()

    def stop(self, b: int, mark: Any) -> None:
        end = time.perf_counter()
        if not self.cpu:
            self.observer.on_run(self.task, b, self.thread, self.iteration(b), mark, end)
        else:
            start, cpu = mark
            self.observer.on_run(self.task, b, self.thread, self.iteration(b), start, end, cpu=time.thread_time() - cpu)


def previous(slots: Slots, b: int, data: str) -> Any:
    """``data`` of batch ``b`` (an earlier one), or None when that batch is not in flight."""
    slot = slots.get(b)
    return None if slot is None else slot[data]
