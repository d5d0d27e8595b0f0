"""The torch runtime: threads, stream pools, the collective turnstile, the interpreter (of plan
programs: ``Engine``; of pipeline-parallel rank programs: ``ProgramEngine``)."""

from torchrec_swp.engine.errors import CollectiveAborted, EngineError, EngineTimeout, TaskAborted
from torchrec_swp.engine.executor import DEFAULT_TIMEOUT_S, BatchLedger, Binding, Engine, Interpreter, Observer
from torchrec_swp.engine.programs import ActionBinding, ProgramEngine
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
    "ActionBinding",
    "BatchLedger",
    "Binding",
    "CollectiveAborted",
    "CudaStreamPool",
    "Engine",
    "EngineError",
    "EngineTimeout",
    "Interpreter",
    "NullStreamPool",
    "Observer",
    "ProgramEngine",
    "RecordingStreamPool",
    "StreamPool",
    "TaskAborted",
    "Turnstile",
    "stream_pool_for",
]
