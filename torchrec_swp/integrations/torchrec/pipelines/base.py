"""TrainPipelineBase on the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out

from torchrec_swp.engine import StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven, nothing_to_undo
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainPipelineBase"]


class TrainPipelineBase(PlanDriven, TrainingTasks, upstream.TrainPipelineBase[In, Out]):
    """TrainPipelineBase on the engine: LoadBatch(i+1), forward/backward(i), H2D(i+1), optimizer(i).

    Same constructor as upstream's, plus the engine's keyword-only options (``PlanDriven``).
    The default plan is ``catalog.train_pipeline_base_plan()``; its source LoadBatch only draws, so
    ``loads=`` moves it to the load threads as it is.
    """

    _swp_counters = ("_batch_count",)  # WaitBatch counts the steps (upstream's logs use it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = EngineOptions.take(kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)
        self._swp_setup(self._swp_default_plan(), options, self._swp_streams())

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan()

    def _swp_streams(self) -> StreamPool:
        pool = stream_pool_for(self._device, {"memcpy": self._memcpy_stream})
        return self._swp_checked(pool, {"_memcpy_stream": "memcpy"})

    def _swp_before_step(self) -> None:
        self._connected = True

    def _swp_on_new_data(self) -> None:
        self._data_iter_stopped = False

    # ------------------------------------------------------------ task functions
    def _swp_draw_undoer(self) -> Callable[[int, Mapping[str, Any]], None]:
        return nothing_to_undo  # LoadBatch only draws

    @task("LoadBatch")
    def _task_load_batch(self, b: int, data: Iterator[Any]) -> Any:
        batch = self._next_batch(data)
        if batch is None:
            raise StopIteration
        return batch

    @task("H2D")
    def _task_h2d(self, b: int, host_batch: Any) -> Any:
        self._copy_batch_to_gpu(host_batch)
        return self._cur_batch

    @task("WaitBatch")
    def _task_wait_batch(self, b: int, batch: Any) -> None:
        self._batch_count += 1
        self._wait_for_batch(batch)

    @task("Forward")
    def _task_forward(self, b: int, batch: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            losses, output = self._model(batch)
        return losses, output
