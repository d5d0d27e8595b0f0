"""The drop-in pipelines, one row each: the one list every other list of them is made from.

Pure data (no torch, no plan layer): ``import torchrec_swp`` reads it to export the pipelines and
load each on first use. From it come ``torchrec_swp.__all__`` and ``pipelines.__all__``, the
catalog's ``default_plans()`` and the plan each class builds by default (``row_of``,
``PlanDriven._swp_row_plan``), the table of ``docs/pipelines.md`` (``markdown_table()``), the GPU
parity cases (``benchmarks/gpu/parity.py``, less the rows' ``not_on_gpu``), the golden plans'
list, the pipelines that take ``async_inplace_copy`` (``compat.ASYNC_INPLACE_COPY_PIPELINES``),
upstream's class in the harnesses (``harness.dlrm.upstream_class``) and what the DLRM example's
harness runs (a row's ``example``: ``harness.dlrm.INFO``, the stream checker's runs in
``tools/stream_check.py``); tests check README.md, docs/install.md and the parity tests against
it. A pipeline class whose module and name are a row here is checked when it is defined
(``pipelines/protocol.py``): its task functions against the catalog's task names, its default
plan's tasks against its task functions, its abstract hooks.

Beside them, ``EXTRAS``: the other classes ``torchrec_swp`` exports (the Maglev schedules, the
accumulation wrapper), a row each, from which ``torchrec_swp.__all__`` takes them.

Adding a pipeline (``docs/adding_a_pipeline.md``): a row here, its plan in the catalog, its
module; the golden plan and the docs' table are regenerated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: Where the drop-ins live (a row's ``module`` is relative to it unless it has a dot in it).
PACKAGE = "torchrec_swp.integrations.torchrec.pipelines"
#: TorchRec's package of pipelines (a row's ``upstream`` is a module in it).
UPSTREAM_PACKAGE = "torchrec.distributed.train_pipeline"


@dataclass(frozen=True)
class Example:
    """How the DLRM example's harness (``harness.dlrm``: the CPU comparisons and benchmarks,
    ``tools/stream_check.py``) runs a drop-in: why upstream's class fails on the CPU as shipped
    (``upstream_fails``; empty: it runs), whether it compiles the model (``compiles``: its first
    steps take tens of seconds), and the runs of ours under the stream checker (``stream_checks``:
    None for the default plan, a thread map's name, ``"nonfinite"`` and ``"nonfinite <thread
    map>"`` for ``on_nonfinite="skip"`` over a poisoned batch; empty: not checked)."""

    upstream_fails: str = ""
    compiles: bool = False
    stream_checks: tuple[str | None, ...] = (None,)


_RECORD_STREAM = "record_stream on CPU tensors, and a CUDA fallback device in runtime_forwards"


@dataclass(frozen=True)
class DropIn:
    """One drop-in: ``name`` (upstream's class name, and ours), the module defining ours
    (``module``: under ``PACKAGE``, or a dotted path), the TorchRec module defining upstream's
    (``upstream``, under ``UPSTREAM_PACKAGE``), the catalog function making its default plan
    (``plan``, in ``torchrec_swp.catalog.torchrec``) and its arguments there (``plan_arguments``),
    and the first TorchRec series that has it (``since``). ``kind``: ``"train"``; ``"eval"``,
    forward only, the model in eval mode; ``"staged"``, the caller trains on what ``progress()``
    returns. ``async_inplace_copy``: upstream's constructor takes ``async_inplace_copy`` from
    TorchRec 1.9 on (ours takes it on 1.8 too and schedules the copy itself). ``not_on_gpu``: why
    the GPU parity check has no case for it (``benchmarks/gpu/parity.py``; empty: it has one).
    ``example``: how the DLRM example runs it (None: it does not)."""

    name: str
    module: str
    upstream: str
    plan: str
    plan_arguments: Mapping[str, Any] = field(default_factory=dict)
    since: str = "1.8"
    kind: Literal["train", "eval", "staged"] = "train"
    async_inplace_copy: bool = False
    not_on_gpu: str = ""
    example: Example | None = None

    @property
    def module_path(self) -> str:
        """The dotted path of the module that defines our class."""
        return self.module if "." in self.module else f"{PACKAGE}.{self.module}"

    @property
    def upstream_path(self) -> str:
        return f"{UPSTREAM_PACKAGE}.{self.upstream}"

    @property
    def experimental(self) -> bool:
        """Upstream's ``experimental_pipelines.py`` defines it."""
        return self.upstream == "experimental_pipelines"


_TRAIN = "train_pipelines"
_EXPERIMENTAL = "experimental_pipelines"

#: The drop-ins, in the order the docs list them: train_pipelines.py's, 1.9's PEC, then
#: experimental_pipelines.py's.
DROP_INS: dict[str, DropIn] = {
    d.name: d
    for d in (
        DropIn("TrainPipelineBase", "base", _TRAIN, "train_pipeline_base_plan", example=Example()),
        DropIn("TrainPipelinePT2", "compiled", _TRAIN, "pt2_phases", example=Example(compiles=True)),
        DropIn(
            "TrainPipelineSparseDist",
            "sparse_dist",
            _TRAIN,
            "sparse_dist_plan",
            async_inplace_copy=True,
            example=Example(stream_checks=(None, "by_stream", "io", "nonfinite", "nonfinite by_stream")),
        ),
        DropIn(
            "TrainPipelineSparseDistLite",
            "lite",
            _TRAIN,
            "sparse_dist_lite_plan",
            async_inplace_copy=True,
            example=Example(stream_checks=(None, "by_stream")),
        ),
        DropIn(
            "TrainPipelineFusedSparseDist",
            "fused",
            _TRAIN,
            "fused_sparse_dist_plan",
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream", "nonfinite by_stream")),
        ),
        # start_batch 900: upstream's default
        DropIn(
            "TrainPipelineSemiSync",
            "semi_sync",
            _TRAIN,
            "semi_sync_phases",
            {"start_batch": 900},
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream", "nonfinite by_stream")),
        ),
        DropIn(
            "PrefetchTrainPipelineSparseDist",
            "prefetch",
            _TRAIN,
            "prefetch_sparse_dist_plan",
            async_inplace_copy=True,
            example=Example(
                upstream_fails="prefetch returns early without a data_dist stream (always so on CPU)",
                stream_checks=(None, "by_stream", "nonfinite by_stream"),
            ),
        ),
        DropIn("EvalPipelineSparseDist", "eval", _TRAIN, "eval_sparse_dist_plan", kind="eval", example=Example()),
        DropIn(
            "EvalPipelineFusedSparseDist",
            "fused",
            _TRAIN,
            "eval_fused_sparse_dist_plan",
            kind="eval",
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream")),
        ),
        # two stages of the user's, as upstream's tests build it (the tasks are named after the stages)
        DropIn(
            "StagedTrainPipeline",
            "staged",
            _TRAIN,
            "staged_plan",
            {
                "stage_names": ["data_copy", "gpu_postproc"],
                "stage_streams": ["memcpy", "postproc"],
                "fill_callbacks": [False, True],
            },
            kind="staged",
            example=Example(upstream_fails="the CPU's default stream has no .device"),
        ),
        DropIn(
            "TrainPipelineSparseDistCompAutograd",
            "compiled",
            _TRAIN,
            "comp_autograd_plan",
            example=Example(upstream_fails="compiled autograd rejects the C++ DDP reducer", compiles=True),
        ),
        # The DLRM's tables are an EmbeddingBagCollection (no PEC tables): every module takes PEC's
        # non-PEC path, looked up at the start of the step like Fused's.
        DropIn(
            "TrainPipelinePEC",
            "pec",
            "pec_train_pipeline",
            "pec_plan",
            since="1.9",
            example=Example(
                upstream_fails="its constructor creates torch.cuda.Event()", stream_checks=(None, "by_stream")
            ),
        ),
        # TrainPipelineSparseDist's constructor, unchanged
        DropIn(
            "TrainEvalHybridPipelineBase",
            "train_eval_hybrid",
            _EXPERIMENTAL,
            "train_eval_hybrid_plan",
            async_inplace_copy=True,
            # trains in train mode and evaluates in eval mode (the example's --eval-mode hybrid);
            # upstream's runs on the CPU as shipped
            example=Example(stream_checks=()),
        ),
        DropIn("TrainPipelineSparseDistT", "threaded_copy", _EXPERIMENTAL, "sparse_dist_t_plan"),
        DropIn("TrainPipelineSparseDistBwdOpt", "backward_optimizer", _EXPERIMENTAL, "sparse_dist_bwd_opt_plan"),
        DropIn("TrainPipelineSparseDistOptStash", "stashing", _EXPERIMENTAL, "opt_stash_plan"),
        DropIn("TrainPipelineSparseDistEmbStash", "stashing", _EXPERIMENTAL, "emb_stash_plan"),
        DropIn("TrainPipelinePrefetchEMS", "stashing", _EXPERIMENTAL, "prefetch_ems_plan"),
        DropIn(
            "EvalPipelineCPUSparse",
            "cpu_sparse",
            _EXPERIMENTAL,
            "eval_cpu_sparse_plan",
            kind="eval",
            not_on_gpu="needs a model with data-parallel tables on the CPU and the dense part on the GPU "
            "(tests/dist/test_parity_cpu_sparse.py runs it on the CPU); not written yet",
        ),
    )
}


def drop_ins() -> Iterator[DropIn]:
    """Every row, in order (a function, so that a test may add a row for a while)."""
    return iter(DROP_INS.values())


def names(series: str | None = None) -> tuple[str, ...]:
    """The drop-ins' names; with ``series`` (``"1.8"``, ``"1.9"``) those that TorchRec series has."""
    return tuple(d.name for d in drop_ins() if series is None or _release(d.since) <= _release(series))


@dataclass(frozen=True)
class Extra:
    """A public class beside the drop-ins, exported by ``torchrec_swp`` as they are (loaded on first
    use) but not the drop-in of one of upstream's train pipelines (no catalog plan, no row above):
    ``name`` (upstream's, and ours), the module defining or exporting ours (``module``, a dotted
    path), what it is (``kind``: ``"maglev"``, TorchRec 1.9's pipeline-parallel schedules, whose
    schedules are programs; ``"accumulation"``, the wrapper around any pipeline), and the first
    TorchRec series that has it (``since``). ``stream_checked``: ``tools/stream_check.py`` runs it
    under the stream checker (``harness.upstream_streams``)."""

    name: str
    module: str
    kind: str
    since: str = "1.8"
    stream_checked: bool = False


_MAGLEV = "torchrec_swp.integrations.torchrec.maglev"  # an ImportError naming TorchRec 1.9 on 1.8
_ACCUMULATION = f"{PACKAGE}.gradient_accumulation"

#: The other exported classes, in the order ``torchrec_swp.__all__`` lists them.
EXTRAS: dict[str, Extra] = {
    e.name: e
    for e in (
        Extra("MaglevPipelineBase", _MAGLEV, "maglev", since="1.9", stream_checked=True),
        Extra("Maglev1F1B", _MAGLEV, "maglev", since="1.9", stream_checked=True),
        Extra("Maglev1F1BRecvAhead", _MAGLEV, "maglev", since="1.9", stream_checked=True),
        Extra("PipelineRank", _MAGLEV, "maglev", since="1.9"),  # a rank holding several stages
        Extra("GradientAccumulationWrapper", _ACCUMULATION, "accumulation"),
        Extra("GradientAccumulationConfig", _ACCUMULATION, "accumulation"),  # upstream's, re-exported
    )
}


def extras(series: str | None = None) -> Iterator[Extra]:
    """The other exported classes, in order; with ``series`` those that TorchRec series has."""
    return (e for e in EXTRAS.values() if series is None or _release(e.since) <= _release(series))


def find(module: str, name: str) -> DropIn | None:
    """The row of class ``name`` defined in ``module`` (None for any other class, e.g. a user's subclass)."""
    row = DROP_INS.get(name)
    return row if row is not None and row.module_path == module else None


def row_of(cls: type) -> DropIn | None:
    """The row of ``cls`` or of the nearest of its bases that has one (a user's subclass of a drop-in:
    the drop-in's); None for a class that is no drop-in."""
    return next((row for c in cls.__mro__ if (row := find(c.__module__, c.__name__)) is not None), None)


def markdown_table() -> str:
    """The table of ``docs/pipelines.md``: a row per drop-in (``tests/unit/test_drop_ins.py`` keeps
    the file equal to it)."""
    lines = [
        "| pipeline | replaces | defined in | default plan | TorchRec |",
        "|---|---|---|---|---|",
    ]
    for d in drop_ins():
        arguments = ", ".join(f"{k}={v!r}" for k, v in d.plan_arguments.items())
        lines.append(
            f"| `{d.name}` | `{d.upstream_path}.{d.name}` | `{d.module_path}` "
            f"| `torchrec_swp.catalog.torchrec.{d.plan}({arguments})` | {d.since} on |"
        )
    return "\n".join(lines) + "\n"


def _release(series: str) -> tuple[int, ...]:
    return tuple(int(part) for part in series.split("."))
