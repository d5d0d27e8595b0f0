"""The engine on real CUDA streams: a two-stream plan, H2D on the memcpy stream, its consumer on
the default stream one stage later, on one thread ("main") and on a thread per stream
("by_stream").

* The engine's cross-stream wait is what orders the consumer after the copy: the same run with
  the pool's ``wait`` removed reads the destination before the (slow) copy wrote it.
* A tensor the engine hands across streams and then drops (the slot of a delivered batch) is
  kept alive for the consumer by ``record_stream``, as TorchRec's ``_wait_for_batch`` does;
  without it the next batch's copy reuses the block under the (slow) consumer's feet.

Without CUDA every test here is skipped.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.gpu.cuda_race import requires_cuda, spin, spin_cycles, wrong_results
from torchrec_swp.engine import CudaStreamPool, Engine
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule

pytestmark = [pytest.mark.cuda, requires_cuda]

N = 1 << 20
"""Elements per batch (4 MiB of float32); batch b holds the value b + 1 everywhere."""

BATCHES = 6
THREAD_MAPS = ("main", "by_stream")


def h2d_consume_plan(thread_map: str) -> PipelinePlan:
    """H2D(b) on memcpy at stage 0, Consume(b) on the default stream at stage 1; Consume fires
    first in an iteration (as the pipelines' compute does), so Consume(b) is issued right after
    H2D(b) was, and only the engine's event between the streams orders them on the device."""
    s = TaskSchedule
    return PipelinePlan(
        schedule={"Consume": s(1), "H2D": s(0, "memcpy")},
        tasks=[PipelineTask("H2D", writes=("x",)), PipelineTask("Consume", reads=("x",), writes=("total",))],
        source="H2D",
        output="total",
        name="h2d_consume",
    ).with_thread_map(thread_map)


class _NoWaitPool(CudaStreamPool):
    """The real pool with its cross-stream wait removed: what a missing wait does."""

    def wait(self, name: str, event: Any) -> None:
        return None


class _Workload:
    """Task functions for ``h2d_consume_plan``; host batches are pinned, so copies are asynchronous.

    ``slow="producer"``: H2D spins on memcpy, then copies into a zeroed buffer allocated up front;
    Consume sums at once. ``slow="consumer"``: H2D copies into a tensor it allocates on memcpy;
    Consume (optionally ``record_stream``-ing it) spins on default, then sums.
    """

    def __init__(self, pool: CudaStreamPool, slow: str, record_stream: bool = False) -> None:
        self.pool, self.slow, self.record_stream = pool, slow, record_stream
        self.device = pool.device
        self.cycles = spin_cycles(self.device)
        self.host = [torch.full((N,), float(b + 1)).pin_memory() for b in range(BATCHES)]
        self.zeroed = [torch.zeros(N, device=self.device) for _ in range(BATCHES)] if slow == "producer" else []
        self.seen: list[tuple[str, Any, str]] = []  # (task, current stream, thread name)
        self.addresses: list[int] = []
        torch.cuda.synchronize(self.device)

    def _note(self, task: str) -> None:
        self.seen.append((task, torch.cuda.current_stream(self.device), threading.current_thread().name))

    def h2d(self, b: int) -> torch.Tensor:
        if b >= BATCHES:
            raise StopIteration
        self._note("H2D")
        if self.slow == "producer":
            spin(self.cycles)
            return self.zeroed[b].copy_(self.host[b], non_blocking=True)
        x = torch.empty(N, device=self.device)
        self.addresses.append(x.data_ptr())
        return x.copy_(self.host[b], non_blocking=True)

    def consume(self, b: int, x: torch.Tensor) -> torch.Tensor:
        self._note("Consume")
        if self.slow == "consumer":
            if self.record_stream:
                x.record_stream(torch.cuda.current_stream(self.device))
            spin(self.cycles)
        return x.sum()

    def run(self, thread_map: str) -> list[float]:
        engine = Engine(h2d_consume_plan(thread_map), {"H2D": self.h2d, "Consume": self.consume}, streams=self.pool)
        try:
            totals = engine.run_to_end()
        finally:
            engine.close()
        torch.cuda.synchronize(self.device)
        return [t.item() for t in totals]


EXPECTED = [float(N * (b + 1)) for b in range(BATCHES)]


def _assert_streams_and_threads(work: _Workload, thread_map: str) -> None:
    pool = work.pool
    main = threading.main_thread().name
    for task, stream, thread in work.seen:
        assert stream == pool.stream("memcpy" if task == "H2D" else "default"), f"{task} ran on {stream}"
        on_main = thread == main
        assert on_main == (thread_map == "main" or task == "Consume"), f"{task} ran on thread {thread} ({thread_map})"


@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_engine_wait_orders_the_consumer_after_a_slow_copy(cuda: torch.device, thread_map: str) -> None:
    for attempt in range(2):
        work = _Workload(CudaStreamPool(cuda), slow="producer")
        assert work.run(thread_map) == EXPECTED, f"{thread_map}, attempt {attempt}"
        _assert_streams_and_threads(work, thread_map)
    seen = wrong_results(lambda: _Workload(_NoWaitPool(cuda), slow="producer").run(thread_map), EXPECTED)
    assert seen[-1] != EXPECTED, (
        f"{thread_map}: with the pool's wait removed every consumer still read the copy, in all "
        f"{len(seen)} attempts: this test cannot show a missing wait"
    )


@pytest.mark.parametrize("thread_map", THREAD_MAPS)
def test_record_stream_keeps_a_dropped_batch_alive_for_a_slow_consumer(cuda: torch.device, thread_map: str) -> None:
    for attempt in range(2):
        work = _Workload(CudaStreamPool(cuda), slow="consumer", record_stream=True)
        assert work.run(thread_map) == EXPECTED, f"{thread_map}, attempt {attempt}"
        _assert_streams_and_threads(work, thread_map)
    reused: list[int] = []

    def without() -> list[float]:
        work = _Workload(CudaStreamPool(cuda), slow="consumer", record_stream=False)
        totals = work.run(thread_map)
        reused.append(BATCHES - len(set(work.addresses)))
        return totals

    seen = wrong_results(without, EXPECTED)
    assert seen[-1] != EXPECTED, (
        f"{thread_map}: without record_stream every consumer read its own batch in all {len(seen)} attempts "
        f"(blocks reused per attempt: {reused}): this test cannot show a missing record_stream"
    )
