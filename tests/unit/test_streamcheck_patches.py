"""What an installed checker patches in torch, the checked stream pool, and the package boundary."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torchrec_swp.streamcheck import (
    DEFAULT_STREAM,
    CheckedStreamPool,
    Event,
    Stream,
    StreamChecker,
    StreamCheckUsageError,
    UnsyncedAccess,
    active_checker,
    checking,
    stream_check_requested,
)


@pytest.fixture
def checker() -> Iterator[StreamChecker]:
    c = StreamChecker()
    with c:
        yield c


def library_helper(x: torch.Tensor, side: Any) -> torch.Tensor:
    """Like TorchRec's helpers: enters a stream through the device module inside the task."""
    module = torch.get_device_module(x.device)
    with module.stream(side):
        x.record_stream(module.current_stream())
        return x * 2


def test_a_helper_entering_a_stream_has_its_ops_attributed_to_it(checker: StreamChecker) -> None:
    side = checker.stream("side")
    with checker.task("Forward", 7):
        x = torch.ones(3)
        side.wait_stream(torch.cpu.current_stream())
        y = library_helper(x, side)
        assert torch.cpu.current_stream() is checker.default_stream
        y.sum()  # default reads what side wrote, no wait
    (f,) = checker.findings
    assert isinstance(f, UnsyncedAccess)
    assert (f.earlier.stream, f.earlier.op, f.later.stream) == ("side", "aten.mul.Tensor", "default")
    assert (f.earlier.task, f.earlier.batch) == ("Forward", 7)
    del x, y  # y, allocated on side, read on default without record_stream: an early free ...
    assert len(checker.findings) == 1
    with checker.task("Forward", 8), torch.cpu.stream(side):
        torch.ones(3)  # ... once the next allocation on side could get its block
    assert len(checker.findings) == 2
    checker.clear()

    with checker.task("Forward", 9):
        x = torch.ones(3)
        side.wait_stream(torch.cpu.current_stream())
        y = library_helper(x, side)
        current = torch.get_device_module("cpu").current_stream()
        current.wait_stream(side)
        y.record_stream(current)
        y.sum()
    del x, y
    checker.check()


def test_the_helper_reading_an_unsynchronised_input_is_caught(checker: StreamChecker) -> None:
    with checker.task("Forward", 0):
        x = torch.ones(3)  # written on default
        library_helper(x, checker.stream("side"))  # read on side without side waiting for default
    (f,) = checker.findings
    assert isinstance(f, UnsyncedAccess) and (f.earlier.stream, f.later.stream) == ("default", "side")


def test_stream_function_references_taken_before_install_are_covered() -> None:
    cpu_stream, cuda_stream, device_module = torch.cpu.stream, torch.cuda.stream, torch.get_device_module("cpu")
    with checking() as c:
        side = c.stream("side")
        for enter in (cpu_stream, cuda_stream, device_module.stream, torch.cpu.StreamContext):
            with enter(side):
                assert torch.cpu.current_stream() is side
            assert torch.cpu.current_stream() is c.default_stream
        with cpu_stream(None), cuda_stream(None):
            assert torch.cpu.current_stream() is c.default_stream


def test_the_current_stream_is_per_thread(checker: StreamChecker) -> None:
    import threading

    seen: list[Any] = []
    with torch.cpu.stream(checker.stream("side")):
        t = threading.Thread(target=lambda: seen.append(torch.cpu.current_stream()))
        t.start()
        t.join()
    assert seen == [checker.default_stream]


def test_cpu_stream_event_and_synchronize_are_emulated_while_installed() -> None:
    originals = (torch.cpu.Stream, torch.cpu.Event, torch.cpu.stream, torch.cpu.current_stream, torch.cpu.synchronize)
    record_stream = torch.Tensor.record_stream
    with checking() as c:
        assert active_checker() is c
        s = torch.get_device_module("cpu").Stream(priority=-1)
        e = torch.cpu.Event()
        assert isinstance(s, Stream) and s.checker is c and s.device == torch.device("cpu")
        assert isinstance(e, Event) and e.checker is c
        e.record(s)
        assert e.recorded_on is s and s.query() and e.query()
        torch.cpu.synchronize()
        with pytest.raises(StreamCheckUsageError, match="another StreamChecker is installed"):
            StreamChecker().install()
    assert active_checker() is None
    assert (
        torch.cpu.Stream,
        torch.cpu.Event,
        torch.cpu.stream,
        torch.cpu.current_stream,
        torch.cpu.synchronize,
    ) == originals
    assert torch.Tensor.record_stream is record_stream  # what it was before install()
    with pytest.raises(RuntimeError):
        torch.ones(1).record_stream(torch.cpu.Stream())  # torch's own CPU behaviour is back
    with pytest.raises(StreamCheckUsageError, match="needs a checker"):
        Stream()


class ForeignStream:
    device = torch.device("cpu")


def test_user_stream_objects_are_adopted(checker: StreamChecker) -> None:
    user = torch.Stream(device="cpu")
    other = ForeignStream()  # e.g. a torch.cpu.Stream made before installing
    with checker.task("H2D", 0), torch.cpu.stream(user):
        x = torch.ones(2)
        assert torch.cpu.current_stream() is checker.resolve(user)
    with checker.task("Forward", 0), torch.cpu.stream(other):
        checker.resolve(other).wait_stream(user)
        x.record_stream(other)
        x.sum()
    del x
    checker.check()
    assert checker.resolve(user) is not checker.resolve(other)


def test_checked_pool_has_the_engine_protocol_shape(checker: StreamChecker) -> None:
    from torchrec_swp.engine.streams import StreamPool

    user = torch.cpu.Stream()  # emulated here; a foreign object below
    foreign = torch.Stream(device="cpu")
    pool = CheckedStreamPool(checker, {"memcpy": user, "data_dist": foreign, "unused": None})
    members = {m for m in StreamPool.__dict__ if not m.startswith("_")} | set(StreamPool.__annotations__)
    assert members == {"has_streams", "stream", "context", "record", "wait", "thread_init"}
    assert all(hasattr(pool, m) for m in members) and pool.has_streams is True
    assert pool.stream(DEFAULT_STREAM) is checker.default_stream and pool.stream("memcpy") is user
    assert pool.stream("data_dist") is checker.resolve(foreign) is checker.stream("data_dist")
    pool.thread_init()
    with checker.task("H2D", 0), pool.context("memcpy"):
        x = torch.ones(4)
    event = pool.record("memcpy")
    with checker.task("Forward", 0), pool.context(DEFAULT_STREAM):
        pool.wait(DEFAULT_STREAM, event)
        x.sum()
    checker.check()
    with checker.task("Forward", 1), pool.context("data_dist"):
        x.sum()  # data_dist never waited for memcpy
    assert len(checker.findings) == 1


def test_default_stream_name_matches_the_plan() -> None:
    from torchrec_swp.plan import DEFAULT_STREAM as PLAN_DEFAULT

    assert DEFAULT_STREAM == PLAN_DEFAULT


def test_env_switch() -> None:
    assert stream_check_requested({"SWP_STREAM_CHECK": "1"})
    assert not stream_check_requested({"SWP_STREAM_CHECK": "0"}) and not stream_check_requested({})


def test_leaving_a_stream_out_of_order_is_an_error(checker: StreamChecker) -> None:
    a, b = checker.stream("a"), checker.stream("b")
    ctx_a, ctx_b = checker.stream_context(a), checker.stream_context(b)
    ctx_a.__enter__()
    ctx_b.__enter__()
    with pytest.raises(
        StreamCheckUsageError, match="leaving Stream\\('a'\\), but the current stream is Stream\\('b'\\)"
    ):
        ctx_a.__exit__(None, None, None)
    ctx_b.__exit__(None, None, None)
    ctx_a.__exit__(None, None, None)


def test_the_package_imports_neither_torchrec_nor_the_engine() -> None:
    # (the parent package's __init__ imports its own version helper, not TorchRec)
    code = (
        "import sys, torchrec_swp.streamcheck as s\n"
        "bad = [m for m in sys.modules if m == 'torchrec' or m.startswith(('torchrec.', 'torchrec_swp.engine',"
        " 'torchrec_swp.compile', 'torchrec_swp.plan', 'torchrec_swp.integrations.torchrec.pipelines'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


_ABSENT = object()


def _patched_attributes() -> list[tuple[Any, str]]:
    """Every attribute ``patches.TorchPatch`` replaces (its module docstring's table)."""
    cpu = [(torch.cpu, n) for n in ("current_stream", "stream", "StreamContext", "Stream", "Event", "synchronize")]
    tensor = [(torch.Tensor, "record_stream"), (torch.Tensor, "to")]
    return [*cpu, (torch.cuda, "StreamContext"), *tensor, (torch.autograd.Function, "apply")]


def _own(owner: Any, name: str) -> Any:
    """What ``owner`` itself holds under ``name`` (its ``__dict__``: a classmethod or C descriptor
    as it is, not the bound method that attribute access makes)."""
    return vars(owner).get(name, _ABSENT)


def test_uninstall_puts_back_exactly_what_was_there() -> None:
    # torch 2.13 defines Function.apply in Python (a classmethod); torch 2.14 makes it C's
    # _FunctionBase.apply (a classmethod_descriptor, without __func__): either is put back as it was
    attributes = _patched_attributes()
    before = [_own(owner, name) for owner, name in attributes]
    apply_before = vars(torch.autograd.Function)["apply"]
    for _ in range(2):  # a second install patches the originals again, not the first one's patches
        c = StreamChecker().install()
        try:
            patched = {(id(owner), name) for owner, name, _ in c._patch._saved}
            assert patched == {(id(owner), name) for owner, name in attributes}  # the list above is complete
            for (owner, name), old in zip(attributes, before, strict=True):
                assert _own(owner, name) is not old, f"{owner.__name__}.{name} is not patched"
        finally:
            c.uninstall()
        for (owner, name), old in zip(attributes, before, strict=True):
            assert _own(owner, name) is old, f"{owner.__name__}.{name} is not what it was"
    assert vars(torch.autograd.Function)["apply"] is apply_before
    if isinstance(apply_before, classmethod):  # torch 2.13
        assert torch.autograd.Function.apply.__func__ is apply_before.__func__
    else:  # torch 2.14: still C's own descriptor
        assert apply_before is vars(torch._C._FunctionBase)["apply"]


class _Scale(torch.autograd.Function):
    """``x * k`` (k a default argument, which apply binds), its backward noting its stream."""

    seen: list[str] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float = 3.0) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _Scale.seen.append(torch.cpu.current_stream().name)
        return grad * ctx.k, None


class _Square(torch.autograd.Function):
    """``x ** 2`` in the ``setup_context`` style (forward without ctx), which only apply's handling
    of the class applied makes work."""

    seen: list[str] = []

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Square.seen.append(torch.cpu.current_stream().name)
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_a_custom_function_runs_as_itself_and_its_backward_is_tagged(checker: StreamChecker) -> None:
    side = checker.stream("side")
    _Scale.seen.clear()
    _Square.seen.clear()
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with checker.task("Lookup", 0), torch.cpu.stream(side):
        side.wait_stream(checker.default_stream)
        scaled = _Scale.apply(w)  # k from forward's default
        squared = _Square.apply(w)
    assert torch.equal(scaled, torch.tensor([3.0, 6.0])) and torch.equal(squared, torch.tensor([1.0, 4.0]))
    for out in (scaled, squared):
        assert out.grad_fn.metadata["swp_stream"] is side  # tagged by the apply patch
    with checker.task("Backward", 0):
        checker.current_stream().wait_stream(side)
        (scaled.sum() + squared.sum()).backward()
        assert torch.cpu.current_stream() is checker.default_stream
        w.grad.sum()
    assert torch.equal(w.grad, torch.tensor([3.0 + 2.0, 3.0 + 4.0]))
    assert _Scale.seen == ["side"] and _Square.seen == ["side"]  # each backward ran on its forward's stream
    assert checker.stats.backward_nodes >= 2
    checker.check()
