"""Stream pools: how the engine talks to device streams.

A pool maps a plan's stream names to stream objects and knows three operations: enter a
stream's context, record an event on a stream, make a stream wait for an event.

* ``CudaStreamPool``: real CUDA (or MTIA) streams and events.
* ``NullStreamPool``: the CPU. Streams are ``None``; ``has_streams`` is False, so the
  compiler emits no device syncs at all and nothing here is ever called on the hot path.
* ``RecordingStreamPool``: fake streams that log every operation, to test the device-sync
  logic of compiled programs without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchrec_swp.plan import DEFAULT_STREAM

#: Device types with streams and events; everywhere else (the CPU) nothing crosses a stream.
STREAM_DEVICE_TYPES = ("cuda", "mtia")


class StreamPool(Protocol):
    has_streams: bool

    def stream(self, name: str) -> Any: ...

    def context(self, name: str) -> contextlib.AbstractContextManager[Any]: ...

    def record(self, name: str) -> Any: ...

    def wait(self, name: str, event: Any) -> None: ...

    def thread_init(self) -> None: ...


class NullStreamPool:
    """CPU: no streams, no events; every operation is a no-op."""

    has_streams = False

    def stream(self, name: str) -> None:
        return None

    def context(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, name: str) -> None:
        return None

    def wait(self, name: str, event: Any) -> None:
        return None

    def thread_init(self) -> None:
        return None


class CudaStreamPool:
    """Streams of a CUDA-like device. Named streams are created on first use (priority -1,
    as TorchRec does) unless given; ``"default"`` is the device's current stream."""

    has_streams = True

    def __init__(self, device: torch.device, streams: Mapping[str, Any] | None = None) -> None:
        self.device = device
        self._mod = torch.get_device_module(device)
        self._streams: dict[str, Any] = {DEFAULT_STREAM: self._mod.current_stream(device)}
        self._streams.update({k: v for k, v in (streams or {}).items() if v is not None})
        self._lock = threading.Lock()

    def stream(self, name: str) -> Any:
        with self._lock:
            if name not in self._streams:
                self._streams[name] = self._mod.Stream(device=self.device, priority=-1)
            return self._streams[name]

    def context(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self._mod.stream(self.stream(name))

    def record(self, name: str) -> Any:
        event = self._mod.Event()
        event.record(self.stream(name))
        return event

    def wait(self, name: str, event: Any) -> None:
        self.stream(name).wait_event(event)

    def thread_init(self) -> None:
        # Worker threads start on device 0; make them submit to the pipeline's device.
        self._mod.set_device(self.device)


@dataclass
class FakeEvent:
    stream: str
    serial: int

    def __repr__(self) -> str:
        return f"ev{self.serial}@{self.stream}"


@dataclass
class RecordingStreamPool:
    """Fake streams for tests: every record/wait/context entry is appended to ``log``."""

    has_streams: bool = True
    log: list[tuple[str, ...]] = field(default_factory=list)
    _serial: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, name: str) -> str:
        return name

    @contextlib.contextmanager
    def context(self, name: str) -> Iterator[str]:
        with self._lock:
            self.log.append(("enter", name))
        yield name

    def record(self, name: str) -> FakeEvent:
        with self._lock:
            self._serial += 1
            event = FakeEvent(name, self._serial)
            self.log.append(("record", name, repr(event)))
        return event

    def wait(self, name: str, event: Any) -> None:
        with self._lock:
            self.log.append(("wait", name, repr(event)))

    def thread_init(self) -> None:
        return None


def device_has_streams(device: torch.device) -> bool:
    """Whether work for ``device`` runs on streams: CUDA and MTIA, and the CPU in checked mode
    (``SWP_STREAM_CHECK=1``), where the code paths that only run with streams (``record_stream``,
    events) must run as on CUDA for the checker to see them."""
    if device.type in STREAM_DEVICE_TYPES:
        return True
    from torchrec_swp.streamcheck import stream_check_requested

    return device.type == "cpu" and stream_check_requested()


def stream_pool_for(device: torch.device, streams: Mapping[str, Any] | None = None) -> StreamPool:
    """The pool for ``device``: CUDA/MTIA streams on those devices, null streams elsewhere; on the
    CPU with ``SWP_STREAM_CHECK=1``, emulated streams watched by the process's stream checker
    (``torchrec_swp.streamcheck``: what a CUDA run would synchronise, checked on the CPU)."""
    if device.type in STREAM_DEVICE_TYPES:
        return CudaStreamPool(device, streams)
    from torchrec_swp.streamcheck import CheckedStreamPool, process_checker, stream_check_requested

    if stream_check_requested():
        return CheckedStreamPool(process_checker(), streams)
    return NullStreamPool()
