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

import time
from collections.abc import Callable
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


def make_invoker(io: PipelineTask, fn: Binding, slots: Slots, extra: Callable[[int], dict[str, Any]] | None = None) -> Invoker:
    """``invoke(b)``: call ``fn`` with batch ``b``'s reads and store what it returns as ``b``'s writes.
    ``extra(b)`` gives keyword arguments of its own (the source's ``data``)."""
    task, writes = io.name, io.writes
    reads = [(read_argument(r), *parse_read(r)) for r in io.reads]  # (keyword, data name, batches back)
    same_batch = all(k == 0 for _, _, k in reads)

    def call(b: int) -> Any:
        if not reads:
            return fn(b) if extra is None else fn(b, **extra(b))
        try:
            if same_batch:
                slot = slots[b]
                args = {arg: slot[data] for arg, data, _ in reads}
            else:
                args = {arg: slots[b][data] if k == 0 else previous(slots, b - k, data) for arg, data, k in reads}
        except KeyError as e:
            raise EngineError(f"task {task} reads {e.args[0]!r} of batch {b}, which was never written") from None
        if extra is not None:
            args.update(extra(b))
        return fn(b, **args)

    if not writes:
        return call
    if len(writes) == 1:
        (w,) = writes

        def invoke_one(b: int) -> None:
            slots[b][w] = call(b)

        return invoke_one

    def invoke_many(b: int) -> None:
        values = call(b)
        if not isinstance(values, tuple) or len(values) != len(writes):
            raise EngineError(f"task {task} must return a tuple of {len(writes)} values for {writes}, got {values!r}")
        slot = slots[b]
        for k, v in zip(writes, values):
            slot[k] = v

    return invoke_many


def make_alias(pairs: tuple[tuple[str, str], ...], slots: Slots) -> Invoker:
    """The call-free stand-in of a task that is a no-op on this device: ``write = read``."""

    def alias(b: int) -> None:
        slot = slots[b]
        for write, read in pairs:
            slot[write] = slot[read]

    return alias


def instrumented(
    task: str, invoke: Invoker, thread: str, iteration: Callable[[int], int], observer: Observer | None, labels: bool
) -> Invoker:
    """``invoke`` timed for ``observer`` (``iteration(b)`` gives the instance's iteration) and,
    with ``labels``, inside ``record_function("## task b ##")`` for profiler traces."""
    if observer is None and not labels:
        return invoke
    record_function = torch.profiler.record_function
    thread_time = time.thread_time if observer is not None and getattr(observer, "wants_cpu", False) else None

    def timed(b: int) -> Any:
        start = time.perf_counter()
        cpu = 0.0 if thread_time is None else thread_time()
        try:
            if labels:
                with record_function(f"## {task} {b} ##"):
                    return invoke(b)
            return invoke(b)
        finally:
            if observer is not None:
                end = time.perf_counter()
                if thread_time is None:
                    observer.on_run(task, b, thread, iteration(b), start, end)
                else:
                    observer.on_run(task, b, thread, iteration(b), start, end, cpu=thread_time() - cpu)

    return timed


def previous(slots: Slots, b: int, data: str) -> Any:
    """``data`` of batch ``b`` (an earlier one), or None when that batch is not in flight."""
    slot = slots.get(b)
    return None if slot is None else slot[data]
