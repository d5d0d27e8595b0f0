"""A pipeline's teardown (``integrations/torchrec/teardown.py``) and the engine's threads: stopped at
``close()`` (idempotent; one inside a draw once the draw returned), when the engine is collected,
and in the order gloo and NCCL need (threads, then input dists moved back, then the groups made,
newest first)."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.engine_fixtures import Toy, drawing, toy_plan
from torchrec_swp.engine import Engine
from torchrec_swp.engine.board import Board
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


def test_an_engine_is_collected_at_the_end_of_data_even_where_a_worker_is_slow_to_drop_its_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's walk says it is at rest before its job returns (the job holds the engine): the
    caller that saw the end of the data must not be left holding an engine that a worker holds too.
    Each worker here sleeps after its last word to the board, as a thread the OS preempted there
    would (once in 300 runs on 2 cores, without the sleep)."""
    changed = Board.changed

    def slow_changed(self: Board, topic: Any = None) -> None:
        changed(self, topic)
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)

    monkeypatch.setattr(Board, "changed", slow_changed)
    ref, threads = _trained_engine(PLANS["io + lookahead 2"]())
    gc.collect()
    assert ref() is None


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


_FORKED_CHILD = """
import gc, os, signal, sys, time
import torch.distributed as dist
from torchrec_swp.integrations.torchrec.teardown import Teardown, known

class Owner:  # a pipeline in a reference cycle: only the garbage collector frees it
    def __init__(self):
        self.me = self
        self.group = dist.new_group(backend="gloo")
        Teardown(self).group(self.group)

dist.init_process_group("gloo", rank=0, world_size=1, init_method=sys.argv[1])
gc.disable()  # the cycle is still there when the child is forked, as at a DataLoader's iter()
owner = Owner()
group = owner.group
del owner
group = None
child = os.fork()
if child == 0:  # a DataLoader worker would now run its garbage collector sooner or later
    gc.collect()
    os._exit(0)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    sys.exit("the forked child hung in its garbage collection for 30 s")
if os.waitstatus_to_exitcode(status) != 0:
    sys.exit(f"the forked child ended with {os.waitstatus_to_exitcode(status)}")
groups = [g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD]
assert len(groups) == 1, groups  # the child destroyed nothing of the parent's
gc.collect()  # the parent collects the pipeline: its teardown destroys the group here
assert not any(g is not dist.group.WORLD for g in dist.distributed_c10d._world.pg_map)
dist.destroy_process_group()
print("child exited; the group destroyed in the parent")
"""


def test_a_dropped_pipelines_group_never_hangs_a_forked_child(tmp_path: Any) -> None:
    """A pipeline dropped in a reference cycle, then a fork (a DataLoader's workers at ``iter()``):
    the child's garbage collector frees the cycle. It must not run the gloo group's destructor
    there (it waits for worker threads the child does not have: the child hung, issue 46) nor the
    teardown (the parent's threads and groups): the group is held (``teardown._HELD``) and
    destroyed by the parent when it collects the pipeline."""
    done = _run_script(tmp_path / "forked.py", _FORKED_CHILD.replace("sys.argv[1]", repr(f"file://{tmp_path}/store")))
    assert "the group destroyed in the parent" in done.stdout


_MID_EPOCH = """
import atexit, sys, threading, time
atexit.register(lambda: print(f"last hook: {time.monotonic() - T0:.2f}s, alive: "
                              f"{[t.name for t in threading.enumerate() if t.name.startswith('swp')]}"))
from tests.unit.engine_fixtures import Toy, toy_plan
from torchrec_swp.engine import Engine
from torchrec_swp.engine.board import Board
from torchrec_swp.plans import with_lookahead
plan = with_lookahead(toy_plan().with_thread_map({"H2D": "io", "Dist": "dist"}), 2)
engine = Engine(plan, Toy(8).bindings(), timeout_s=60)
engine.step()
engine.step()  # a script that stops before its data ends: the workers wait for the next call
T0 = time.monotonic()
"""


def _run_script(script: Path, text: str) -> subprocess.CompletedProcess[str]:
    """``text`` written to ``script`` and run in a fresh interpreter from the repository's root;
    it must exit with 0 (its stderr's tail in the message otherwise)."""
    root = Path(__file__).resolve().parents[2]
    script.write_text(text)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_an_engine_left_mid_epoch_is_stopped_at_exit_at_once_before_finalization(tmp_path: Any) -> None:
    """At exit, the engine's hook interrupts its workers' waits and joins them: the last exit hook
    (registered first, so run last) finds none alive, and exit does not wait for join timeouts
    (before, each worker's 5 s join timed out and the threads lived on into finalization)."""
    done = _run_script(tmp_path / "mid_epoch.py", _MID_EPOCH)
    line = next(x for x in done.stdout.splitlines() if x.startswith("last hook: "))
    seconds, alive = line.removeprefix("last hook: ").split("s, alive: ")
    assert alive == "[]"
    assert float(seconds) < 4.0  # one worker's join timeout is 5 s


class _SlowLoader:
    """Three items at once, then a draw that works for ``slow_s`` (torch ops, each leaving and
    re-taking the GIL, as a loader that collates does); ``in_draw`` is set once it is inside it."""

    def __init__(self, slow_s: float) -> None:
        self.slow_s, self.drawn = slow_s, 0
        self.in_draw = threading.Event()

    def __iter__(self) -> _SlowLoader:
        return self

    def __next__(self) -> int:
        if self.drawn >= 3:
            self.in_draw.set()
            a, end = torch.ones(32, 32), time.monotonic() + self.slow_s
            while time.monotonic() < end:
                a = (a @ a).clamp_(max=1.0)
        self.drawn += 1
        return self.drawn


def _drawing_engine(timeout_s: float) -> Engine:
    return Engine(with_lookahead(toy_plan().with_thread_map({"H2D": "io"}), 2), drawing(Toy(8)), timeout_s=timeout_s)


def test_close_waits_for_a_thread_inside_a_draw() -> None:
    """close() while the io thread is inside a draw returns once the draw returned and the thread
    ended: nothing of the engine runs after close()."""
    engine, loader = _drawing_engine(timeout_s=30), _SlowLoader(1.0)
    engine.step(loader)
    assert loader.in_draw.wait(10)
    threads = engine.worker_threads
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start > 0.5  # it waited for the draw
    assert [t.name for t in threads if t.is_alive()] == []


def test_close_names_a_thread_still_inside_a_task_after_the_engines_timeout() -> None:
    """The wait is bounded by the engine's timeout: a draw that outlasts it is named in a warning."""
    engine, loader = _drawing_engine(timeout_s=0.5), _SlowLoader(2.0)
    engine.step(loader)
    assert loader.in_draw.wait(10)
    threads = engine.worker_threads
    with pytest.warns(RuntimeWarning, match="swp-io still inside a task after 0.5s"):
        engine.close()
    for t in threads:  # the draw ends by itself; the test leaves no thread behind
        t.join(10)


_SLOW_DRAW_AT_EXIT = """
import threading, time
from tests.unit.test_teardown import _SlowLoader, _drawing_engine
engine, loader = _drawing_engine(timeout_s=60), _SlowLoader(6.0)
engine.step(loader)
loader.in_draw.wait(10)
start = time.monotonic()
engine.close()
alive = [t.name for t in threading.enumerate() if t.name.startswith("swp")]
print(f"close: {time.monotonic() - start:.2f}s, alive: {alive}", flush=True)
"""


@pytest.mark.slow
def test_a_script_that_closes_during_a_draw_longer_than_5s_exits_cleanly(tmp_path: Any) -> None:
    """Issue 46: close() joined each worker for 5 s at most and returned with one still inside a
    6 s draw; the script's return then began finalization, the thread's next re-take of the GIL
    ended it by pthread_exit through a torch frame: "terminate called without an active
    exception", exit code 134. Now close() waits for the draw and the script exits with 0."""
    done = _run_script(tmp_path / "slow_draw.py", _SLOW_DRAW_AT_EXIT)
    assert "terminate called" not in done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("close: "))
    seconds, alive = line.removeprefix("close: ").split("s, alive: ")
    assert alive == "[]"
    assert float(seconds) > 5.0  # it waited past the old 5 s join for the 6 s draw
