"""Emulated device streams and events, with the method names of CUDA's.

They run nothing: every method tells the owning ``StreamChecker`` what a CUDA stream or event
would do, from the calling CPU thread's point of view (the checker keeps the vector clocks).
Both can be built without naming a checker while one is installed (``torch.cpu.Stream()`` and
``torch.cpu.Event()`` build these then).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from torchrec_swp.streamcheck.findings import StreamCheckUsageError

if TYPE_CHECKING:
    from torchrec_swp.streamcheck.checker import StreamChecker

_CPU = torch.device("cpu")
_active: StreamChecker | None = None


def active_checker() -> StreamChecker | None:
    """The installed checker, if any."""
    return _active


def set_active(checker: StreamChecker | None) -> None:
    global _active
    _active = checker


def _owner(checker: StreamChecker | None, what: str) -> StreamChecker:
    owner = checker if checker is not None else _active
    if owner is None:
        raise StreamCheckUsageError(f"an emulated {what} needs a checker: pass checker= or install one first")
    return owner


class Stream:
    """An emulated stream named ``name``. Equality is identity (as for distinct CUDA streams).

    ``device`` is the CPU, so ``torch.get_device_module(stream.device)`` is ``torch.cpu``, whose
    stream functions the installed checker patches (TorchRec's helpers take that path)."""

    device = _CPU
    device_type = "cpu"
    device_index = -1

    def __init__(
        self, priority: int = 0, *, name: str | None = None, checker: StreamChecker | None = None, device: Any = None
    ) -> None:
        self.checker = _owner(checker, "stream")
        self.priority = priority
        self.stream_id = self.checker._next_stream_id()
        self.name = name if name is not None else f"stream{self.stream_id}"

    def wait_stream(self, stream: Any) -> None:
        """Work enqueued on this stream after this call waits for the work the calling thread knows
        to be enqueued on ``stream`` (its own, and other threads' up to their last ``cpu_release``
        it acquired)."""
        self.checker._wait_stream(self, stream)

    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream after this call waits for ``event``'s last record."""
        self.checker._wait_event(self, event)

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream; returns it."""
        event = event if event is not None else Event(checker=self.checker)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The calling thread knows this stream's work (as the thread knows it) has completed."""
        self.checker._sync_stream(self)

    def query(self) -> bool:
        """Always True (emulated work completes at once), with the effect of ``synchronize``."""
        self.checker._sync_stream(self)
        return True

    def __enter__(self) -> Self:
        self.checker._push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.checker._pop_stream(self)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


class Event:
    """An emulated event. ``record`` keeps the recording stream's clock as the calling thread knows
    it, and where the record ran; waits and synchronisations use the last record."""

    _serial = itertools.count(1)

    def __init__(
        self,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        *,
        checker: StreamChecker | None = None,
        device: Any = None,
    ) -> None:
        self.checker = _owner(checker, "event")
        self.event_id = next(Event._serial)
        # set in one assignment by the checker: (clock, recorder thread uid, its host epoch, where,
        # stream, recorder's task without the batch)
        self._state: tuple[dict[int, int], int, int, str, Stream, str] | None = None

    def record(self, stream: Any = None) -> None:
        """Record on ``stream`` (the calling thread's current stream if None)."""
        self.checker._record_event(self, stream)

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (the current stream if None) wait for the last record."""
        self.checker._wait_event(stream, self)

    def synchronize(self) -> None:
        """The calling thread waits for the last record: it knows that work has completed."""
        self.checker._sync_event(self, report=True)

    def query(self) -> bool:
        """Always True, with the effect of ``synchronize`` where the record is host-ordered before
        (a query never reports: polling before the record is legitimate)."""
        self.checker._sync_event(self, report=False)
        return True

    @property
    def recorded_on(self) -> Stream | None:
        return None if self._state is None else self._state[4]

    def __repr__(self) -> str:
        where = "" if self._state is None else f"@{self._state[4].name}"
        return f"ev{self.event_id}{where}"
