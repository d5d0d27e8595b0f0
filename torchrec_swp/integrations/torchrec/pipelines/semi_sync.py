"""TrainPipelineSemiSync on the engine: two plans, one per phase, switched at ``start_batch``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext, In, Out
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.utils import _wait_for_events
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedTensor

from torchrec_swp.engine import device_has_streams
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.lookup_sync import start_embedding_lookup as _start_embedding_lookup
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PhasedPlan, PlanError

__all__ = ["TrainPipelineSemiSync"]


class _EmbeddingPipelinedForward(EmbeddingPipelinedForward):
    """Upstream's EmbeddingPipelinedForward, also correct without a data-dist stream (CPU).

    Upstream falls back to ``torch.device("cuda")`` when it has no stream and then asks CUDA
    for its current stream; and it calls ``record_stream`` on the embeddings, which CPU tensors
    reject. Without a stream nothing changes streams: the device is the CPU and there is
    nothing to record. With a stream (CUDA, MTIA) this is upstream's class unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    def detach_embeddings(self, embeddings: dict[str, Any] | KeyedTensor, cur_stream: Any) -> None:
        if self._stream is not None or not isinstance(embeddings, KeyedTensor):
            # upstream's path; for a dict of JaggedTensors it records no stream anyway
            super().detach_embeddings(embeddings, cur_stream)
            return
        # upstream's KeyedTensor branch without embeddings.record_stream(cur_stream)
        tensor = embeddings.values()
        detached = tensor.detach().requires_grad_()
        detached.retain_grad()
        embeddings._values = detached
        self._context.embedding_tensors.append([tensor])
        self._context.embedding_features.append([list(embeddings.keys())])
        self._context.detached_embedding_tensors.append([detached])


class _ReplayedEmbeddings(torch.autograd.Function):
    """Forward: the embeddings looked up before a checkpoint's cut; backward: the gradient goes
    to the same lookup run again after the resume (the tables' gradient depends on the indices
    and the gradient, not on the weights looked up), so the optimizer sees what it saw."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        return saved.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _replayed(saved: torch.Tensor, what: str) -> Callable[[Any], Any]:
    def replay(embeddings: Any) -> Any:
        if not isinstance(embeddings, KeyedTensor) or embeddings.values().shape != saved.shape:
            raise RuntimeError(
                f"TrainPipelineSemiSync resume: the embeddings of {what} looked up again differ in shape from "
                "the ones saved at the cut (another model, sharding or data?)"
            )
        embeddings._values = _ReplayedEmbeddings.apply(embeddings.values(), saved.to(embeddings.values().device))
        return embeddings

    return replay


class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSemiSync[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSemiSync on the engine: H2D(i+3), InputDist(i+2), EmbLookup(i+1), fwd/bwd/opt(i).

    Same constructor as upstream's SemiSync (``start_batch``, ``stash_gradients``, ...), plus
    the engine's keyword-only options (``EngineOptions``).

    The default plan is a PhasedPlan, ``catalog.semi_sync_phases(start_batch=...)``: each
    ``progress()`` runs the phase of the batch it forwards, as upstream decides ``is_semi_sync``
    per call from that batch's context index: below ``start_batch`` EmbLookup(i+1) follows the
    optimizer of batch i and a device synchronize() (the embeddings of i+1 see batch i's
    update); from ``start_batch`` on it is issued before Backward(i) (they see updates up to
    i-1), and with ``stash_gradients`` a GradSwap task swaps the stashed gradients in before the
    optimizer step. Upstream's ``_mlp_optimizer_step`` skips the step of batch ``start_batch``
    itself with ``stash_gradients``; in the plan that batch has a phase of its own
    (``semi_sync_start``) without OptimizerStep, so ``plan.print_schedule(n)`` shows the skip.
    OptimizerStep still calls ``_mlp_optimizer_step``, which keeps upstream's check for a
    ``plan=`` that runs it there. A ``plan=`` may be a PipelinePlan (run throughout) or a
    PhasedPlan; ``thread_map`` applies to every phase.

    Runs on CPU as shipped, where upstream fails: its embedding lookup and forward call
    ``record_stream`` on CPU tensors, and its pipelined forward asks CUDA for a stream. Here the
    lookup and forward pass no stream on a device without streams, and the pipelined forward is
    ``_EmbeddingPipelinedForward``. On CUDA/MTIA both are upstream's code paths.
    """

    _pipelined_forward_type = _EmbeddingPipelinedForward

    def _swp_default_plan(self) -> PhasedPlan:
        return self._swp_row_plan(
            start_batch=self._start_batch,
            # SemiSync's own copy never raises at the end of data; the in-place copy does
            execute_all_batches=self._execute_all_batches or not self._enable_inplace_copy_batch,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            stash_gradients=self._stash_gradients,
        )

    # ------------------------------------------------- upstream helpers, CPU-safe
    def _swp_current_stream(self) -> torch.Stream | None:
        """The compute stream, or None on a device without streams (nothing to record there)."""
        if device_has_streams(self._device):  # the CPU too in checked mode
            return torch.get_device_module(self._device).current_stream()
        return None

    def start_embedding_lookup(self, batch: In | None, context: EmbeddingTrainPipelineContext) -> None:
        """Upstream's start_embedding_lookup, with no target stream on a device without streams."""
        if batch is None:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            current_stream = self._swp_current_stream()
            _wait_for_events(batch, context, current_stream)
            for module in self._pipelined_modules:
                _start_embedding_lookup(
                    module,
                    context,
                    source_stream=self._data_dist_stream,
                    target_stream=current_stream,
                    stream_context=self._stream_context,
                )
                event = torch.get_device_module(self._device).Event()
                event.record()
                context.events.append(event)

    def _mlp_forward(self, batch: In, context: Any) -> tuple[torch.Tensor, Out]:
        """Upstream's _mlp_forward, with no stream to record on a device without streams."""
        with record_function(f"## forward {context.index} ##"):
            _wait_for_events(batch, context, self._swp_current_stream())
            return self._model_fwd(batch)

    # ------------------------------------------------------------ task functions
    def _task_init_pipelined_modules(self, b: int, batch: Any, context: Any) -> None:
        # upstream's fill_pipeline rewrites the model the first time, starts input dist, and
        # checks the optimizer holds no pipelined parameter
        self._init_pipelined_modules(batch, context, self._pipelined_forward_type)
        self._validate_optimizer()

    @task("EmbLookup")
    def _task_emb_lookup(self, b: int, batch: Any, context: Any) -> None:
        self.start_embedding_lookup(batch, context)
        replays = getattr(self, "_swp_replays", None)
        if replays:
            for name, awaitable in context.embedding_a2a_requests.items():
                saved = replays.pop((context.index, name), None)
                if saved is not None:
                    awaitable.callbacks.append(_replayed(saved, f"batch {context.index}, module {name}"))

    # ---------------------------------------------------------------- checkpoints
    def _swp_state_dict(self) -> dict[str, Any]:
        """The embeddings already looked up for the batches in flight at the cut: in the
        semi-sync phase they were looked up before the last trained batch's update, which the
        checkpointed tables already hold, so the resumed run uses these values instead (see
        ``_ReplayedEmbeddings``). Waiting for them here changes no value, only when they are waited for.
        With ``stash_gradients``, also the stashed gradients (upstream's ``_gradients``: those of
        the last trained batch, which the next batch's optimizer step applies), copied to the CPU."""
        engine = self._swp_engine
        looked: dict[tuple[int, str], torch.Tensor] = {}
        for b in engine.in_flight():
            context: Any = engine.slot(b).get("context")
            requests = getattr(context, "embedding_a2a_requests", None) or {}
            for name, awaitable in list(requests.items()):
                if not isinstance(awaitable, Awaitable):
                    raise TypeError(
                        f"TrainPipelineSemiSync.state_dict(): module {name} looks up more than embeddings "
                        "(a managed-collision module), which a checkpoint does not carry yet"
                    )
                embeddings = awaitable.wait()
                if not isinstance(embeddings, KeyedTensor):
                    raise TypeError(
                        f"TrainPipelineSemiSync.state_dict(): module {name} returns {type(embeddings).__name__}, "
                        "a checkpoint carries KeyedTensor lookups only"
                    )
                requests[name] = NoWait(embeddings)
                looked[(context.index, name)] = embeddings.values().detach().cpu().clone()
        state: dict[str, Any] = {"looked_up": looked}
        if self._stash_gradients:
            state["stashed_gradients"] = {name: g.detach().cpu().clone() for name, g in self._gradients.items()}
        return state

    def _swp_resized(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """On another world size the looked-up embeddings are dropped: they are the old rank's
        lookups of its batches in flight, which go back to the data and reach other ranks; the
        new ranks look their batches up again, from the checkpointed tables (a step fresher than
        the uninterrupted run's, for that one batch: its samples are still trained once). The
        stashed gradients are kept: DDP all-reduced them, so every old rank's are the same, the
        gradient of the last trained step, which the next step applies on any number of ranks."""
        return {k: v for k, v in state.items() if k != "looked_up"}

    def _swp_load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._swp_replays = dict(state.get("looked_up", {}))
        stashed = state.get("stashed_gradients")
        if (stashed is not None) != self._stash_gradients:
            saved = "with" if stashed is not None else "without"
            raise PlanError(
                f"TrainPipelineSemiSync.load_state_dict(): the state was saved {saved} stash_gradients, "
                f"this pipeline has stash_gradients={self._stash_gradients}"
            )
        if stashed is not None:
            params = dict(self._model.named_parameters())
            for name, g in stashed.items():
                if name not in params or params[name].shape != g.shape:
                    raise PlanError(
                        f"TrainPipelineSemiSync.load_state_dict(): the stashed gradient of {name!r} "
                        f"({tuple(g.shape)}) fits no parameter of the model (another model?)"
                    )
            self._gradients = {
                name: g.to(device=params[name].device, dtype=params[name].dtype) for name, g in stashed.items()
            }

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        losses, output = self._mlp_forward(batch, context)
        return losses, output

    def _task_dequeue(self, b: int, context: Any) -> None:
        self.dequeue_batch()
        # upstream frees the cached postproc results of the batch as soon as it is forwarded
        del context.postproc_fwd_results

    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            with record_function(f"## backward {context.index or 0} ##"):
                torch.sum(losses, dim=0).backward()

    @task("EmbBackward")
    def _task_emb_backward(self, b: int, context: Any) -> None:
        if self._model.training:
            with record_function(f"## emb_backward {context.index or 0} ##"):
                self.embedding_backward(context)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)

    @task("GradSwap")
    def _task_grad_swap(self, b: int) -> None:
        if self._model.training:
            self._grad_swap()

    def _task_optimizer_step(self, b: int, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            iteration = context.index or 0
            with record_function(f"## optimizer {iteration - 1} ##"):
                self._mlp_optimizer_step(iteration)

    @task("Synchronize")
    def _task_synchronize(self, b: int) -> None:
        # Upstream synchronizes the device before the next batch's lookup (the plan runs this
        # only when there is one). A device without streams runs everything in order already.
        if device_has_streams(self._device):
            torch.get_device_module(self._device).synchronize()
