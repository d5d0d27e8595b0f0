"""Errors the engine raises. Each says where: task, batch, thread, internal iteration."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class of the engine's own errors."""


class CollectiveAborted(EngineError):
    """A globally ordered task was not started because an earlier one failed on this rank.

    Issuing it anyway could pair it with a different collective on another rank."""


class TaskAborted(EngineError):
    """A task did not run because a task it waits on (or the iteration) failed."""


class EngineTimeout(EngineError, TimeoutError):
    """A blocking wait in the engine exceeded its timeout; the message shows what each
    thread was waiting on and the schedule with the current position marked."""


class Interrupted(Exception):
    """A thread was told to stop where it is (a failure elsewhere, a stop, a reset): it parks at
    the instruction it was about to execute and goes on from there when resumed. Never leaves
    the engine."""


class Stopped(Exception):
    """The source found no batch under ``on_exhausted="stop"``: this thread parks where it is
    (what single-thread order would not have run yet). Never leaves the engine."""


class FailedDrawWarning(RuntimeWarning):
    """The data iterator raised inside its own ``next()`` and cannot draw the same item again:
    the item that call took, if any, is not trained (``BatchLedger.failed_draws`` lists it)."""


def describe(task: str, batch: int, thread: str, iteration: int) -> str:
    return f"task {task} (batch {batch}, internal iteration {iteration}) on thread {thread!r}"
