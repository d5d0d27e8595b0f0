"""Emulated device streams and events, with the method names of CUDA's.

They run nothing: every method tells the owning checker what a CUDA stream or event would do,
from the calling CPU thread's point of view, through ``StreamOps`` (the checker keeps the vector
clocks). Both can be built without naming a checker while one is installed (``torch.cpu.Stream()``
and ``torch.cpu.Event()`` build these then).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol, Self

import torch

from torchrec_swp.streamcheck.findings import StreamCheckUsageError

_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class EventRecord:
    """An event's last record: the recording stream's clock as the recording thread knew it
    (lane id -> step), that thread's uid and host epoch, where it ran, the stream, and the
    recorder's task without the batch (for finding signatures)."""

    clock: dict[int, int]
    thread: int
    epoch: int
    where: str
    stream: Stream
    task: str


class StreamOps(Protocol):
    """What emulated streams and events ask of their checker (``StreamChecker`` is one); each
    acts for the calling thread."""

    def next_stream_id(self) -> int: ...

    def wait_stream(self, stream: Stream, other: Any) -> None: ...

    def wait_event(self, stream: Any, event: Event) -> None: ...

    def record_event(self, stream: Any) -> EventRecord: ...

    def sync_stream(self, stream: Stream) -> None: ...

    def sync_event(self, event: Event, report: bool) -> None: ...

    def push_stream(self, stream: Stream) -> None: ...

    def pop_stream(self, stream: Stream) -> None: ...


_installed: StreamOps | None = None


def installed_ops() -> StreamOps | None:
    """The installed checker, if any (``checker.active_checker`` gives it typed)."""
    return _installed


def set_installed(checker: StreamOps | None) -> None:
    """Make ``checker`` the owner of streams and events built without one (None: no owner)."""
    global _installed
    _installed = checker


def _owner(checker: StreamOps | None, what: str) -> StreamOps:
    owner = checker if checker is not None else _installed
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
        self, priority: int = 0, *, name: str | None = None, checker: StreamOps | None = None, device: Any = None
    ) -> None:
        self.checker = _owner(checker, "stream")
        self.priority = priority
        self.stream_id = self.checker.next_stream_id()
        self.name = name if name is not None else f"stream{self.stream_id}"

    def wait_stream(self, stream: Any) -> None:
        """Work enqueued on this stream after this call waits for the work the calling thread knows
        to be enqueued on ``stream`` (its own, and other threads' up to their last ``cpu_release``
        it acquired)."""
        self.checker.wait_stream(self, stream)

    def wait_event(self, event: Event) -> None:
        """Work enqueued on this stream after this call waits for ``event``'s last record."""
        self.checker.wait_event(self, event)

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream; returns it."""
        event = event if event is not None else Event(checker=self.checker)
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The calling thread knows this stream's work (as the thread knows it) has completed."""
        self.checker.sync_stream(self)

    def query(self) -> bool:
        """Always True (emulated work completes at once), with the effect of ``synchronize``."""
        self.checker.sync_stream(self)
        return True

    def __enter__(self) -> Self:
        self.checker.push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.checker.pop_stream(self)

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
        checker: StreamOps | None = None,
        device: Any = None,
    ) -> None:
        self.checker = _owner(checker, "event")
        self.event_id = next(Event._serial)
        self._record: EventRecord | None = None

    def record(self, stream: Any = None) -> None:
        """Record on ``stream`` (the calling thread's current stream if None)."""
        self._record = self.checker.record_event(stream)

    @property
    def last_record(self) -> EventRecord | None:
        """The last ``record`` (None before the first)."""
        return self._record

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` (the current stream if None) wait for the last record."""
        self.checker.wait_event(stream, self)

    def synchronize(self) -> None:
        """The calling thread waits for the last record: it knows that work has completed."""
        self.checker.sync_event(self, report=True)

    def query(self) -> bool:
        """Always True, with the effect of ``synchronize`` where the record is host-ordered before
        (a query never reports: polling before the record is legitimate)."""
        self.checker.sync_event(self, report=False)
        return True

    @property
    def recorded_on(self) -> Stream | None:
        return None if self._record is None else self._record.stream

    def __repr__(self) -> str:
        where = "" if self._record is None else f"@{self._record.stream.name}"
        return f"ev{self.event_id}{where}"
