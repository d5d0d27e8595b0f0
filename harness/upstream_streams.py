"""Upstream TorchRec's pipelines, and our Maglev drop-ins, under the CPU stream checker.

``tools/stream_check.py`` checks our plan-driven pipelines; this module runs the code they
replace, so that what the checker reports about ours can be compared with upstream's own
stream discipline, and runs the Maglev drop-ins (which have no plan-driven engine) checked.

``train_upstream_checked(name, checker, steps)``: upstream's pipeline ``name`` on the DLRM
example's small model, 1 gloo rank in this process (the default process group must exist), with
the stream attributes a CUDA construction would give it (``_memcpy_stream``,
``_data_dist_stream``, ...; StagedTrainPipeline: its stages' streams) set to the checker's
emulated streams, so that TorchRec's CUDA branches (``wait_stream``, events, ``record_stream``)
run against the checker. Every ``progress()`` is ``checker.task("progress", step)``, and inside
it upstream's own steps are labelled by the method that runs them (``start_sparse_data_dist``,
``_wait_for_batch``, ``_backward``, ..., the model's forward as ``forward``, the optimizer's
``step``/``zero_grad``) with the batch of the context they work on, so findings name the step.

Not the repository's ``upstream_cpu_patch``: that one makes ``record_stream`` a no-op on CPU
tensors and passes CPU streams as None to the embedding lookup, which would hide exactly what
the checker looks at. With emulated streams (which have a ``.device``) only the CUDA event of
TrainPipelinePEC's constructor needs replacing (by an emulated event).

``train_maglev_checked(name, checker, steps)``: ``Maglev1F1B``, ``Maglev1F1BRecvAhead`` or
``MaglevPipelineBase`` (ours) on a one-stage TorchRec ``MaglevTestModel``, the only pipeline
length one process can hold (a stage per rank; the default group of this process has one rank).
The drop-ins' ``ProgramEngine`` runs checked with ``SWP_STREAM_CHECK=1`` (the process's
checker); here, to use the given checker, the pipeline's engine is replaced by one built on the
same bindings with ``CheckedStreamPool(checker)``: each action runs inside
``checker.task(<action>, microbatch, thread)`` and the engine's ``signal``/``wait`` pairs
publish and acquire the thread's clocks, as the plan engine's latches do.

``maglev_rank_checked``: the same on each rank of a ``world_size``-stage run
(``harness.ranks.run_on_ranks``), each rank with a checker of its own (a checker sees one
process: the wires between ranks are not checked).

Not seen by the checker: EvalPipelineSparseDist's ``DataLoadingThread`` copies batches on a
thread of its own, outside every task, so its copies are not recorded (its consumers' waits are).

Both take ``ops_per_stream``: a dict filled with the number of aten ops run on each emulated
stream (to see that the CUDA branches ran).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.dlrm import PIPELINES
from torchrec_swp import drop_ins

__all__ = [
    "MAGLEV_PIPELINES",
    "UPSTREAM_PIPELINES",
    "maglev_rank_checked",
    "train_maglev_checked",
    "train_upstream_checked",
]

#: Upstream pipelines this module runs: every one ``harness.dlrm`` builds.
UPSTREAM_PIPELINES: tuple[str, ...] = PIPELINES

#: Our Maglev drop-ins this module runs: the rows of ``torchrec_swp.drop_ins.EXTRAS`` that say so.
MAGLEV_PIPELINES: tuple[str, ...] = tuple(e.name for e in drop_ins.extras() if e.stream_checked)

#: Upstream's methods whose work is labelled with their name (those the class has).
_LABELLED = (
    "fill_pipeline",
    "_connect",
    "_copy_batch_to_gpu",
    "copy_batch_to_gpu",
    "inplace_copy_batch_to_gpu",
    "enqueue_batch",
    "dequeue_batch",
    "_wait_for_batch",
    "start_sparse_data_dist",
    "wait_sparse_data_dist",
    "clear_sparse_data_dist_inputs",
    "start_embedding_lookup",
    "wait_embedding_lookup",
    "_prefetch",
    "_mlp_forward",
    "_backward",
    "embedding_backward",
    "_grad_swap",
    "_mlp_optimizer_step",
    "_optimizer_step",
    "_pec_overlap_dist",
    "_compute_and_output_dist",
    "_pec_ol_compute",
    "_pec_nol_compute",
)


class _StreamCounter(TorchDispatchMode):
    """Counts the aten ops per emulated stream (the calling thread's current one)."""

    def __init__(self, checker: Any, counts: dict[str, int]) -> None:
        super().__init__()
        self.checker, self.counts = checker, counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = self.checker.current_stream().name
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _in_task(checker: Any, counts: dict[str, int] | None, name: str, batch: int | None, thread: str | None) -> Any:
    """``checker.task(...)``, with the op counter inside it if ``counts`` is given."""
    stack = contextlib.ExitStack()
    stack.enter_context(checker.task(name, batch, thread))
    if counts is not None:
        stack.enter_context(_StreamCounter(checker, counts))
    return stack


# ------------------------------------------------------------------------------ upstream
def _cuda_like_streams(pipeline: Any, checker: Any) -> dict[str, Any]:
    """The stream attributes upstream's constructor sets on a CUDA device (it leaves them None on
    the CPU), as emulated streams: ``{attribute: stream}``."""
    from torchrec.distributed.train_pipeline import train_pipelines as up

    streams: dict[str, Any] = {}
    if isinstance(pipeline, up.TrainPipelineBase):
        streams["_memcpy_stream"] = checker.stream("memcpy")
    if isinstance(pipeline, up.TrainPipelineSparseDist):
        streams["_memcpy_stream"] = checker.stream("memcpy")
        # Lite keeps no data_dist stream on any device (its constructor sets it to None)
        if not isinstance(pipeline, up.TrainPipelineSparseDistLite):
            streams["_data_dist_stream"] = checker.stream("data_dist")
    if isinstance(pipeline, up.TrainPipelineFusedSparseDist):
        # the constructor's default (emb_lookup_stream="data_dist"): the data_dist stream itself
        streams["_emb_lookup_stream"] = streams["_data_dist_stream"]
    if isinstance(pipeline, up.PrefetchTrainPipelineSparseDist):
        streams["_prefetch_stream"] = checker.stream("prefetch")
        # a new stream on CUDA too (``torch.cuda.Stream()``), despite the name
        streams["_default_stream"] = checker.stream("prefetch_default")
    return streams


def _batch_of(pipeline: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], step: list[int]) -> int:
    """The batch a method works on: its context argument's index, else that of the pipeline's
    first context, else the step."""
    for a in (*args, *kwargs.values()):
        index = getattr(a, "index", None)
        if isinstance(index, int) and not isinstance(index, bool) and hasattr(a, "module_contexts"):
            return index
    contexts = getattr(pipeline, "contexts", None)
    if contexts:
        index = getattr(contexts[0], "index", None)
        if isinstance(index, int):
            return index
    return step[0]


def _label_methods(pipeline: Any, checker: Any, counts: dict[str, int] | None, step: list[int]) -> None:
    """Wrap upstream's methods (those of ``_LABELLED`` the pipeline has) in checker labels."""
    for name in _LABELLED:
        method = getattr(pipeline, name, None)
        if method is None or not callable(method):
            continue

        @functools.wraps(method)
        def labelled(*args: Any, __m: Callable[..., Any] = method, __n: str = name, **kwargs: Any) -> Any:
            with _in_task(checker, counts, __n, _batch_of(pipeline, args, kwargs, step), None):
                return __m(*args, **kwargs)

        setattr(pipeline, name, labelled)


def _label_model_and_optimizer(
    model: torch.nn.Module, optimizer: Any, checker: Any, counts: dict[str, int] | None, batch: Callable[[], int]
) -> None:
    """The model's forward as ``forward``, the optimizer's ``step``/``zero_grad`` by name."""
    open_tasks: list[Any] = []

    def pre(module: Any, inputs: Any) -> None:
        ctx = _in_task(checker, counts, "forward", batch(), None)
        ctx.__enter__()
        open_tasks.append(ctx)

    def post(module: Any, inputs: Any, output: Any) -> None:
        if open_tasks:
            open_tasks.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post, always_call=True)
    for name in ("step", "zero_grad"):
        method = getattr(optimizer, name)

        @functools.wraps(method)
        def labelled(*args: Any, __m: Callable[..., Any] = method, __n: str = name, **kwargs: Any) -> Any:
            with _in_task(checker, counts, f"optimizer.{__n}", batch(), None):
                return __m(*args, **kwargs)

        setattr(optimizer, name, labelled)


@contextlib.contextmanager
def _cuda_events_emulated() -> Iterator[None]:
    """``torch.cuda.Event()`` is the installed checker's emulated event while CUDA is absent
    (TrainPipelinePEC makes two in its constructor; a CPU build refuses to)."""
    original = torch.cuda.Event
    if not torch.cuda.is_available():
        torch.cuda.Event = lambda *args, **kwargs: torch.cpu.Event()  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Event = original  # type: ignore[misc]


def _build_upstream(name: str, checker: Any) -> Any:
    """``harness.dlrm.Runner`` of upstream's ``name`` with emulated streams (no CPU patch)."""
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import INFO, PipelineUnavailable, Runner, upstream_class
    from harness.dlrm_data import SIZES

    if name not in UPSTREAM_PIPELINES:
        raise PipelineUnavailable(f"unknown pipeline {name!r}; choose one of {', '.join(UPSTREAM_PIPELINES)}")
    info = INFO[name]
    patch = contextlib.ExitStack()
    try:
        if name == "TrainPipelineSparseDistCompAutograd":
            # as harness.dlrm: compiled autograd needs DDP's Python reducer, and no full graph
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                model, optimizer = build_dlrm(0, 1, SIZES["small"])
            model._compiled_autograd_options = {"backend": "inductor", "dynamic": True, "fullgraph": False}
        else:
            model, optimizer = build_dlrm(0, 1, SIZES["small"])
        if info.kind == "eval":
            model.eval()
        cpu = torch.device("cpu")
        if name == "StagedTrainPipeline":
            pipeline = _staged_checked(model, checker)
        else:
            cls = upstream_class(name)
            if name == "TrainPipelinePEC":
                with _cuda_events_emulated():
                    pipeline = cls(model, optimizer, cpu, **info.options)
            else:
                pipeline = cls(model, optimizer, cpu, **info.options)
            for attribute, stream in _cuda_like_streams(pipeline, checker).items():
                setattr(pipeline, attribute, stream)
        return Runner(info, "upstream", pipeline, model, optimizer, patch)
    except BaseException:
        patch.close()
        raise


def _staged_checked(model: torch.nn.Module, checker: Any) -> Any:
    """Upstream's StagedTrainPipeline as ``harness.dlrm`` builds it (copy the batch, start its
    sparse data dist), every stage on its own emulated stream, the compute stream the default."""
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil
    from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline

    sdd = SparseDataDistUtil(model, data_dist_stream=checker.stream("data_dist"))

    def copy(batch: Any) -> Any:
        return batch.to(torch.device("cpu"), non_blocking=True)

    stages = [
        PipelineStage("data_copy", copy, checker.stream("data_copy")),
        PipelineStage(
            "start_sparse_data_dist",
            sdd.start_sparse_data_dist,
            checker.stream("start_sparse_data_dist"),
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]
    pipeline = StagedTrainPipeline(stages, compute_stream=checker.default_stream)
    pipeline._swp_sdd = sdd  # type: ignore[attr-defined]
    return pipeline


def _label_stages(pipeline: Any, checker: Any, counts: dict[str, int] | None, step: list[int]) -> None:
    for stage in pipeline._pipeline_stages:
        runnable = stage.runnable

        def labelled(batch: Any, __r: Callable[..., Any] = runnable, __n: str = stage.name) -> Any:
            with _in_task(checker, counts, __n, step[0], None):
                return __r(batch)

        stage.runnable = labelled
    sdd = pipeline._swp_sdd
    for name in ("wait_sdd_fill_callback", "data_exhausted_callback", "wait_sparse_data_dist"):
        method = getattr(sdd, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def labelled_method(*args: Any, __m: Callable[..., Any] = method, __n: str = name, **kwargs: Any) -> Any:
            with _in_task(checker, counts, __n, step[0], None):
                return __m(*args, **kwargs)

        setattr(sdd, name, labelled_method)


def train_upstream_checked(
    name: str,
    checker: Any,
    steps: int = 12,
    *,
    copies: bool = True,
    ops_per_stream: dict[str, int] | None = None,
) -> int:
    """Train (eval pipelines: evaluate) upstream's ``name`` for up to ``steps`` batches under
    ``checker`` (installed, with the default process group of 1 rank initialised); the number of
    ``progress()`` calls that returned a batch. Findings land in ``checker``.

    ``copies`` (default): the batches are made before the run (host memory, as a loader's), so
    the installed checker makes upstream's host-to-device copy new tensors on the copy stream
    (``StreamChecker.host_to_device``); False: the loader runs inside the tasks, its tensors
    count as device memory and ``.to(cpu)`` copies nothing.

    Raises ``harness.dlrm.PipelineUnavailable`` where upstream cannot run here, saying why.
    """
    from harness.dlrm_data import SIZES, batches

    if not checker.installed:
        raise ValueError("train_upstream_checked needs an installed checker (checker.install())")
    runner = _build_upstream(name, checker)
    pipeline = runner.pipeline
    step = [0]
    if runner.info.kind == "staged":
        _label_stages(pipeline, checker, ops_per_stream, step)
    else:
        _label_methods(pipeline, checker, ops_per_stream, step)
    _label_model_and_optimizer(
        runner.model, runner.optimizer, checker, ops_per_stream, lambda: _batch_of(pipeline, (), {}, step)
    )
    data = batches(SIZES["small"], 0, steps, 0.0)
    if copies:
        data = iter(list(data))  # made outside every task: host memory
    done = 0
    try:
        while True:
            step[0] = done
            try:
                with _in_task(checker, ops_per_stream, "progress", done, None):
                    out = pipeline.progress(data)
                if runner.info.kind == "staged":
                    with _in_task(checker, ops_per_stream, "train", done, None):
                        runner.finish(out)
            except StopIteration:
                return done
            done += 1
    finally:
        runner.close()


# ------------------------------------------------------------------------------ Maglev
def _counted(
    checker: Any, counts: dict[str, int], fn: Callable[[int, int | None], Any]
) -> Callable[[int, int | None], Any]:
    """``fn`` with the aten ops it runs counted per emulated stream."""

    def run(stage: int, microbatch: int | None) -> Any:
        with _StreamCounter(checker, counts):
            return fn(stage, microbatch)

    return run


def train_maglev_checked(
    name: str,
    checker: Any,
    steps: int = 4,
    *,
    num_microbatches: int = 4,
    thread_map: Any = "main",
    ops_per_stream: dict[str, int] | None = None,
) -> int:
    """Train our Maglev drop-in ``name`` (``MAGLEV_PIPELINES``) for ``steps`` optimizer steps on
    a one-stage MaglevTestModel under ``checker`` (installed, default process group of 1 rank:
    one process holds one stage); the steps run. Each action is one checker task (labelled
    ``<stage><kind><microbatch>``, batch = the microbatch) on the engine thread that runs it; the
    step's input driver and optimizer ``zero_grad`` are task ``take_inputs``."""
    import torch.distributed as dist
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.engine import ProgramEngine
    from torchrec_swp.integrations.torchrec import maglev
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches, on_cpu
    from torchrec_swp.streamcheck import CheckedStreamPool

    if name not in MAGLEV_PIPELINES:
        raise ValueError(f"unknown Maglev pipeline {name!r}; choose one of {', '.join(MAGLEV_PIPELINES)}")
    if not checker.installed:
        raise ValueError("train_maglev_checked needs an installed checker (checker.install())")
    world = dist.get_world_size()
    config = ModelConfig(layers_per_stage=(2,) * world)
    stage = on_cpu(StageWrapper(build_model(config, seed=0), list(config.layers_per_stage), stage_size=1))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    cls = getattr(maglev, name)
    if name == "MaglevPipelineBase":
        pipeline = cls(stage, optimizer, thread_map=thread_map)
    else:
        pipeline = cls(stage, optimizer, num_microbatches, thread_map=thread_map)
    old = pipeline.engine  # replaced by one on this checker (SWP_STREAM_CHECK=1 gives the process's)
    bindings = pipeline.runtime.bindings()
    if ops_per_stream is not None:
        bindings = {kind: _counted(checker, ops_per_stream, fn) for kind, fn in bindings.items()}
    pipeline.engine = ProgramEngine(
        bindings, streams=CheckedStreamPool(checker), timeout_s=old.timeout_s, name=old.name
    )
    old.close()
    take_inputs = stage.take_inputs

    def labelled_take(*args: Any, **kwargs: Any) -> Any:
        with _in_task(checker, ops_per_stream, "take_inputs", None, None):
            return take_inputs(*args, **kwargs)

    stage.take_inputs = labelled_take  # type: ignore[method-assign]
    data = iter(make_batches(config, steps * pipeline.microbatches_per_pass, seed=dist.get_rank()))
    done = 0
    try:
        for _ in range(steps):
            pipeline.progress(data)
            done += 1
    finally:
        pipeline.close()
    return done


def maglev_rank_checked(
    rank: int, world_size: int, name: str, thread_map: Any = "main", steps: int = 2
) -> dict[str, Any]:
    """One rank of a ``world_size``-stage Maglev run (``harness.ranks.run_on_ranks``), under a
    checker of its own: ``{"steps", "ops_per_stream", "findings": [str], "counts"}``. A checker
    sees one process: it checks each rank's streams and threads, not what crosses ranks."""
    from torchrec_swp.streamcheck import StreamChecker

    checker = StreamChecker().install()
    counts: dict[str, int] = {}
    try:
        done = train_maglev_checked(name, checker, steps, thread_map=thread_map, ops_per_stream=counts)
    finally:
        checker.uninstall()
    return {
        "steps": done,
        "ops_per_stream": counts,
        "findings": [str(f) for f in checker.findings],
        "counts": checker.counts,
    }
