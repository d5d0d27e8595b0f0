"""TorchRec's memory-stashing pipelines on the engine (experimental; in 1.8.0 and 1.9): optimizer
state or embedding weights off the device between their uses (``experimental_pipelines``:
TrainPipelineSparseDistOptStash, TrainPipelineSparseDistEmbStash, TrainPipelinePrefetchEMS).

The stashing itself is TorchRec's ``MemoryStashingManager`` (class-level, process-wide): its
streams are set by the pipeline's constructor, the embedding stash happens inside TorchRec's
sharded modules right after their lookup once it has streams, and its restores are called by
the tasks and backward hooks here, as upstream's ``progress()`` calls them.

Upstream's constructors create ``torch.cuda.Stream(device=device)`` for the device-to-host
copies, which a CPU build refuses ("torch.cuda.Stream requires CUDA support"). Here the stream
is the device's own (``torch.get_device_module(device).Stream``: CUDA's on CUDA), and the
manager gets the pipeline's streams after the engine's pool has them: on a device without
streams none, so that TorchRec's modules do not stash (the manager moves CUDA tensors only:
on the CPU there is nothing to stash either way); in checked mode (``SWP_STREAM_CHECK=1``) the
pool's emulated ``memcpy`` and ``d2h`` streams.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torchrec.distributed.memory_stashing import MemoryStashingManager
from torchrec.distributed.train_pipeline import experimental_pipelines as upstream
from torchrec.distributed.train_pipeline.backward_injection import (
    FirstGradTensorFinder,
    InjectionSite,
    InjectionTargetType,
    OutputDistTensorFinder,
)
from torchrec.distributed.train_pipeline.pipeline_context import In, Out, TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist as UpstreamSparseDist
from torchrec.distributed.types import LazyNoWait

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.engine import STREAM_DEVICE_TYPES, StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainPipelinePrefetchEMS", "TrainPipelineSparseDistEmbStash", "TrainPipelineSparseDistOptStash"]

#: TrainPipelineSparseDist's constructor arguments (the rest of a stashing pipeline's are its own).
_SPARSE_DIST_ARGS = tuple(inspect.signature(UpstreamSparseDist.__init__).parameters)[1:]


class _Stashing(TrainPipelineSparseDist[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """What the three share: upstream's constructor with the device's streams, and the manager's
    streams set from the engine's pool."""

    #: the upstream class whose constructor arguments this one takes
    _swp_upstream: type[Any]

    def _swp_init_upstream(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(self._swp_upstream.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        UpstreamSparseDist.__init__(self, **{k: v for k, v in arguments.items() if k in _SPARSE_DIST_ARGS})
        self._swp_init_stashing(arguments)

    # The rest of the upstream constructor, less its streams (``arguments``: all of them, by name).
    _swp_init_stashing: Callable[[dict[str, Any]], None]

    def _swp_streams(self) -> StreamPool:
        streams = {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream}
        if self._device.type in STREAM_DEVICE_TYPES:
            # as upstream: a stream of default priority for the device-to-host copies
            streams[catalog.D2H] = torch.get_device_module(self._device).Stream(device=self._device)
        pool = stream_pool_for(self._device, streams)
        pool = self._swp_checked(pool, {"_memcpy_stream": "memcpy", "_data_dist_stream": "data_dist"})
        if pool.has_streams:
            MemoryStashingManager.set_streams(pool.stream("memcpy"), pool.stream(catalog.D2H))
        return pool

    @property
    def _swp_moves_tensors(self) -> bool:
        """Whether the manager has anything to move here: it stashes CUDA tensors only (its
        collectors test ``is_cuda``), and its restores create CUDA events."""
        return self._device.type == "cuda"


class TrainPipelineSparseDistOptStash(_Stashing[In, Out], upstream.TrainPipelineSparseDistOptStash):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSparseDistOptStash (experimental; TorchRec 1.8.0 and 1.9) on the engine: the
    optimizer state stashed off the device after each step, restored during the next backward.

    Same constructor as upstream's (``model, optimizer, device, site_fqn, sharding_type``, then
    TrainPipelineSparseDist's) plus the engine's keyword-only options. The default plan is
    ``catalog.opt_stash_plan(...)``: SparseDist's tasks, with StashOptimizerState after
    OptimizerStep on thread ``stash`` and stream ``d2h`` (upstream's background stash thread),
    Backward of the next batch after it, and RestoreWait before OptimizerStep. The restore
    itself starts in Backward, from the backward hook at the output dist of ``site_fqn`` (as
    upstream: ``restore_optimizer_state_threaded``).

    The stash task calls ``MemoryStashingManager.stash_optimizer_state`` on the plan's thread
    inside the ``d2h`` stream, with the event OptimizerStep recorded on the compute stream after
    the step (upstream's ``stash_optimizer_state_threaded`` hands the same event to the manager's
    thread); the plan also orders d2h after OptimizerStep. On a device other than CUDA the
    manager has nothing to move (CUDA tensors only) and the stash, restore and their events are
    skipped: on the CPU, in checked mode too, the stash tasks run but move nothing.
    """

    _swp_upstream = upstream.TrainPipelineSparseDistOptStash

    def _swp_init_stashing(self, arguments: dict[str, Any]) -> None:
        self._output_dist_site = InjectionSite(
            fqn=arguments["site_fqn"],
            tensor_finder=OutputDistTensorFinder(sharding_type=arguments["sharding_type"]),
        )
        self._await_restore: Callable[..., None] = lambda: None
        self._stash_future = None  # upstream's; the plan's stash thread replaces it
        self._restore_future = None
        self._swp_step_done: Any = None  # the event after the last optimizer step (CUDA)

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            h2d_thread=self._swp_h2d_thread(),
        )

    def _pipeline_model(
        self,
        batch: In | None,
        context: TrainPipelineContext,
        pipelined_forward: type[PipelinedForward] = PipelinedForward,
    ) -> None:
        UpstreamSparseDist._pipeline_model(self, batch, context, pipelined_forward)
        self.register_backward_hook(self._output_dist_site, self._swp_restore_in_backward)

    def _swp_restore_in_backward(self, _pipeline: Any) -> None:
        """Upstream's hook work: start restoring the stashed state on the manager's thread."""
        if self._swp_moves_tensors:
            with record_function("## restore_optimizer_state ##"):
                self._restore_future = MemoryStashingManager.restore_optimizer_state_threaded()

    @task("RestoreWait")
    def _task_restore_wait(self, b: int) -> None:
        # upstream's, right before the optimizer step: the restore's host work done, then the
        # compute stream made to wait for its copies (a no-op until a stash returned a wait)
        if not self._model.training:
            return
        with record_function("## await_restore_optimizer_state ##"):
            if self._restore_future is not None:
                self._restore_future.result()
                self._restore_future = None
            self._await_restore()

    def _task_optimizer_step(self, b: int, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        super()._task_optimizer_step(b, context)
        if self._model.training and self._swp_moves_tensors:
            # as upstream, an event after the step on the compute stream for the stash: its copies
            # wait for it on the device, and the host waits for it before freeing the optimizer's
            # scratch buffers (MemoryStashingManager._release_optimizer_scratch_buffers)
            self._swp_step_done = torch.cuda.Event()
            self._swp_step_done.record(torch.cuda.current_stream())

    @task("StashOptimizerState")
    def _task_stash_optimizer_state(self, b: int) -> None:
        # upstream's stash_optimizer_state_threaded, on the plan's thread (after OptimizerStep)
        if not (self._model.training and self._swp_moves_tensors):
            return
        with record_function("## stash_optimizer_state ##"):
            self._await_restore, _ = MemoryStashingManager.stash_optimizer_state(
                self._optimizer, sync_event=self._swp_step_done
            )


class TrainPipelineSparseDistEmbStash(_Stashing[In, Out], upstream.TrainPipelineSparseDistEmbStash):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSparseDistEmbStash (experimental; TorchRec 1.8.0 and 1.9) on the engine:
    embedding weights stashed off the device after their lookup, restored during backward.

    Same constructor as upstream's (``model, optimizer, device, site_fqn``, SparseDist's,
    ``delay_stash``, ``stash_site_fqn``) plus the engine's keyword-only options. The default plan
    is ``catalog.emb_stash_plan(...)``, SparseDist's tasks (upstream's ``progress()`` is
    SparseDist's): the stash happens in Forward, inside TorchRec's sharded modules, and the
    restore in Backward, from upstream's backward hook at ``site_fqn`` (its ``_pipeline_model``).
    """

    _swp_upstream = upstream.TrainPipelineSparseDistEmbStash

    def _swp_init_stashing(self, arguments: dict[str, Any]) -> None:
        site = arguments["site_fqn"]
        if isinstance(site, str):
            site = InjectionSite(
                fqn=site, tensor_finder=FirstGradTensorFinder(), target_type=InjectionTargetType.PARAM_GRAD
            )
        self._injection_site = site
        self._delay_stash = arguments.get("delay_stash", False)
        self._stash_site_fqn = arguments.get("stash_site_fqn")
        self._stash_hook_handle = None
        if self._delay_stash:
            MemoryStashingManager.set_delay_stash(True)
        self._log_ems_config()

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            h2d_thread=self._swp_h2d_thread(),
        )


class TrainPipelinePrefetchEMS(TrainPipelineSparseDistEmbStash[In, Out], upstream.TrainPipelinePrefetchEMS):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelinePrefetchEMS (experimental; TorchRec 1.8.0 and 1.9) on the engine: EmbStash, and
    before backward the stashed weights and EMO caches restored and the next batch prefetched into
    the caches.

    Same constructor as upstream's plus the engine's keyword-only options. The default plan is
    ``catalog.prefetch_ems_plan(...)``: RestoreEmbeddings (upstream's ``_restore_and_prefetch``,
    its first step) and PrefetchNext of the next batch (its second), in training and eval.
    """

    _swp_upstream = upstream.TrainPipelinePrefetchEMS

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            h2d_thread=self._swp_h2d_thread(),
        )

    @task("RestoreEmbeddings")
    def _task_restore_embeddings(self, b: int) -> None:
        with record_function("## restore_and_prefetch ##"):
            MemoryStashingManager.restore_embedding_weights()
            MemoryStashingManager.restore_emo_cache()

    @task("PrefetchNext")
    def _task_prefetch_next(self, b: int, context: Any) -> None:
        """Upstream's ``_restore_and_prefetch`` step 2 for batch ``b`` (the one after the batch
        being trained): its input-dist output materialised, kept for the forward as a
        ``LazyNoWait``, and prefetched by every sharded module that has one.

        Upstream materialises it on the compute stream, where the input dist's buffers, made on
        the data_dist stream, are read and freed with no ``record_stream`` (the CPU stream
        checker found it). Here, as TorchRec's pipelined forward does it: on the data_dist
        stream, then the compute stream waits for it and the output is recorded on it."""
        with record_function("## restore_and_prefetch ##"):
            for sharded_module in self._pipelined_modules:
                name = sharded_module.forward._name
                if name not in context.input_dist_tensors_requests:
                    continue
                request = context.input_dist_tensors_requests[name]
                if isinstance(request, LazyNoWait):
                    data = request._obj
                else:
                    data = self._swp_materialise(request)
                    context.input_dist_tensors_requests[name] = LazyNoWait(data)
                sharded_module.prefetch(ctx=context.module_contexts.get(name), dist_input=data)

    def _swp_materialise(self, request: Any) -> Any:
        with self._stream_context(self._data_dist_stream):
            data = request.wait()
        if self._data_dist_stream is not None:
            compute = torch.get_device_module(self._device).current_stream()
            compute.wait_stream(self._data_dist_stream)
            data.record_stream(compute)
        return data
