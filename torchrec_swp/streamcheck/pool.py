"""The engine's stream pool in checked mode (``checked_mode`` has the switch that asks for it).

``CheckedStreamPool`` has the shape of ``torchrec_swp.engine.streams.StreamPool`` with
``has_streams = True``, so the compiler emits every device sync it would emit for CUDA and the
engine performs them on emulated streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from torchrec_swp.streamcheck.checker import StreamChecker
from torchrec_swp.streamcheck.emulated import Event, Stream


class CheckedStreamPool:
    """Plan stream names -> emulated streams of ``checker``; ``"default"`` is the checker's
    default stream. ``streams`` maps names to given stream objects (as ``CudaStreamPool``'s
    does): an emulated stream is used as is, a foreign one (a user's ``torch.cpu.Stream``, a
    ``torch.Stream``) is adopted under that name; None values are ignored."""

    has_streams = True

    def __init__(self, checker: StreamChecker, streams: Mapping[str, Any] | None = None) -> None:
        self.checker = checker
        self._streams: dict[str, Stream] = {}
        for name, obj in (streams or {}).items():
            if obj is None:
                continue
            self._streams[name] = (
                obj if isinstance(obj, Stream) and obj.checker is checker else checker.adopt(obj, name)
            )

    def stream(self, name: str) -> Stream:
        s = self._streams.get(name)
        return s if s is not None else self.checker.stream(name)

    def context(self, name: str) -> AbstractContextManager[Any]:
        return self.checker.stream_context(self.stream(name))

    def record(self, name: str) -> Event:
        return self.stream(name).record_event()

    def wait(self, name: str, event: Any) -> None:
        self.stream(name).wait_event(event)

    def thread_init(self) -> None:
        self.checker.thread_init()
