"""The torch runtime: how one batch goes through one ``progress()`` call.

docs/engine.md is the map: the calls in order (``file:function``), the glossary (internal
iteration ``P``, batch ``b``/``d``, serial, number, slot, latch, credit, lane, walker, board,
turnstile, cut) and which part owns which state. In short:

1. ``progress(data)`` is ``Engine.step(data)`` (``engine.py``): it asks ``Batches`` for batch
   ``d``, the oldest not yet returned, and walks the calling thread's program through internal
   iteration ``d + top`` - the iteration where ``d`` is at the highest stage.
2. Each thread walks its program, one iteration after the other (``interpreter.py``): at
   iteration ``P`` a task of stage ``s`` works on batch ``P - s``; threads other than the caller
   walk on in the background, with no barrier between iterations. Each instruction is an op
   (``ops.py``): a task instance runs once its batch exists, its guard admits it, its
   dependencies on other threads are done (``wait``/``signal`` latches on the ``Board``,
   ``board.py``) and its collective ticket comes up (``turnstile.py``); it reads its inputs from
   slots and writes its outputs back (the call ``Batches`` made for it, ``batches.py``), inside
   its device stream (``streams.py``). Whether batch ``b`` exists at all, and whether the data
   has ended, only the end of data's state machine says (``end_of_data.py``).
3. The source draws batch ``b`` from ``data`` (``source.py``) once the credit allows:
   ``b < returned + pipeline_depth + lookahead``; its values go into ``b``'s slot, and the
   batch's life - drawn, in flight, trained or dropped, epochs - is kept by ``Batches``
   (``batches.py``; its ``BatchBook`` per epoch and the ``BatchLedger``), epochs decided by
   ``Epochs`` (``epochs.py``).
4. When every thread has finished its part of batch ``d``, ``step()`` returns ``d``'s output and
   retires it: one more batch of credit for the source.

``state_dict()`` cuts at the first batch not returned (``cuts.py``): the data position before it
was drawn, its number and the ledger; the batches in flight are drawn again after a resume. The
installed plans, a pending switch and the walkers they need are ``InstalledPlans`` (``installed.py``).

A failure anywhere parks every thread where it is and comes out of ``step()`` named
(``errors.py``); ``ProgramEngine`` (``programs.py``) runs pipeline-parallel rank programs on the
same interpreter.
"""

from torchrec_swp.engine.batches import BatchBook, BatchLedger
from torchrec_swp.engine.engine import Engine
from torchrec_swp.engine.errors import CollectiveAborted, EngineError, EngineTimeout, TaskAborted
from torchrec_swp.engine.interpreter import DEFAULT_TIMEOUT_S, Interpreter
from torchrec_swp.engine.programs import ActionBinding, ProgramEngine
from torchrec_swp.engine.source import Draws
from torchrec_swp.engine.streams import (
    STREAM_DEVICE_TYPES,
    CudaStreamPool,
    NullStreamPool,
    RecordingStreamPool,
    StreamPool,
    device_has_streams,
    stream_pool_for,
)
from torchrec_swp.engine.tasks import Binding, Observer
from torchrec_swp.engine.turnstile import Turnstile

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "STREAM_DEVICE_TYPES",
    "ActionBinding",
    "BatchBook",
    "BatchLedger",
    "Binding",
    "CollectiveAborted",
    "CudaStreamPool",
    "Draws",
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
    "device_has_streams",
    "stream_pool_for",
]
