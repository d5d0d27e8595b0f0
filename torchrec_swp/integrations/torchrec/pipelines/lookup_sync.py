"""Upstream's ``_start_embedding_lookup`` where it orders the lookup after the input dist's stream
(TorchRec 1.9.2), and the same on TorchRec 1.8.0, whose helper does not.

Fused and SemiSync wait for a module's input dist on the data-dist stream and then look its
tables up on another stream (Fused's ``emb_lookup`` stream, SemiSync's compute stream).
TorchRec 1.8.0's helper records the KJT on the target stream only: nothing orders the lookup
after the data-dist stream's recat kernels, and the stream that reads the KJT is never told to
the caching allocator. TorchRec 1.9.2 fixed it (``_start_embedding_lookup_stream_synced``:
"Races when the embedding lookup runs on a stream other than source_stream", its docstring says
of the old one): an event on the source stream that the lookup's stream waits for, and
``record_stream`` on every consumer stream. On 1.8.0 the checked parity tests
(``SWP_STREAM_CHECK=1``, 2 ranks) report that race in every Fused and SemiSync run (the lookup's
``asynchronous_complete_cumsum`` reading what ``permute_2D_sparse_data`` wrote on ``data_dist``,
and early frees of those blocks). ``start_embedding_lookup`` is upstream's helper where it has
the fix (1.9, killswitch included), else this module's copy of 1.9.2's synced body: the same
calls, the same numerics, one event and the record_streams more; nothing on a device without
streams (both streams None). The copy reproduces TorchRec's code (BSD-3-Clause, Meta Platforms,
Inc. and affiliates), as does everything this package subclasses; drop it with TorchRec 1.8.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torchrec.distributed.train_pipeline import utils as _upstream


def _stream_synced(
    module: Any,
    context: Any,
    source_stream: torch.Stream | None,
    target_stream: torch.Stream | None,
    stream_context: Callable[..., AbstractContextManager[Any]],
) -> None:
    """TorchRec 1.9.2's ``_start_embedding_lookup_stream_synced``, line for line."""
    name = module.forward.name
    module_context = context.module_contexts[name]
    # the caller may have made a third stream current for the lookup itself
    current_stream = None
    device_stream = source_stream or target_stream
    if device_stream:
        current_stream = torch.get_device_module(device_stream.device).current_stream()
    with stream_context(source_stream):
        kjt = context.input_dist_tensors_requests[name].wait()
        source_event = (
            source_stream.record_event() if source_stream is not None and source_stream != current_stream else None
        )
    if current_stream is not None and source_event is not None:
        current_stream.wait_event(source_event)
    consumer_streams = {s for s in (current_stream, target_stream) if s is not None}
    consumer_streams.discard(source_stream)  # it allocated them
    for stream in consumer_streams:
        kjt.record_stream(stream)
        module_context.record_stream(stream)
    context.embedding_a2a_requests[name] = module.compute_and_output_dist(module_context, kjt)


#: Upstream's helper where it orders the lookup (TorchRec 1.9.2), else the copy above.
start_embedding_lookup: Callable[..., None] = (
    _upstream._start_embedding_lookup if hasattr(_upstream, "_start_embedding_lookup_stream_synced") else _stream_synced
)
