"""TorchRec's train pipelines by name, upstream's or ours, ready to train one DLRM.

``make_runner(name, impl, build)`` builds a model with ``build()`` and wraps it in pipeline
``name`` of ``impl`` ("upstream": TorchRec's class; "ours": the torchrec_swp class of the
same name). ``Runner.step(it)`` trains (or, for the eval pipelines, evaluates) one batch and
returns what the model returned for it, ``(loss, logits, labels)``.

Our pipelines are the names ``torchrec_swp`` exports (``torchrec_swp.__all__``); a name it does
not export (yet) is reported by ``not_exported()`` and refused by ``make_runner`` with a
message saying so.

``device`` (default: the CPU) is the device the pipeline trains on: with a CUDA device the plans
run on real streams (and upstream's pipelines as shipped).

Upstream on CPU (see ``docs/install.md``): Base, SparseDist, Lite, PT2, EvalSparseDist and the
experimental TrainEvalHybridPipelineBase run as shipped. The others fail there; they run only with
``upstream_patch=True``, which applies the repository's test-only patch
(``examples/dlrm/upstream_cpu_patch.py``: CPU tensors ignore ``record_stream``, the CUDA fallback
device becomes the CPU) for as long as the runner
lives, plus the per-pipeline tweaks the parity tests use (Prefetch: a CPU data_dist stream during
prefetch; CompAutograd: DDP's Python reducer and ``fullgraph=False``; Staged: CPU streams with a
``.device``). The patch is process-wide: while it is on, our pipelines run under it too.

How each kind trains:

* train pipelines: ``progress()`` does zero_grad, forward, backward and the optimizer step;
* eval pipelines: the model is put in eval mode, ``progress()`` runs the forward only;
* StagedTrainPipeline: its stages copy the batch and start the sparse data dist
  (``SparseDataDistUtil``); the caller trains on the batch ``progress()`` returns, as upstream's
  docs show; ``Runner.step`` does both.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchrec_swp import drop_ins

Impl = Literal["upstream", "ours"]
Kind = Literal["train", "eval", "staged"]
ModelAndOptimizer = tuple[torch.nn.Module, torch.optim.Optimizer]

CPU = torch.device("cpu")


@dataclass(frozen=True)
class PipelineInfo:
    """What the example needs to know about one pipeline.

    ``upstream_fails``: why upstream's class fails on CPU as shipped ("" when it runs).
    ``options``: constructor options passed to both implementations.
    ``compiles``: it compiles the model (the first steps take tens of seconds).
    """

    name: str
    kind: Kind = "train"
    upstream_fails: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    compiles: bool = False


#: Constructor options the example passes to both implementations, by pipeline: SemiSync's
#: semi-sync phase (stale embeddings) starts at batch 10, not 900, so that a short run measures it.
OPTIONS: Mapping[str, Mapping[str, Any]] = {"TrainPipelineSemiSync": {"start_batch": 10}}

#: Every drop-in the example runs (its row's ``example``, ``torchrec_swp.drop_ins``), the compiled
#: ones last (they change global dynamo settings).
INFO: dict[str, PipelineInfo] = {
    d.name: PipelineInfo(d.name, d.kind, d.example.upstream_fails, OPTIONS.get(d.name, {}), d.example.compiles)
    for d in sorted(drop_ins.drop_ins(), key=lambda d: d.example is not None and d.example.compiles)
    if d.example is not None
}

PIPELINES: tuple[str, ...] = tuple(INFO)


class PipelineUnavailable(RuntimeError):
    """The pipeline cannot be built here; the message says why and what to do."""


def not_exported() -> dict[str, str]:
    """``{name: reason}`` for every pipeline torchrec_swp does not export (yet)."""
    exported = _ours_exports()
    return {n: f"torchrec_swp does not export {n} (yet)" for n in PIPELINES if n not in exported}


def _ours_exports() -> set[str]:
    import torchrec_swp

    return set(torchrec_swp.__all__)


def upstream_class(name: str) -> type:
    """Upstream's class ``name``, from the TorchRec module its row in ``torchrec_swp.drop_ins`` names."""
    row = drop_ins.DROP_INS[name]
    try:
        module = importlib.import_module(row.upstream_path)
    except ImportError:
        raise PipelineUnavailable(f"{name} is new in TorchRec {row.since}") from None
    return getattr(module, name)


def _pipeline_class(name: str, impl: Impl) -> type:
    if impl == "upstream":
        if name == "PrefetchTrainPipelineSparseDist":
            return _upstream_prefetch_on_cpu()
        return upstream_class(name)
    if name not in _ours_exports():
        raise PipelineUnavailable(
            f"torchrec_swp does not export {name} (yet); it exports "
            + ", ".join(sorted(_ours_exports() - {"__version__"}))
        )
    import torchrec_swp

    return getattr(torchrec_swp, name)


def upstream_unavailable(name: str, impl: Impl, device: torch.device, upstream_patch: bool) -> str:
    """Why ``make_runner`` would refuse upstream's ``name`` here (checked before launch), or ""."""
    info = INFO.get(name)
    if impl != "upstream" or info is None or not info.upstream_fails or device.type != "cpu" or upstream_patch:
        return ""
    return (
        f"upstream's {name} fails on CPU as shipped ({info.upstream_fails}); allow the test-only CPU patch "
        "(--upstream-cpu-patch) or use our pipeline"
    )


def ours_takes(name: str, keyword: str) -> bool:
    """Whether torchrec_swp's pipeline ``name`` takes the constructor keyword ``keyword`` (e.g.
    ``input_dist_group``, which only the SparseDist family has); False for a name it does not export."""
    if name not in _ours_exports():
        return False
    return any(keyword in _parameters(klass) for klass in _pipeline_class(name, "ours").__mro__)


def unknown_options(name: str, impl: Impl, options: Mapping[str, Any]) -> str:
    """A message naming the ``options`` that ``name``'s constructor does not take (its upstream
    class's parameters, and for ours the engine's keyword options), or "" (checked before launch)."""
    if name not in INFO or not options:
        return ""
    try:
        upstream_cls = _pipeline_class(name, "upstream")
    except PipelineUnavailable:
        return ""
    taken = {p for klass in upstream_cls.__mro__ for p in _parameters(klass)}
    if impl == "ours":
        from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions

        taken |= {*EngineOptions.names(), "input_dist_group", "streams"}
    unknown = sorted(set(options) - taken)
    if not unknown:
        return ""
    return f"--option {', '.join(unknown)}: not an option of {name} (it takes {', '.join(sorted(taken))})"


def _parameters(klass: type) -> list[str]:
    init = klass.__dict__.get("__init__")
    if init is None:
        return []
    params = inspect.signature(init).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


class Runner:
    """One pipeline and the model it trains. ``step(it)`` handles one batch; ``close()`` ends it.

    ``model`` / ``optimizer`` are the ones ``build()`` returned; ``pipeline`` is the pipeline
    object (ours has ``.plan`` and ``.engine``); ``stepper`` is what ``step`` calls and a
    checkpoint saves: the pipeline, or the GradientAccumulationWrapper around it (``accumulate``).
    """

    def __init__(
        self,
        info: PipelineInfo,
        impl: Impl,
        pipeline: Any,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        patch: contextlib.ExitStack,
        stepper: Any = None,
    ) -> None:
        self.info, self.impl = info, impl
        self.pipeline, self.model, self.optimizer = pipeline, model, optimizer
        self.stepper = pipeline if stepper is None else stepper
        self._patch = patch

    def step(self, batches: Iterator[Any]) -> Any:
        """Train (or evaluate) one batch; return ``(loss, logits, labels)``. StopIteration at the end of data."""
        return self.finish(self.stepper.progress(batches))

    def finish(self, progressed: Any) -> Any:
        """What ``step`` does after ``pipeline.progress()`` returned ``progressed``: nothing for
        the pipelines that train in ``progress()``; for StagedTrainPipeline, train on the batch
        it returned (StopIteration when it returned None, the end of data)."""
        if self.info.kind != "staged":
            return progressed
        if progressed is None:
            raise StopIteration
        self.optimizer.zero_grad()
        loss, output = self.model(progressed)
        loss.backward()
        self.optimizer.step()
        return output

    def close(self) -> None:
        """Stop our engine's worker threads and lift the upstream CPU patch (idempotent)."""
        for part in (self.stepper, self.pipeline):
            if hasattr(part, "close"):
                part.close()
        self._patch.close()


def make_runner(
    name: str,
    impl: Impl,
    build: Callable[[], ModelAndOptimizer],
    *,
    plan: Any = None,
    thread_map: Any = None,
    edit_plan: Callable[[Any], Any] | None = None,
    options: Mapping[str, Any] | None = None,
    upstream_patch: bool = False,
    device: torch.device = CPU,
    accumulate: int = 1,
) -> Runner:
    """Build a model with ``build()`` and pipeline ``name`` of ``impl`` around it, on ``device``
    (``build()`` puts the model there).

    ``plan`` and ``thread_map`` (ours only) replace the default plan and thread map;
    ``edit_plan`` (ours only) edits the plan before the thread map: the pipeline runs
    ``edit_plan(plan)``, or ``edit_plan(its default plan)`` (see ``default_plan_of``);
    ``options`` add constructor options (on top of ``INFO[name].options``).
    ``upstream_patch`` allows upstream pipelines that need the test-only CPU patch (see the
    module docstring; on a CUDA device they run as shipped). ``accumulate`` > 1: the runner steps
    through a GradientAccumulationWrapper with ``num_steps=accumulate`` (ours over ours, upstream's
    over upstream's). Raises PipelineUnavailable when the pipeline cannot run as asked.
    """
    if name not in INFO:
        raise PipelineUnavailable(f"unknown pipeline {name!r}; choose one of {', '.join(PIPELINES)}")
    info = INFO[name]
    if impl not in ("upstream", "ours"):
        raise PipelineUnavailable(f"impl must be 'upstream' or 'ours', got {impl!r}")
    if impl == "upstream" and (plan is not None or thread_map is not None or edit_plan is not None):
        raise PipelineUnavailable("a plan, a plan edit or a thread_map applies to our pipelines only (impl='ours')")
    if edit_plan is not None and info.kind == "staged":
        raise PipelineUnavailable("StagedTrainPipeline's plan follows its stages: it takes no plan edit")
    on_cpu = device.type == "cpu"
    if impl == "upstream" and info.upstream_fails and on_cpu and not upstream_patch:
        raise PipelineUnavailable(
            f"upstream's {name} fails on CPU as shipped ({info.upstream_fails}); "
            "allow the test-only CPU patch (--upstream-cpu-patch) or use our pipeline"
        )
    cls = _pipeline_class(name, impl)
    kwargs = {**info.options, **(options or {})}
    patch = contextlib.ExitStack()
    try:
        if impl == "upstream" and info.upstream_fails and on_cpu:
            from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch

            patch.enter_context(upstream_cpu_patch())
        if impl == "upstream" and name == "TrainPipelineSparseDistCompAutograd":
            # DDP picks its reducer when built; compiled autograd needs the Python one, and
            # fbgemm_gpu_cpu has no fake kernel for the TBE backward, so no full graph.
            with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
                model, optimizer = build()
            model._compiled_autograd_options = {"backend": "inductor", "dynamic": True, "fullgraph": False}
        else:
            model, optimizer = build()
        if info.kind == "eval":
            model.eval()
        if edit_plan is not None:
            if kwargs.get("input_dist_group") is True:  # one new group, for the default plan's pipeline too
                from torchrec_swp.integrations.torchrec.input_dist_group import new_input_dist_group

                kwargs["input_dist_group"] = new_input_dist_group(where=f"{name}(input_dist_group=True)")
            plan = edit_plan(plan if plan is not None else default_plan_of(cls, model, optimizer, device, kwargs))
        engine_options = {k: v for k, v in (("plan", plan), ("thread_map", thread_map)) if v is not None}
        if info.kind == "staged":
            if kwargs:
                raise PipelineUnavailable(f"StagedTrainPipeline takes no options here, got {sorted(kwargs)}")
            pipeline = _staged(cls, impl, model, engine_options, device)
        else:
            pipeline = cls(model, optimizer, device, **kwargs, **engine_options)
        stepper = None
        if accumulate > 1:
            if info.kind != "train":
                raise PipelineUnavailable(f"{name} steps no optimizer in progress(): nothing to accumulate for")
            stepper = _accumulating(impl, pipeline, optimizer, model, accumulate)
    except BaseException:
        patch.close()
        raise
    return Runner(info, impl, pipeline, model, optimizer, patch, stepper)


def _accumulating(impl: Impl, pipeline: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module, n: int) -> Any:
    """GradientAccumulationWrapper (``impl``'s) around ``pipeline``, windows of ``n`` batches."""
    if impl == "ours":
        from torchrec_swp import GradientAccumulationConfig, GradientAccumulationWrapper
    else:
        from torchrec.distributed.train_pipeline.gradient_accumulation import (
            GradientAccumulationConfig,
            GradientAccumulationWrapper,
        )
    config = GradientAccumulationConfig(is_enabled=True, num_steps=n)
    return GradientAccumulationWrapper(pipeline, optimizer, model, config)


def default_plan_of(
    cls: type, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, kwargs: Mapping[str, Any]
) -> Any:
    """The default plan of our pipeline class ``cls`` built with these arguments (it depends on
    them: SemiSync's ``start_batch``, ``input_dist_group``'s comm group, ...), read from a pipeline
    built for it and closed at once: building one draws no batch, changes nothing in the model and
    issues no collective (``input_dist_group=True`` would create a process group: pass the group
    itself, as ``make_runner`` does)."""
    probe = cls(model, optimizer, device, **kwargs)
    try:
        return probe.plan
    finally:
        probe.close()


def _staged(
    cls: type, impl: Impl, model: torch.nn.Module, engine_options: dict[str, Any], device: torch.device = CPU
) -> Any:
    """StagedTrainPipeline with two stages: copy the batch to ``device``, start its sparse data
    dist, on streams of ``device``: on CPU the stream objects a user writes there
    (``torch.Stream(device="cpu")``, which upstream needs: its streams must have a ``.device``;
    ours runs with them as shipped), on CUDA new CUDA streams."""
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil

    if device.type == "cuda":
        stream: Callable[[], Any] = lambda: torch.cuda.Stream(device=device)  # noqa: E731
    else:
        stream = lambda: torch.Stream(device="cpu")  # noqa: E731
    sdd = SparseDataDistUtil(model, data_dist_stream=stream())
    stages = [
        PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True), stream()),
        PipelineStage(
            "start_sparse_data_dist",
            sdd.start_sparse_data_dist,
            stream(),
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]
    if impl == "ours":
        return cls(stages, **engine_options)
    return cls(stages, compute_stream=stream())


def _upstream_prefetch_on_cpu() -> type:
    import torchrec.distributed.train_pipeline.train_pipelines as upstream
    from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext

    class UpstreamPrefetchOnCpu(upstream.PrefetchTrainPipelineSparseDist):
        """Upstream's Prefetch pipeline, whose ``prefetch_embeddings`` does nothing without a
        data_dist stream: during ``_prefetch`` only, that stream is the CPU's current stream (a
        dummy whose context and waits do nothing). The same tweak as the parity tests'."""

        def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
            self._data_dist_stream = torch.cpu.current_stream()
            try:
                super()._prefetch(context)
            finally:
                self._data_dist_stream = None

    return UpstreamPrefetchOnCpu
