"""Drop-in subclasses of TorchRec's pipelines whose ``progress()`` is the engine running a plan.

Change one import line and training is identical; pass ``plan=`` or ``thread_map=`` to change
the schedule without changing code::

    from torchrec_swp import TrainPipelineSparseDist
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    pipeline.plan.print_schedule(5)
    pipeline = TrainPipelineSparseDist(model, optimizer, device, thread_map={"H2D": "io"})

Each class keeps its upstream constructor (every argument passes through unchanged) and adds
keyword-only engine options:

* ``plan``: a PipelinePlan (or the path of a plan text file) replacing the default plan; its
  tasks must be among the class's task functions (``available_tasks()``).
* ``thread_map``: ``"by_stream"``, ``"per_task"``, ``"main"``, a dict ``{task: thread}`` or a
  callable, applied on top of the plan.
* ``engine_timeout_s``: bound on every blocking wait of the engine.

Task functions call upstream's helpers through ``self`` (``enqueue_batch``,
``start_sparse_data_dist``, ``wait_sparse_data_dist``, ``_wait_for_batch``, ...), so user code
that patches them by name keeps working, and get the batch and context of the batch they work
on from the engine, not from a position in ``self.batches``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrec_swp.integrations.torchrec.compat import check_torchrec_version

check_torchrec_version()

import torch  # noqa: E402
from torch.autograd.profiler import record_function  # noqa: E402
from torchrec.distributed.train_pipeline import train_pipelines as upstream  # noqa: E402
from torchrec.distributed.train_pipeline.pipeline_context import In, Out  # noqa: E402
from torchrec.distributed.train_pipeline.types import PipelineState  # noqa: E402

from torchrec_swp.engine import DEFAULT_TIMEOUT_S, Engine, StreamPool, stream_pool_for  # noqa: E402
from torchrec_swp.integrations.torchrec import plans  # noqa: E402
from torchrec_swp.plan import PipelinePlan, PlanError, ThreadMap  # noqa: E402

__all__ = ["TrainPipelineBase", "TrainPipelineSparseDist"]

PlanLike = PipelinePlan | str | os.PathLike[str]


class _PlanDriven:
    """What every torchrec_swp pipeline adds to its upstream class: a plan and an engine."""

    _swp_engine: Engine
    _swp_iter: Iterator[Any] | None

    def _swp_setup(
        self,
        default_plan: PipelinePlan,
        plan: PlanLike | None,
        thread_map: ThreadMap | None,
        timeout_s: float,
        streams: StreamPool,
    ) -> None:
        if plan is None:
            chosen = default_plan
        elif isinstance(plan, PipelinePlan):
            chosen = plan
        elif isinstance(plan, (str, os.PathLike)):
            chosen = PipelinePlan.load(os.fspath(plan))
        else:
            raise TypeError(f"plan must be a PipelinePlan or a path to a plan file, got {type(plan).__name__}")
        if thread_map is not None:
            chosen = chosen.with_thread_map(thread_map)
        functions = self._swp_task_functions()
        unknown = [t for t in chosen.fire_order if t not in functions]
        if unknown:
            raise PlanError(
                f"{type(self).__name__} has no task {unknown[0]!r}; its tasks are {', '.join(functions)}",
                culprit=unknown[0],
            )
        self._swp_iter = None
        self._swp_engine = Engine(
            chosen,
            {t: functions[t] for t in chosen.fire_order},
            streams=streams,
            timeout_s=timeout_s,
            name=f"swp-{type(self).__name__}",
        )

    # Each pipeline lists its task functions: {task name: fn(b, **reads)}.
    _swp_task_functions: Callable[[], Mapping[str, Callable[..., Any]]]

    @classmethod
    def available_tasks(cls) -> tuple[str, ...]:
        """Names of the tasks a plan for this pipeline may use."""
        return tuple(cls._SWP_TASKS)  # type: ignore[attr-defined]

    @property
    def plan(self) -> PipelinePlan:
        """The plan ``progress()`` runs (print it with ``plan.print_schedule(n)``)."""
        return self._swp_engine.plan

    @property
    def engine(self) -> Engine:
        return self._swp_engine

    def close(self) -> None:
        """Stop the engine's worker threads (they also stop when the pipeline is collected)."""
        self._swp_engine.close()


class TrainPipelineBase(upstream.TrainPipelineBase[In, Out], _PlanDriven):
    """TrainPipelineBase on the engine: LoadBatch(i+1), forward/backward(i), H2D(i+1), optimizer(i).

    The default plan is ``plans.train_pipeline_base_plan()``.
    """

    _SWP_TASKS = ("LoadBatch", "ZeroGrad", "WaitBatch", "Forward", "Backward", "H2D", "OptimizerStep")

    def __init__(
        self,
        *args: Any,
        plan: PlanLike | None = None,
        thread_map: ThreadMap | None = None,
        engine_timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        streams = stream_pool_for(self._device, {"memcpy": self._memcpy_stream})
        self._swp_setup(plans.train_pipeline_base_plan(), plan, thread_map, engine_timeout_s, streams)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        self._swp_iter = dataloader_iter
        self._connected = True
        return self._swp_engine.step()

    def reset(self) -> None:
        super().reset()
        self._swp_engine.reset()

    # ------------------------------------------------------------ task functions
    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        return {
            "LoadBatch": self._task_load_batch,
            "ZeroGrad": self._task_zero_grad,
            "WaitBatch": self._task_wait_batch,
            "Forward": self._task_forward,
            "Backward": self._task_backward,
            "H2D": self._task_h2d,
            "OptimizerStep": self._task_optimizer_step,
        }

    def _task_load_batch(self, b: int) -> Any:
        batch = self._next_batch(self._swp_iter)  # type: ignore[arg-type]
        if batch is None:
            raise StopIteration
        return batch

    def _task_h2d(self, b: int, host_batch: Any) -> Any:
        self._copy_batch_to_gpu(host_batch)
        return self._cur_batch

    def _task_zero_grad(self, b: int) -> None:
        if self._model.training:
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()

    def _task_wait_batch(self, b: int, batch: Any) -> None:
        self._batch_count += 1
        self._wait_for_batch(batch)

    def _task_forward(self, b: int, batch: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            losses, output = self._model(batch)
        return losses, output

    def _task_backward(self, b: int, losses: torch.Tensor) -> None:
        if self._model.training:
            self._backward(losses)

    def _task_optimizer_step(self, b: int) -> None:
        if self._model.training:
            with record_function("## optimizer ##"):
                self._optimizer.step()


class TrainPipelineSparseDist(upstream.TrainPipelineSparseDist[In, Out], _PlanDriven):
    """TrainPipelineSparseDist on the engine: H2D(i+2) || InputDist(i+1) || fwd/bwd/opt(i).

    The default plan is ``plans.sparse_dist_plan(...)`` with this pipeline's
    ``enqueue_batch_after_forward``, ``execute_all_batches`` and ``clear_data_dist_inputs``.
    """

    _SWP_TASKS = (
        "ZeroGrad",
        "WaitBatch",
        "ClearDataDistInputs",
        "InputDistStart",
        "H2D",
        "Forward",
        "InputDistWait",
        "Backward",
        "OptimizerStep",
        "Dequeue",
    )

    def __init__(
        self,
        *args: Any,
        plan: PlanLike | None = None,
        thread_map: ThreadMap | None = None,
        engine_timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._swp_setup(self._swp_default_plan(), plan, thread_map, engine_timeout_s, self._swp_streams())

    def _swp_default_plan(self) -> PipelinePlan:
        return plans.sparse_dist_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            name=type(self).__name__,
        )

    def _swp_streams(self) -> StreamPool:
        return stream_pool_for(self._device, {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream})

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        self._state = PipelineState.IDLE
        # attach the model in case the user detached it and forgot to attach it (as upstream does)
        if not self._model_attached:
            self.attach(self._model)
        engine = self._swp_engine
        if dataloader_iter is not self._swp_iter:
            # a new iterator after the previous one was drained: a new epoch
            if engine.num_batches is not None and engine.delivered >= engine.num_batches and not engine.stopped:
                engine.reset()
            self._swp_iter = dataloader_iter
        return engine.step()

    def reset(self) -> None:
        super().reset()
        self._swp_engine.reset()

    # ------------------------------------------------------------ task functions
    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        return {
            "ZeroGrad": self._task_zero_grad,
            "WaitBatch": self._task_wait_batch,
            "ClearDataDistInputs": self._task_clear_data_dist_inputs,
            "InputDistStart": self._task_input_dist_start,
            "H2D": self._task_h2d,
            "Forward": self._task_forward,
            "InputDistWait": self._task_input_dist_wait,
            "Backward": self._task_backward,
            "OptimizerStep": self._task_optimizer_step,
            "Dequeue": self._task_dequeue,
        }

    def _task_h2d(self, b: int) -> tuple[Any, Any]:
        # enqueue_batch appends to self.batches/self.contexts (user-visible state) and, with
        # execute_all_batches=False, raises StopIteration itself at the end of data.
        if not self.enqueue_batch(self._swp_iter):  # type: ignore[arg-type]
            raise StopIteration
        return self.batches[-1], self.contexts[-1]

    def _task_input_dist_start(self, b: int, batch: Any, context: Any) -> None:
        if b == self._swp_engine.delivered:
            # the oldest batch in flight: the pipeline is (re)filling. The first time this
            # rewrites the model; afterwards it sets the module context and starts input dist.
            self._init_pipelined_modules(batch, context, self._pipelined_forward_type)
        else:
            self.start_sparse_data_dist(batch, context)

    def _task_input_dist_wait(self, b: int, context: Any) -> None:
        self.wait_sparse_data_dist(context)

    def _task_zero_grad(self, b: int) -> None:
        if self._model.training:
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()

    def _task_wait_batch(self, b: int, batch: Any, context: Any) -> None:
        self._set_module_context(context)
        self._wait_for_batch()

    def _task_clear_data_dist_inputs(self, b: int, context: Any) -> None:
        self.clear_sparse_data_dist_inputs(context)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## forward {context.index} ##"):
            self._state = PipelineState.CALL_FWD
            losses, output = self._model_fwd(batch)
        return losses, output

    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:
        if self._model.training:
            self._state = PipelineState.CALL_BWD
            self._backward(losses)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)

    def _task_optimizer_step(self, b: int, context: Any) -> None:
        if self._model.training:
            self._optimizer_step()

    def _task_dequeue(self, b: int, context: Any) -> None:
        self.dequeue_batch()
