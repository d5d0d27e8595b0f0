"""The smallest patch that lets upstream's CUDA-minded pipelines run on CPU, for comparisons.

Used only where upstream runs as a reference for the pipelines that fail on CPU as shipped:
the parity tests, the benchmarks and this example's ``--impl upstream --upstream-cpu-patch``.
torchrec_swp itself never patches torchrec. What fails on CPU and why is in docs/install.md.

* ``Tensor.record_stream`` is a no-op on CPU tensors (upstream calls it on KJTs and embeddings;
  on CPU it raises "unknown parameter type").
* ``BaseForward`` (runtime_forwards) falls back to ``torch.device("cuda")`` when it has no
  stream, then asks CUDA for its current stream; the fallback becomes the CPU.
* TorchRec 1.9's ``_start_embedding_lookup`` (as ``train_pipelines`` imported it) reads
  ``.device`` of the streams it is handed; Fused and SemiSync hand it
  ``torch.cpu.current_stream()``, which has none. CPU streams are passed as None (no stream),
  which is what they are.
* ``torch.cuda.Event()`` (TorchRec 1.9's TrainPipelinePEC creates two in its constructor) is
  the CPU's dummy ``torch.cpu.Event()`` when there is no CUDA: a CPU build refuses to create
  a CUDA event ("Tried to instantiate dummy base class Event").
* Without CUDA, ``torch.cuda.Stream(...)`` is a new ``torch.cpu.Stream()``, ``torch.cuda.current_stream()``
  the CPU's, ``torch.cuda.current_device()`` 0 and ``torch.cuda.set_device`` a no-op: TorchRec 1.9's
  stashing pipelines (TrainPipelineSparseDistOptStash, ...EmbStash, TrainPipelinePrefetchEMS)
  create a CUDA stream in their constructors, and MemoryStashingManager's threaded stash and
  restore record CUDA events on the current CUDA stream of the current device. (On the CPU it
  stashes nothing: it moves CUDA tensors only.)
* Without CUDA, ``torch.empty_like(..., pin_memory=True)`` allocates unpinned memory: TorchRec's
  EvalPipelineCPUSparse pins its embedding buffers, which a CPU-only build refuses ("pin_memory=True
  requires a CUDA or other accelerator backend").

Other pipeline-specific tweaks (Prefetch's missing data_dist stream, Staged's compute stream,
CompAutograd's reducer) belong in the test that needs them, next to a comment saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import runtime_forwards, train_pipelines


@contextlib.contextmanager
def upstream_cpu_patch() -> Iterator[None]:
    original_record_stream = torch.Tensor.record_stream
    original_init = runtime_forwards.BaseForward.__init__

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.device.type == "cpu":
            return
        original_record_stream(self, stream)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    original_lookup = train_pipelines._start_embedding_lookup

    def device_stream(stream: Any) -> Any:
        device = getattr(stream, "device", None)
        return stream if device is not None and torch.device(device).type != "cpu" else None

    def start_embedding_lookup(
        module: Any, context: Any, source_stream: Any, target_stream: Any, stream_context: Any
    ) -> None:
        original_lookup(module, context, device_stream(source_stream), device_stream(target_stream), stream_context)

    cuda_event = torch.cuda.Event
    cuda_stream, cuda_current_stream = torch.cuda.Stream, torch.cuda.current_stream
    cuda_current_device, cuda_set_device = torch.cuda.current_device, torch.cuda.set_device
    empty_like = torch.empty_like

    def unpinned_empty_like(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return empty_like(*args, **kwargs)

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    runtime_forwards.BaseForward.__init__ = init  # type: ignore[method-assign]
    train_pipelines._start_embedding_lookup = start_embedding_lookup
    if not torch.cuda.is_available():
        torch.cuda.Event = lambda *args, **kwargs: torch.cpu.Event()  # type: ignore[assignment,misc]
        torch.cuda.Stream = lambda *args, **kwargs: torch.cpu.Stream()  # type: ignore[assignment,misc]
        torch.cuda.current_stream = lambda *args, **kwargs: torch.cpu.current_stream()  # type: ignore[assignment]
        torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
        torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
        torch.empty_like = unpinned_empty_like  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.record_stream = original_record_stream  # type: ignore[method-assign]
        runtime_forwards.BaseForward.__init__ = original_init  # type: ignore[method-assign]
        train_pipelines._start_embedding_lookup = original_lookup
        torch.cuda.Event = cuda_event  # type: ignore[misc]
        torch.cuda.Stream, torch.cuda.current_stream = cuda_stream, cuda_current_stream  # type: ignore[misc]
        torch.cuda.current_device, torch.cuda.set_device = cuda_current_device, cuda_set_device
        torch.empty_like = empty_like  # type: ignore[assignment]
