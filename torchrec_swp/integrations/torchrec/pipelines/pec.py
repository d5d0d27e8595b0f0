"""TrainPipelinePEC (TorchRec 1.9) on the engine: compute-ahead training for PEC embedding collections."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from typing import Any

import torch
from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection
from torchrec.distributed.train_pipeline import pec_train_pipeline as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out, PECTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PECPipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist as UpstreamSparseDist

from torchrec_swp.engine import device_has_streams
from torchrec_swp.engine.labels import record_function
from torchrec_swp.engine.transaction import running_as
from torchrec_swp.integrations.torchrec.pipelines.cpu_safe import stream_of_a_streamed_device, streamless_on_cpu
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import Dep, PipelinePlan

__all__ = ["TrainPipelinePEC"]

_UPSTREAM_INIT = inspect.signature(upstream.TrainPipelinePEC.__init__)
_NOT_CAPTURED = contextlib.nullcontext()  # stateless: one serves every call


class TrainPipelinePEC(TrainPipelineSparseDist[In, Out], upstream.TrainPipelinePEC):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelinePEC on the engine: OL lookups and non-PEC lookups of batch N, the overlap of
    N+1 with N and N+1's NOL lookups ahead, input dist of N+2, then forward/backward/optimizer
    of N with its OL gradient applied and its NOL gradient deferred to the next step.

    Same constructor as upstream's (``model, optimizer, device, execute_all_batches, apply_jit,
    custom_model_fwd``) plus the keyword-only engine options of TrainPipelineSparseDist. The
    default plan is ``catalog.pec_plan(...)``, upstream's progress() steps #1-#14 as tasks; the
    first batch of an epoch (upstream's ``fill_pipeline``) and the last one (no successor) are
    tasks guarded ``first`` and ``last``. Task functions call upstream's helpers through
    ``self`` (``_pec_overlap_dist``, ``_pec_ol_compute``, ``_pec_nol_compute``,
    ``_compute_and_output_dist``, ``_start_deferred_nol_grad``, ``_defer_nol_grad``, ...).

    Runs on CPU as shipped, where upstream cannot even be constructed: its constructor creates
    ``torch.cuda.Event()`` objects (a CPU build raises "Tried to instantiate dummy base class
    Event"), its helpers ``record_stream`` CPU tensors onto the CPU's current stream, and its
    pipelined forward falls back to CUDA without a stream. Here the events are the device's
    own (``torch.get_device_module(device).Event()``: CUDA's on CUDA), ``record_stream`` happens
    only on devices with streams, and the forward is upstream's ``PECPipelinedForward`` made
    stream-aware (``cpu_safe.streamless_on_cpu``). On CUDA/MTIA every path is upstream's.

    Differences: the fill interleaves batch 1's input dist with batch 0's overlap detection
    (same calls, same collective order on every rank); ``progress()`` re-attaches a detached
    model, as TrainPipelineSparseDist does.
    """

    # SparseDist's tasks its steps do not run (the module context is SetModuleContext's)
    _swp_without_tasks = ("WaitBatch", "ClearDataDistInputs")

    def _swp_init_upstream(self, *args: Any, **kwargs: Any) -> None:
        # upstream TrainPipelinePEC.__init__, with the device's events instead of CUDA's
        bound = _UPSTREAM_INIT.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        UpstreamSparseDist.__init__(
            self,
            model=a["model"],
            optimizer=a["optimizer"],
            device=a["device"],
            execute_all_batches=a["execute_all_batches"],
            apply_jit=a["apply_jit"],
            context_type=PECTrainPipelineContext,
            custom_model_fwd=a["custom_model_fwd"],
        )
        self._pec_modules: dict[str, Any] = {}  # upstream's: name -> ShardedPECEmbeddingCollection
        device_module = torch.get_device_module(self._device)
        self._input_dist_event = device_module.Event()
        self._overlap_dist_event = device_module.Event()
        self._pipelined_forward_type = streamless_on_cpu(PECPipelinedForward)
        # asked twice a step; the device and the checked mode are fixed for the pipeline's life
        self._swp_has_streams = device_has_streams(self._device)
        # on_nonfinite: each batch's context from its OlGradStart to its verdict (DeferredNolGrad)
        self._swp_pec_open: dict[int, PECTrainPipelineContext] = {}

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(execute_all_batches=self._execute_all_batches)

    # ------------------------------------------------- on_nonfinite: a step undone
    def _swp_undoable_plan(self, plan: PipelinePlan) -> PipelinePlan:
        return last_nol_before_ol(plan)

    def _swp_extra_effects(self) -> dict[str, Any]:
        return {"stashed_grads": DeferredNolGrad(self)}

    def _swp_nol_appliers(self, b: int) -> list[Any]:
        """Batch ``b``'s NOL gradient appliers (made by its backward, applied in the next step),
        where OlGradStart recorded ``b``'s context (``on_nonfinite``, training)."""
        context = self._swp_pec_open.get(b)
        if context is None:
            return []
        return [
            a.nol_grad_apply
            for name in self._pec_modules
            for a in (self._pec_module_ctx(context, name).autograd_ctx_per_sharding or ())
            if a.nol_grad_apply is not None
        ]

    def _swp_drop_nol_grad(self, b: int, drop: bool) -> None:
        """Batch ``b``'s step decided: where it rolled back (``drop``), its NOL gradient is not
        deferred to the next step (DeferNolGrad hands on nothing: its backward partitions go)."""
        context = self._swp_pec_open.pop(b, None)
        for older in [k for k in self._swp_pec_open if k < b]:
            del self._swp_pec_open[older]
        if drop and context is not None:
            context.pec_backward_ctxs.clear()

    # ------------------------------------------------- upstream helpers, CPU-safe
    @staticmethod
    def _record_stream_forward_ctx(ctx: Any, stream: Any) -> None:
        if stream_of_a_streamed_device(stream):
            upstream.TrainPipelinePEC._record_stream_forward_ctx(ctx, stream)

    @staticmethod
    def _record_stream_backward_ctx(ctx: Any, stream: Any) -> None:
        if stream_of_a_streamed_device(stream):
            upstream.TrainPipelinePEC._record_stream_backward_ctx(ctx, stream)

    def _wait_pec_overlap_results(self, results: Any, default_stream: Any) -> Any:
        """Upstream's, with the partitions recorded on the compute stream that consumes them.
        Upstream's ``_pec_overlap_dist`` passes the stream current when it starts, the compute
        stream in its ``progress()``; the plan runs OverlapDist inside the ``data_dist`` stream,
        where that would record them on ``data_dist`` and free them under the compute stream's
        lookups (the CPU stream checker found it)."""
        return super()._wait_pec_overlap_results(results, self._swp_compute_stream())

    def _compute_and_output_dist(self, context: PECTrainPipelineContext) -> None:
        """Upstream's: look up the non-PEC modules of ``context``'s batch. Without streams the
        same waits and lookups, minus the stream event and ``record_stream`` calls."""
        if self._swp_has_streams:
            super()._compute_and_output_dist(context)
            return
        modules = [m for m in self._pipelined_modules if not isinstance(m, ShardedPECEmbeddingCollection)]
        with self._stream_context(self._data_dist_stream):
            waited = {m.forward.name: context.input_dist_tensors_requests[m.forward.name].wait() for m in modules}
        for m in modules:
            name = m.forward.name
            context.embedding_a2a_requests[name] = m.compute_and_output_dist(
                context.module_contexts[name], waited[name]
            )

    # ------------------------------------------------------------ task functions
    @task("SetModuleContext")
    def _task_set_module_context(self, b: int, context: Any) -> None:
        self._set_module_context(context)

    @task("OlCompute")
    def _task_ol_compute(self, b: int, context: Any) -> None:
        with record_function("## pec_ol_compute ##"):
            self._pec_ol_compute(context)

    @task("EmbLookup")
    def _task_emb_lookup(self, b: int, context: Any) -> None:
        with record_function("## pec_compute_and_output_dist ##"):
            self._compute_and_output_dist(context)

    @task("OverlapDist")
    def _task_overlap_dist(self, b: int, context: Any, prev_context: Any) -> None:
        # the overlap of batch b with b-1 (None for the first batch of an epoch)
        with record_function("## pec_overlap_dist ##"):
            self._pec_overlap_dist(context, prev_context)
        self._swp_record_pec_inputs(context)

    def _swp_record_pec_inputs(self, context: PECTrainPipelineContext) -> None:
        """Record on the compute stream what the PEC modules' input dist of ``context``'s batch
        made on ``data_dist`` and the compute stream reads (the module contexts' sharding
        tensors, the dist output that OverlapDist waited for): upstream records the non-PEC
        modules' contexts only (``_compute_and_output_dist``), so their memory could be handed
        out again on ``data_dist`` before the lookups that read it ran (the CPU stream checker
        found it; upstream's PEC has the same gap). A no-op without streams."""
        compute = self._swp_compute_stream()
        if not stream_of_a_streamed_device(compute):
            return
        for name in self._pec_modules:
            self._pec_module_ctx(context, name).record_stream(compute)
            context.pec_dist_inputs[name].record_stream(compute)

    @task("OverlapDistLast")
    def _task_overlap_dist_last(self, b: int, context: Any) -> None:
        # the last batch has no successor: its backward partition alone
        with record_function("## pec_overlap_dist ##"):
            self._pec_overlap_dist(None, context)

    @task("NolGradStart")
    def _task_nol_grad_start(self, b: int, context: Any) -> Any:
        with record_function("## pec_nol_grad_a2a ##"):
            return self._start_deferred_nol_grad(context)

    @task("RecordBatch")
    def _task_record_batch(self, b: int, batch: Any) -> None:
        # upstream keeps the batch alive on the compute stream, which reads its dense features;
        # an in-place copy reuses a persistent buffer. Nothing to record without streams.
        if self._swp_has_streams and not self._enable_inplace_copy_batch:
            batch.record_stream(torch.get_device_module(self._device).current_stream())

    @task("Forward")
    def _task_forward(self, b: int, batch: Any) -> tuple[Any, Any]:  # type: ignore[override]  # called with its plans' reads, which here never include context
        with record_function("## forward ##"):
            losses, output = self._model_fwd(batch)
        return losses, output

    @task("NolGradApply")
    def _task_nol_grad_apply(self, b: int, nol_grad: Any) -> None:
        # batch b-1's gradient, whose step is decided: its lookups again are no batch's to undo
        # (no batch's to count where nothing captures: on_nonfinite="off")
        counted = running_as(None) if self._swp_nonfinite is not None else _NOT_CAPTURED
        with record_function("## pec_nol_grad_apply ##"), counted:
            self._wait_pec_grad(nol_grad)

    @task("NolCompute")
    def _task_nol_compute(self, b: int, context: Any) -> None:
        torch.get_device_module(self._device).current_stream().wait_event(self._overlap_dist_event)
        with record_function("## pec_nol_compute ##"):
            self._pec_nol_compute(context)

    # upstream's PEC: backward through the hook without the 2D embedding sync, the optimizer
    # stepped inline (TrainingTasks, not SparseDist's)
    _task_backward = TrainingTasks._task_backward
    _task_optimizer_step = TrainingTasks._task_optimizer_step

    @task("WaitOverlapDist")
    def _task_wait_overlap_dist(self, b: int) -> None:
        # the last batch's backward partition is first needed by its OL gradient
        if self._model.training:
            torch.get_device_module(self._device).current_stream().wait_event(self._overlap_dist_event)

    @task("OlGradStart")
    def _task_ol_grad_start(self, b: int, context: Any) -> Any:
        if not self._model.training:
            return {}
        if self._swp_nonfinite is not None:  # (its NOL gradient: checked, dropped if it rolls back)
            self._swp_pec_open[b] = context
        with record_function("## pec_ol_grad_a2a ##"):
            return self._start_pec_ol_grad(context)

    @task("OlGradApply")
    def _task_ol_grad_apply(self, b: int, ol_grad: Any) -> None:
        if self._model.training:
            with record_function("## pec_ol_grad_apply ##"):
                self._wait_pec_grad(ol_grad)

    @task("DeferNolGrad")
    def _task_defer_nol_grad(self, b: int, context: Any, prev_context: Any) -> None:
        # batch b-1's NOL gradient rides on batch b's context to b's step
        if self._model.training:
            self._defer_nol_grad(prev_context, context)

    @task("DeferNolGradLast")
    def _task_defer_nol_grad_last(self, b: int, context: Any) -> None:
        # the last batch has no successor: its NOL gradient is applied in its own step
        if self._model.training:
            self._defer_nol_grad(context, context)
            self._wait_pec_grad(self._start_deferred_nol_grad(context))


class DeferredNolGrad:
    """``stashed_grads`` of TrainPipelinePEC (``on_nonfinite``): the NOL gradient a batch's
    backward made, which the next step applies (its ids are not in the next batch). Nothing to
    copy: at the verdict it is checked (a finite loss can leave it non-finite) and, where the
    step rolls back, not handed on (the pipeline's ``_swp_drop_nol_grad``). What is dropped or
    not is decided on the host (a device verdict is read there). Holds the pipeline weakly."""

    empty = False

    def __init__(self, pipeline: TrainPipelinePEC) -> None:
        self._pipeline = weakref.ref(pipeline)

    def capture(self, b: int) -> int:
        return b

    def changed(self, b: int) -> tuple[list[torch.Tensor], str]:
        pipeline = self._pipeline()
        appliers = [] if pipeline is None else pipeline._swp_nol_appliers(b)
        pending = [a._grad for a in appliers if isinstance(getattr(a, "_grad", None), torch.Tensor)]
        return pending, "the deferred NOL gradient"

    def restore(self, b: int, keep: torch.Tensor | bool) -> None:
        pipeline = self._pipeline()
        if pipeline is not None:
            pipeline._swp_drop_nol_grad(b, not bool(keep))


def last_nol_before_ol(plan: PipelinePlan) -> PipelinePlan:
    """``plan`` with the last batch's NOL gradient applied before its OL gradient (DeferNolGradLast
    before OlGradApply, after OptimizerStep), so that every change of a batch's rows comes before
    the task that decides its step (``on_nonfinite``: OlGradApply). The two touch disjoint rows
    (a batch's ids split into those of the next batch and the others), so for a row-wise
    optimizer the order changes no value; OlGradStart declares the NOL gradient it stashes
    (``stashed_grads``); and NolGradApply(b) declares nothing: what it changes is batch b-1's
    (its deferred NOL gradient, rows not in b), whose step was decided, so it is neither
    captured nor undone with b's, and nothing waits for b's verdict because of it (b+1's NOL
    lookups read those rows ahead, before b's OL gradient, as upstream). A plan without these
    tasks is returned as it is."""
    names = set(plan.fire_order)
    if {"DeferNolGradLast", "OlGradApply", "OptimizerStep"} <= names and plan.fire_index(
        "DeferNolGradLast"
    ) > plan.fire_index("OlGradApply"):
        deps = [d for d in plan.explicit_deps if d != Dep("DeferNolGradLast", "OlGradApply")]
        deps += [Dep("OlGradApply", "DeferNolGradLast"), Dep("DeferNolGradLast", "OptimizerStep")]
        fire = [t for t in plan.fire_order if t != "DeferNolGradLast"]
        fire.insert(fire.index("OlGradApply"), "DeferNolGradLast")
        plan = plan.replace(
            fire_order=fire,
            intra_iter_deps=[d for d in deps if d.distance == 0],
            inter_iter_deps=[d for d in deps if d.distance],
        )
    tasks = dict(plan.tasks)
    if "OlGradStart" in tasks and "stashed_grads" not in tasks["OlGradStart"].effects:
        io = tasks["OlGradStart"]
        tasks["OlGradStart"] = dataclasses.replace(io, effects=(*io.effects, "stashed_grads"))
    if "NolGradApply" in tasks and tasks["NolGradApply"].effects:
        tasks["NolGradApply"] = dataclasses.replace(tasks["NolGradApply"], effects=())
    if tasks != dict(plan.tasks):
        plan = plan.replace(tasks=list(tasks.values()))
    return plan
