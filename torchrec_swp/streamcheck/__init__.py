"""Stream checking on the CPU: what a CUDA run of the same tasks would synchronise, and where not.

How one batch's tensors flow through it, in the order the code runs:

1. ``StreamChecker().install()`` patches torch's CPU stream APIs (``patches``) so that
   ``torch.cpu.stream(s)``, ``current_stream()``, ``Tensor.record_stream`` and TorchRec's
   ``_stream_context`` reach the checker; the engine gets a ``CheckedStreamPool`` (``pool``),
   whose ``has_streams`` makes the compiler emit every event record and wait it would for CUDA.
2. The engine runs each task inside ``checker.task(name, batch, thread)`` and the pool's
   ``context(stream)``: an ``AccessMode`` (``dispatch``) sees every aten op and, from the op
   schema's alias information, the storages it reads and writes; each op is one step of the lane
   (current stream, calling thread).
3. ``record``/``wait`` of the pool, ``wait_stream``/``wait_event``/``record_event`` of the
   emulated streams (``emulated``) and the engine's CPU-side hand-offs (``cpu_release`` before a
   signal, ``cpu_acquire`` after the wait) move vector clocks (``checker``).
4. Each access is checked against the storage's last write and reads: an unordered pair is an
   ``UnsyncedAccess``; when the storage dies, a use on another stream covered neither by
   ``record_stream`` nor a wait is an ``EarlyFree``; a wait on an event whose record is not
   CPU-ordered before it is a ``HostOrder`` finding (``findings``).
5. ``checker.check()`` raises ``StreamCheckError`` listing them (the first of each kind, with
   counts); ``checker.findings`` has them as data. In checked mode (``SWP_STREAM_CHECK=1``,
   ``checked_mode``) the process's checker also writes its first finding and a summary line at
   exit to stderr.

Pure torch: nothing here imports TorchRec or the engine.
"""

from torchrec_swp.streamcheck.checked_mode import ENV_VAR, CheckReport, process_checker, stream_check_requested
from torchrec_swp.streamcheck.checker import (
    DEFAULT_STREAM,
    CheckStats,
    StreamChecker,
    TaskLabel,
    active_checker,
    checking,
)
from torchrec_swp.streamcheck.emulated import Event, Stream
from torchrec_swp.streamcheck.findings import (
    Access,
    EarlyFree,
    Finding,
    HostOrder,
    StreamCheckError,
    StreamCheckUsageError,
    UnsyncedAccess,
)
from torchrec_swp.streamcheck.pool import CheckedStreamPool

__all__ = [
    "DEFAULT_STREAM",
    "ENV_VAR",
    "Access",
    "CheckReport",
    "CheckStats",
    "CheckedStreamPool",
    "EarlyFree",
    "Event",
    "Finding",
    "HostOrder",
    "Stream",
    "StreamCheckError",
    "StreamCheckUsageError",
    "StreamChecker",
    "TaskLabel",
    "UnsyncedAccess",
    "active_checker",
    "checking",
    "process_checker",
    "stream_check_requested",
]
