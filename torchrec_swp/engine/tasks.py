"""Task bindings: what a plan's task is bound to, and what its call ``invoke(b)`` runs in.

A binding is ``fn(b, **reads)``: called with the index of the batch it works on and the values
its PipelineTask declares it reads - from that batch's slot, or for ``x@k`` from batch
``b - k``'s (None when that batch is not in flight), as keyword ``PipelineTask.arguments``. It
returns None (no writes), the value (one write) or a tuple in declared order (several). The
source's binding also gets ``data=`` (``torchrec_swp.engine.source.Draws``) when ``step()`` was
given an iterator; it raises StopIteration at the end of data. When a plan is bound
(``installed.check_bindings``) each row is checked against its function's signature
(``torchrec_swp.plan.calls``): a row it cannot be called with is refused there, not at its first call.

The call itself, which reads and writes the slots, is made by their owner
(``torchrec_swp.engine.batches``: ``Batches.invoker``); here are the pieces it runs with: the
context a task's calls run in (``task_context``: its stream, its profiler label), the timer that
tells an observer (``TaskTimer``), the name its frame has in tracebacks (``named``).

``Observer``: what ``Engine.instrument`` attaches (the profiler is one).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torchrec_swp.engine.labels import record_function

Binding = Callable[..., Any]
Invoker = Callable[[int], Any]


class Observer(Protocol):
    """Receives timings (``time.perf_counter()`` seconds) while attached with ``Engine.instrument``.

    ``on_run``: one task instance ran; ``on_wait``: a thread waited for another thread's task
    instance (``producer``), in its ``iteration``; ``on_iteration``: the calling thread finished
    its part of internal ``iteration`` (other threads' parts may run before or after it).

    An observer whose ``wants_cpu`` attribute is true also gets, as ``on_run``'s keyword ``cpu``,
    the CPU time the running thread spent in the task (``time.thread_time()``: what it computed,
    not what it waited; about 1 us more per task call).
    """

    def on_run(
        self, task: str, batch: int, thread: str, iteration: int, start: float, end: float, *, cpu: float | None = None
    ) -> None: ...

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None: ...

    def on_iteration(self, iteration: int, start: float, end: float) -> None: ...


def named(invoke: Invoker, task: str) -> Invoker:
    """``invoke`` with its frame named ``<task T>``: a traceback through it says which task it is."""
    name = f"<task {task}>"
    code = invoke.__code__
    invoke.__code__ = code.replace(co_name=name, co_qualname=name)
    invoke.__name__ = invoke.__qualname__ = name
    return invoke


#: ``around(b)``: the context manager a task instance for batch ``b`` runs in.
Around = Callable[[int], contextlib.AbstractContextManager[Any]]


def task_context(
    task: str, labels: bool, stream: Callable[[], contextlib.AbstractContextManager[Any]] | None
) -> Around | None:
    """What a task's calls run in: ``stream()`` (its device stream), inside
    ``record_function("## task b ##")`` with ``labels`` (for profiler traces); None for nothing."""
    if not labels:
        return None if stream is None else lambda b: stream()
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
