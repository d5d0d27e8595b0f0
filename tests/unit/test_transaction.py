"""A step as a transaction (``torchrec_swp.engine.transaction``) on a toy plan: a non-finite batch
is rolled back as if never seen, captures are made once per batch and effect before the first task
that declares it, the verdict is reduced once per step, on the host or by device-side selects, and
a plan that cannot be undone one batch at a time is refused with the reason."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from torchrec_swp.engine import Engine
from torchrec_swp.engine.transaction import NonFiniteStep, Transaction, check_plan, decider, ordered
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, PlanError, TaskSchedule, When

S = TaskSchedule


def _plan(*, opt_stage: int = 1, opt_thread: str = "default", comm: str | None = "world") -> PipelinePlan:
    """Load (stage 0) -> Fwd -> Bwd (grads) -> Opt (params): a 2-stage training step."""
    return PipelinePlan(
        schedule={
            "Load": S(0),
            "Zero": S(1),
            "Fwd": S(1),
            "Bwd": S(1, comm_group="world"),
            "Opt": S(opt_stage, thread_group=opt_thread, comm_group=comm),
        },
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Zero", effects=("dense_grads",)),
            PipelineTask("Fwd", reads=("x",), writes=("losses",)),
            PipelineTask("Bwd", reads=("x",), effects=("dense_grads",)),
            PipelineTask("Opt", effects=("dense_params", "dense_optim")),
        ],
        intra_iter_deps=[("Fwd", "Zero"), ("Bwd", "Fwd"), ("Opt", "Bwd")],
        inter_iter_deps=[("Zero", "Opt"), ("Fwd", "Opt")],
        source="Load",
        output="losses",
        name="toy_step",
        **({"fire_order": ["Opt", "Load", "Zero", "Fwd", "Bwd"]} if opt_stage > 1 else {}),
    )


class Model:
    """w, its gradient g and a step count (the optimizer's state): loss = w.x, g = x * x * w, w -= 0.5 * g."""

    def __init__(self, data: list[float]) -> None:
        self.w = torch.tensor([1.0, 2.0])
        self.g = torch.zeros(2)
        self.steps = torch.zeros(())
        self.data = iter(data)
        self.log: list[str] = []

    def bindings(self) -> dict[str, Any]:
        def load(b: int) -> torch.Tensor:
            return torch.full((2,), next(self.data))

        def zero(b: int) -> None:
            self.log.append(f"Zero {b}")
            self.g.zero_()

        def fwd(b: int, x: torch.Tensor) -> torch.Tensor:
            return (self.w * x).sum()

        def bwd(b: int, x: torch.Tensor) -> None:
            self.log.append(f"Bwd {b}")
            self.g += x * x * self.w

        def opt(b: int) -> None:
            self.log.append(f"Opt {b}")
            self.w -= 0.5 * self.g
            self.steps += 1

        return {"Load": load, "Zero": zero, "Fwd": fwd, "Bwd": bwd, "Opt": opt}


class Copy:
    """The effect of one tensor: a copy of it (each capture logged)."""

    def __init__(self, name: str, tensor: torch.Tensor, log: list[str]) -> None:
        self.name, self.tensor, self.log = name, tensor, log

    def capture(self, b: int) -> torch.Tensor:
        self.log.append(f"capture {self.name}")
        return self.tensor.clone()

    def changed(self, saved: torch.Tensor) -> tuple[list[torch.Tensor], str]:
        return [self.tensor], f"the {self.name}"

    def restore(self, saved: torch.Tensor, keep: torch.Tensor | bool) -> None:
        if keep is True:
            return
        self.tensor.copy_(saved if keep is False else torch.where(keep, self.tensor, saved))


def _effects(m: Model) -> dict[str, Copy]:
    return {
        "dense_grads": Copy("grads", m.g, m.log),
        "dense_params": Copy("params", m.w, m.log),
        "dense_optim": Copy("steps", m.steps, m.log),
    }


def _run(data: list[float], plan: PipelinePlan | None = None, **options: Any) -> tuple[Model, list[Any], Transaction]:
    m = Model(data)
    transaction = Transaction(_effects(m), **{"mode": "skip", **options})
    engine = Engine(plan or _plan(), m.bindings(), transaction=transaction)
    outputs = []
    while True:
        try:
            outputs.append(engine.step())
        except StopIteration:
            break
        except NonFiniteStep as e:
            outputs.append(e)
    engine.close()
    return m, outputs, transaction


def _same(a: Model, b: Model) -> None:
    assert torch.equal(a.w, b.w) and torch.equal(a.steps, b.steps), (a.w, b.w, a.steps, b.steps)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_selects"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_batch_is_rolled_back_as_if_never_seen(host: bool, bad: float) -> None:
    data = [0.5, 0.25, bad, 0.125, 0.5]
    skipped, outputs, transaction = _run(data, host=host)
    reference, _, _ = _run([d for d in data if d == d and d != bad])
    _same(skipped, reference)
    assert torch.equal(skipped.steps, torch.tensor(4.0))
    assert [v.batch for v in transaction.settled().skipped] == [2]
    assert len(outputs) == 5  # the batch's output still comes back: its step alone is undone
    # "the losses" is not finite, and with it what the step wrote
    assert transaction.settled().skipped[0].what[0] == "the losses"


def test_captures_once_per_batch_and_effect_before_its_first_task() -> None:
    m, _, _ = _run([1.0, 2.0])
    assert m.log[:6] == ["capture grads", "Zero 0", "Bwd 0", "capture params", "capture steps", "Opt 0"]
    assert m.log[6:] == ["capture grads", "Zero 1", "Bwd 1", "capture params", "capture steps", "Opt 1"]


def test_a_finite_loss_with_a_non_finite_effect_is_rolled_back() -> None:
    """The loss is finite; the parameters the step wrote are not (an overflow in the update)."""
    data = [0.5, 1e20, 0.5]  # a loss of 3e20, a gradient of 1e40
    skipped, _, transaction = _run(data)
    reference, _, _ = _run([0.5, 0.5])
    _same(skipped, reference)
    assert transaction.settled().skipped[0].what == ("the grads", "the params")


def test_raise_mode_raises_after_the_rollback_and_goes_on() -> None:
    data = [0.5, math.nan, 0.25]
    m, outputs, _ = _run(data, mode="raise")
    assert isinstance(outputs[1], NonFiniteStep) and "batch 1 of the epoch" in str(outputs[1])
    assert "the losses" in str(outputs[1])
    assert not isinstance(outputs[2], Exception)
    reference, _, _ = _run([0.5, 0.25])
    _same(m, reference)


def test_the_verdict_is_reduced_once_per_step_and_a_peers_flag_rolls_back() -> None:
    """A peer's batch 1 was not finite: the reduction says so, this rank's finite step is undone."""
    calls: list[list[float]] = []

    def reduce(flags: torch.Tensor) -> torch.Tensor:
        calls.append(flags.tolist())
        if len(calls) == 2:
            flags[0] = 1.0  # the peer's batch
        return flags

    m, _, transaction = _run([0.5, 0.25, 0.125], reduce=reduce)
    assert len(calls) == 3 and all(len(c) == 1 for c in calls)  # on the host: one flag
    reference, _, _ = _run([0.5, 0.125])
    _same(m, reference)
    assert transaction.settled().skipped[0].what == ()
    assert "on another rank" in transaction.settled().skipped[0].line()


def test_device_selects_read_the_verdict_later() -> None:
    m = Model([0.5, math.nan, 0.25])
    transaction = Transaction(_effects(m), mode="skip", host=False)
    engine = Engine(_plan(), m.bindings(), transaction=transaction)
    engine.step()
    engine.step()  # batch 1 rolled back by selects; not read yet
    assert transaction.account.skipped == []
    assert [v.batch for v in transaction.settled().skipped] == [1]
    engine.close()


def test_state_of_the_account_round_trips() -> None:
    _, _, transaction = _run([0.5, math.nan, 0.25])
    state = transaction.settled().state_dict()
    other = Transaction({}, mode="skip")
    other.account.load_state_dict(state)
    assert other.account.skipped == transaction.account.skipped


def test_the_deciding_task_is_the_last_with_an_effect_and_is_ordered() -> None:
    plan = _plan(comm=None)
    assert decider(plan) == "Opt"
    with pytest.raises(PlanError, match="Opt decides each step .* in no comm group"):
        check_plan(plan, ["dense_grads", "dense_params", "dense_optim"])
    fixed = ordered(plan)
    assert fixed.task("Opt").comm_group == "world"
    check_plan(fixed, ["dense_grads", "dense_params", "dense_optim"])


def test_a_never_guarded_task_does_not_decide() -> None:
    plan = _plan().with_schedule("Opt", when=When.NEVER)
    assert decider(plan) == "Bwd"


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan(), "task Opt declares dense_params, dense_optim, which this pipeline cannot capture"),
        (_plan(opt_stage=2), "on several stages"),
        (_plan(opt_thread="worker"), "on several threads"),
    ],
    ids=["no_capture", "stages", "threads"],
)
def test_a_plan_that_cannot_be_undone_is_refused(plan: PipelinePlan, message: str) -> None:
    known = ["dense_grads"] if "capture" in message else ["dense_grads", "dense_params", "dense_optim"]
    with pytest.raises(PlanError, match=message):
        check_plan(plan, known)


def test_effect_tasks_on_a_worker_thread_are_undone_too() -> None:
    """Every task with an effect moved to one worker thread: same result as on the caller's."""
    threaded = _plan().with_thread_map({"Zero": "w", "Fwd": "w", "Bwd": "w", "Opt": "w"})
    check_plan(threaded, ["dense_grads", "dense_params", "dense_optim"])
    data = [0.5, math.nan, 0.25, 0.125]
    m, _, _ = _run(data, plan=threaded)
    reference, _, _ = _run([0.5, 0.25, 0.125])
    _same(m, reference)


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="on_nonfinite must be one of 'off', 'skip', 'raise'"):
        Transaction({}, mode="ignore")  # type: ignore[arg-type]


def test_an_effect_after_the_deciding_task_is_refused() -> None:
    """A task guarded ``last`` that changes state after the step was decided (PEC's
    DeferNolGradLast) could not be undone: refused, naming it."""
    plan = _plan().with_task(
        PipelineTask("Late", effects=("dense_params",)), S(1, comm_group="world", when=When.LAST), after="Opt",
        deps=[("Late", "Opt")],
    )
    assert decider(plan) == "Opt"
    with pytest.raises(PlanError, match="task Late \\(when=last\\) changes dense_params after Opt"):
        check_plan(plan, ["dense_grads", "dense_params", "dense_optim"])


def test_effects_with_nothing_to_capture_constrain_nothing() -> None:
    """An effect the model has nothing of (``Effect.empty``: a cache it does not have) on another
    stage: not refused, and its task is not the deciding one."""
    plan = _plan().with_task(
        PipelineTask("Prefetch", effects=("emb_cache",)), S(0), after="Load", deps=[("Prefetch", "Load")]
    )
    with pytest.raises(PlanError, match="several stages"):
        check_plan(plan, ["dense_grads", "dense_params", "dense_optim", "emb_cache"])
    check_plan(plan, ["dense_grads", "dense_params", "dense_optim", "emb_cache"], empty=["emb_cache"])
    assert decider(plan, empty=["emb_cache"]) == "Opt"


def test_the_running_batch_is_known_inside_every_task() -> None:
    """Hooks learn whose lookup they see (``running_batch``): every task of an undoable plan runs
    with its batch set on its thread, and nothing outside."""
    from torchrec_swp.engine.transaction import running_batch

    m = Model([0.5, 0.25, 0.125])
    seen: list[tuple[str, int | None]] = []
    bindings = m.bindings()
    fwd = bindings["Fwd"]
    bindings["Fwd"] = lambda b, x: (seen.append(("Fwd", running_batch())), fwd(b, x))[1]
    engine = Engine(_plan(), bindings, transaction=Transaction(_effects(m), mode="skip"))
    engine.step()
    engine.step()
    assert seen == [("Fwd", 0), ("Fwd", 1)] and running_batch() is None
    engine.close()


def test_what_waits_for_an_effect_waits_for_the_deciding_task() -> None:
    """The next batch's lookup on a stream of its own waits for this batch's Backward (it reads the
    rows Backward updated); a rollback rewrites them in the deciding task (Opt), so the lookup
    waits for Opt too (the CPU stream checker found Fused's lookup reading rows Opt put back)."""
    plan = _plan().with_task(
        PipelineTask("Lookup", reads=("x",)), S(1, "data_dist"), after="Load"
    )
    plan = plan.replace(inter_iter_deps=[*plan.explicit_deps[-2:], ("Lookup", "Bwd", 1)])
    fixed = ordered(plan)
    assert ("Lookup", "Opt", 1) in {(d.consumer, d.producer, d.distance) for d in fixed.deps}
    assert ("Lookup", "Opt", 1) not in {(d.consumer, d.producer, d.distance) for d in plan.deps}


def _window(plan: PipelinePlan) -> PhasedPlan:
    """``plan`` accumulating over windows of 2 on the clock ``"trained"``: the first batch of a
    window zeroes and does not step, the second steps and does not zero."""
    first = ordered(plan.with_schedule("Opt", when=When.NEVER).replace(name="accumulate"))
    second = ordered(plan.with_schedule("Zero", when=When.NEVER).replace(name="step"))
    return PhasedPlan([(0, first), (1, second)], name="window", clock="trained", cycle=(0, 2))


@pytest.mark.parametrize("host", [True, False], ids=["host", "device_selects"])
@pytest.mark.parametrize("bad", [1, 2, 3])
def test_a_rolled_back_batch_does_not_count_on_the_clock_trained(host: bool, bad: int) -> None:
    """Phases on the clock ``"trained"`` (a window of 2): batch ``bad`` rolled back, the window
    closes one batch later, as in the run without it; on a device the verdict is then read at once
    (the next batch's phase depends on it)."""
    data = [0.5, 0.25, 0.125, 0.75, 0.5, 0.25]
    poisoned = [*data]
    poisoned[bad] = math.nan
    m = Model(poisoned)
    transaction = Transaction(_effects(m), mode="skip", host=host)
    engine = Engine(_window(_plan()), m.bindings(), transaction=transaction)
    assert transaction.host, "the verdict must be read before the next batch's phase is picked"
    while True:
        try:
            engine.step()
        except StopIteration:
            break
    assert engine.trained_since_reset == len(data) - 1
    engine.close()
    reference = Model(data[:bad] + data[bad + 1 :])
    other = Engine(_window(_plan()), reference.bindings())
    while True:
        try:
            other.step()
        except StopIteration:
            break
    other.close()
    _same(m, reference)
    assert torch.equal(m.g, reference.g)
    assert [v.batch for v in transaction.settled().skipped] == [bad]


def test_phases_on_the_clock_trained_that_differ_off_the_deciding_thread_are_refused() -> None:
    """A thread that may walk ahead picks its phase before the step before it is decided: phases
    that give it different programs cannot follow a rollback; refused when the engine is built."""
    plan = PipelinePlan(
        schedule={**_plan().schedule, "Log": S(1, thread_group="w")},
        tasks=[*_plan().tasks.values(), PipelineTask("Log", reads=("x",))],
        intra_iter_deps=_plan().explicit_deps,
        source="Load",
        output="losses",
        name="logged",
    )
    phases = _window(plan)
    quiet = phases.plans[0].with_schedule("Log", when=When.NEVER)
    m = Model([0.5])
    with pytest.raises(PlanError, match="phases accumulate and step differ in thread w"):
        Engine(
            PhasedPlan([(0, quiet), (1, phases.plans[1])], name="window", clock="trained", cycle=(0, 2)),
            {**m.bindings(), "Log": lambda b, x: None},
            transaction=Transaction(_effects(m), mode="skip"),
        )
