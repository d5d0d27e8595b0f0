"""What the CUDA tests share: a device fixture that skips without CUDA, and a calibrated busy
producer that makes a missing cross-stream wait (or a missing ``record_stream``) visible.

``torch.cuda._sleep(cycles)`` spins one thread on the GPU for ``cycles`` clock cycles on the
current stream. Work queued behind it on that stream starts only when it ends, while work on
another stream starts at once unless it waits for an event recorded after it. With
``SPIN_MS`` (50 ms) against a kernel launch of microseconds, a consumer that is not made to wait
reads the memory before the producer wrote it, on every attempt in practice; the tests still
try a few times and only require one wrong result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

SPIN_MS = 50.0
"""How long a deliberately slow producer (or consumer) spins before touching memory, in ms."""

ATTEMPTS = 5
"""How often a test that must show a wrong result tries before it gives up."""

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
"""Skip (never pass) without CUDA; every module in tests/gpu carries it with the ``cuda`` marker."""


@functools.cache
def _cycles_per_ms(device_index: int) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured with CUDA events."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(1_000)  # loads the kernel; not timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe = 20_000_000  # about 10 ms at 2 GHz
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        elapsed_ms = start.elapsed_time(end)
    if elapsed_ms <= 0:
        raise RuntimeError(f"torch.cuda._sleep({probe}) took {elapsed_ms} ms: cannot calibrate the spin")
    return probe / elapsed_ms


def spin_cycles(device: torch.device, ms: float = SPIN_MS) -> int:
    """Cycles for ``torch.cuda._sleep`` to spin about ``ms`` milliseconds on ``device``."""
    return max(1, int(_cycles_per_ms(device.index if device.index is not None else 0) * ms))


def spin(cycles: int) -> None:
    """Busy the current stream for ``cycles`` GPU clock cycles (asynchronous for the host)."""
    torch.cuda._sleep(cycles)


def wrong_results(run: Callable[[], list[float]], expected: list[float], attempts: int = ATTEMPTS) -> list[list[float]]:
    """Call ``run`` until one of its results differs from ``expected`` (at most ``attempts`` times);
    every result seen. The caller asserts that the last one is wrong."""
    seen: list[list[float]] = []
    for _ in range(attempts):
        seen.append(run())
        if seen[-1] != expected:
            break
    return seen


@pytest.fixture
def cuda() -> torch.device:
    """The current CUDA device; skips the test without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", torch.cuda.current_device())
