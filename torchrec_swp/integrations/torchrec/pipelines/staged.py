"""StagedTrainPipeline on the engine: a list of PipelineStage is a plan."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In
from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil, StageOut
from typing_extensions import Unpack

from torchrec_swp.engine import STREAM_DEVICE_TYPES, StreamPool, device_has_streams, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines import cpu_safe
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanDriven
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineKeywords, EngineOptions
from torchrec_swp.plan import DEFAULT_STREAM, PipelinePlan

__all__ = ["StagedTrainPipeline"]

logger = logging.getLogger(__name__)


def _stream_device(stream: Any) -> torch.device:
    """The device of a stage's stream; the CPU for a stream without one (``torch.cpu.Stream``)."""
    device = getattr(stream, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _streamless_sparse_data_dist(stages: Sequence[PipelineStage]) -> None:
    """On a device without streams, the SparseDataDistUtil objects behind the stages rewrite the
    model with a pipelined forward that ignores their CPU stream objects (``cpu_safe``): given
    ``torch.Stream(device="cpu")`` upstream's would ``record_stream`` CPU tensors and fail."""
    for stage in stages:
        for fn in (stage.runnable, stage.fill_callback, stage.data_exhausted_callback):
            util = getattr(fn, "__self__", None)
            if isinstance(util, SparseDataDistUtil) and not util.initialized:
                util._pipelined_forward = cpu_safe.streamless_on_cpu(util._pipelined_forward)


def stage_task_names(stages: Sequence[PipelineStage]) -> list[str]:
    """The plan's task name of each stage: its name made an identifier, unique, never ``Emit``."""
    names: list[str] = []
    for k, stage in enumerate(stages):
        name = re.sub(r"[^A-Za-z0-9_.]", "_", stage.name)
        if not re.match(r"[A-Za-z_]", name):
            name = f"stage{k}_{name}"
        if name in names or name == "Emit":
            name = f"{name}_{k}"
        names.append(name)
    return names


class StagedTrainPipeline(PlanDriven, upstream.StagedTrainPipeline[In, StageOut]):
    """StagedTrainPipeline on the engine: stage k of the list works on batch i+N-k while the
    caller trains batch i on what ``progress()`` returned.

    Same constructor as upstream's, plus the engine's keyword-only options (``PlanDriven``;
    ``loads=`` is refused: stage 0 runs the user's code after the draw). The default plan is
    ``catalog.staged_plan(names, streams)``: stage k is a task at stage k (named after the stage, made
    an identifier), and Emit, at stage N, hands out the batch that left the last stage, first in
    each call as upstream's ``_advance()``; a stage with a ``fill_callback`` is followed by a task
    ``NAME.fill`` (``when=fill``) that calls it. Stages sharing a stream object share a stream name
    in the plan, so ``thread_map="by_stream"`` gives each stream its own thread.

    Contract, as upstream's:

    * Stage 0 pulls with upstream's ``_next_batch`` (None once the iterator is exhausted or
      while flushing). A None flows through the stages like a batch: each stage whose input is
      None skips its runnable and calls its ``data_exhausted_callback``, on every call.
      ``progress()`` returns None at the end of data, again on every later call, and a new
      iterator starts feeding stage 0 again.
    * During the fill (the first N internal iterations after construction or a flush) each stage
      calls its ``fill_callback`` after it ran, whether its input was None or not.
    * ``set_flush(True)``: stage 0 stops pulling, the batches in flight are returned; in the call
      where the output would be None, ``flush_end()`` runs ``on_flush_end`` and the same call
      refills from the iterator and returns the first new batch.
    * With a ``thread_map`` the stages of one call (and their callbacks) run on the plan's
      threads, concurrently with each other.

    Difference: within the fill, upstream runs the stages batch by batch (b0: s0 s1 s2, b1:
    s0 s1, b2: s0); the engine runs them iteration by iteration (s0(b0) | s0(b1) s1(b0) |
    s0(b2) s1(b1) s2(b0)). Every stage sees the same batches in the same order and every
    callback is called as often, in the same ``progress()`` call. The stage outputs live in the
    engine's slots; upstream's ``_stage_outputs`` list stays unused.

    Runs on CPU as shipped: upstream reads ``.device`` of its default compute stream (the CPU's
    has none) and calls ``record_stream`` on CPU tensors. Here the CPU gets a
    ``torch.Stream(device="cpu")`` as compute stream for upstream's constructor, and the engine
    does the stream waits, with ``record_stream`` only on devices that have streams.
    """

    # and one task per stage, named by stage_task_names()

    def __init__(
        self,
        pipeline_stages: list[PipelineStage],
        debug_mode: bool = False,
        compute_stream: torch.Stream | None = None,
        on_flush_end: Callable[[], None] | None = None,
        **engine: Unpack[EngineKeywords],
    ) -> None:
        rest: dict[str, Any] = dict(engine)
        options = EngineOptions.take(rest, type(self).__name__)
        if rest:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {next(iter(rest))!r}")
        if not pipeline_stages:
            raise ValueError("StagedTrainPipeline needs at least one PipelineStage in pipeline_stages")
        device = _stream_device(compute_stream if compute_stream is not None else pipeline_stages[0].stream)
        if compute_stream is None and device.type not in STREAM_DEVICE_TYPES:
            # upstream would take torch.cpu.current_stream(), which has no .device
            compute_stream = torch.Stream(device="cpu")
        super().__init__(pipeline_stages, debug_mode, compute_stream, on_flush_end)
        self._swp_device_streams = device.type in STREAM_DEVICE_TYPES
        self._swp_has_streams = device_has_streams(device)  # also the CPU in checked mode
        if not self._swp_has_streams:
            _streamless_sparse_data_dist(pipeline_stages)
        self._swp_device = device
        self._swp_stage_tasks = stage_task_names(pipeline_stages)
        self._swp_setup(self._swp_default_plan(), options, self._swp_streams())

    def _swp_default_plan(self) -> PipelinePlan:
        stream_names, _ = self._swp_stream_names()
        fills = [s.fill_callback is not None for s in self._pipeline_stages]
        return self._swp_row_plan(stage_names=self._swp_stage_tasks, stage_streams=stream_names, fill_callbacks=fills)

    def _swp_streams(self) -> StreamPool:
        _, streams = self._swp_stream_names()
        return stream_pool_for(self._swp_device, streams)

    def _swp_stream_names(self) -> tuple[list[str], dict[str, Any]]:
        """Each stage's stream name in the plan (the compute stream is ``default``, another
        stream is named after the first stage on it), and the stream objects by name."""
        streams: dict[str, Any] = {DEFAULT_STREAM: self._compute_stream}
        names = []
        for task, stage in zip(self._swp_stage_tasks, self._pipeline_stages):
            if stage.stream is None:
                names.append(DEFAULT_STREAM)  # no stream of its own: the compute stream
                continue
            # Every CPU stream object compares equal to every other (the CPU has one stream);
            # there, stages are told apart by object so that "by_stream" still separates them.
            name = next(
                (
                    n
                    for n, s in streams.items()
                    if s is stage.stream or (self._swp_device_streams and s == stage.stream)
                ),
                task,
            )
            streams.setdefault(name, stage.stream)
            names.append(name)
        return names, streams

    def progress(self, dataloader_iter: Iterator[In]) -> StageOut | None:
        self._swp_check_progress(dataloader_iter)
        out = self._swp_engine.step(dataloader_iter)
        while out is None and self._flushing:
            # Everything in flight has drained: end the flush and refill within this call (upstream
            # calls progress() again, as often). The refill is the plan's fill phase, run anew after the
            # engine's reset: print_schedule shows it (the NAME.fill tasks).
            self.flush_end()
            out = self._swp_engine.step(dataloader_iter)
        return out

    def reset(self) -> None:
        """As upstream's: StagedTrainPipeline has no state to reset (TrainPipeline.reset does
        nothing), so the batches in flight stay and the next ``progress()`` goes on with them."""
        upstream.StagedTrainPipeline.reset(self)

    def flush_end(self) -> None:
        """Upstream's flush_end (stop flushing, refill next, ``on_flush_end()``); the batches
        in flight, all None by now, are dropped so that the next step refills (after the worker
        threads finished this call's stages, as upstream runs them all before flushing)."""
        self._swp_engine.wait_until_blocked()
        self._swp_engine.reset()
        super().flush_end()

    # ------------------------------------------------------------ task functions
    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        functions: dict[str, Callable[..., Any]] = {"Emit": self._task_emit}
        for k, task in enumerate(self._swp_stage_tasks):
            functions[task] = functools.partial(self._task_stage, k)
            functions[f"{task}.fill"] = functools.partial(self._task_fill_callback, k)
        return functions

    def _task_stage(self, k: int, b: int, data: Iterator[In] | None = None, **inputs: Any) -> Any:
        """Upstream's _run_stage for stage k: the runnable on the input, or the
        data_exhausted_callback on None (the plan's ``NAME.fill`` task calls the fill_callback
        after it during the fill)."""
        stage = self._pipeline_stages[k]
        with record_function(f"## Pipeline Stage {k} : {stage.name} for batch {b} ##"):
            if k == 0:
                batch = self._next_batch(data)
            else:
                (batch,) = inputs.values()
            if self._debug_mode:
                action = "Skipping due to None" if batch is None else "Executing"
                logger.info("%s ## Pipeline Stage %d : %s for batch %d ##", action, k, stage.name, b)
            if batch is not None:
                if k and self._swp_has_streams:
                    # the engine made this stage's stream wait for the previous stage
                    batch.record_stream(stage.stream)
                output = stage.runnable(batch)
            else:
                output = None
                if stage.data_exhausted_callback is not None:
                    stage.data_exhausted_callback()
        return output

    def _task_fill_callback(self, k: int, b: int) -> None:
        callback = self._pipeline_stages[k].fill_callback
        if callback is not None:
            callback()

    def _task_emit(self, b: int, **inputs: Any) -> Any:
        (out,) = inputs.values()
        self._initialized = True
        self._num_steps += 1
        if out is not None and self._swp_has_streams:
            # the engine made the compute stream wait for the last stage
            out.record_stream(self._compute_stream)
        return out
