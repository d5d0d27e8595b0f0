"""The unrolled code (``torchrec_swp/engine/unrolled.py``) is the walk compiled: every catalog plan,
through every event the engine knows (the fill, the end of data drained or stopped and new data,
a failure and the step that resumes, ``reset()``, a new iterator mid-epoch, a plan switch, eval
and training steps), gives the same task calls in the same order, the same outputs, the same
errors and the same ledger with the unrolled code as with every instruction through its op."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from torchrec_swp import plans
from torchrec_swp.engine import Engine, ops
from torchrec_swp.engine import engine as engine_module
from torchrec_swp.engine.unrolled import NOT_STEADY, steady_step
from torchrec_swp.plan import PhasedPlan, PipelinePlan, When

CATALOG = plans.default_plans()
RAN: dict[str, int] = {}  # the last run's count of calls the steady step took


def _plans(plan: PipelinePlan | PhasedPlan) -> tuple[PipelinePlan, ...]:
    return plan.plans if isinstance(plan, PhasedPlan) else (plan,)


class Run:
    """Stand-in task functions of ``plan`` that record every call as ``(task, b)`` and write values
    that say who wrote them for which batch, checking what they read; ``fail`` makes one instance
    raise once."""

    def __init__(self, plan: PipelinePlan | PhasedPlan) -> None:
        self.trace: list[tuple[str, int]] = []
        self.fail: tuple[str, int] | None = None
        self.training = True
        self.bindings = {}
        tasks = {t: p.task(t) for p in _plans(plan) for t in p.fire_order}
        for name, t in tasks.items():
            self.bindings[name] = self._fn(name, t.io.writes)

    def _fn(self, name: str, writes: tuple[str, ...]) -> Any:
        def fn(b: int, **reads: Any) -> Any:
            self.trace.append((name, b))
            if self.fail == (name, b):
                self.fail = None
                raise ValueError(f"{name} failed at batch {b}")
            if "data" in reads:
                item = next(reads.pop("data"))
                reads = {"item": item}
            for key, value in reads.items():  # what a task reads was written for its batch (or one before)
                if value is not None and key != "item":
                    assert isinstance(value, tuple) and value[1] <= b, (name, b, key, value)
            values = tuple((w, b, reads.get("item")) for w in writes)
            return None if not writes else values[0] if len(writes) == 1 else values

        return fn


def _run(plan: PipelinePlan | PhasedPlan, events: list[tuple[str, Any]], unrolled: bool, **options: Any) -> Any:
    """``events`` on an engine of ``plan`` (its ops alone where not ``unrolled``): what each gave."""
    run = Run(plan)
    steady = [0]  # calls the steady step took

    def counted(*args: Any, **kwargs: Any) -> Any:
        step = steady_step(*args, **kwargs)

        def counting(data: Any) -> Any:
            out = step(data)
            steady[0] += out is not NOT_STEADY
            return out

        return counting

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "steady_step", counted)
        if not unrolled:
            mp.setattr(ops, "unroll", lambda *a, **k: None)
        engine = Engine(plan, run.bindings, training=lambda: run.training, timeout_s=10, **options)
    data: Iterator[int] = iter(range(10_000))
    seen: list[Any] = []
    try:
        for kind, arg in events:
            try:
                if kind == "step":
                    seen.append(("out", engine.step(data)))
                elif kind == "data":
                    data = iter(range(arg * 1000, arg * 1000 + arg))  # a new iterator of arg items
                    seen.append(("out", engine.step(data)))
                elif kind == "fail":
                    run.fail = arg
                elif kind == "mode":
                    run.training = arg
                elif kind == "reset":
                    engine.reset()
                elif kind == "switch":
                    seen.append(("switched", engine.switch_plan(arg)))
            except StopIteration:
                seen.append(("stop",))
            except Exception as e:  # noqa: BLE001 - compared, with where it happened
                seen.append(("error", type(e).__name__, str(e).split("\n")[0], getattr(e, "swp_task", None)))
        ledger = engine.ledger
        RAN["steady"] = steady[0]
        return seen, run.trace, (ledger.drawn, ledger.trained, list(ledger.dropped)), engine.untrained()
    finally:
        engine.close()


def _events(plan: PipelinePlan | PhasedPlan, seed: int, other: PipelinePlan | PhasedPlan | None) -> list[Any]:
    rng = random.Random(seed)
    tasks = sorted({t for p in _plans(plan) for t in p.fire_order})
    events: list[tuple[str, Any]] = [("data", rng.randint(20, 60))]
    for _ in range(120):
        r = rng.random()
        if r < 0.70:
            events.append(("step", None))
        elif r < 0.78:
            events.append(("fail", (rng.choice(tasks), rng.randint(0, 12))))
        elif r < 0.84:
            events.append(("data", rng.choice([0, 1, 2, *[rng.randint(20, 60)] * 5])))
        elif r < 0.88:
            events.append(("reset", None))
        elif r < 0.94:
            events.append(("mode", rng.random() < 0.6))
        elif other is not None:  # to another plan and back: the steady steps made again
            events += [("switch", other), ("step", None), ("step", None), ("switch", plan)]
    return events


def _reordered(plan: PipelinePlan | PhasedPlan) -> PipelinePlan | PhasedPlan | None:
    """``plan`` with one task fired earlier, the first its dependencies allow (a switch may change
    the fire order; the plan stays on the calling thread, so every run is deterministic)."""
    first = plan if isinstance(plan, PipelinePlan) else plan.plans[0]
    order = first.fire_order
    for i in range(len(order) - 1, 0, -1):
        for j in range(i):

            def edit(p: PipelinePlan, i: int = i, j: int = j) -> PipelinePlan:
                return p.moved(order[i], before=order[j])

            try:
                return edit(plan) if isinstance(plan, PipelinePlan) else plan.each(edit)
            except Exception:  # noqa: BLE001, S112 - an order its dependencies forbid: the next one
                continue
    return None


@pytest.mark.parametrize("on_exhausted", ["drain", "stop"])
@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_catalog_plan_runs_the_same_unrolled_as_through_its_ops(name: str, on_exhausted: str) -> None:
    plan = CATALOG[name]
    edit = lambda p: p.replace(on_exhausted=on_exhausted)  # noqa: E731
    plan = edit(plan) if isinstance(plan, PipelinePlan) else plan.each(edit)
    # The unrolled code is the calling thread's alone, where no other thread walks (a threaded
    # plan keeps its ops: test_a_threaded_plan_keeps_its_ops); a threaded plan's tasks, stages and
    # guards are checked here on the calling thread, where every run is deterministic (on threads
    # the calls interleave as the threads run, differently from one run to the next).
    plan = plan.with_thread_map("main")
    other = _reordered(plan)
    took = 0
    for seed in range(4):
        events = _events(plan, seed, other)
        unrolled = _run(plan, events, unrolled=True, device_type="cpu")
        took += RAN["steady"]
        assert unrolled == _run(plan, events, unrolled=False, device_type="cpu"), (name, seed)
        assert RAN["steady"] == 0
        assert any(e[0] == "out" for e in unrolled[0])  # it trained something
    assert took > 0, name  # the steady step ran


@pytest.mark.parametrize(
    "name", sorted(n for n, p in CATALOG.items() if any(q.thread_groups != ("default",) for q in _plans(p)))
)
def test_a_threaded_plan_keeps_its_ops(name: str) -> None:
    """Where another thread walks, no thread's iteration is compiled and no steady step is made:
    the ops run, as the other threads' do (the threads meet at their latches, which the unrolled
    code does not wait on); the same plan on the calling thread alone gets both."""
    for plan, threaded in ((CATALOG[name], True), (CATALOG[name].with_thread_map("main"), False)):
        run = Run(plan)
        engine = Engine(plan, run.bindings, device_type="cpu")
        try:
            installed = engine.installed.by_id.values()
            assert all(not inst.bodies for inst in installed) == threaded, name
            assert (not engine._steady) == threaded, name
            data = iter(range(40))
            for _ in range(8):
                engine.step(data)
        finally:
            engine.close()


def test_the_steady_step_runs_where_it_should_and_only_there() -> None:
    """On one thread, past the fill, with the same data: the steady step; with an observer or
    on threads: never."""
    plan = CATALOG["TrainPipelineSparseDist"]
    run = Run(plan)
    engine = Engine(plan, run.bindings)
    data = iter(range(100))
    steady = engine._steady[id(engine.plan)]
    taken = []

    def counting(d: Any) -> Any:
        out = steady(d)
        taken.append(out is not NOT_STEADY)
        return out

    engine._steady[id(engine.plan)] = counting
    for _ in range(6):
        engine.step(data)
    assert taken == [False, True, True, True, True, True]  # the first call (new data) fills the pipeline
    engine.instrument(object())  # an observer: every call takes the general step
    assert id(engine.plan) not in engine._steady
    engine.instrument()
    assert id(engine.plan) in engine._steady
    engine.switch_plan(plan.with_thread_map("io"))
    assert id(engine.plan) not in engine._steady
    engine.close()


@pytest.mark.parametrize("when", [When.HAS_NEXT, When.LAST, When.TRAIN, When.FILL, When.FIRST, When.NEVER])
@pytest.mark.parametrize("task", ["Dequeue", "InputDistWait"])  # stage 2 (the top), stage 1
def test_every_guard_runs_the_same_unrolled(task: str, when: When) -> None:
    """A guard inline (on the task's stage, and for has_next and last on the next batch's
    existence) admits what the op's gate admits, the data ending at every batch of the fill and
    beyond, with eval steps between."""
    plan = CATALOG["TrainPipelineSparseDist"]
    if when is When.TRAIN and task != "Dequeue":
        pytest.skip("train: a task of the highest stage only")
    guarded = plan.with_schedule(task, when=when)
    for n in (0, 1, 2, 3, 7):
        events = [("data", n), *[("step", None)] * 3, ("mode", False), *[("step", None)] * 6, ("data", 5)]
        events += [("step", None)] * 7
        assert _run(guarded, events, unrolled=True) == _run(guarded, events, unrolled=False), n


def test_generated_code_writes_only_what_the_walk_writes() -> None:
    """The ownership rules hold in the code the engine generates (which the static ownership
    test does not read): it assigns no attribute but the walker's fields the walk and the ops
    set (its position, what it works on, its plan, its tickets), and changes no part's state
    but through calls (``Batches.ask``, ``Batches.retire``, ``open_slot``...) and the slot values
    of its tasks' calls (the code ``Batches`` writes)."""
    import ast
    import linecache

    allowed = {"P", "done_through", "inst", "bases", "i", "current"}
    seen = 0
    for name, plan in sorted(CATALOG.items()):
        run = Run(plan)
        before = set(linecache.cache)
        engine = Engine(plan, run.bindings, training=lambda: True, device_type="cpu")
        engine.close()
        for filename in set(linecache.cache) - before:
            if not filename.startswith(("<steady step of ", "<iteration of ")):
                continue
            seen += 1
            tree = ast.parse("".join(linecache.cache[filename][2]))
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Attribute):
                            assert isinstance(t.value, ast.Name) and t.value.id == "w", (name, ast.unparse(t))
                            assert t.attr in allowed, (name, ast.unparse(t))
                        if isinstance(t, ast.Subscript):  # a slot value (s<stage>[...]) or a ticket base
                            assert ast.unparse(t.value).startswith(("s", "w.bases")), (name, ast.unparse(t))
    assert seen >= 30
