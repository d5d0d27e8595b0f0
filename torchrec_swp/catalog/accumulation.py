"""Gradient accumulation as phases of a plan: TorchRec's GradientAccumulationWrapper's window.

Upstream's wrapper (``torchrec.distributed.train_pipeline.gradient_accumulation``, TorchRec 1.9)
counts the ``progress()`` calls that returned (``n``, from 0 since it was built or reset) and
intercepts the optimizer the pipeline calls: ``step()`` acts only in call ``n`` with
``(n + 1) % k == 0``, the window's last batch; ``zero_grad()`` acts only the first time it is
called after a step that acted (and once at the start). The gradients of the other calls are
not all-reduced (DDP's ``no_sync()`` around the whole call), except in call 0, in the first
``num_warmup_steps`` calls and in every window's last call.

Here the same decisions are the plan's: ``accumulation_phases(plan, k, w)`` gives one phase per
kind of call - ZeroGrad and OptimizerStep guarded ``never`` where upstream's wrapper makes them
do nothing (they keep their place: what waits for them still waits for what they wait for, as
around upstream's calls that do nothing; tasks left out of a phase would let the next batch's
Forward on another thread race the last step) - on the clock
``"trained"`` (the calls that returned, as upstream counts them), the phases of one window
repeating every ``k`` batches (``PhasedPlan.cycle``). Which call has which is found by running
upstream's rules over the plan's own order of ZeroGrad and OptimizerStep (``accumulation_calls``),
so a pipeline that zeroes after its step gets what upstream's wrapper does to it too. Whether a
call all-reduces is in each phase's name (``..._nosync``); the wrapper enters ``no_sync()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError, When

__all__ = ["AccumulationCall", "accumulation_calls", "accumulation_phases", "syncs"]

ZERO_GRAD, OPTIMIZER_STEP = "ZeroGrad", "OptimizerStep"


@dataclass(frozen=True, slots=True)
class AccumulationCall:
    """What one ``progress()`` call does under gradient accumulation: whether its ZeroGrad and
    its OptimizerStep run, and whether its gradients are all-reduced."""

    zero: bool
    step: bool
    sync: bool

    @property
    def label(self) -> str:
        """``zero``, ``step``, ``zero_step`` or ``accumulate``, with ``_nosync`` when not all-reduced."""
        done = "_".join(n for n, on in (("zero", self.zero), ("step", self.step)) if on) or "accumulate"
        return done if self.sync else f"{done}_nosync"


def syncs(n: int, num_steps: int, num_warmup_steps: int) -> bool:
    """Whether call ``n`` all-reduces its gradients (upstream's ``_should_sync_grad``): call 0,
    the warm-up calls and every window's last call."""
    return n == 0 or n < num_warmup_steps or (n + 1) % num_steps == 0


def _order(plan: PipelinePlan) -> tuple[str, str]:
    """ZeroGrad and OptimizerStep in the order one call runs them; PlanError where one is missing,
    runs below the training step's stage (for another batch than the call trains) or is guarded."""
    missing = [t for t in (ZERO_GRAD, OPTIMIZER_STEP) if t not in plan.schedule]
    if missing:
        raise PlanError(
            f"plan {plan.name} has no {missing[0]} task: nothing to accumulate gradients for", culprit=missing[0]
        )
    zero, step = plan.task(ZERO_GRAD), plan.task(OPTIMIZER_STEP)
    for t in (zero, step):
        if t.stage != plan.max_stage:
            raise PlanError(
                f"plan {plan.name}: {t.name} runs at stage {t.stage}, not with the batch trained (stage "
                f"{plan.max_stage}); gradient accumulation counts the calls that train",
                culprit=t.name,
            )
        if t.schedule.when is not When.ALWAYS:
            raise PlanError(
                f"plan {plan.name}: {t.name} runs when={t.schedule.when}; gradient accumulation guards it itself",
                culprit=t.name,
            )
    # fire order is the plan's single-thread order, which any thread map keeps (through deps)
    return (ZERO_GRAD, OPTIMIZER_STEP) if zero.fire_index < step.fire_index else (OPTIMIZER_STEP, ZERO_GRAD)


def _checked(num_steps: object, num_warmup_steps: object) -> tuple[int, int]:
    for name, value in (("num_steps", num_steps), ("num_warmup_steps", num_warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"gradient accumulation: {name} must be an int >= 1, got {value!r}", culprit=name)
    return num_steps, num_warmup_steps  # type: ignore[return-value]  # both checked to be ints just above


def accumulation_calls(plan: PipelinePlan, num_steps: int, num_warmup_steps: int, count: int) -> list[AccumulationCall]:
    """What calls ``0 .. count - 1`` do, by upstream's rules over ``plan``'s order of ZeroGrad and
    OptimizerStep: a step acts in a window's last call; a zero_grad acts when it is the first
    since a step acted (or since the start)."""
    k, w = _checked(num_steps, num_warmup_steps)
    order = _order(plan)
    calls = []
    needs_zero = True
    for n in range(count):
        zero = step = False
        for task in order:
            if task == ZERO_GRAD:
                zero, needs_zero = needs_zero, False
            elif (n + 1) % k == 0:
                step = needs_zero = True
        calls.append(AccumulationCall(zero, step, syncs(n, k, w)))
    return calls


def accumulation_phases(plan: PipelinePlan, num_steps: int, num_warmup_steps: int = 1) -> PhasedPlan:
    """``plan`` with gradient accumulation over ``num_steps`` batches (after ``num_warmup_steps``
    that all-reduce), as upstream's GradientAccumulationWrapper: a PhasedPlan on the clock
    ``"trained"`` whose phases guard ZeroGrad or OptimizerStep ``never`` where upstream's wrapper
    makes them do nothing. The calls before the first window boundary at or past the warm-up are phases
    of their own; from there one window's phases repeat (``cycle``). Phase names say what a call
    does (``AccumulationCall.label``)."""
    k, w = _checked(num_steps, num_warmup_steps)
    first = k * max(1, -(-w // k))  # from here every window is alike
    calls = accumulation_calls(plan, k, w, first + k)
    variants: dict[AccumulationCall, PipelinePlan] = {}
    for call in dict.fromkeys(calls):
        variant = plan
        for task, runs in ((ZERO_GRAD, call.zero), (OPTIMIZER_STEP, call.step)):
            if not runs:
                variant = variant.with_schedule(task, when=When.NEVER)
        variants[call] = variant.replace(name=f"{plan.name}_{call.label}")
    phases: list[tuple[int, PipelinePlan]] = []
    for n, call in enumerate(calls):
        if n in (0, first) or call != calls[n - 1]:
            phases.append((n, variants[call]))
    warmup = "" if w == 1 else f"_warmup{w}"
    return PhasedPlan(phases, name=f"{plan.name}_accumulate{k}{warmup}", clock="trained", cycle=(first, k))
