"""The stream checker across CPU threads: host order of event records and waits, lanes of one
stream enqueued by two threads, frees on another thread, and the cpu_release/cpu_acquire hooks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from torchrec_swp.streamcheck import EarlyFree, HostOrder, StreamChecker, UnsyncedAccess


@pytest.fixture
def checker() -> Iterator[StreamChecker]:
    c = StreamChecker()
    with c:
        yield c


def on_thread(fn: Callable[[], Any], name: str = "io") -> Any:
    """Run ``fn`` on a new thread and return its result (the join is a real host edge that the
    checker is not told about: the tests say it with cpu_release/cpu_acquire where they mean it)."""
    out: list[Any] = []
    errors: list[Exception] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 (re-raised on the caller)
            errors.append(e)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0] if out else None


def h2d(c: StreamChecker, batch: int = 0, release: str | None = None) -> tuple[torch.Tensor, Any]:
    """On the calling thread: write a tensor on memcpy, record an event, optionally release."""
    with c.task("H2D", batch), torch.cpu.stream(c.stream("memcpy")):
        x = torch.full((2, 3), float(batch))
        event = c.stream("memcpy").record_event()
    if release is not None:
        c.cpu_release(release)
    return x, event


def test_event_recorded_on_another_thread_and_released_is_clean(checker: StreamChecker) -> None:
    x, event = on_thread(lambda: h2d(checker, release="H2D 0"))
    checker.cpu_acquire("H2D 0")
    with checker.task("Forward", 0):
        event.wait()
        x.sum()
    checker.check()


def test_event_waited_without_a_host_edge_from_its_record_is_caught(checker: StreamChecker) -> None:
    x, event = on_thread(lambda: h2d(checker))  # recorded before in real time, but nothing orders it
    with checker.task("Forward", 0):
        event.wait()
        x.sum()
    host, race = checker.findings
    assert isinstance(host, HostOrder) and host.recorder is not None
    assert "stream 'default' waits on" in str(host) and "task H2D batch 0 (thread io)" in str(host)
    assert "in task Forward batch 0 (thread MainThread)" in str(host)
    assert isinstance(race, UnsyncedAccess)  # such a wait orders nothing
    assert (race.earlier.thread, race.later.thread) == ("io", "MainThread")


def test_waiting_on_an_event_before_it_is_recorded_is_caught(checker: StreamChecker) -> None:
    event = checker.event()
    with checker.task("Forward", 0):
        checker.current_stream().wait_event(event)
    event.record(checker.stream("memcpy"))
    (f,) = checker.findings
    assert isinstance(f, HostOrder) and f.recorder is None and "never recorded" in str(f)


def test_host_synchronise_with_an_unordered_event_is_caught(checker: StreamChecker) -> None:
    _, event = on_thread(lambda: h2d(checker))
    event.synchronize()
    assert event.query()  # a query never reports
    (f,) = checker.findings
    assert isinstance(f, HostOrder) and "the host synchronises with" in str(f)


def test_one_stream_enqueued_by_two_threads_needs_a_host_edge(checker: StreamChecker) -> None:
    def producer() -> torch.Tensor:
        with checker.task("Dist", 0):  # on the default stream, thread io
            y = torch.ones(5)
        checker.cpu_release("Dist 0")
        return y

    y = on_thread(producer)
    with checker.task("Forward", 0):
        y.sum()  # default stream, main thread: nothing orders the two enqueues
    (f,) = checker.findings
    assert isinstance(f, UnsyncedAccess) and f.earlier.stream == f.later.stream == "default"
    assert "enqueued by threads io and MainThread with no CPU-side edge" in str(f)

    checker.clear()
    y = on_thread(producer)
    checker.cpu_acquire("Dist 0")
    with checker.task("Forward", 0):
        y.sum()
    checker.check()


def test_wait_stream_sees_only_work_the_thread_knows_enqueued(checker: StreamChecker) -> None:
    x, _ = on_thread(lambda: h2d(checker, release="H2D 0"))
    with checker.task("Forward", 0):
        checker.current_stream().wait_stream(checker.stream("memcpy"))  # the copy is not known here
        x.sum()
    assert [type(f) for f in checker.findings] == [UnsyncedAccess]

    checker.clear()
    y, _ = on_thread(lambda: h2d(checker, batch=1, release="H2D 1"))
    checker.cpu_acquire("H2D 1")
    with checker.task("Forward", 1):
        checker.current_stream().wait_stream(checker.stream("memcpy"))
        y.sum()
    checker.check()


def test_a_free_on_another_thread_uses_that_thread_knowledge(checker: StreamChecker) -> None:
    memcpy = checker.stream("memcpy")
    for batch, tell in ((0, False), (1, True)):
        holder = list(on_thread(lambda b=batch: h2d(checker, b, release=f"H2D {b}")))
        checker.cpu_acquire(f"H2D {batch}")
        with checker.task("Forward", batch):
            checker.current_stream().wait_stream(memcpy)
            holder[0].sum()
        checker.cpu_release(f"Forward {batch}")

        def drop(b: int = batch, tell: bool = tell, holder: list[Any] = holder) -> None:
            if tell:
                checker.cpu_acquire(f"Forward {b}")
            with checker.task("H2D", b + 1), torch.cpu.stream(memcpy):
                memcpy.wait_stream(checker.default_stream)  # knows Forward's read only if told
                holder.clear()

        on_thread(drop)
    (f,) = checker.findings
    assert isinstance(f, EarlyFree) and f.use.batch == 0 and "freed in task H2D batch 1 (thread io)" in str(f)


def test_concurrent_threads_with_hand_offs_stay_clean(checker: StreamChecker) -> None:
    """Two threads run at once, handing batches over through a queue with release/acquire."""
    import queue

    handoff: queue.SimpleQueue[tuple[int, torch.Tensor]] = queue.SimpleQueue()
    n = 20

    def producer() -> None:
        memcpy = checker.stream("memcpy")
        for b in range(n):
            with checker.task("H2D", b), torch.cpu.stream(memcpy):
                x = torch.randn(8, 8) + b
            checker.cpu_release(("H2D", b))
            handoff.put((b, x))

    t = threading.Thread(target=producer, name="io")
    t.start()
    total = torch.zeros(8)
    for _ in range(n):
        b, x = handoff.get()
        checker.cpu_acquire(("H2D", b))
        with checker.task("Forward", b):
            current = torch.cpu.current_stream()
            current.wait_stream(checker.stream("memcpy"))
            x.record_stream(current)
            total += x.sum(0)
        del x
    t.join()
    checker.check()
    assert checker.stats.ops >= 3 * n
