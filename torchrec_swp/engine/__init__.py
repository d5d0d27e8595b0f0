"""The torch runtime: threads, stream pools, the collective turnstile, the interpreter."""

from torchrec_swp.engine.errors import CollectiveAborted, EngineError, EngineTimeout, TaskAborted
from torchrec_swp.engine.executor import DEFAULT_TIMEOUT_S, BatchLedger, Binding, Engine, Observer
from torchrec_swp.engine.streams import (
    STREAM_DEVICE_TYPES,
    CudaStreamPool,
    NullStreamPool,
    RecordingStreamPool,
    StreamPool,
    stream_pool_for,
)
from torchrec_swp.engine.turnstile import Turnstile

__all__ = [
    "STREAM_DEVICE_TYPES",
    "DEFAULT_TIMEOUT_S",
    "BatchLedger",
    "Binding",
    "CollectiveAborted",
    "CudaStreamPool",
    "Engine",
    "EngineError",
    "EngineTimeout",
    "NullStreamPool",
    "Observer",
    "RecordingStreamPool",
    "StreamPool",
    "TaskAborted",
    "Turnstile",
    "stream_pool_for",
]
