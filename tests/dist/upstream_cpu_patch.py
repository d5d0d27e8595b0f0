"""The smallest test-only patch that lets upstream's CUDA-minded pipelines run on CPU.

Used ONLY by tests, to have an upstream reference for the pipelines that fail on CPU as
shipped (see /work/shared/UPSTREAM_CPU_NOTES.md). torchrec_swp itself never patches torchrec.

* ``Tensor.record_stream`` is a no-op on CPU tensors (upstream calls it on KJTs and embeddings;
  on CPU it raises "unknown parameter type").
* ``BaseForward`` (runtime_forwards) falls back to ``torch.device("cuda")`` when it has no
  stream, then asks CUDA for its current stream; the fallback becomes the CPU.

Other pipeline-specific tweaks (Prefetch's missing data_dist stream, Staged's compute stream,
CompAutograd's reducer) belong in the test that needs them, next to a comment saying why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import runtime_forwards


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

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
    runtime_forwards.BaseForward.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.record_stream = original_record_stream  # type: ignore[method-assign]
        runtime_forwards.BaseForward.__init__ = original_init  # type: ignore[method-assign]
