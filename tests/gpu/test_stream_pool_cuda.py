"""CudaStreamPool on real CUDA streams: named streams, record/wait between them, record_stream.

Each race test runs the same producer/consumer pair with and without the synchronisation under
test: with it the consumer must read what the producer wrote, every time; without it the
consumer must read stale memory at least once in a few attempts, which shows the test can fail
(see ``cuda_race``). Without CUDA every test here is skipped.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.cuda_race import requires_cuda, spin, spin_cycles, wrong_results
from torchrec_swp.engine import CudaStreamPool, stream_pool_for

pytestmark = [pytest.mark.cuda, requires_cuda]

N = 1 << 20
"""Elements per buffer (4 MiB of float32); a sum of N ones is exact in float32."""


def test_named_streams_are_distinct_cached_and_entered(cuda: torch.device) -> None:
    pool = stream_pool_for(cuda)
    assert isinstance(pool, CudaStreamPool) and pool.has_streams
    default, memcpy, data_dist = (pool.stream(n) for n in ("default", "memcpy", "data_dist"))
    assert default == torch.cuda.current_stream(cuda)
    assert len({default, memcpy, data_dist}) == 3, "named streams must be distinct CUDA streams"
    assert pool.stream("memcpy") is memcpy, "a named stream is created once"
    assert memcpy.device == cuda
    with pool.context("memcpy"):
        assert torch.cuda.current_stream(cuda) == memcpy
    assert torch.cuda.current_stream(cuda) == default
    given = torch.cuda.Stream(cuda)
    assert CudaStreamPool(cuda, {"memcpy": given}).stream("memcpy") == given


def test_an_event_recorded_after_a_slow_producer_is_pending_until_it_ends(cuda: torch.device) -> None:
    pool = CudaStreamPool(cuda)
    torch.cuda.synchronize(cuda)
    with pool.context("memcpy"):
        spin(spin_cycles(cuda))
    event = pool.record("memcpy")
    assert not event.query(), "the event completed while the producer was still spinning"
    event.synchronize()
    assert event.query()


def _produce_then_consume(pool: CudaStreamPool, wait: bool, cycles: int) -> list[float]:
    """Producer on memcpy: spin, then fill a zeroed buffer with ones. Consumer on default: sum it
    (waiting for the producer's event only if ``wait``). Returns ``[sum]``; N when ordered."""
    device = pool.device
    buffer = torch.zeros(N, device=device)
    torch.cuda.synchronize(device)
    with pool.context("memcpy"):
        spin(cycles)
        buffer.fill_(1.0)
    event = pool.record("memcpy")
    if wait:
        pool.wait("default", event)
    with pool.context("default"):
        total = buffer.sum()
    torch.cuda.synchronize(device)  # the buffer outlives both streams' use of it
    return [total.item()]


def test_pool_wait_orders_the_consumer_after_the_producer_and_its_absence_races(cuda: torch.device) -> None:
    pool = CudaStreamPool(cuda)
    cycles = spin_cycles(cuda)
    for attempt in range(3):
        assert _produce_then_consume(pool, True, cycles) == [float(N)], f"with the wait, attempt {attempt}"
    seen = wrong_results(lambda: _produce_then_consume(pool, False, cycles), [float(N)])
    assert seen[-1] != [float(N)], (
        f"without the wait the consumer read the producer's write in all {len(seen)} attempts {seen}: "
        "the streams were ordered anyway, so this test cannot show a missing wait"
    )


def _reuse_after_free(pool: CudaStreamPool, record: bool, cycles: int) -> tuple[list[float], bool]:
    """A tensor allocated on memcpy and read on default after a spin; its last reference is
    dropped right after the read is queued, and a new tensor of the same size is allocated and
    filled with -1 on memcpy. Without ``record_stream`` the allocator hands the freed block
    straight back to memcpy, whose fill overwrites it before the delayed read. Returns
    ``([sum read], whether the block was reused)``; the sum is N when the tensor stayed alive."""
    device = pool.device
    torch.cuda.synchronize(device)
    with pool.context("memcpy"):
        x = torch.ones(N, device=device)
    pool.wait("default", pool.record("memcpy"))
    with pool.context("default"):
        spin(cycles)
        total = x.sum()
        if record:
            x.record_stream(pool.stream("default"))
    address = x.data_ptr()
    del x
    with pool.context("memcpy"):
        y = torch.empty(N, device=device)
        y.fill_(-1.0)
    reused = y.data_ptr() == address
    torch.cuda.synchronize(device)
    return [total.item()], reused


def test_record_stream_keeps_a_cross_stream_tensor_alive_and_its_absence_races(cuda: torch.device) -> None:
    pool = CudaStreamPool(cuda)
    cycles = spin_cycles(cuda)
    for attempt in range(3):
        total, _ = _reuse_after_free(pool, True, cycles)
        assert total == [float(N)], f"with record_stream, attempt {attempt}: read {total}"
    reuse: list[bool] = []

    def without() -> list[float]:
        total, reused = _reuse_after_free(pool, False, cycles)
        reuse.append(reused)
        return total

    seen = wrong_results(without, [float(N)])
    assert seen[-1] != [float(N)], (
        f"without record_stream the read was right in all {len(seen)} attempts {seen} "
        f"(block reused: {reuse}): this test cannot show a missing record_stream"
    )
