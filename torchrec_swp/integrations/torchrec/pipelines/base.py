"""TrainPipelineBase on the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out

from torchrec_swp.catalog import torchrec as plans
from torchrec_swp.engine import stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks

__all__ = ["TrainPipelineBase"]


class TrainPipelineBase(PlanDriven, TrainingTasks, upstream.TrainPipelineBase[In, Out]):
    """TrainPipelineBase on the engine: LoadBatch(i+1), forward/backward(i), H2D(i+1), optimizer(i).

    Same constructor as upstream's, plus the engine's keyword-only options (``PlanDriven``).
    The default plan is ``plans.train_pipeline_base_plan()``; its source LoadBatch only draws, so
    ``loads=`` moves it to the load threads as it is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = EngineOptions.take(kwargs, type(self).__name__)
        super().__init__(*args, **kwargs)
        streams = self._swp_checked(
            stream_pool_for(self._device, {"memcpy": self._memcpy_stream}), {"_memcpy_stream": "memcpy"}
        )
        self._swp_setup(plans.train_pipeline_base_plan(), options, streams)

    def _swp_before_step(self) -> None:
        self._connected = True

    def _swp_on_new_data(self) -> None:
        self._data_iter_stopped = False

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

    def _task_load_batch(self, b: int, data: Iterator[Any]) -> Any:
        batch = self._next_batch(data)
        if batch is None:
            raise StopIteration
        return batch

    def _task_h2d(self, b: int, host_batch: Any) -> Any:
        self._copy_batch_to_gpu(host_batch)
        return self._cur_batch

    def _task_wait_batch(self, b: int, batch: Any) -> None:
        self._batch_count += 1
        self._wait_for_batch(batch)

    def _task_forward(self, b: int, batch: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            losses, output = self._model(batch)
        return losses, output

