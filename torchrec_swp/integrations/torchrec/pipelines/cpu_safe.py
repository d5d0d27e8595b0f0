"""Stream handling for upstream helpers that assume a CUDA-like device.

TorchRec 1.8.0's Fused, EvalFused and Prefetch pipelines fail on CPU as shipped. Our pipelines
fix that in their own types and helpers, never by patching torchrec:

* ``InSyncEmbeddingForward``: upstream's ``InSyncEmbeddingPipelinedForward`` that knows the
  pipeline's device. Without a stream, upstream's ``BaseForward`` assumes
  ``torch.device("cuda")`` and then asks CUDA for its current stream on every forward.
* ``prefetch_embeddings``: upstream's ``utils.prefetch_embeddings``, which returns without doing
  anything when there is no data_dist stream (always so on CPU), so the forward then finds no
  prefetched input ("Invalid PrefetchPipelinedForward usage"). Without streams this does the
  same work with no stream syncs; with streams it is upstream's function unchanged.
* ``streamless_on_cpu``: any upstream pipelined-forward type made to treat a stream of a device
  without streams (``torch.Stream(device="cpu")``, which users pass to ``SparseDataDistUtil``
  on CPU) as no stream: upstream's forward would ``record_stream`` CPU tensors on it.
* ``without_stream_lookups``: on a device without streams, a pipeline's stream contexts that
  enter nothing for no stream without asking torch. Upstream keeps ``torch.cuda.stream`` as
  ``_stream_context`` on such a device and calls it with a None stream (its memcpy and data dist
  streams) about four times a step, and its ``PipelinedForward`` without a stream assumes CUDA
  and does the same: each ``torch.cuda.stream(None)`` looks the current CUDA device up (4.5 us on
  the 2-core CI machine; on a machine with a GPU it initialises CUDA) to then enter nothing.
* (in ``fused.py``) ``start_embedding_lookup`` records the looked-up KJTs on the engine's
  compute stream, which is None on CPU; upstream records them on ``current_stream()``, which
  on CPU is a ``torch.cpu.Stream`` that ``Tensor.record_stream`` rejects ("unknown parameter type").

With CUDA (or MTIA) streams every path here issues exactly upstream's waits and
``record_stream`` calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, cast

import torch
from torchrec.distributed.model_parallel import ShardedModule
from torchrec.distributed.train_pipeline import runtime_forwards
from torchrec.distributed.train_pipeline import utils as upstream_utils
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext
from torchrec.distributed.train_pipeline.types import CallArgs

from torchrec_swp.engine import device_has_streams
from torchrec_swp.engine.labels import record_function

__all__ = [
    "InSyncEmbeddingForward",
    "none_is_no_stream",
    "prefetch_embeddings",
    "stream_of_a_streamed_device",
    "streamless_on_cpu",
    "without_stream_lookups",
]


class InSyncEmbeddingForward(runtime_forwards.InSyncEmbeddingPipelinedForward):
    """Upstream's forward for TrainPipelineFusedSparseDist, on the pipeline's device.

    Contract: identical to upstream's when it has a stream (its device is the stream's). Without
    one, its device is ``device`` (the pipeline's; set by ``on(device)``), not CUDA; the forward
    then only asks that device for its current stream, to hand it to ``detach_embeddings``,
    which does nothing in this forward.
    """

    device: ClassVar[torch.device] = torch.device("cpu")

    def __init__(
        self,
        name: str,
        args: CallArgs,
        module: ShardedModule,
        context: Any,
        stream: torch.Stream | None = None,
    ) -> None:
        super().__init__(name, args, module, context, stream)
        if stream is None:
            self._device = self.device

    @classmethod
    def on(cls, device: torch.device) -> type[InSyncEmbeddingForward]:
        """This forward type bound to ``device`` (one class per device, reused)."""
        # (cast: a class is hashable; mypy checks type[cls] against Hashable with the instances' __hash__)
        return _bound_forward(cast(Hashable, cls), torch.device(device))


@functools.cache
def _bound_forward(cls: type[InSyncEmbeddingForward], device: torch.device) -> type[InSyncEmbeddingForward]:
    return type(cls.__name__, (cls,), {"device": device, "__module__": cls.__module__, "__doc__": cls.__doc__})


def prefetch_embeddings(
    context: PrefetchTrainPipelineContext,
    pipelined_modules: Sequence[ShardedModule],
    device: torch.device,
    stream_context: Callable[[Any], AbstractContextManager[Any]],
    data_dist_stream: torch.Stream | None,
    forward_stream: torch.Stream | None,
) -> None:
    """Prefetch the embeddings of the batch of ``context`` into the modules' caches.

    Reads and pops ``context.input_dist_tensors_requests[name]`` and
    ``context.module_contexts[name]`` for every pipelined module; writes
    ``context.module_input_post_prefetch[name]`` and ``context.module_contexts_post_prefetch[name]``,
    which PrefetchPipelinedForward consumes. With a data_dist stream this is upstream's
    ``prefetch_embeddings`` (stream waits and ``record_stream`` included); without one, the same
    steps with no stream work.

    Raises:
        RuntimeError: a module is not pipelined with a PrefetchPipelinedForward, or the input
            dist of a module was not waited for (no request for it in the context).
    """
    if data_dist_stream is not None:
        upstream_utils.prefetch_embeddings(
            context, list(pipelined_modules), device, stream_context, data_dist_stream, forward_stream
        )
        return
    for module in pipelined_modules:
        forward = module.forward
        if not isinstance(forward, runtime_forwards.PrefetchPipelinedForward):
            raise RuntimeError(
                f"cannot prefetch for {type(module).__name__}: its forward is {type(forward).__name__}, "
                "not a PrefetchPipelinedForward (was the model detached from the pipeline?)"
            )
        name = forward.name
        if name not in context.input_dist_tensors_requests:
            raise RuntimeError(
                f"cannot prefetch module {name!r} for batch {context.index}: its input dist was not waited "
                f"for (requests available: {sorted(context.input_dist_tensors_requests)})"
            )
        request = context.input_dist_tensors_requests.pop(name)
        with record_function(f"## _prefetch_embeddings {name}: {context.index} ##"):
            dist_input = request.wait()
        module_context = context.module_contexts[name]
        module.prefetch(ctx=module_context, dist_input=dist_input, forward_stream=forward_stream)
        context.module_input_post_prefetch[name] = dist_input
        context.module_contexts_post_prefetch[name] = context.module_contexts.pop(name)


def stream_of_a_streamed_device(stream: Any) -> bool:
    """Whether ``stream`` belongs to a device whose work runs on streams (``device_has_streams``)."""
    device = getattr(stream, "device", None)
    return device is not None and device_has_streams(torch.device(device))  # the CPU too in checked mode


@functools.cache
def streamless_on_cpu(forward_type: type[runtime_forwards.BaseForward]) -> type[runtime_forwards.BaseForward]:
    """``forward_type`` (an upstream pipelined forward) that, handed a stream of a device without
    streams, behaves as if handed none: no ``record_stream``, no stream switch, and its device is
    the CPU rather than upstream's CUDA fallback. With a CUDA/MTIA stream it is ``forward_type``."""
    if getattr(forward_type, "_swp_streamless_on_cpu", False):
        return forward_type

    def __init__(self: Any, name: str, args: CallArgs, module: ShardedModule, context: Any, stream: Any = None) -> None:
        device_stream = stream if stream is not None and stream_of_a_streamed_device(stream) else None
        forward_type.__init__(self, name, args, module, context, device_stream)
        if device_stream is None:
            self._device = torch.device("cpu")

    return type(
        forward_type.__name__,
        (forward_type,),
        {"__init__": __init__, "__module__": __name__, "__doc__": forward_type.__doc__, "_swp_streamless_on_cpu": True},
    )


#: what a stream context of no stream enters: nothing (stateless, so one serves every call and thread)
_NO_STREAM: AbstractContextManager[None] = nullcontext()


def none_is_no_stream(stream_context: Callable[[Any], AbstractContextManager[Any]]) -> Callable[[Any], Any]:
    """``stream_context`` (``torch.cuda.stream`` or a device module's ``stream``) entering nothing
    for a None stream without building a ``StreamContext``, which enters nothing for None either;
    any other stream goes to ``stream_context`` as it is (looked up by it at call time, so the
    stream checker's patches still see it)."""
    if getattr(stream_context, "_swp_none_is_no_stream", False):
        return stream_context

    def context(stream: Any) -> AbstractContextManager[Any]:
        return _NO_STREAM if stream is None else stream_context(stream)

    context._swp_none_is_no_stream = True  # type: ignore[attr-defined]
    return context


def without_stream_lookups(pipeline: Any) -> None:
    """On a device without streams (not in checked mode): ``pipeline._stream_context`` through
    ``none_is_no_stream``, and upstream's ``PipelinedForward`` (which assumes CUDA without a
    stream) as ``streamless_on_cpu``'s, whose device is the CPU. Nothing changes what runs: every
    context replaced entered nothing. With streams the pipeline is left as it is."""
    device = getattr(pipeline, "_device", None)
    if not isinstance(device, torch.device) or device_has_streams(device):
        return
    stream_context = getattr(pipeline, "_stream_context", None)
    if callable(stream_context):
        pipeline._stream_context = none_is_no_stream(stream_context)
    if getattr(pipeline, "_pipelined_forward_type", None) is runtime_forwards.PipelinedForward:
        pipeline._pipelined_forward_type = streamless_on_cpu(runtime_forwards.PipelinedForward)
