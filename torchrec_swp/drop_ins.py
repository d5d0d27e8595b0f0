"""The drop-in pipelines, one row each: the one list every other list of them is made from.

Pure data (no torch, no plan layer): ``import torchrec_swp`` reads it to export the pipelines and
load each on first use. From it come ``torchrec_swp.__all__`` and ``pipelines.__all__``, the
catalog's ``default_plans()`` and the plan each class builds by default (``row_of``,
``PlanDriven._swp_row_plan``), the table of ``docs/pipelines.md`` (``markdown_table()``) and
README.md's table of replacements (``readme_table()``), docs/install.md's table of what
upstream runs on a CPU (``install_table()``), the GPU parity cases
(``benchmarks/gpu/parity.py``, less the rows' ``not_on_gpu``), the golden plans' list, the
pipelines that take ``async_inplace_copy`` (``compat.ASYNC_INPLACE_COPY_PIPELINES``), upstream's
class in the harnesses (``harness.dlrm.upstream_class``) and what the DLRM example's harness runs
(a row's ``example``: ``harness.dlrm.INFO``, the stream checker's runs in
``tools/stream_check.py``); tests check the parity tests against it. A
pipeline class whose module and name are a row here is checked when it is defined
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
class OnCpu:
    """How upstream's class fares on a CPU as shipped and how ours does, as docs/install.md's
    table "Upstream on CPU" says it (``install_table()``): ``upstream`` ("runs", "fails", "cannot
    be constructed", with what it needs), ``why`` (what fails; empty where it runs), ``ours``."""

    upstream: str = "runs"
    why: str = ""
    ours: str = "runs, bit-identical"


_FAILS_ON_CPU_STREAMS = OnCpu(
    "fails",
    '`record_stream` of CPU tensors ("unknown parameter type"); the pipelined forward falls back to '
    '`torch.device("cuda")` without a stream; on 1.9 the stream-synced embedding lookup also reads `.device` of '
    "`torch.cpu.current_stream()`, which has none",
    "runs",
)
_STASHING_NEEDS_CUDA = OnCpu(
    "cannot be constructed",
    'the constructors call `torch.cuda.Stream(device=device)`: "torch.cuda.Stream requires CUDA support"; '
    "MemoryStashingManager's threaded stash and restore (OptStash) record `torch.cuda.Event()`s on "
    "`torch.cuda.current_stream()` of `torch.cuda.current_device()`, and restore on the pipeline's memcpy stream, "
    "which the CPU has not",
    "runs, bit-identical to upstream under the patch (on the CPU the manager stashes nothing: it moves CUDA tensors "
    "only)",
)


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
    ``example``: how the DLRM example runs it (None: it does not). ``exported``: upstream's
    package exports the class (a user imports it from there); ``notes``: what README.md's table of
    replacements says of it (``readme_table()``); ``on_cpu``: upstream's and ours on a CPU, for
    docs/install.md (``install_table()``)."""

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
    exported: bool = False
    notes: str = ""
    on_cpu: OnCpu = OnCpu()

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
        DropIn(
            "TrainPipelineBase",
            "base",
            _TRAIN,
            "train_pipeline_base_plan",
            example=Example(),
            exported=True,
            notes="bit-identical (1.9, 1.8). LoadBatch(i+1), fwd/bwd(i), H2D(i+1), opt(i)",
        ),
        DropIn(
            "TrainPipelinePT2",
            "compiled",
            _TRAIN,
            "pt2_phases",
            example=Example(compiles=True),
            exported=True,
            notes="bit-identical (1.9, 1.8); compiles on the 4th call (a Compile task in a phase of its own)",
            on_cpu=OnCpu("runs (first compile 20-80 s)"),
        ),
        DropIn(
            "TrainPipelineSparseDist",
            "sparse_dist",
            _TRAIN,
            "sparse_dist_plan",
            async_inplace_copy=True,
            example=Example(stream_checks=(None, "by_stream", "io", "nonfinite", "nonfinite by_stream")),
            exported=True,
            notes=(
                "bit-identical (1.9, 1.8). `enqueue_batch_after_forward`, `execute_all_batches`, "
                "`clear_data_dist_inputs` change the plan; 1.9's `async_inplace_copy` puts the in-place H2D on its "
                "own thread (also on 1.8 and on CPU); batches put in `batches`/`contexts` by user code are trained, "
                "as upstream"
            ),
        ),
        DropIn(
            "TrainPipelineSparseDistLite",
            "lite",
            _TRAIN,
            "sparse_dist_lite_plan",
            async_inplace_copy=True,
            example=Example(stream_checks=(None, "by_stream")),
            notes=(
                "bit-identical (1.9, 1.8); input dist in the critical path (upstream's design); "
                "`async_inplace_copy` as SparseDist"
            ),
        ),
        DropIn(
            "TrainPipelineFusedSparseDist",
            "fused",
            _TRAIN,
            "fused_sparse_dist_plan",
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream", "nonfinite by_stream")),
            exported=True,
            notes=(
                "upstream fails on CPU; ours runs. Equal to patched upstream and to a plain loop, all "
                "`emb_lookup_stream` choices"
            ),
            on_cpu=_FAILS_ON_CPU_STREAMS,
        ),
        # start_batch 900: upstream's default
        DropIn(
            "TrainPipelineSemiSync",
            "semi_sync",
            _TRAIN,
            "semi_sync_phases",
            {"start_batch": 900},
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream", "nonfinite by_stream")),
            notes=(
                "upstream fails on CPU; ours runs. A PhasedPlan: sync phase, then semi-sync at `start_batch`; "
                "`stash_gradients` is a GradSwap task"
            ),
            on_cpu=_FAILS_ON_CPU_STREAMS,
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
            exported=True,
            notes=(
                "upstream fails on CPU; ours runs. Ours orders the data-dist stream after the prefetch stream "
                "before each later input dist (`dep InputDistStart <- EmbPrefetch @1`, in the plan), the fence of "
                "TorchRec's open PR #4191 (a UVM-cache race its authors saw as device-side asserts and NaNs); same "
                "calls and numbers as upstream. With `execute_all_batches=False` ours stops at the first missing "
                "batch (upstream drops the last 4)"
            ),
            on_cpu=OnCpu(
                "fails",
                "prefetch returns early when there is no data_dist stream (always on CPU): "
                '"Invalid PrefetchPipelinedForward usage"',
                "runs",
            ),
        ),
        DropIn(
            "EvalPipelineSparseDist",
            "eval",
            _TRAIN,
            "eval_sparse_dist_plan",
            kind="eval",
            example=Example(),
            exported=True,
            notes="equal outputs; upstream's loading thread is the plan's `io` thread group",
        ),
        DropIn(
            "EvalPipelineFusedSparseDist",
            "fused",
            _TRAIN,
            "eval_fused_sparse_dist_plan",
            kind="eval",
            example=Example(upstream_fails=_RECORD_STREAM, stream_checks=(None, "by_stream")),
            notes="upstream fails on CPU; ours runs; forward under `no_grad`",
            on_cpu=_FAILS_ON_CPU_STREAMS,
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
            exported=True,
            notes=(
                'upstream fails on CPU; ours runs with any stream objects (`torch.Stream(device="cpu")`, '
                "`torch.cpu.Stream()`, None), SparseDataDistUtil stages included"
            ),
            on_cpu=OnCpu(
                "fails",
                "its default compute stream is a `torch.cpu.Stream` without `.device`; given "
                '`torch.Stream(device="cpu")`, `record_stream` raises',
                "runs with any stream object",
            ),
        ),
        DropIn(
            "TrainPipelineSparseDistCompAutograd",
            "compiled",
            _TRAIN,
            "comp_autograd_plan",
            example=Example(upstream_fails="compiled autograd rejects the C++ DDP reducer", compiles=True),
            exported=True,
            notes=(
                "upstream fails on CPU (C++ DDP reducer); ours switches DDP to its Python reducer and uses "
                "`fullgraph=False` on CPU"
            ),
            on_cpu=OnCpu(
                "fails",
                "compiled autograd rejects the C++ DDP reducer",
                "runs (Python reducer; `fullgraph=False` on CPU)",
            ),
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
            notes=(
                "upstream cannot be constructed on CPU (`torch.cuda.Event()`); ours runs, bit-identical to patched "
                "upstream with any thread map (PEC tables, 2 ranks)"
            ),
            on_cpu=OnCpu(
                "cannot be constructed",
                'its constructor calls `torch.cuda.Event()`: "Tried to instantiate dummy base class Event" on a CPU '
                "build; then `record_stream` of CPU tensors",
                "runs, bit-identical to upstream under the patch",
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
            notes=(
                "bit-identical (1.9, 1.8) across train → eval → train switches. ZeroGrad, Backward, OptimizerStep "
                "guarded `when=train` (`model.training` at each call); eval batches forwarded under `no_grad`, "
                "drained at the end of the eval data; Fetch draws i+2 first, as upstream's pre-fetch. "
                "`execute_all_batches=False` refused (one line); lookahead draws ahead of upstream across an "
                "iterator switch. Plan `torchrec_swp.catalog.torchrec.train_eval_hybrid_plan`"
            ),
        ),
        DropIn(
            "TrainPipelineSparseDistT",
            "threaded_copy",
            _EXPERIMENTAL,
            "sparse_dist_t_plan",
            notes=(
                "bit-identical (1.9, 1.8). Upstream's background copy thread is the plan's thread `io` running H2D "
                "(the draw, Fetch, on the caller). Plan `torchrec_swp.catalog.torchrec.sparse_dist_t_plan`"
            ),
        ),
        DropIn(
            "TrainPipelineSparseDistBwdOpt",
            "backward_optimizer",
            _EXPERIMENTAL,
            "sparse_dist_bwd_opt_plan",
            notes=(
                "bit-identical (1.9, 1.8) with DDP's all-reduce made synchronous in the test: upstream's hook steps "
                "the optimizer mid-backward while the asynchronous all-reduce writes the dense gradients in place "
                "(a race, upstream's too). No OptimizerStep task: BackwardOptimizerStep, the backward in which "
                "`site_fqn`'s hook steps. Plan `torchrec_swp.catalog.torchrec.sparse_dist_bwd_opt_plan`"
            ),
        ),
        DropIn(
            "TrainPipelineSparseDistOptStash",
            "stashing",
            _EXPERIMENTAL,
            "opt_stash_plan",
            notes=(
                "upstream cannot be constructed on CPU (`torch.cuda.Stream`); ours runs, bit-identical to patched "
                "upstream (1.9, 1.8). Plan `torchrec_swp.catalog.torchrec.opt_stash_plan`: StashOptimizerState on "
                "thread `stash`, stream `d2h`, after the step; RestoreWait before it (the restore starts in the "
                "backward hook at `site_fqn`). TorchRec's MemoryStashingManager moves CUDA tensors only: on CPU "
                "nothing is stashed"
            ),
            on_cpu=_STASHING_NEEDS_CUDA,
        ),
        DropIn(
            "TrainPipelineSparseDistEmbStash",
            "stashing",
            _EXPERIMENTAL,
            "emb_stash_plan",
            notes=(
                "as OptStash (CPU, 1.9, 1.8). Plan `torchrec_swp.catalog.torchrec.emb_stash_plan`: SparseDist's "
                "tasks; the stash is inside TorchRec's lookups (Forward), the restore in the backward hook at "
                "`site_fqn` (Backward)"
            ),
            on_cpu=_STASHING_NEEDS_CUDA,
        ),
        DropIn(
            "TrainPipelinePrefetchEMS",
            "stashing",
            _EXPERIMENTAL,
            "prefetch_ems_plan",
            notes=(
                "as OptStash (CPU, 1.9, 1.8). Plan `torchrec_swp.catalog.torchrec.prefetch_ems_plan`: "
                "RestoreEmbeddings, then PrefetchNext of the next batch, before Backward; ours waits for the next "
                "batch's input dist on the data_dist stream and records it on the compute stream (upstream's waits "
                "on the compute stream with no `record_stream`)"
            ),
            on_cpu=_STASHING_NEEDS_CUDA,
        ),
        DropIn(
            "EvalPipelineCPUSparse",
            "cpu_sparse",
            _EXPERIMENTAL,
            "eval_cpu_sparse_plan",
            kind="eval",
            not_on_gpu="needs a model with data-parallel tables on the CPU and the dense part on the GPU "
            "(tests/dist/test_parity_cpu_sparse.py runs it on the CPU); not written yet",
            notes=(
                "upstream fails on CPU (`pin_memory=True`); ours runs, bit-identical to patched upstream (1.9, 1.8) "
                "and equal to the non-pipelined model (data-parallel tables, 2 ranks). Plan "
                "`torchrec_swp.catalog.torchrec.eval_cpu_sparse_plan`: Enqueue, SparseForward (CPU), CopyToDevice "
                "(memcpy), DenseForward; `multi_thread` puts the sparse work on thread `sparse`. Ours waits for the "
                "copy that read an embedding buffer before refilling it (upstream refills it while the copy may "
                "run) and on CPU takes a new buffer per batch (upstream's, patched, feeds each dense forward the "
                "next batch's embeddings)"
            ),
            on_cpu=OnCpu(
                "fails",
                'it pins its embedding buffers: "pin_memory=True requires a CUDA or other accelerator backend"; '
                "under the patch it runs but is wrong on the CPU: the copy to the device of a CPU buffer is the "
                "buffer itself, which it refills with the next batch's embeddings before the dense forward reads "
                "it (every output but the last differs from the model's)",
                "runs, equal to the model's predictions, and bit-identical to upstream under the patch with a new "
                "buffer per batch (`tests/dist/test_parity_cpu_sparse.py`)",
            ),
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
    under the stream checker (``harness.upstream_streams``). Where README.md's table of
    replacements has a row for it: ``notes``, upstream's module (``upstream``, under
    ``UPSTREAM_PACKAGE``) and the classes imported in the same line (``imported_with``)."""

    name: str
    module: str
    kind: str
    since: str = "1.8"
    stream_checked: bool = False
    upstream: str = ""
    imported_with: tuple[str, ...] = ()
    notes: str = ""


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
        Extra(
            "GradientAccumulationWrapper",
            _ACCUMULATION,
            "accumulation",
            upstream='gradient_accumulation',
            imported_with=("GradientAccumulationConfig",),
            notes=(
                "wraps any pipeline, as upstream's; over ours the window is phases of the plan (ZeroGrad, "
                "OptimizerStep every `num_steps` batches: `plans.accumulation_phases`); bit-identical (1.9, 1.8) "
                "over Base, SparseDist, Lite, Fused, SemiSync, and PEC (1.9); checkpoints carry the accumulated "
                "gradients (`docs/long_jobs.md`)"
            ),
        ),
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


def readme_table() -> str:
    """README.md's table of replacements: a row per drop-in, then one per extra with ``notes``
    (``tests/unit/test_drop_ins.py`` keeps the file equal to it)."""
    lines = ["| upstream import | replacement | notes |", "|---|---|---|"]
    for d in drop_ins():
        module = UPSTREAM_PACKAGE if d.exported else d.upstream_path
        since = f" ({d.since})" if d.since != "1.8" else ""
        lines.append(f"| `from {module} import {d.name}`{since} | `from torchrec_swp import {d.name}` | {d.notes} |")
    for e in extras():
        if e.notes:
            names = ", ".join((e.name, *e.imported_with))
            since = f" ({e.since})" if e.since != "1.8" else ""
            lines.append(
                f"| `from {UPSTREAM_PACKAGE}.{e.upstream} import {names}`{since} "
                f"| `from torchrec_swp import {names}` | {e.notes} |"
            )
    return "\n".join(lines) + "\n"


def install_table() -> str:
    """docs/install.md's table "Upstream on CPU": a line per kind of drop-in (the rows alike in
    ``on_cpu``, experimental or not, and series), in the order of their first row
    (``tests/unit/test_drop_ins.py`` keeps the file equal to it)."""
    groups: dict[tuple[OnCpu, bool, str], list[str]] = {}
    for d in drop_ins():
        groups.setdefault((d.on_cpu, d.experimental, d.since), []).append(d.name)
    lines = ["| pipeline | upstream as shipped | why it fails | ours |", "|---|---|---|---|"]
    for (on_cpu, experimental, since), members in groups.items():
        tags = ["experimental"] if experimental else []
        tags += [since] if since != "1.8" else []
        suffix = f" ({', '.join(tags)})" if tags else ""
        lines.append(f"| {', '.join(members)}{suffix} | {on_cpu.upstream} | {on_cpu.why} | {on_cpu.ours} |")
    return "\n".join(lines) + "\n"


def _release(series: str) -> tuple[int, ...]:
    return tuple(int(part) for part in series.split("."))
