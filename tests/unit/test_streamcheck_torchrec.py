"""TorchRec's own stream helpers under the checker: ``_wait_for_batch`` (current_stream through
``torch.get_device_module``, ``wait_stream``, ``KeyedJaggedTensor.record_stream``) and its CPU
``_stream_context`` (``torch.cuda.stream``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchrec_swp.streamcheck import EarlyFree, StreamChecker, UnsyncedAccess

jagged_tensor = pytest.importorskip("torchrec.sparse.jagged_tensor")
utils = pytest.importorskip("torchrec.distributed.train_pipeline.utils")
KeyedJaggedTensor = jagged_tensor.KeyedJaggedTensor


@pytest.fixture
def checker() -> Iterator[StreamChecker]:
    c = StreamChecker()
    with c:
        yield c


def host_batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.arange(6.0), lengths=torch.tensor([2, 4]))


def copy_to_device(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """What ``_to_device`` does on CUDA: new tensors written on the current stream. (On the CPU
    ``_to_device`` returns the same tensors; the installed checker copies host memory only, and
    this batch was made inside the task.)"""
    assert utils._to_device(kjt, torch.device("cpu"), non_blocking=True).values() is kjt.values()
    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths().clone()
    )


def run(checker: StreamChecker, consume: object) -> None:
    memcpy = checker.stream("memcpy")
    for b in range(2):
        with checker.task("H2D", b), torch.cpu.stream(memcpy):
            batch = copy_to_device(host_batch())
        with checker.task("Forward", b):
            consume(batch, memcpy)  # type: ignore[operator]
            batch.values().sum()
            batch.offsets()
        del batch


def test_wait_for_batch_is_clean(checker: StreamChecker) -> None:
    run(checker, utils._wait_for_batch)
    checker.check()


def test_record_stream_without_the_wait_is_caught(checker: StreamChecker) -> None:
    run(checker, lambda batch, stream: batch.record_stream(torch.cpu.current_stream()))
    reads = [(f.earlier.op, f.later.op, f.later.arg) for f in checker.findings if isinstance(f, UnsyncedAccess)]
    assert reads == [
        ("aten.clone.default", "aten.sum.default", "self"),  # values
        ("aten.clone.default", "fbgemm.asynchronous_complete_cumsum.default", "t_in"),  # lengths -> offsets
    ]
    assert checker.counts == [2, 2]
    assert not any(isinstance(f, EarlyFree) for f in checker.findings)


def test_the_wait_without_record_stream_is_an_early_free(checker: StreamChecker) -> None:
    run(checker, lambda batch, stream: utils._wait_for_batch(batch, stream, record_stream=False))
    assert checker.findings and all(isinstance(f, EarlyFree) for f in checker.findings)
    assert {f.use.task for f in checker.findings if isinstance(f, EarlyFree)} == {"Forward"}


def test_torchrec_cpu_stream_context_enters_emulated_streams(checker: StreamChecker) -> None:
    stream_context = torch.cuda.stream  # what TorchRec's pipelines keep as _stream_context on CPU devices
    dist = checker.stream("data_dist")
    with checker.task("InputDist", 0), stream_context(dist):
        assert torch.get_device_module(torch.device("cpu")).current_stream() is dist
    with stream_context(None):
        assert torch.cpu.current_stream() is checker.default_stream
