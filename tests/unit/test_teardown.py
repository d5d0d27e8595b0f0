"""A pipeline's teardown (``integrations/torchrec/teardown.py``) and the engine's threads: stopped at
``close()`` (idempotent), when the engine is collected, and in the order gloo and NCCL need
(threads, then input dists moved back, then the groups made, newest first)."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import pytest
import torch.distributed as dist

from tests.unit.engine_fixtures import Toy, toy_plan
from torchrec_swp.engine import Engine
from torchrec_swp.integrations.torchrec.teardown import Teardown, known
from torchrec_swp.plans import with_lookahead

PLANS = {
    "per_task": lambda: toy_plan().with_thread_map("per_task"),
    "io + lookahead 2": lambda: with_lookahead(toy_plan().with_thread_map({"H2D": "io", "Dist": "dist"}), 2),
}


def _trained_engine(plan: Any) -> tuple[weakref.ref[Engine], list[Any]]:
    engine = Engine(plan, Toy(8).bindings(), timeout_s=5)
    assert len(engine.run_to_end()) == 8
    threads = engine.worker_threads
    assert threads and all(t.is_alive() for t in threads)
    return weakref.ref(engine), threads


@pytest.mark.parametrize("name", PLANS)
def test_an_engine_whose_data_ended_is_collected_and_stops_its_threads(name: str) -> None:
    """Nothing but the caller holds an engine once its data ended: dropped, the garbage collector
    takes it and its finalizer joins its threads (a worker kept its last job, which holds the
    engine, until it got the next one)."""
    ref, threads = _trained_engine(PLANS[name]())
    gc.collect()
    assert ref() is None
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t.name for t in threads if t.is_alive()] == []


def test_close_stops_every_thread_even_one_waiting_mid_epoch_and_is_idempotent() -> None:
    """Mid-epoch, with lookahead, the workers wait on the board for the next call: close()
    interrupts that wait and joins them, at once; closing again does nothing."""
    engine = Engine(PLANS["io + lookahead 2"](), Toy(8).bindings(), timeout_s=30)
    engine.step()
    engine.step()
    threads = engine.worker_threads
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 5  # not a join timing out: the wait was interrupted
    assert [t.name for t in threads if t.is_alive()] == []
    engine.close()
    assert engine.stop_threads.alive is False


class _Owner:
    pass


def test_teardown_stops_threads_then_undoes_then_destroys_newest_first_once() -> None:
    """The order: every thread stop (newest first), then each group's undo, newest group first.
    Groups torch.distributed does not know (here: no process group at all) are not destroyed."""
    calls: list[str] = []
    owner = _Owner()
    teardown = Teardown(owner)
    teardown.threads(lambda: calls.append("stop engine 1"))
    teardown.group("group A", lambda: calls.append("undo A"))  # type: ignore[arg-type]
    teardown.threads(lambda: calls.append("stop engine 2"))
    teardown.group("group B", lambda: calls.append("undo B"))  # type: ignore[arg-type]
    teardown()
    teardown()
    assert calls == ["stop engine 2", "stop engine 1", "undo B", "undo A"]
    assert teardown.done


def test_teardown_runs_when_its_owner_is_collected() -> None:
    calls: list[str] = []
    owner = _Owner()
    teardown = Teardown(owner)
    teardown.threads(lambda: calls.append("stopped"))
    del owner
    gc.collect()
    assert calls == ["stopped"] and teardown.done


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a default process group")
def test_teardown_destroys_the_groups_it_made_and_leaves_the_default_group(tmp_path: Any) -> None:
    """A real gloo world of one: the group made is destroyed, the default group is untouched; a
    group that destroy_process_group() already took is left alone (no error)."""
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    try:
        made, other = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        owner = _Owner()
        teardown = Teardown(owner)
        teardown.group(made)
        teardown.group(other)
        dist.destroy_process_group(other)  # the user destroyed it first
        teardown()
        assert not known(made) and not known(other)
        assert known(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


_MID_EPOCH = """
import atexit, sys, threading, time
atexit.register(lambda: print(f"last hook: {time.monotonic() - T0:.2f}s, alive: "
                              f"{[t.name for t in threading.enumerate() if t.name.startswith('swp')]}"))
from tests.unit.engine_fixtures import Toy, toy_plan
from torchrec_swp.engine import Engine
from torchrec_swp.plans import with_lookahead
plan = with_lookahead(toy_plan().with_thread_map({"H2D": "io", "Dist": "dist"}), 2)
engine = Engine(plan, Toy(8).bindings(), timeout_s=60)
engine.step()
engine.step()  # a script that stops before its data ends: the workers wait for the next call
T0 = time.monotonic()
"""


def test_an_engine_left_mid_epoch_is_stopped_at_exit_at_once_before_finalization(tmp_path: Any) -> None:
    """At exit, the engine's hook interrupts its workers' waits and joins them: the last exit hook
    (registered first, so run last) finds none alive, and exit does not wait for join timeouts
    (before, each worker's 5 s join timed out and the threads lived on into finalization)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "mid_epoch.py"
    script.write_text(_MID_EPOCH)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("last hook: "))
    seconds, alive = line.removeprefix("last hook: ").split("s, alive: ")
    assert alive == "[]"
    assert float(seconds) < 4.0  # one worker's join timeout is 5 s
