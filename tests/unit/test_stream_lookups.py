"""On a device without streams our pipelines build no stream context for no stream
(``cpu_safe.without_stream_lookups``): upstream's ``_stream_context`` is ``torch.cuda.stream`` there,
called with None streams about four times a step, and each call looks the current CUDA device up
to enter nothing. With streams, and in checked mode, the pipeline keeps upstream's.

The training test needs a default process group of one gloo rank in this process (``one_rank``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from torchrec.distributed.train_pipeline import runtime_forwards
from torchrec.distributed.train_pipeline import train_pipelines as upstream

import torchrec_swp
from torchrec_swp.integrations.torchrec.pipelines.cpu_safe import none_is_no_stream, without_stream_lookups
from torchrec_swp.streamcheck import active_checker

CPU = torch.device("cpu")


def test_no_stream_enters_nothing_without_calling_the_context() -> None:
    calls: list[Any] = []

    def inner(stream: Any) -> Any:
        calls.append(stream)
        return MagicMock()

    context = none_is_no_stream(inner)
    with context(None) as entered:
        assert entered is None
    assert calls == []
    stream = object()
    context(stream)
    assert calls == [stream]  # any other stream: the original context, as it is
    assert none_is_no_stream(context) is context  # wrapping twice changes nothing


def _sparse_dist(cls: type) -> Any:
    model = MagicMock(spec=torch.nn.Module)
    model.training = True
    return cls(model, MagicMock(spec=torch.optim.Optimizer), device=CPU)


@pytest.fixture
def no_cuda_lookup(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """torch.cuda.StreamContext replaced by one that records what it was built for."""
    built: list[Any] = []
    original = torch.cuda.StreamContext

    class Recorded(original):  # type: ignore[misc, valid-type]
        def __init__(self, stream: Any) -> None:
            built.append(stream)
            super().__init__(stream)

    monkeypatch.setattr(torch.cuda, "StreamContext", Recorded)
    return built


@pytest.mark.skipif(active_checker() is not None, reason="checked mode: CPU streams are emulated ones")
def test_a_cpu_pipeline_builds_no_stream_context_for_no_stream(no_cuda_lookup: list[Any]) -> None:
    theirs, ours = _sparse_dist(upstream.TrainPipelineSparseDist), _sparse_dist(torchrec_swp.TrainPipelineSparseDist)
    assert theirs._memcpy_stream is None and theirs._data_dist_stream is None
    with theirs._stream_context(theirs._memcpy_stream):
        pass
    assert no_cuda_lookup == [None]  # upstream's: torch.cuda.stream(None), a StreamContext that enters nothing
    with ours._stream_context(ours._memcpy_stream), ours._stream_context(ours._data_dist_stream):
        pass
    assert no_cuda_lookup == [None]
    # upstream's PipelinedForward without a stream assumes CUDA; ours is on the CPU
    forward_type = ours._pipelined_forward_type
    assert forward_type is not runtime_forwards.PipelinedForward
    assert issubclass(forward_type, runtime_forwards.PipelinedForward)
    forward = forward_type("ebc", MagicMock(), MagicMock(), MagicMock(), None)
    assert forward._device == CPU and forward._stream is None
    assert theirs._pipelined_forward_type("ebc", MagicMock(), MagicMock(), MagicMock(), None)._device.type == "cuda"


def test_checked_mode_and_streamed_devices_keep_upstream_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = MagicMock()
    pipeline._device = torch.device("cuda")
    pipeline._stream_context = original = MagicMock()
    pipeline._pipelined_forward_type = runtime_forwards.PipelinedForward
    without_stream_lookups(pipeline)
    assert pipeline._stream_context is original
    assert pipeline._pipelined_forward_type is runtime_forwards.PipelinedForward
    monkeypatch.setenv("SWP_STREAM_CHECK", "1")  # the CPU has (emulated) streams: the checker must see them
    pipeline._device = CPU
    without_stream_lookups(pipeline)
    assert pipeline._stream_context is original
    assert pipeline._pipelined_forward_type is runtime_forwards.PipelinedForward


def _trained(impl: str, steps: int) -> Iterator[Any]:
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from harness.dlrm_data import SIZES, batches

    size = SIZES["small"]
    runner = make_runner("TrainPipelineSparseDist", impl, lambda: build_dlrm(0, 1, size))
    data = batches(size, 0, steps + 2)
    try:
        for _ in range(steps):
            loss, _, _ = runner.step(data)
            yield loss.item()
    finally:
        runner.close()


@pytest.mark.skipif(active_checker() is not None, reason="checked mode: CPU streams are emulated ones")
def test_a_cpu_training_run_builds_no_cuda_stream_context(one_rank: None, no_cuda_lookup: list[Any]) -> None:
    theirs = list(_trained("upstream", 4))
    assert len(no_cuda_lookup) >= 4 * 3 and set(no_cuda_lookup) == {None}  # copy, input dist start and wait
    no_cuda_lookup.clear()
    ours = list(_trained("ours", 4))
    assert no_cuda_lookup == []
    assert ours == theirs
