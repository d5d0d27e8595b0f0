"""The stream checker on one thread: unsynchronised accesses and early frees, caught and clean."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchrec_swp.streamcheck import (
    EarlyFree,
    StreamChecker,
    StreamCheckError,
    UnsyncedAccess,
)


@pytest.fixture
def checker() -> Iterator[StreamChecker]:
    c = StreamChecker()
    with c:
        yield c


def produce(c: StreamChecker, batch: int = 0, stream: str = "memcpy") -> torch.Tensor:
    """H2D-like task: a fresh tensor written on ``stream``."""
    with c.task("H2D", batch), torch.cpu.stream(c.stream(stream)):
        return torch.ones(4, 8).mul_(batch + 1)


def copied_and_read(c: StreamChecker, batch: int = 0) -> torch.Tensor:
    """``produce`` on memcpy, then read on default after waiting for memcpy (no record_stream)."""
    x = produce(c, batch=batch)
    with c.task("Forward", batch):
        c.current_stream().wait_stream(c.stream("memcpy"))
        x.sum()
    return x


def only(c: StreamChecker) -> UnsyncedAccess | EarlyFree:
    assert len(c.findings) == 1, c.findings
    return c.findings[0]


def test_read_without_wait_is_caught_naming_both_accesses(checker: StreamChecker) -> None:
    x = produce(checker, batch=3)
    with checker.task("Forward", 3):
        x.sum()
    f = only(checker)
    assert isinstance(f, UnsyncedAccess) and f.kind == "W/R"
    assert (f.earlier.task, f.earlier.batch, f.earlier.stream, f.earlier.op) == ("H2D", 3, "memcpy", "aten.mul_.Tensor")
    assert (f.later.task, f.later.batch, f.later.stream, f.later.op) == ("Forward", 3, "default", "aten.sum.default")
    assert f.earlier.shape == f.later.shape == (4, 8)
    text = str(f)
    assert "task H2D batch 3 on stream 'memcpy'" in text and "task Forward batch 3 on stream 'default'" in text
    with pytest.raises(StreamCheckError, match=r"1 distinct finding\(s\), 1 in all"):
        checker.check()


def test_wait_stream_orders_the_read(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("Forward", 0):
        torch.cpu.current_stream().wait_stream(checker.stream("memcpy"))
        x.sum()
    checker.check()


def test_event_record_and_wait_order_the_read(checker: StreamChecker) -> None:
    x = produce(checker)
    event = checker.stream("memcpy").record_event()
    with checker.task("Forward", 0):
        event.wait()  # on the current stream
        x.sum()
    y = produce(checker, batch=1)
    event = checker.event()
    event.record(checker.stream("memcpy"))
    with checker.task("Forward", 1):
        checker.default_stream.wait_event(event)
        y.sum()
    checker.check()


def test_a_wait_recorded_before_the_write_does_not_order_it(checker: StreamChecker) -> None:
    early = checker.stream("memcpy").record_event()
    x = produce(checker)
    with checker.task("Forward", 0):
        checker.default_stream.wait_event(early)
        x.sum()
    assert isinstance(only(checker), UnsyncedAccess)


def test_the_same_stream_is_ordered(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("Consumer", 0), torch.cpu.stream(checker.stream("memcpy")):
        x.add_(1).sum()
    checker.check()


def test_write_after_read_is_caught_and_ordered_by_a_wait(checker: StreamChecker) -> None:
    memcpy = checker.stream("memcpy")
    buffer = produce(checker)
    with checker.task("Forward", 0):
        memcpy_done = memcpy.record_event()
        checker.current_stream().wait_event(memcpy_done)
        buffer.sum()  # read on default
    with checker.task("H2D", 1), torch.cpu.stream(memcpy):
        buffer.copy_(torch.zeros(4, 8))  # in-place refill while default may still read it
    f = only(checker)
    assert isinstance(f, UnsyncedAccess) and f.kind == "R/W"
    assert (f.earlier.task, f.earlier.stream, f.later.task, f.later.stream) == ("Forward", "default", "H2D", "memcpy")
    assert f.later.arg == "self" and f.later.op == "aten.copy_.default"

    checker.clear()
    with checker.task("Forward", 1):
        memcpy.wait_stream(memcpy)  # a no-op
        checker.current_stream().wait_stream(memcpy)
        buffer.sum()
    with checker.task("H2D", 2), torch.cpu.stream(memcpy):
        memcpy.wait_stream(checker.default_stream)
        buffer.copy_(torch.zeros(4, 8))
    checker.check()


def test_write_write_on_two_streams(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("Other", 0), torch.cpu.stream(checker.stream("side")):
        x.fill_(2)
    f = only(checker)
    assert isinstance(f, UnsyncedAccess) and f.kind == "W/W"
    assert (f.earlier.stream, f.later.stream) == ("memcpy", "side")


def test_a_view_shares_its_base_storage(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("Forward", 0):
        x.view(32)[:4].sum()  # views are no accesses; the read through them is
    f = only(checker)
    assert isinstance(f, UnsyncedAccess) and f.later.shape == (4,)


def test_ops_outside_tasks_are_not_recorded(checker: StreamChecker) -> None:
    with torch.cpu.stream(checker.stream("memcpy")):
        x = torch.ones(3)
    x.sum()
    checker.check()
    assert checker.stats.ops == 0


def test_early_free_without_record_stream_is_caught(checker: StreamChecker) -> None:
    x = copied_and_read(checker, batch=5)
    with checker.task("Drop", 5):
        del x
    checker.check()  # freed, but nothing can have its block yet
    produce(checker, batch=6)  # the next allocation on memcpy, not ordered after Forward's read
    f = only(checker)
    assert isinstance(f, EarlyFree) and f.alloc_stream == "memcpy" and f.nbytes == 4 * 8 * 4
    assert (f.use.task, f.use.batch, f.use.stream, f.use.kind) == ("Forward", 5, "default", "read")
    text = str(f)
    assert "freed in task Drop batch 5" in text and "record_stream('default')" in text
    assert "next allocation on 'memcpy', aten.ones.default (output [4, 8]) in task H2D batch 6" in text


def test_a_wait_between_the_free_and_the_next_allocation_makes_it_safe(checker: StreamChecker) -> None:
    memcpy = checker.stream("memcpy")
    x = copied_and_read(checker)
    del x  # freed before memcpy waited for the read: pending
    with checker.task("H2D", 1), torch.cpu.stream(memcpy):
        memcpy.wait_stream(checker.default_stream)
        torch.ones(4, 8)  # ordered after the read: the block is safe to reuse
        torch.ones(4, 8)
    checker.check()
    assert checker.stats.frees_pending == 1


def test_an_allocation_of_the_other_pool_cannot_get_the_block(checker: StreamChecker) -> None:
    x = copied_and_read(checker)
    del x
    with checker.task("H2D", 1), torch.cpu.stream(checker.stream("memcpy")):
        torch.empty(1 << 19).fill_(1.0)  # 2 MiB: the large pool, not the freed 128-byte block's
    checker.check()
    produce(checker, batch=2)
    assert isinstance(only(checker), EarlyFree)


def test_record_stream_keeps_the_block(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("Forward", 0):
        current = torch.cpu.current_stream()
        current.wait_stream(checker.stream("memcpy"))
        x.record_stream(current)
        x.sum()
    del x
    checker.check()
    assert checker.stats.storages_freed >= 1


def test_a_wait_of_the_allocation_stream_or_a_host_sync_covers_the_free(checker: StreamChecker) -> None:
    memcpy = checker.stream("memcpy")
    x = copied_and_read(checker)
    memcpy.wait_stream(checker.default_stream)  # the next copy waits for Forward: the block is safe
    del x
    y = produce(checker, batch=1)
    with checker.task("Forward", 1):
        checker.current_stream().wait_stream(memcpy)
        y.sum()
    torch.cpu.synchronize()
    del y
    checker.check()


def test_item_synchronises_the_host_with_the_current_stream(checker: StreamChecker) -> None:
    x = produce(checker)
    with checker.task("H2D", 0), torch.cpu.stream(checker.stream("memcpy")):
        x.sum().item()  # a device-to-host copy: the host knows memcpy's work completed
    with checker.task("Forward", 0):
        x.sum()
    checker.check()


def test_repeats_are_counted_once(checker: StreamChecker) -> None:
    for b in range(4):
        x = produce(checker, batch=b)
        with checker.task("Forward", b):
            checker.current_stream().wait_stream(checker.stream("memcpy"))
            x.record_stream(checker.current_stream())
            x.sum()
        with checker.task("Backward", b), torch.cpu.stream(checker.stream("side")):
            x.sum()  # no wait of side on memcpy (and no record_stream(side): an early free too)
    kinds = [type(f).__name__ for f in checker.findings]
    # x of batch b is freed after batch b+1 was allocated, so batch b+2's allocation decides it:
    # batches 0 and 1
    assert kinds == ["UnsyncedAccess", "EarlyFree"] and checker.counts == [4, 2]
    f = checker.findings[0]
    assert isinstance(f, UnsyncedAccess) and f.later.task == "Backward" and f.later.batch == 0  # the first is kept


def test_fail_fast_raises_at_the_op() -> None:
    with StreamChecker(fail_fast=True) as c:
        x = produce(c)
        with pytest.raises(StreamCheckError, match="unsynchronised W/R"), c.task("Forward", 0):
            x.sum()


def test_a_clean_training_step_reports_nothing(checker: StreamChecker) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memcpy = checker.stream("memcpy")
    for b in range(3):
        with checker.task("H2D", b), torch.cpu.stream(memcpy):
            batch = torch.randn(4, 8).clone()
        with checker.task("Train", b):
            current = torch.cpu.current_stream()
            current.wait_stream(memcpy)
            batch.record_stream(current)
            loss = model(batch).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        del batch
    checker.check()
    assert checker.stats.ops > 50


class _Probe(torch.autograd.Function):
    """Identity whose backward notes the stream it runs on."""

    seen: list[str] = []

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        _Probe.seen.append(torch.cpu.current_stream().name)
        return grad * 1


def test_backward_ops_run_on_their_forward_ops_stream(checker: StreamChecker) -> None:
    """As CUDA autograd: a node made on 'side' runs its backward on 'side', after the current
    stream's work, and the current stream's later work waits for it."""
    side = checker.stream("side")
    w = torch.ones(4, requires_grad=True)
    _Probe.seen.clear()
    with checker.task("Lookup", 0), torch.cpu.stream(side):
        side.wait_stream(checker.default_stream)
        h = torch.full((4,), 2.0)  # allocated on side, saved for mul's backward
        y = _Probe.apply(w * h)
    with checker.task("Forward", 0):
        checker.current_stream().wait_stream(side)
        y.record_stream(checker.current_stream())
        loss = (y * 3).sum()
    with checker.task("Backward", 0):
        loss.backward()  # mul's backward reads h on side; w.grad is accumulated on default
        w.grad.sum()  # default waited for side's backward ops
        del h, y, loss
    with checker.task("Lookup", 1), torch.cpu.stream(side):
        torch.full((4,), 2.0)  # may reuse h's block: h was only used on side
    assert _Probe.seen == ["side"]
    assert checker.stats.backward_nodes >= 2
    checker.check()


def test_only_host_reads_synchronise_the_host(checker: StreamChecker) -> None:
    """``.item()`` waits for the stream; an ``_local_scalar_dense`` a CPU kernel runs inside
    (CUDA kernels do not) is no synchronisation."""
    x = produce(checker)
    with checker.task("H2D", 0), torch.cpu.stream(checker.stream("memcpy")):
        torch.ops.aten._local_scalar_dense.default(x.sum())  # as a CPU kernel's internals do
    with checker.task("Forward", 0):
        x.sum()
    assert isinstance(only(checker), UnsyncedAccess)


def test_skip_sync_ignores_the_chosen_call_sites(checker: StreamChecker) -> None:
    sites: list[tuple[str, str]] = []

    def skip(kind: str, site: str) -> bool:
        sites.append((kind, site))
        return kind == "wait_stream"

    checker.skip_sync = skip
    x = produce(checker)
    with checker.task("Forward", 0):
        torch.cpu.current_stream().wait_stream(checker.stream("memcpy"))  # skipped: the read is unordered
        x.sum()
    assert isinstance(only(checker), UnsyncedAccess)
    ((kind, site),) = sites
    assert kind == "wait_stream" and site.startswith(__file__.removesuffix("c") + ":")
