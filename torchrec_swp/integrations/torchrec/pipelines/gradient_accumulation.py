"""GradientAccumulationWrapper over our pipelines: the accumulation window in the plan.

Upstream's wrapper swaps the pipeline's optimizer for one that ignores ``zero_grad()`` and
``step()`` inside a window of ``num_steps`` calls, and runs the calls whose gradients are not to
be all-reduced under DDP's ``no_sync()``. Over a torchrec_swp pipeline whose plan has one phase
with ZeroGrad and OptimizerStep (TrainPipelineBase, SparseDist, Lite, Fused, Prefetch, PEC,
CompAutograd), built and not yet run nor tuning itself (``PlanDriven.can_replan``), this one
leaves the optimizer alone and puts the window into the plan instead:
``plans.accumulation_phases`` (``torchrec_swp.catalog.accumulation``) drops ZeroGrad and
OptimizerStep from the calls where upstream's optimizer wrapper would make them do nothing,
phases on the clock ``"trained"`` that repeat every ``num_steps`` batches, so
``pipeline.plan.print_schedule(n)`` shows the window. Over any other pipeline (a PhasedPlan of
its own: SemiSync, PT2; no optimizer tasks: Staged, the eval pipelines; upstream's pipelines;
one that has run or tunes itself) it is upstream's wrapper. Either way ``no_sync()``, the flush
of a partial window when the data ends (or at ``is_last_batch``) and the counting are upstream's
code; on the plan route the counter (``current_step``) is the engine's count of trained batches.

Upstream's module is ``torchrec.distributed.train_pipeline.gradient_accumulation``, the same file
in TorchRec 1.8.0 and 1.9.2.

Checkpoints (ours): ``state_dict()`` is the pipeline's cut plus what accumulation carries over
it, the gradients accumulated so far in the window (every parameter's ``.grad``, on the CPU), the
step counter and, on upstream's route, its zero_grad flag; ``load_state_dict()`` restores them on
a new pipeline, model and optimizer, and the run goes on bit for bit, in the middle of a window
too. One limit, DDP's: a DDP module built with ``static_graph=True`` (TorchRec's DMP default)
must all-reduce in its first backward, so a resumed run can only start with a call that
all-reduces (a window's last batch, or a warm-up one): ``state_dict()`` refuses other cuts over
such a model with one line saying which steps qualify.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torchrec.distributed.train_pipeline import gradient_accumulation as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out

from torchrec_swp.catalog.accumulation import accumulation_phases, syncs
from torchrec_swp.integrations.torchrec.engine_driven import PipelineLife
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven, check_world_size
from torchrec_swp.plan import PipelinePlan, PlanError

__all__ = ["GradientAccumulationConfig", "GradientAccumulationWrapper"]

#: Upstream's configuration, unchanged (``is_enabled``, ``num_steps``, ``num_warmup_steps``).
GradientAccumulationConfig = upstream.GradientAccumulationConfig

_STATE_KEY = "gradient_accumulation"


def _in_plan(pipeline: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the window can be the plan's: our pipeline, not yet run and not tuning itself
    (``can_replan``), one phase with both optimizer tasks, and the optimizer it steps is the one
    given (upstream's wrapper would step the given one)."""
    if not isinstance(pipeline, PlanDriven) or getattr(pipeline, "_optimizer", None) is not optimizer:
        return False
    if not pipeline.can_replan:
        return False
    plan = pipeline.plan
    return isinstance(plan, PipelinePlan) and {"ZeroGrad", "OptimizerStep"} <= set(plan.schedule)


class GradientAccumulationWrapper(PipelineLife, upstream.GradientAccumulationWrapper[In, Out]):
    """Upstream's GradientAccumulationWrapper, same constructor (``pipeline, optimizer, model,
    config``) and methods; over a torchrec_swp pipeline whose plan allows it, the window is phases
    of the plan (see the module docstring) and ``state_dict()`` / ``load_state_dict()`` carry the
    gradients accumulated so far. ``close()`` (or the end of a ``with`` block) ends the wrapper
    and closes the pipeline it wraps, where that one can be closed (``PipelineLife``)."""

    def __init__(
        self,
        pipeline: Any,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        config: upstream.GradientAccumulationConfig,
    ) -> None:
        in_plan = config.is_enabled and _in_plan(pipeline, optimizer)
        super().__init__(pipeline, optimizer, model, config)
        self._swp_in_plan = in_plan
        if in_plan:
            # the window is the plan's: the pipeline steps the optimizer itself, in the phases
            # that keep OptimizerStep (upstream's __init__ has just swapped in its interceptor)
            pipeline._optimizer = optimizer
            pipeline.replan(accumulation_phases(pipeline.plan, config.num_steps, config.num_warmup_steps))

    def progress(self, dataloader_iter: Iterator[In], is_last_batch: bool | None = None) -> Out:
        """Upstream's; after ``close()``, PipelineClosed naming the class."""
        self._swp_check_open()
        return super().progress(dataloader_iter, is_last_batch)

    def close(self) -> None:
        """End the wrapper and the pipeline it wraps (if that has a ``close()``: upstream's have none)."""
        close = getattr(self._pipeline, "close", None)
        if close is not None:
            close()
        super().close()

    @property
    def window_in_plan(self) -> bool:
        """Whether the window is the plan's phases (our pipeline, see the module docstring), not
        upstream's optimizer wrapper."""
        return self._swp_in_plan

    @property
    def current_step(self) -> int:
        """The calls that trained a batch since the wrapper was built or reset (upstream's
        counter; on the plan route the engine's clock ``"trained"``)."""
        if self._swp_in_plan:
            return self._pipeline.engine.trained_since_reset
        return super().current_step

    def _advance_state(self) -> None:
        if self._swp_in_plan:  # the engine counted; the optimizer wrapper shows the same number
            self._optimizer_wrapper.set_step(self.current_step)
        else:
            super()._advance_state()

    def set_step(self, step: int) -> None:
        """Upstream's ``set_step``; on the plan route before the first ``progress()`` only (or
        right after ``reset()``), when no thread has picked the phase of a batch yet."""
        if self._swp_in_plan:
            self._pipeline.engine.count_trained_from(step)
        self._optimizer_wrapper.set_step(step)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The pipeline's ``state_dict()`` (a cut at the batches trained so far) with, under
        ``"gradient_accumulation"``, the step counter, the zero_grad flag of upstream's route and
        the gradients accumulated in the window so far (``{name: grad}`` on the CPU, per rank:
        while not all-reduced they differ between ranks). Raises PlanError where the pipeline
        has no ``state_dict()`` (upstream's pipelines) or where the cut's next call would skip the
        all-reduce over a DDP module with ``static_graph=True``, which a resumed run cannot start
        with."""
        if not isinstance(self._pipeline, PlanDriven):
            raise PlanError(
                f"GradientAccumulationWrapper.state_dict(): {type(self._pipeline).__name__} has no state_dict() "
                "(a torchrec_swp pipeline has)"
            )
        state = self._pipeline.state_dict()
        if not self._config.is_enabled:
            return state
        step = self.current_step
        self._check_resumable(step, "state_dict()")
        state[_STATE_KEY] = {
            "num_steps": self._config.num_steps,
            "num_warmup_steps": self._config.num_warmup_steps,
            "step": step,
            "needs_zero_grad": self._optimizer_wrapper._needs_zero_grad,
            "gradients": {
                name: p.grad.detach().cpu().clone() for name, p in self._model.named_parameters() if p.grad is not None
            },
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, resized: bool = False) -> None:
        """Go on from ``state_dict()``'s cut: the pipeline's state, then the counter and the
        accumulated gradients (``.grad`` of every parameter; None for those saved without).
        Before the first ``progress()``; model and optimizer restored from the same step.

        ``resized=True`` (a state cut on another number of ranks, ``PlanDriven.load_state_dict``):
        refused, in one line, at a cut inside a window, whose gradients each old rank accumulated
        from its own batches without the all-reduce (they belong to no new rank); after a window's
        last batch (or a warm-up one) the gradients were all-reduced, the same on every old rank,
        and carry over. ``resized`` must agree with the state's world size, as the pipeline's
        (``check_world_size``), checked first."""
        if not isinstance(self._pipeline, PlanDriven):
            raise PlanError(
                f"GradientAccumulationWrapper.load_state_dict(): {type(self._pipeline).__name__} has no "
                "load_state_dict() (a torchrec_swp pipeline has)"
            )
        saved = state.get(_STATE_KEY) if isinstance(state, Mapping) else None
        if isinstance(state, Mapping):  # before the window's check, which trusts resized=
            check_world_size(state, resized=resized, owner="GradientAccumulationWrapper")
        if not self._config.is_enabled:
            if saved is not None:
                raise PlanError(
                    "GradientAccumulationWrapper.load_state_dict(): the state accumulated gradients, "
                    "this wrapper's config does not"
                )
            self._pipeline.load_state_dict(state, resized=resized)
            return
        if saved is None:
            raise PlanError(
                "GradientAccumulationWrapper.load_state_dict(): the state holds no accumulated gradients "
                "(saved by the pipeline, not by a GradientAccumulationWrapper)"
            )
        ours = (self._config.num_steps, self._config.num_warmup_steps)
        if (saved["num_steps"], saved["num_warmup_steps"]) != ours:
            raise PlanError(
                f"GradientAccumulationWrapper.load_state_dict(): the state was saved with num_steps="
                f"{saved['num_steps']}, num_warmup_steps={saved['num_warmup_steps']}; "
                f"this wrapper has {ours[0]}, {ours[1]}"
            )
        step = int(saved["step"])
        if resized and step > 0 and not syncs(step - 1, *ours):
            raise PlanError(
                f"GradientAccumulationWrapper.load_state_dict(resized=True): the cut at step {step} is inside an "
                f"accumulation window, whose gradients each old rank accumulated alone: they cannot move to another "
                f"world size; resize from a checkpoint where step % {ours[0]} == 0"
            )
        self._check_resumable(step, "load_state_dict()")
        params = dict(self._model.named_parameters())
        gradients: dict[str, torch.Tensor] = saved["gradients"]
        grad: torch.Tensor | None  # (None below: a parameter without a saved gradient)
        for name, grad in gradients.items():
            if name not in params or params[name].shape != grad.shape:
                raise PlanError(
                    f"GradientAccumulationWrapper.load_state_dict(): the gradient of {name!r} ({tuple(grad.shape)}) "
                    "fits no parameter of the model (another model?)"
                )
        self._pipeline.load_state_dict(state, resized=resized)
        if self._swp_in_plan:
            if self.current_step != step:
                raise PlanError(
                    "GradientAccumulationWrapper.load_state_dict(): the pipeline's cut is at step "
                    f"{self.current_step}, "
                    f"the accumulation's at {step} (a state from another wrapper?)"
                )
        else:
            self._optimizer_wrapper.set_step(step)
        self._optimizer_wrapper._needs_zero_grad = bool(saved["needs_zero_grad"])
        for name, param in params.items():
            grad = gradients.get(name)
            param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)

    def _check_resumable(self, step: int, what: str) -> None:
        """PlanError when a run resumed at ``step`` would start with a call that skips the
        all-reduce over a DDP module with ``static_graph=True`` (DDP fails there)."""
        k, w = self._config.num_steps, self._config.num_warmup_steps
        if syncs(step, k, w):
            return
        static = [m for m in self._get_ddp_modules() if getattr(m, "static_graph", False)]
        if static:
            raise PlanError(
                f"GradientAccumulationWrapper.{what}: at step {step} the next batch accumulates without the "
                f"all-reduce, and the model's DDP has static_graph=True, whose first backward after a resume must "
                f"all-reduce: cut where step % {k} == {k - 1} (the window's last batch next), or build DDP "
                "with static_graph=False"
            )
