"""The wires' bounded receives (maglev.runtime), without process groups: a fake work handle
stands for gloo's (``wait(timeout)`` raises RuntimeError once the bound passed, or at once when
the peer closed the connection), a fake stage for upstream's receive queues. The 2-rank cases
are tests/dist/test_pp_failure.py."""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import pytest

from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9")


class FakeWork:
    """A receive's work: ``fails`` = the RuntimeError its wait raises (None: the data came)."""

    def __init__(self, fails: str | None = None) -> None:
        self.fails = fails
        self.waits: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.fails is not None:
            raise RuntimeError(self.fails)
        return True

    def is_completed(self) -> bool:
        return self.fails is None and bool(self.waits)


class FakeStage:
    """Upstream's StageWrapper's receive queues and sends in flight (stage 1 of 3 on ranks 0..2),
    one work per transfer; as upstream's, a send's start puts a new list in flight."""

    def __init__(self, work: FakeWork) -> None:
        self.work = work
        self._recv_act: deque[tuple[list[Any], list[Any]]] = deque()
        self._recv_grad: deque[tuple[list[Any], list[Any]]] = deque()
        self._send_act: list[tuple[Any, Any]] = []
        self._send_grad: list[tuple[Any, Any]] = []

    def start_send_act(self, outputs: tuple[Any, ...]) -> None:
        self._send_act = [(self.work, t) for t in outputs]

    def finish_send_act(self) -> None:
        for w, _ in self._send_act:
            w.wait()  # upstream's: no timeout
        self._send_act.clear()

    def start_send_grad(self, in_activations: tuple[Any, ...]) -> None:
        self._send_grad = [(self.work, t) for t in in_activations]

    def finish_send_grad(self) -> None:
        for w, _ in self._send_grad:
            w.wait()
        self._send_grad.clear()

    def neighbor_rank(self, offset: int) -> int:
        return 1 + offset

    def start_recv_act(self) -> None:
        self._recv_act.append(([self.work], ["activation"]))

    def wait_for_act(self) -> tuple[Any, ...]:
        works, tensors = self._recv_act.popleft()
        for w in works:
            w.wait()  # upstream's: no timeout
        return tuple(tensors)

    def start_recv_grad(self) -> None:
        self._recv_grad.append(([self.work], ["gradient"]))

    def wait_for_grad(self) -> list[Any]:
        works, tensors = self._recv_grad.popleft()
        for w in works:
            w.wait()
        return tensors


def test_upstreams_untimed_wait_on_a_posted_receive_is_bounded_by_the_wire_timeout() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import StageWrapperWire

    work = FakeWork()
    wire = StageWrapperWire(FakeStage(work), timeout_s=7.0)
    wire.post_recv_act(1, 3)
    assert wire.await_act(1, 3) == ("activation",)
    wire.post_recv_grad(1, 3)
    assert wire.await_grad(1, 3) == ["gradient"]
    assert work.waits == [timedelta(seconds=7.0)] * 2


def test_a_receive_past_its_bound_raises_receive_timeout_naming_stage_microbatch_and_peer() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import StageWrapperWire, TransferTimeout

    wire = StageWrapperWire(FakeStage(FakeWork(fails="Timed out waiting 0ms for recv")), timeout_s=0.0)
    wire.post_recv_grad(1, 2)
    expected = r"receive of the gradient for stage 1, microbatch 2 from rank 2: not done within 0s \(engine_timeout_s\)"
    with pytest.raises(TransferTimeout, match=expected):
        wire.await_grad(1, 2)


def test_a_receive_failing_before_its_bound_keeps_its_error_and_names_the_receive() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import StageWrapperWire

    wire = StageWrapperWire(FakeStage(FakeWork(fails="Connection closed by peer")), timeout_s=600.0)
    wire.post_recv_act(1, 0)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        wire.await_act(1, 0)
    assert not isinstance(info.value, TimeoutError)
    assert any("receive of the activation for stage 1, microbatch 0 from rank 0" in n for n in info.value.__notes__)


def test_upstreams_untimed_wait_on_a_send_is_bounded_and_a_send_past_it_names_it() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import StageWrapperWire, TransferTimeout

    work = FakeWork()
    wire = StageWrapperWire(FakeStage(work), timeout_s=7.0)
    wire.send_act(1, 0, ("activation",))
    wire.send_act(1, 1, ("activation",))  # finishes the send of microbatch 0
    wire.send_grad(1, 0, ("input",))
    wire.stage.finish_send_grad()
    assert work.waits == [timedelta(seconds=7.0)] * 2

    wire = StageWrapperWire(FakeStage(FakeWork(fails="Timed out waiting 0ms for send")), timeout_s=0.0)
    wire.send_act(1, 4, ("activation",))
    with pytest.raises(TransferTimeout, match=r"^send of the activation of stage 1, microbatch 4 to rank 2: not done"):
        wire.send_act(1, 5, ("activation",))


def test_a_bounded_work_waits_once() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import BoundedWork

    work = FakeWork()
    bounded = BoundedWork(work, 1.0, "the activation")
    assert bounded.wait() and bounded.wait() and bounded.is_completed()
    assert len(work.waits) == 1  # gloo's second wait on a finished receive waits for another message


def test_a_stage_without_upstreams_receive_queues_is_refused() -> None:
    from torchrec_swp.integrations.torchrec.maglev.runtime import StageWrapperWire

    with pytest.raises(TypeError, match="has no deque _recv_act of work handles"):
        StageWrapperWire(object(), timeout_s=1.0)
