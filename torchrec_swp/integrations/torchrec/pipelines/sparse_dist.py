"""TrainPipelineSparseDist on the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState

from torchrec_swp.autotune import Hooks
from torchrec_swp.catalog import transforms
from torchrec_swp.engine import StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec import compat
from torchrec_swp.integrations.torchrec.input_dist_group import (
    new_input_dist_group,
    rebind_input_dists,
    restore_input_dists,
)
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import DEFAULT_STREAM, MAIN_THREAD, PhasedPlan, PipelinePlan
from torchrec_swp.plan.threads import IO_THREAD

__all__ = ["TrainPipelineSparseDist"]

ASYNC_INPLACE_COPY = "async_inplace_copy"
#: The thread group ``async_inplace_copy`` runs the in-place H2D copy on: ``io``, the one name of a
#: thread that loads or copies the next batch (``catalog.COPY_THREAD``, the ``"io"`` thread map's).
INPLACE_COPY_THREAD = IO_THREAD


def _upstream_name(cls: type) -> str:
    """The name of the TorchRec class ``cls`` wraps (the first torchrec class in its MRO)."""
    return next(c.__name__ for c in cls.__mro__ if c.__module__.startswith("torchrec."))


class TrainPipelineSparseDist(PlanDriven, TrainingTasks, upstream.TrainPipelineSparseDist[In, Out]):
    """TrainPipelineSparseDist on the engine: H2D(i+2) || InputDist(i+1) || fwd/bwd/opt(i).

    Same constructor as upstream's, plus the engine's keyword-only options (``EngineOptions``),
    which this class's subclasses share. The default plan is ``catalog.sparse_dist_plan(...)`` with this pipeline's
    ``enqueue_batch_after_forward``, ``execute_all_batches`` and ``clear_data_dist_inputs``. With
    ``loads=`` its source H2D is split: a Fetch task draws on the load threads, H2D copies.

    ``async_inplace_copy`` (TorchRec 1.9's option; accepted here on 1.8 too, and by Lite and
    Prefetch): with ``enable_inplace_copy_batch`` the default plan puts the H2D task on thread
    group ``io`` (the catalog's ``h2d_thread``), as upstream's background copy thread
    would, on every device (upstream keeps it off on CPU); a ``plan=`` of the user's keeps its own
    threads. Same results either way.

    ``input_dist_group`` (ours): ``True`` gives the sparse input dist a process group of its own,
    created here over the ranks of the default group with its backend (every rank must build
    the pipeline); a ProcessGroup object is used as given (e.g. one group shared by several
    pipelines). The input dists are moved to it right after TorchRec creates them (the first
    input dist), and the default plan gets ``transforms.with_input_dist_group``: with the input dist
    tasks on a thread of their own (``thread_map={"InitPipelinedModules": "dist",
    "InputDistStart": "dist", "InputDistWait": "dist"}`` or ``"by_stream"``), the next batch's
    input dist overlaps this batch's forward and backward collectives (a ``plan=`` of the
    user's keeps its own comm groups). Same results; see
    ``integrations/torchrec/input_dist_group.py`` for what moves and its cost.
    """

    _swp_keywords = (ASYNC_INPLACE_COPY,)  # TorchRec 1.8's constructor does not name it

    def __init__(self, *args: Any, input_dist_group: bool | dist.ProcessGroup = False, **kwargs: Any) -> None:
        options = EngineOptions.take(kwargs, type(self).__name__)
        self._swp_input_dist_group: dist.ProcessGroup | None = None
        self._swp_rebound_modules: list[Any] | None = None  # the _pipelined_modules last rebound
        # the input dists this pipeline moved to its own group, and the groups they had
        self._swp_moved_input_dists: list[tuple[Any, dist.ProcessGroup]] = []
        if input_dist_group is True:
            self._swp_input_dist_group = self._swp_made_input_dist_group("input_dist_group=True")
        elif isinstance(input_dist_group, dist.ProcessGroup):
            self._swp_input_dist_group = input_dist_group
        elif input_dist_group is not False:
            raise TypeError(f"input_dist_group must be a bool or a ProcessGroup, got {type(input_dist_group).__name__}")
        # async_inplace_copy (TorchRec 1.9) is ours to schedule, on any supported version and
        # device: never handed to upstream, whose background copy thread would bypass the engine.
        if _upstream_name(type(self)) in compat.ASYNC_INPLACE_COPY_PIPELINES:
            args, kwargs, async_copy = compat.take_argument(super().__init__, ASYNC_INPLACE_COPY, args, kwargs)
        else:
            async_copy = None
        self._swp_async_inplace_copy = bool(async_copy)
        self._swp_init_upstream(*args, **kwargs)
        default_plan: PipelinePlan | PhasedPlan = self._swp_default_plan()
        if self._swp_input_dist_group is not None:
            # (cast: PlanT is constrained to either plan type, not their union)
            default_plan = transforms.with_input_dist_group(cast(Any, default_plan))
        self._swp_setup(default_plan, options, self._swp_streams())

    def _swp_init_upstream(self, *args: Any, **kwargs: Any) -> None:
        """The upstream class's constructor (a subclass overrides it where upstream's cannot run
        on every device as it is)."""
        super().__init__(*args, **kwargs)

    def _swp_h2d_thread(self) -> str:
        """The thread group of H2D in the default plan (the catalog's ``h2d_thread``): as upstream's
        AsyncInplaceCopyMixin, the in-place copy (and only it) leaves the calling thread."""
        return INPLACE_COPY_THREAD if self._swp_async_inplace_copy and self._enable_inplace_copy_batch else MAIN_THREAD

    def _swp_default_plan(self) -> PipelinePlan | PhasedPlan:  # a PhasedPlan for SemiSync
        return self._swp_row_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            h2d_thread=self._swp_h2d_thread(),
            name=type(self).__name__,
        )

    def _swp_streams(self) -> StreamPool:
        pool = stream_pool_for(self._device, {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream})
        return self._swp_checked(pool, {"_memcpy_stream": "memcpy", "_data_dist_stream": "data_dist"})

    def start_sparse_data_dist(self, batch: In | None, context: Any) -> None:
        super().start_sparse_data_dist(batch, context)
        # TorchRec creates the input dists in the first call (inside _pipeline_model, which then
        # hands their group to _override_input_dist_forwards): move them to their own group now.
        group = self._swp_input_dist_group
        if group is not None and batch is not None and self._swp_rebound_modules is not self._pipelined_modules:
            rebind_input_dists(self._pipelined_modules, group, self._swp_moved_input_dists)
            self._swp_rebound_modules = self._pipelined_modules

    def _swp_autotune_hooks(self) -> Hooks:
        """The tuner may give the input dist a process group of its own (where there is a world of
        more than one rank and the pipeline was not built with one)."""
        if self._swp_input_dist_group is not None or not (dist.is_initialized() and dist.get_world_size() > 1):
            return Hooks()
        return Hooks(own_group=transforms.INPUT_DIST_TASKS, enable=self._swp_own_input_dist_group)

    def _swp_own_input_dist_group(self) -> None:
        """The input dist's own process group, made now (a collective: every rank at the same
        batch boundary), its input dists moved to it (or after the first input dist, when TorchRec
        makes them)."""
        self._swp_input_dist_group = self._swp_made_input_dist_group("autotune")
        if self._pipelined_modules:
            rebind_input_dists(self._pipelined_modules, self._swp_input_dist_group, self._swp_moved_input_dists)
            self._swp_rebound_modules = self._pipelined_modules

    def _swp_made_input_dist_group(self, why: str) -> dist.ProcessGroup:
        """A new input dist group (``why``: the option that asked for it), destroyed by the
        pipeline's teardown after its input dists went back to the group they had."""
        group = new_input_dist_group(where=f"{type(self).__name__}({why})")
        self._swp_teardown().group(group, partial(restore_input_dists, self._swp_moved_input_dists))
        return group

    def _swp_before_step(self) -> None:
        self._state = PipelineState.IDLE
        # attach the model in case the user detached it and forgot to attach it (as upstream does)
        if not self._model_attached:
            self.attach(self._model)
        engine = self._swp_engine
        if self.batches and not engine.batches.book.in_flight:
            # Batches the engine did not load: user code (or a test) put them where upstream's
            # progress() reads them. batches[0] is the one to train now, as upstream assumes.
            engine.adopt([{"batch": b, "context": c} for b, c in zip(self.batches, self.contexts)])

    def _swp_on_new_data(self) -> None:
        self._dataloader_exhausted = False

    def _swp_draw_undoer(self) -> Callable[[int, Mapping[str, Any]], None]:
        return self._swp_dequeue_retracted

    def _swp_dequeue_retracted(self, b: int, slot: Mapping[str, Any]) -> None:
        """Batch ``b`` was retracted (uneven data): the source (``H2D``: ``enqueue_batch``)
        appended it to ``self.batches``/``self.contexts``, last; it leaves them (a source that only
        draws, ``Fetch`` or ``LoadBatch``, appended nothing: its slot has no context there)."""
        context = slot.get("context")
        if context is not None and self.contexts and self.contexts[-1] is context:
            self.contexts.pop()
            self.batches.pop()

    # ------------------------------------------------------------ task functions
    @task(transforms.FETCH)
    def _task_fetch(self, b: int, data: Iterator[In]) -> In:
        # transforms.with_parallel_loads: the draw alone, on the loads' lanes; H2D copies it
        return next(data)

    @task("H2D")
    def _task_h2d(self, b: int, data: Iterator[In] | None = None, host: In | None = None) -> tuple[Any, Any]:
        if data is None:  # the item was drawn by Fetch (transforms.with_parallel_loads)
            data = iter((host,))
        # enqueue_batch appends to self.batches/self.contexts (user-visible state) and, with
        # execute_all_batches=False, raises StopIteration itself at the end of data.
        if self._enable_inplace_copy_batch:
            # In-place copy allocates the batch on the current stream and copies on the memcpy
            # stream itself; upstream allocates on the compute stream (and, from TorchRec 1.9,
            # skips record_stream for it), so the allocation must not happen on the memcpy
            # stream the engine entered for this task.
            with self._swp_engine.streams.context(DEFAULT_STREAM):
                loaded = self.enqueue_batch(data)
        else:
            loaded = self.enqueue_batch(data)
        if not loaded:
            raise StopIteration
        return self.batches[-1], self.contexts[-1]

    @task("InitPipelinedModules")
    def _task_init_pipelined_modules(self, b: int, batch: Any, context: Any) -> None:
        # upstream's fill: the first time this rewrites the model; afterwards it sets the module
        # context and starts the input dist
        self._init_pipelined_modules(batch, context, self._pipelined_forward_type)

    @task("InputDistStart")
    def _task_input_dist_start(self, b: int, batch: Any, context: Any) -> None:
        self.start_sparse_data_dist(batch, context)

    @task("InputDistWait")
    def _task_input_dist_wait(self, b: int, context: Any) -> None:
        self.wait_sparse_data_dist(context)

    @task("WaitBatch")
    def _task_wait_batch(self, b: int, batch: Any, context: Any) -> None:
        self._set_module_context(context)
        self._wait_for_batch()

    @task("ClearDataDistInputs")
    def _task_clear_data_dist_inputs(self, b: int, context: Any) -> None:
        self.clear_sparse_data_dist_inputs(context)

    @task("Forward")
    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## forward {context.index} ##"):
            self._state = PipelineState.CALL_FWD
            losses, output = self._model_fwd(batch)
        return losses, output

    @task("Backward")
    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            self._state = PipelineState.CALL_BWD
            self._backward(losses)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)

    @task("OptimizerStep")
    def _task_optimizer_step(self, b: int, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            self._optimizer_step()

    @task("Dequeue")
    def _task_dequeue(self, b: int, context: Any) -> None:
        self.dequeue_batch()
