"""EvalPipelineCPUSparse (TorchRec's experimental; in 1.8.0 and 1.9) on the engine: evaluation
with the sparse part on the CPU and the dense part on the device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import experimental_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.utils import _start_data_dist, use_context_for_postprocs

from torchrec_swp.catalog.transforms import FETCH
from torchrec_swp.engine import STREAM_DEVICE_TYPES
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan

__all__ = ["EvalPipelineCPUSparse"]


class EvalPipelineCPUSparse(TrainPipelineSparseDist[In, Out], upstream.EvalPipelineCPUSparse):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """EvalPipelineCPUSparse on the engine: the CPU's sparse work for batch i+2, the copy of batch
    i+1 to the device, the dense forward of batch i.

    Same constructor as upstream's (``model, optimizer, device, execute_all_batches, apply_jit,
    pipeline_postproc, enable_inplace_copy_batch, multi_thread, pipeline_depth,
    free_features_storage_early, clear_data_dist_inputs``) plus the engine's keyword-only
    options. The default plan is ``catalog.eval_cpu_sparse_plan(...)``: LoadBatch, Enqueue, SparseForward
    (InitPipelinedModules for the first batch of an epoch), CopyToDevice, DenseForward and
    Dequeue, upstream's stages as tasks; with ``multi_thread`` the sparse work runs on the plan's
    thread ``sparse`` instead of upstream's executor (which is not made).

    Differences from upstream, same results:

    * On a device with streams, before an embedding buffer is written again for a later batch
      the host waits for the copy that read it to the device (an event recorded after
      CopyToDevice): upstream overwrites it in the next step's sparse work while that
      asynchronous copy may still be reading it. Its buffers are pinned only where the device has
      an accelerator.
    * On the CPU every batch gets new embedding buffers. There the copy to the device returns
      the buffer itself, which upstream (run under the test-only CPU patch, as it pins memory,
      which a CPU-only build refuses) reuses for the next batch before the dense forward reads
      it: every output but the last is computed with the next batch's embeddings.
    """

    # an eval pipeline of its own stages: of SparseDist's tasks only InitPipelinedModules and Dequeue
    _swp_without_tasks = (
        "ZeroGrad",
        "WaitBatch",
        "ClearDataDistInputs",
        "InputDistStart",
        "H2D",
        FETCH,
        "Forward",
        "InputDistWait",
        "Backward",
        "OptimizerStep",
    )

    _sparse_executor: Any  # upstream's ThreadPoolExecutor (None without multi_thread)

    def _swp_init_upstream(self, *args: Any, **kwargs: Any) -> None:
        super()._swp_init_upstream(*args, **kwargs)
        # upstream's background thread for the sparse work: the plan's thread ``sparse`` instead
        if self._sparse_executor is not None:
            self._sparse_executor.shutdown()
            self._sparse_executor = None
        self._swp_pinned_reads: dict[str, Any] = {}  # module name -> event after the copy that read its buffer

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            pipeline_depth=self._pipeline_depth,
            multi_thread=self._multi_thread,
            execute_all_batches=self._execute_all_batches,
        )

    def _get_or_alloc_pinned(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._device.type == "cpu":
            # the "copy to the device" of a CPU buffer is the buffer itself, read by DenseForward
            # a step later: a new one per batch
            return torch.empty_like(tensor)
        read = self._swp_pinned_reads.pop(name, None)
        if read is not None:
            read.synchronize()
        buffer = self._pinned_buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = self._device.type in STREAM_DEVICE_TYPES
            self._pinned_buffers[name] = buffer = torch.empty_like(tensor, pin_memory=pinned)
        return buffer

    # ------------------------------------------------------------ task functions
    @task("LoadBatch")
    def _task_load_batch(self, b: int, data: Iterator[In]) -> In:
        # the draw alone (on the load threads with loads=); Enqueue does the rest
        return next(data)

    @task("Enqueue")
    def _task_enqueue(self, b: int, host_batch: In) -> tuple[Any, Any]:
        # upstream's enqueue_batch of the drawn batch (left on the CPU): its context, and both queued
        if not self.enqueue_batch(iter((host_batch,))):
            raise StopIteration
        return self.batches[-1], self.contexts[-1]

    @task("InitPipelinedModules")
    def _task_init_pipelined_modules(self, b: int, host: Any, context: Any) -> None:
        # upstream's fill: the model rewrite and the bootstrap input dist, then the lookups
        self._pipeline_model(host, context, self._pipelined_forward_type)
        self._embedding_lookup_and_pin(context)

    @task("SparseForward")
    def _task_sparse_forward(self, b: int, host: Any, context: Any) -> None:
        # upstream's _sparse_forward less its copy (the CopyToDevice task)
        with record_function(f"## sparse_forward {context.index} on CPU ##"):
            with use_context_for_postprocs(self._pipelined_postprocs, context):
                _start_data_dist(self._pipelined_modules, host, context)
            for names, awaitable in context.fused_splits_awaitables:
                for name, request in zip(names, awaitable.wait()):
                    context.input_dist_tensors_requests[name] = request
            context.fused_splits_awaitables.clear()
            self._embedding_lookup_and_pin(context)

    @task("CopyToDevice")
    def _task_copy_to_device(self, b: int, host: Any, context: Any) -> Any:
        batch = self.copy_data_to_gpu(host, context)
        read = self._swp_engine.streams.record("memcpy")
        if read is not None:
            self._swp_pinned_reads.update(dict.fromkeys(context.embedding_a2a_requests, read))
        return batch

    @task("DenseForward")
    def _task_dense_forward(self, b: int, batch: Any, context: Any) -> Any:
        return self._dense_forward(batch, context)
