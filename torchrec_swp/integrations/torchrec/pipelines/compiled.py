"""TrainPipelinePT2 and TrainPipelineSparseDistCompAutograd on the engine: the pipelines that compile.

Both constructors change global dynamo/inductor settings, as upstream's do.
TrainPipelineSparseDistCompAutograd also switches the model's DistributedDataParallel to DDP's
Python reducer (compiled autograd refuses the C++ one); see ``_use_ddp_python_reducer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch._dynamo.trace_rules
import torch._inductor.config
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.comm_ops import torchrec_use_sync_collectives
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState
from torchrec.distributed.train_pipeline.utils import _to_device

from torchrec_swp.engine import Engine, StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven, nothing_to_undo
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import PhasedPlan, PipelinePlan

__all__ = ["TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd"]

logger: logging.Logger = logging.getLogger(__name__)


class TrainPipelinePT2(PlanDriven, TrainingTasks, upstream.TrainPipelinePT2[In, Out]):
    """TrainPipelinePT2 on the engine: one batch per call, no overlap; the model is compiled right
    before the Forward of batch ``compile_configs.compile_on_iter`` (from 0, over the pipeline's
    life: the 4th by default).

    Same constructor as upstream's (which does not run TrainPipelineBase's), plus the engine's
    keyword-only options (``PlanDriven``; its source LoadBatch only draws, so ``loads=`` moves it
    to the load threads as it is). The default plan is ``catalog.pt2_phases(compile_on_iter=...)``:
    the compile step is a phase of its own with a Compile task, so ``plan.print_schedule(n)`` shows it. A
    ``plan=`` without a Compile task compiles inside Forward when upstream would
    (``_iter == compile_on_iter``). At the end of data the dataloader's StopIteration ends the
    call; every later call asks the iterator again, as upstream does, so a new iterator starts a
    new epoch.

    Under ``on_nonfinite``, a rolled-back step puts ``_iter`` back (its ``counters`` effect), so the
    forward it counted never happened, and the phases go by the clock ``"trained"`` counted from
    ``_iter`` (``"drawn"`` would count the rolled-back batch): the model compiles before the same
    batch as in the run whose data lacks the rolled-back one. A rolled-back compile step is not
    undone (the model stays compiled, its hooks ran once); the next batch, now the compile step's,
    finds the model compiled and does not compile it again.
    """

    _swp_counters = ("_iter",)  # Forward counts the forwards, which say when a plan without Compile compiles

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = EngineOptions.take(kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)
        self._swp_compiled = False  # whether this pipeline compiled its model (_compile_model, from Compile or Forward)
        self._swp_setup(self._swp_default_plan(), options, self._swp_streams())
        # a plan of the user's without the Compile step: compile where upstream does, in forward
        self._swp_compile_in_forward = all("Compile" not in p.schedule for p in self._swp_engine.phased.plans)

    def _swp_default_plan(self) -> PhasedPlan:
        return self._swp_row_plan(compile_on_iter=self._compile_configs.compile_on_iter)

    def _swp_new_engine(self, plan: PipelinePlan | PhasedPlan) -> Engine:
        undoing = self._swp_nonfinite is not None
        if undoing and isinstance(plan, PhasedPlan) and plan.clock == "drawn":
            plan = PhasedPlan(plan.phases, name=plan.name, clock="trained", cycle=plan.cycle)
        engine = super()._swp_new_engine(plan)
        if undoing:
            engine.count_trained_from(self._iter)  # upstream's _iter counts on across epochs and reset()
        return engine

    def reset(self) -> None:
        super().reset()
        if self._swp_nonfinite is not None:
            self._swp_engine.count_trained_from(self._iter)

    def _swp_streams(self) -> StreamPool:
        return stream_pool_for(self._device)

    def _swp_before_step(self) -> None:
        # as upstream's progress() (a call after StopIteration asks the iterator again)
        self._state = PipelineState.IDLE

    # ------------------------------------------------------------ task functions
    def _swp_draw_undoer(self) -> Callable[[int, Mapping[str, Any]], None]:
        return nothing_to_undo  # LoadBatch only draws

    @task("LoadBatch")
    def _task_load_batch(self, b: int, data: Iterator[In]) -> Any:
        with record_function("## load_batch ##"):
            return next(data)

    @task("H2D")
    def _task_h2d(self, b: int, host_batch: Any) -> Any:
        with record_function("## copy_batch_to_gpu ##"):
            self._cur_batch = _to_device(host_batch, self._device, non_blocking=False)
        return self._cur_batch

    @task("InputTransform")
    def _task_input_transform(self, b: int, batch: Any) -> Any:
        # Upstream applies it after the copy, to the very object the compiled model receives.
        if self._input_transformer:
            self._cur_batch = self._input_transformer(batch)
        return self._cur_batch

    @task("Compile")
    def _task_compile(self, b: int) -> None:
        with record_function("## forward ##"):  # upstream compiles inside its forward's range
            self._state = PipelineState.CALL_FWD
            if not self._swp_compiled:  # (compiled already: the compile step was rolled back)
                self._compile_model()

    @task("Forward")
    def _task_forward(self, b: int, model_input: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            self._state = PipelineState.CALL_FWD
            compile_now = self._iter == self._compile_configs.compile_on_iter and not self._swp_compiled
            if self._swp_compile_in_forward and compile_now:
                self._compile_model()
            losses, output = self._model(model_input)
            self._iter += 1
        return losses, output

    def _compile_model(self) -> None:
        """Upstream's compile step: pre-compile hook, the dynamo settings TorchRec's PT2 tracing
        needs, ``model.compile(...)`` with ``compile_configs``, post-compile hook."""
        cc = self._compile_configs
        self._swp_compiled = True
        logger.info("Compiling model...")
        if self._pre_compile_fn:
            self._pre_compile_fn(self._model)
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.force_unspec_int_unbacked_size_like_on_torchrec_kjt = True
        torch._dynamo.config.skip_torchrec = False
        torch.ops.import_module("fbgemm_gpu.sparse_ops")
        self._model.compile(fullgraph=cc.fullgraph, dynamic=cc.dynamic, backend=cc.backend)
        if self._post_compile_fn:
            self._post_compile_fn(self._model)

    @task("Backward")
    def _task_backward(self, b: int, losses: torch.Tensor) -> None:  # type: ignore[override]  # called with its plans' reads, which here never include context
        if self._model.training:
            with record_function("## backward ##"):
                self._state = PipelineState.CALL_BWD
                torch.sum(losses).backward()


class TrainPipelineSparseDistCompAutograd(
    TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSparseDistCompAutograd[In, Out]  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
):
    """TrainPipelineSparseDistCompAutograd on the engine: TrainPipelineSparseDist's schedule with
    Forward and Backward under compiled autograd and TorchRec's synchronous collectives.

    Same constructor as upstream's, plus TrainPipelineSparseDist's keyword-only engine options.
    The default plan is ``catalog.comp_autograd_plan(...)`` with this pipeline's
    ``execute_all_batches`` and ``clear_data_dist_inputs``. As upstream, the first Forward runs
    without compiled autograd and every Backward runs under it.

    Two changes make it run as shipped, on any device:

    * the model's DDP switches to the Python reducer (``_use_ddp_python_reducer``): upstream
      fails in the first backward unless ``torch._dynamo.config.optimize_ddp`` was
      ``"python_reducer"`` when the model was built;
    * on the CPU, unless the model sets ``_compiled_autograd_options``, compiled autograd uses
      ``fullgraph=False``: fbgemm_gpu_cpu registers no fake kernel for the TBE backward op
      (``split_embedding_codegen_grad_indice_weights_pt2_wrapper``), so dynamo must break the
      graph there. Other devices keep upstream's ``fullgraph=True``.
    """

    compiled_autograd_options: dict[str, str | bool]  # upstream's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _use_ddp_python_reducer(self._model)
        if self._device.type == "cpu" and not hasattr(self._model, "_compiled_autograd_options"):
            self.compiled_autograd_options = {**self.compiled_autograd_options, "fullgraph": False}

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
        )

    # ------------------------------------------------------------ task functions
    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        ctx = self.get_compiled_autograd_ctx()
        with ctx, torchrec_use_sync_collectives(), record_function("## forward ##"):
            losses, output = self._model_fwd(batch)
        return losses, output

    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            ctx = self.get_compiled_autograd_ctx()
            with ctx, torchrec_use_sync_collectives(), record_function("## backward ##"):
                torch.sum(losses, dim=0).backward()

    _task_optimizer_step = TrainingTasks._task_optimizer_step  # upstream steps inline, not _optimizer_step()


def _use_ddp_python_reducer(model: torch.nn.Module) -> None:
    """Switch every DistributedDataParallel in ``model`` to DDP's Python reducer, in place.

    Afterwards each DDP is as if built under ``torch._dynamo.config.optimize_ddp =
    "python_reducer"``: every parameter's gradient is divided by the world size and all-reduced
    in a post-accumulate-grad hook, which compiled autograd traces into the backward graph.
    The C++ reducer's gradient hooks are removed, because compiled autograd raises on them
    ("Compiled autograd is not compatible with C++ DDP Reducer"), and DMP builds its DDP before
    any pipeline exists. The C++ reducer then stays idle: DDP's forward no longer prepares it.
    The rest repeats what DDP's constructor does in that mode (torch 2.13,
    ``nn/parallel/distributed.py``): inductor fuses the all-reduces into buckets, and dynamo
    inlines DDP's module so the hooks trace instead of breaking the graph.
    """
    for module in model.modules():
        if not isinstance(module, DistributedDataParallel) or module._use_python_reducer:
            continue
        module._remove_autograd_hooks()
        module._use_python_reducer = True
        torch._inductor.config._fuse_ddp_communication = True
        torch._inductor.config._fuse_ddp_bucket_size = module._bucket_config.bucket_cap_mb
        torch._dynamo.trace_rules.LEGACY_MOD_INLINELIST.add("torch.nn.parallel.distributed")
        torch._dynamo.trace_rules.get_legacy_mod_inlinelist.cache_clear()
        module._register_accum_grad_hook()
