"""One rank's pipeline-parallel program on the engine (ProgramEngine.run_program): threads,
dependencies, tickets, failures on any thread, timeouts that report positions, no hang.

The ranks here are toy ones in one process: bindings record what ran where, and a fake wire
(one queue per channel) carries numbers between two ranks run on two Python threads.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from torchrec_swp.compile import IterationProgram, Run, RunAction, Signal, WaitTask, format_program
from torchrec_swp.engine import CollectiveAborted, EngineError, EngineTimeout, ProgramEngine
from torchrec_swp.pp import build
from torchrec_swp.pp.actions import Action
from torchrec_swp.pp.builders import maglev_1f1b
from torchrec_swp.pp.lower_rank import lower_rank

KINDS = ("F", "E", "B", "I", "W", "SF", "RF", "SB", "RB", "G", "O")


class Recorder:
    """Bindings for every kind that record (action, thread) in the order they ran."""

    def __init__(self, fail: str | None = None, exc: type[BaseException] = ValueError) -> None:
        self.ran: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.fail = fail
        self.exc = exc

    def bindings(self) -> dict[str, Callable[[int, int | None], None]]:
        def bind(kind: str) -> Callable[[int, int | None], None]:
            def fn(stage: int, mb: int | None) -> None:
                action = f"{stage}{kind}{'' if mb is None else mb}"
                if action == self.fail:
                    raise self.exc(f"boom in {action}")
                with self.lock:
                    self.ran.append((action, threading.current_thread().name))

            return fn

        return {k: bind(k) for k in KINDS}


def test_a_rank_runs_every_action_once_on_its_thread_in_dependency_order() -> None:
    program = build("1F1B", 2, 4, recv_ahead=1)
    for rank in range(2):
        lowered = lower_rank(program, rank)
        rec = Recorder()
        engine = ProgramEngine(rec.bindings(), name=f"r{rank}", timeout_s=10)
        try:
            for _ in range(3):  # three steps: workers are reused, latches are fresh each step
                rec.ran.clear()
                engine.run_program(lowered)
                actions = program.ranks[rank]
                assert sorted(a for a, _ in rec.ran) == sorted(map(str, actions))
                at = {a: k for k, (a, _) in enumerate(rec.ran)}
                for a in actions:
                    thread = dict(rec.ran)[str(a)]
                    assert thread.endswith("-comm") == a.is_p2p, (a, thread)
                    if a.kind.value in ("SF", "SB"):  # a send after the compute it sends
                        producer = "F" if a.kind.value == "SF" else "B"
                        assert at[f"{a.stage}{producer}{a.microbatch}"] < at[str(a)]
                    if a.kind.value in ("RF", "RB"):  # a receive posted before its consumer
                        consumer = "F" if a.kind.value == "RF" else "B"
                        assert at[str(a)] < at[f"{a.stage}{consumer}{a.microbatch}"]
                compute = [str(a) for a in actions if not a.is_p2p]
                assert [a for a, _ in rec.ran if a in set(compute)] == compute  # program order
            assert engine.steps == 3
        finally:
            engine.close()


class Wire:
    """Channels between toy ranks: a posted receive gets the value its sender put."""

    def __init__(self) -> None:
        self.channels: dict[tuple[str, int, int], queue.Queue[float]] = {}
        self.lock = threading.Lock()

    def channel(self, direction: str, stage: int, mb: int) -> queue.Queue[float]:
        with self.lock:
            return self.channels.setdefault((direction, stage, mb), queue.Queue())


class ToyRank:
    """Stage ``s`` computes ``y = w_s * x``; loss ``y``; ``dx = w_s * dy``, ``dw_s += x * dy``.

    Receives are posts: the consumer waits for the value (as the torch bindings do)."""

    def __init__(self, wire: Wire, placement: tuple[int, ...], inputs: list[float], weights: list[float]) -> None:
        self.wire, self.S, self.inputs, self.w = wire, len(placement), inputs, weights
        self.placement = placement
        self.x: dict[tuple[int, int], float] = {}
        self.dy: dict[tuple[int, int], float] = {}
        self.dx: dict[tuple[int, int], float] = {}
        self.grad = [0.0] * self.S
        self.posted: dict[tuple[str, int, int], queue.Queue[float]] = {}

    def bindings(self) -> dict[str, Callable[..., None]]:
        def f(s: int, m: int) -> None:
            if s == 0:
                x = self.inputs[m]
            elif self.placement[s - 1] == self.placement[s]:  # the previous stage is here
                x = self.w[s - 1] * self.x[(s - 1, m)]
            else:
                x = self.posted.pop(("F", s, m)).get(timeout=5)
            self.x[(s, m)] = x

        def i(s: int, m: int) -> None:
            if s == self.S - 1:
                dy = 1.0
            elif self.placement[s + 1] == self.placement[s]:
                dy = self.dx[(s + 1, m)]
            else:
                dy = self.posted.pop(("B", s, m)).get(timeout=5)
            self.dy[(s, m)] = dy
            self.dx[(s, m)] = self.w[s] * dy

        def w(s: int, m: int) -> None:
            self.grad[s] += self.x[(s, m)] * self.dy[(s, m)]

        def b(s: int, m: int) -> None:
            i(s, m)
            w(s, m)

        def sf(s: int, m: int) -> None:
            self.wire.channel("F", s + 1, m).put(self.w[s] * self.x[(s, m)])

        def sb(s: int, m: int) -> None:
            self.wire.channel("B", s - 1, m).put(self.dx[(s, m)])

        def rf(s: int, m: int) -> None:
            self.posted[("F", s, m)] = self.wire.channel("F", s, m)

        def rb(s: int, m: int) -> None:
            self.posted[("B", s, m)] = self.wire.channel("B", s, m)

        def nothing(s: int, m: int | None) -> None:
            return None

        return {"F": f, "B": b, "I": i, "W": w, "SF": sf, "SB": sb, "RF": rf, "RB": rb, "G": nothing, "O": nothing}


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "ZBV", "InterleavedZB"])
def test_two_toy_ranks_compute_what_a_sequential_loop_computes(name: str) -> None:
    R, M = 2, 4
    program = build(name, R, M)
    S = program.num_stages
    inputs, weights = [1.0, 2.0, 3.0, 4.0], [0.5 * (s + 1) for s in range(S)]
    wire = Wire()
    ranks = [ToyRank(wire, program.placement, inputs, weights) for _ in range(R)]
    engines = [ProgramEngine(t.bindings(), name=f"r{r}", timeout_s=10) for r, t in enumerate(ranks)]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            engines[r].run_program(lower_rank(program, r, {"SF": "send", "SB": "send", "RF": "recv", "RB": "recv"}))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for e in engines:
        e.close()
    assert not errors, errors
    expected = [0.0] * S
    for m in range(M):  # d loss / d w_s with y = prod(w) * x: prod of the other weights * x
        for s in range(S):
            others = 1.0
            for k in range(S):
                others *= weights[k] if k != s else 1.0
            expected[s] += others * inputs[m]
    got = [ranks[program.rank_of(s)].grad[s] for s in range(S)]
    assert got == pytest.approx(expected)


def test_a_failure_on_the_comm_thread_surfaces_with_action_and_thread_named() -> None:
    program = maglev_1f1b(2, 4)
    rec = Recorder(fail="0SF1")
    engine = ProgramEngine(rec.bindings(), name="Maglev1F1B-rank0", timeout_s=10)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="boom in 0SF1") as info:
            engine.run_program(lower_rank(program, 0))
        assert time.monotonic() - start < 5  # every waiter woke up: no hang
        err = info.value
        assert (err.swp_task, err.swp_batch, err.swp_thread, err.swp_iteration) == ("0SF1", 1, "comm", 0)  # type: ignore[attr-defined]
        assert any("action 0SF1, microbatch 1 on thread 'comm', step 0 of Maglev1F1B-rank0" in n for n in err.__notes__)
        # whatever waited on the comm thread was aborted (not reported as the cause), and the
        # actions after the failure never ran
        assert "0SF2" not in {a for a, _ in rec.ran}
        # every worker is idle again: the next step runs
        rec.fail = None
        rec.ran.clear()
        engine.run_program(lower_rank(program, 0))
        assert len(rec.ran) == len(program.ranks[0])
    finally:
        engine.close()


def test_a_failure_on_the_main_thread_wakes_the_comm_thread_waiting_for_it() -> None:
    program = maglev_1f1b(2, 2)
    rec = Recorder(fail="1B0", exc=KeyError)
    engine = ProgramEngine(rec.bindings(), timeout_s=10)
    try:
        with pytest.raises(KeyError) as info:
            engine.run_program(lower_rank(program, 1))  # comm waits on 1B0 to send 1SB0
        assert info.value.swp_thread == "default"  # type: ignore[attr-defined]
        assert "1SB0" not in {a for a, _ in rec.ran}
    finally:
        engine.close()


def test_a_timeout_reports_each_threads_position_and_never_hangs() -> None:
    """A timeout is a deadlock (no thread made progress for timeout_s): here the receive waits on
    the board for what never comes, and the thread that needs it waits for the receive."""
    program = maglev_1f1b(2, 2)
    never = threading.Event()
    rec = Recorder()
    bindings = rec.bindings()
    bindings["RF"] = lambda s, m: engine.board.wait(never.is_set, lambda: "a receive that never lands", 60)
    engine = ProgramEngine(bindings, name="Maglev1F1B-rank1", timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(EngineTimeout) as info:
            engine.run_program(lower_rank(program, 1))
        assert time.monotonic() - start < 3
        text = str(info.value)
        assert "step 0 of Maglev1F1B-rank1" in text
        assert "thread 'default': failed in wait 1RF0" in text or "thread 'default': at wait 1RF0" in text
        assert "thread 'comm': parked (interrupted) at run 1RF0" in text
        assert "> run 1RF0" in text and "> wait 1RF0" in text  # the program, stuck instructions marked
        assert "no thread made progress for 0.3s while waiting for action 1RF0" in str(info.value.__cause__)
    finally:
        engine.close()


def test_threads_that_wait_on_each_other_time_out_and_a_slow_action_does_not() -> None:
    """Two threads each waiting for the other's signal: a deadlock, an EngineTimeout within about
    the timeout. The same program's order made acyclic, with one action blocking three timeouts
    (it runs: progress), finishes."""
    timeout = 0.3
    cycle = IterationProgram((0,), (
        ("default", (WaitTask("0B0"), RunAction("0F0", "F", 0, 0), Signal("0F0"))),
        ("comm", (WaitTask("0F0"), RunAction("0B0", "B", 0, 0), Signal("0B0"))),
    ))
    engine = ProgramEngine(Recorder().bindings(), name="cycle", timeout_s=timeout)
    try:
        start = time.monotonic()
        with pytest.raises(EngineTimeout, match="step 0 of cycle"):
            engine.run_program(cycle)
        assert time.monotonic() - start < 3
    finally:
        engine.close()
    chain = IterationProgram((0,), (
        ("default", (RunAction("0F0", "F", 0, 0), Signal("0F0"))),
        ("comm", (WaitTask("0F0"), RunAction("0B0", "B", 0, 0), Signal("0B0"))),
    ))
    rec = Recorder()
    bindings = rec.bindings()
    backward = bindings["B"]
    blocked: list[float] = []

    def slow(stage: int, mb: int | None) -> None:
        release = threading.Event()
        threading.Timer(3 * timeout, release.set).start()
        began = time.monotonic()
        assert release.wait(60)
        blocked.append(time.monotonic() - began)
        backward(stage, mb)

    engine = ProgramEngine(dict(bindings, B=slow), name="chain", timeout_s=timeout)
    try:
        engine.run_program(chain)  # the calling thread waits for 0B0 (to end the step) while it runs
    finally:
        engine.close()
    assert [a for a, _ in rec.ran] == ["0F0", "0B0"] and blocked[0] > timeout


def test_collectives_on_several_threads_take_tickets_in_program_order() -> None:
    program = build("Interleaved1F1B", 2, 2)
    by_stage = lambda a: "comm" if a.is_p2p else ("low" if a.stage < 2 else "default")
    lowered = lower_rank(program, 0, by_stage)
    assert lowered.tickets == (("dp", 2),)
    text = format_program(lowered)
    gs = [a for a in program.ranks[0] if a.kind.value == "G"]
    assert [str(g) for g in gs] == ["2G", "0G"]
    assert "run 2G #0@dp" in text and "run 0G #1@dp" in text
    issued: list[str] = []
    zero_g_started = threading.Event()
    overlapped: list[bool] = []
    rec = Recorder()
    bindings = rec.bindings()

    def grad_sync(s: int, m: int | None) -> None:
        if s == 0:
            zero_g_started.set()
        else:
            # 2G holds ticket #0 and stays in its collective a while: without tickets 0G's
            # thread, which has nothing else to wait for, would enter its own meanwhile
            overlapped.append(zero_g_started.wait(0.3))
        issued.append(f"{s}G")

    bindings["G"] = grad_sync
    engine = ProgramEngine(bindings, timeout_s=10)
    try:
        engine.run_program(lowered)
        assert overlapped == [False], "0G entered its collective while 2G, the earlier ticket, was in its own"
        assert issued == ["2G", "0G"]
    finally:
        engine.close()


def test_a_failed_collective_aborts_later_tickets_until_reset() -> None:
    program = build("Interleaved1F1B", 2, 2)
    lowered = lower_rank(program, 0, lambda a: "comm" if a.is_p2p else ("low" if a.stage < 2 else "default"))
    down = [True]

    def grad_sync(s: int, m: int | None) -> None:
        if s == 2 and down[0]:
            raise RuntimeError("gloo down")

    engine = ProgramEngine(dict(Recorder().bindings(), G=grad_sync), timeout_s=10)
    try:
        with pytest.raises(RuntimeError, match="gloo down") as info:
            engine.run_program(lowered)
        assert info.value.swp_task == "2G"  # type: ignore[attr-defined]
        down[0] = False
        with pytest.raises(CollectiveAborted, match="aborted"):  # not issued: the ranks would desync
            engine.run_program(lowered)
        engine.reset()
        engine.run_program(lowered)
    finally:
        engine.close()


def test_what_cannot_run_is_refused_before_anything_runs() -> None:
    program = maglev_1f1b(2, 2)
    rec = Recorder()
    bindings = rec.bindings()
    del bindings["SB"]
    engine = ProgramEngine(bindings)
    with pytest.raises(EngineError, match="no function bound to action kind 'SB'"):
        engine.run_program(lower_rank(program, 1))
    assert rec.ran == []
    full = ProgramEngine(Recorder().bindings())
    lone_wait = IterationProgram((0,), (("default", (WaitTask("0F0"), RunAction("0F1", "F", 0, 1))),))
    with pytest.raises(EngineError, match="has no `signal 0F0`"):
        full.run_program(lone_wait)
    plan_task = IterationProgram((0,), (("default", (Run("Forward", 0),)),))
    with pytest.raises(EngineError, match="got `run Forward`"):
        full.run_program(plan_task)
    twice = IterationProgram((0,), (("default", (RunAction("0F0", "F", 0, 0), Signal("0F0"), Signal("0F0"))),))
    with pytest.raises(EngineError, match="signalled twice"):
        full.run_program(twice)
    with pytest.raises(TypeError, match="not callable"):
        ProgramEngine({"F": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="timeout_s"):
        ProgramEngine({}, timeout_s=0)


class Timings:
    def __init__(self) -> None:
        self.runs: list[tuple[str, int, str, int]] = []
        self.waits: list[str] = []
        self.steps: list[int] = []

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        assert end >= start
        self.runs.append((task, batch, thread, iteration))

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        self.waits.append(producer)

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        self.steps.append(iteration)


def test_an_observer_sees_every_action_with_its_thread() -> None:
    program = maglev_1f1b(2, 2)
    engine = ProgramEngine(Recorder().bindings())
    timings = Timings()
    engine.instrument(timings)
    try:
        engine.run_program(lower_rank(program, 0))
        assert sorted(t[0] for t in timings.runs) == sorted(map(str, program.ranks[0]))
        assert {(t[0], t[2]) for t in timings.runs} >= {("0SF0", "comm"), ("0F0", "default"), ("0G", "default")}
        assert ("0G", -1, "default", 0) in timings.runs
        assert timings.steps == [0] and timings.waits
        engine.instrument()
        engine.run_program(lower_rank(program, 0))
        assert timings.steps == [0]
    finally:
        engine.close()


def test_run_action_text() -> None:
    instr = RunAction("0G", "G", 0, None, 1, "dp")
    assert str(instr) == "run 0G #1@dp"
    assert str(RunAction(str(Action(1, "RB", 3)), "RB", 1, 3)) == "run 1RB3"
    lowered: Any = lower_rank(maglev_1f1b(2, 2), 0)
    assert "run 0F0" in format_program(lowered) and not lowered.tickets


def test_rebind_replaces_an_action_and_keeps_the_observer_timing_it() -> None:
    program = maglev_1f1b(2, 2)
    rec = Recorder()
    engine = ProgramEngine(rec.bindings(), timeout_s=10)
    timed: list[str] = []

    class Observer:
        def on_run(self, action: str, *args: Any) -> None:
            timed.append(action)

        def on_wait(self, *args: Any) -> None: ...

        def on_iteration(self, *args: Any) -> None: ...

    try:
        engine.instrument(Observer())  # type: ignore[arg-type]
        forwards: list[tuple[int, int | None]] = []
        engine.rebind("F", lambda stage, mb: forwards.append((stage, mb)))
        engine.run_program(lower_rank(program, 0))
        assert forwards == [(0, 0), (0, 1)]
        assert not any(a.startswith("0F") for a, _ in rec.ran)  # the old binding is gone
        assert [a for a in timed if a.startswith("0F")] == ["0F0", "0F1"]
        with pytest.raises(KeyError, match="no action kind 'X'"):
            engine.rebind("X", print)
        with pytest.raises(TypeError, match="not callable"):
            engine.rebind("F", 3)  # type: ignore[arg-type]
    finally:
        engine.close()
