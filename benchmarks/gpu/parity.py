"""Part (b): every one of our pipelines against upstream's on one GPU (nccl, world size 1).

The harness of the CPU parity tests (``harness/ranks.py and harness/parity.py``) with ``backend="nccl"`` and the
model sharded onto ``cuda:0``: per pipeline, upstream's class as shipped and ours (default plan
and a few thread maps) train a fresh copy of the same model on the same 20 batches; outputs,
losses, final weights, batch count and the StopIteration call must be bit-identical. Where ours
differs, upstream runs a second time: if upstream differs from itself too, the GPU run is not
deterministic and the comparison is ``inconclusive`` rather than failed.

The pipelines run in one rank process, the compiled ones last (they change global dynamo
settings). After each pipeline the results so far are written to ``parity.partial.json``, which
survives a timeout.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrec_swp import drop_ins

STEPS = 20
SEED = 1234
PARTIAL_NAME = "parity.partial.json"


@dataclass(frozen=True)
class Case:
    """One pipeline: upstream's constructor ``options`` (ours gets the same), our variants as
    ``{label: engine options}``, and how the run is driven (``train``; ``eval_fwd``: model in
    eval mode with a custom forward returning ``(zero loss, output)``; ``staged``: the caller
    trains on what ``progress()`` returns). ``one_rank``: why the pipeline cannot run on one rank
    (this part's world), upstream's as ours; its rows are ``skipped`` with that reason."""

    pipeline: str
    options: Mapping[str, Any] = field(default_factory=dict)
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {"default": {}})
    mode: str = "train"
    one_rank: str = ""


def _io(*tasks: str) -> dict[str, dict[str, Any]]:
    return {"default": {}, "io thread": {"thread_map": dict.fromkeys(tasks, "io")}}


#: The drop-ins whose case is not ``default_case``'s: their options, variants or mode.
_OWN_CASES: tuple[Case, ...] = (
    Case("TrainPipelineBase", variants=_io("LoadBatch", "H2D")),
    Case(
        "TrainPipelineSparseDist",
        variants={**_io("H2D"), "by_stream": {"thread_map": "by_stream"}, "per_task": {"thread_map": "per_task"}},
    ),
    Case("TrainPipelineSparseDistLite", variants=_io("H2D")),
    Case("TrainPipelineFusedSparseDist", variants={"default": {}, "by_stream": {"thread_map": "by_stream"}}),
    Case("TrainPipelineSemiSync", {"start_batch": 10}, {"default": {}, "by_stream": {"thread_map": "by_stream"}}),
    Case("PrefetchTrainPipelineSparseDist", variants=_io("H2D")),
    Case("EvalPipelineSparseDist", variants={"default": {}, "main thread": {"thread_map": "main"}}),
    Case("EvalPipelineFusedSparseDist", mode="eval_fwd"),
    Case("StagedTrainPipeline", variants=_io("data_copy"), mode="staged"),
    Case("TrainPipelinePT2"),
    Case("TrainPipelineSparseDistCompAutograd"),
    # TorchRec 1.9: with the test model's EmbeddingBagCollection only (no PEC tables), every module
    # takes PEC's non-PEC path (looked up in the step, like Fused)
    Case("TrainPipelinePEC", variants=_io("H2D")),
    # experimental_pipelines.py (the hybrid here in training mode only; the CPU parity test switches modes)
    Case("TrainEvalHybridPipelineBase", variants=_io("Fetch", "H2D")),
    Case("TrainPipelineSparseDistT", variants={"default": {}, "main thread": {"thread_map": "main"}}),
    Case(
        "TrainPipelineSparseDistBwdOpt",
        {"site_fqn": "sparse.ebc"},
        _io("H2D"),
        one_rank="on one rank the output dist has no all-to-all whose gradient upstream's backward hook could wait "
        "for (upstream raises 'no grad-requiring tensor in output of sparse.ebc'); 2 gloo ranks: "
        "tests/dist/test_parity_experimental.py",
    ),
    # TorchRec's experimental memory-stashing pipelines: the output dist of the table-wise
    # EmbeddingBagCollection, the over-arch as injection sites. The test model's tables are not
    # marked stash_weights and its optimizer state is under MemoryStashingManager's 1 MiB
    # threshold: what is compared is the schedule around the stashing, not stashed data.
    Case(
        "TrainPipelineSparseDistOptStash",
        {"site_fqn": "sparse.ebc"},
        {**_io("H2D"), "stash on the calling thread": {"thread_map": "main"}},
    ),
    Case("TrainPipelineSparseDistEmbStash", {"site_fqn": "over"}, _io("H2D")),
    Case("TrainPipelinePrefetchEMS", {"site_fqn": "over"}, _io("H2D")),
)


def default_case(name: str) -> Case:
    """The case of a drop-in without one of its own: upstream's constructor as it is, ours with
    the default plan and with its stage-0 tasks on thread ``io`` (``thread_map="io"``)."""
    return Case(name, variants={"default": {}, "io thread": {"thread_map": "io"}})


def cases() -> tuple[Case, ...]:
    """A case per drop-in of ``torchrec_swp.drop_ins`` (in its order) but those ``NOT_ON_GPU``."""
    own = {c.pipeline: c for c in _OWN_CASES}
    return tuple(own.get(d.name) or default_case(d.name) for d in drop_ins.drop_ins() if not d.not_on_gpu)


#: Exported pipelines without a case here, and why (their rows' ``not_on_gpu``).
NOT_ON_GPU: Mapping[str, str] = {d.name: d.not_on_gpu for d in drop_ins.drop_ins() if d.not_on_gpu}
#: The memory-stashing pipelines (TorchRec's MemoryStashingManager is process-wide).
_STASHING = tuple(d.name for d in drop_ins.drop_ins() if d.module == "stashing")


def _pipeline_class(name: str, impl: str) -> type:
    if impl == "upstream":
        from harness.dlrm import upstream_class

        return upstream_class(name)
    import torchrec_swp

    return getattr(torchrec_swp, name)


def device_of(device_type: str, rank: int) -> Any:
    """``cuda:rank`` on CUDA; the CPU otherwise (a smoke run of the same code with gloo)."""
    import torch

    return torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")


def backend_of(device_type: str) -> str:
    return "gloo" if device_type == "cpu" else "nccl"


def _train(
    case: Case, impl: str, engine: Mapping[str, Any], rank: int, world_size: int, steps: int, device: Any
) -> Any:
    """One run of ``case`` by ``impl`` on a fresh model on ``device``; its RunResult."""
    import torch
    import torch._dynamo

    from harness.parity import build_model, make_batches, train_pipeline_run

    if case.mode == "staged":
        return _staged(impl, engine, rank, world_size, steps, device)
    if impl == "upstream" and case.pipeline == "TrainPipelineSparseDistCompAutograd":
        # compiled autograd rejects the C++ DDP reducer; DDP picks its reducer when built
        # (ours switches to the Python one itself)
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            model, optimizer = build_model(rank, world_size, SEED, device)
    else:
        model, optimizer = build_model(rank, world_size, SEED, device)
    options = dict(case.options)
    if case.mode == "eval_fwd":
        model.eval()
        options["custom_model_fwd"] = lambda batch: (torch.zeros((), device=device), model(batch))
    pipeline = _pipeline_class(case.pipeline, impl)(model, optimizer, device, **options, **engine)
    try:
        return train_pipeline_run(pipeline, make_batches(rank, world_size, steps, SEED), steps + 5, model=model)
    finally:
        if hasattr(pipeline, "close"):
            pipeline.close()
        if case.pipeline in _STASHING:  # TorchRec's MemoryStashingManager is process-wide
            from torchrec.distributed.memory_stashing import MemoryStashingManager

            MemoryStashingManager.reset()


def _staged(impl: str, engine: Mapping[str, Any], rank: int, world_size: int, steps: int, device: Any) -> Any:
    """StagedTrainPipeline as upstream's docs set it up on CUDA (an H2D stage on its own stream,
    SparseDataDistUtil's input dist on its data_dist stream); the caller trains on each batch
    ``progress()`` returns, until it returns None."""
    import torch

    from harness.parity import build_model, make_batches, sparse_data_dist_stages, staged_pipeline_run

    model, optimizer = build_model(rank, world_size, SEED, device)

    def stream() -> Any:  # a real stream on CUDA; one with a .device on the CPU (as upstream needs there)
        return torch.cuda.Stream(device) if device.type == "cuda" else torch.Stream(device="cpu")

    data_dist_stream = stream()
    stages = sparse_data_dist_stages(model, stream(), device=device, data_dist_stream=data_dist_stream)
    pipeline = _pipeline_class("StagedTrainPipeline", impl)(stages, **engine)
    try:
        return staged_pipeline_run(pipeline, model, optimizer, make_batches(rank, world_size, steps, SEED))
    finally:
        if hasattr(pipeline, "close"):
            pipeline.close()


def _difference(a: Any, b: Any) -> str | None:
    from harness.parity import assert_runs_equal

    try:
        assert_runs_equal(a, b)
    except AssertionError as e:
        return str(e)
    return None


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _error(e: BaseException) -> str:
    lines = traceback.format_exception_only(type(e), e)
    return lines[-1].strip()[:300]


def compare_case(case: Case, rank: int, world_size: int, steps: int, device: Any) -> list[dict[str, Any]]:
    """Upstream once, each of our variants, and upstream again if a variant differs."""
    options = ", ".join(f"{k}={v}" for k, v in case.options.items())
    rows = [
        {"pipeline": case.pipeline, "options": options, "variant": label, "status": "error"} for label in case.variants
    ]
    if case.one_rank and world_size == 1:
        return [{**row, "status": "skipped", "difference": case.one_rank} for row in rows]
    try:
        reference, up_s = _timed(lambda: _train(case, "upstream", {}, rank, world_size, steps, device))
    except Exception as e:  # noqa: BLE001  (reported as this run's result)
        for row in rows:
            row["difference"] = f"upstream raised {_error(e)}"
        return rows
    for row, engine in zip(rows, case.variants.values()):
        row["upstream_seconds"] = up_s
        row["upstream_batches"] = reference.num_calls
        try:
            ours, row["seconds"] = _timed(lambda e=engine: _train(case, "ours", e, rank, world_size, steps, device))
        except Exception as e:  # noqa: BLE001  (reported as this run's result)
            row["difference"] = f"ours raised {_error(e)}"
            continue
        row["batches"] = ours.num_calls
        row["difference"] = _difference(reference, ours)
        if reference.num_calls != steps:
            row["difference"] = f"upstream trained {reference.num_calls} of {steps} batches"
        else:
            row["status"] = "equal" if row["difference"] is None else "differs"
    if any(row["status"] == "differs" for row in rows):
        try:
            repeatable: bool | None = (
                _difference(reference, _train(case, "upstream", {}, rank, world_size, steps, device)) is None
            )
        except Exception:  # noqa: BLE001  (then nothing is known about upstream's determinism)
            repeatable = None
        for row in rows:
            row["upstream_repeatable"] = repeatable
            if row["status"] == "differs" and repeatable is False:
                row["status"] = "inconclusive"
    return rows


def _rank(
    rank: int, world_size: int, steps: int, names: list[str], partial: str, device_type: str
) -> list[dict[str, Any]]:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    for case in cases():
        if case.pipeline in names:
            rows += compare_case(case, rank, world_size, steps, device_of(device_type, rank))
            Path(partial).write_text(json.dumps(rows, indent=1, default=str))
    return rows


def status_of(rows: list[dict[str, Any]]) -> str:
    """failed if any run differs from a repeatable upstream or raised; passed otherwise (rows
    ``skipped`` for a pipeline that cannot run on one rank included)."""
    return "failed" if not rows or any(r["status"] in ("differs", "error") for r in rows) else "passed"


def run(
    out: Path,
    timeout_s: float,
    steps: int = STEPS,
    pipelines: list[str] | None = None,
    device_type: str = "cuda",
) -> dict[str, Any]:
    import torchrec_swp
    from harness.ranks import run_on_ranks

    # every pipeline the installed TorchRec has (TrainPipelinePEC from 1.9 on)
    names = pipelines or [c.pipeline for c in cases() if c.pipeline in torchrec_swp._available()]
    partial = out / PARTIAL_NAME
    partial.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        [rows] = run_on_ranks(
            _rank,
            steps,
            names,
            str(partial),
            device_type,
            world_size=1,
            backend=backend_of(device_type),
            timeout_s=timeout_s,
        )
    except (RuntimeError, TimeoutError) as e:
        rows = json.loads(partial.read_text()) if partial.exists() else []
        reason = str(e).strip().splitlines()
        return {
            "status": "error",
            "seconds": time.perf_counter() - start,
            "steps": steps,
            "cases": rows,
            "reason": (
                f"{type(e).__name__}: {reason[-1] if reason else ''} (after {len(rows)} runs; see {PARTIAL_NAME})"
            ),
        }
    partial.unlink(missing_ok=True)
    return {"status": status_of(rows), "seconds": time.perf_counter() - start, "steps": steps, "cases": rows}
