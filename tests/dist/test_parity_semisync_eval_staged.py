"""Our TrainPipelineSemiSync, EvalPipelineSparseDist and StagedTrainPipeline against upstream's,
on 2 gloo ranks with the sharded test model, 20 steps (one run_on_ranks call for all of them).

* SemiSync: upstream fails on CPU as shipped, so its reference runs under
  ``upstream_cpu_patch``; ours runs as shipped. Equal to upstream for the whole run (outputs,
  losses, final weights, StopIteration call) with ``start_batch=10``, ``stash_gradients``
  False and True, and over two epochs; before ``start_batch`` equal to the plain loop; never
  switching (the default ``start_batch=900``) equal to the plain loop for the whole run.
* EvalPipelineSparseDist: upstream runs on CPU as shipped. It calls ``self._model(batch)`` and
  unpacks ``(losses, output)``, which the test model returns in training mode only (in eval
  mode it returns just the predictions), so the model stays in training mode; the pipeline
  never runs backward or the optimizer, so the weights must not change.
* StagedTrainPipeline with SparseDataDistUtil stages (H2D copy, start_sparse_data_dist), the
  caller training on what ``progress()`` returns: equal to upstream (run with the test-only
  tweaks noted in ``_staged_run``) and to the plain loop; None on the same call, and again after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import (
    RunResult,
    assert_runs_equal,
    build_model,
    local_state,
    make_batches,
    plain_loop_run,
    sparse_data_dist_stages,
    staged_pipeline_run,
    train_pipeline_run,
)
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.pipelines.eval import EvalPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.semi_sync import TrainPipelineSemiSync
from torchrec_swp.integrations.torchrec.pipelines.staged import StagedTrainPipeline

pytestmark = [pytest.mark.multiprocess, pytest.mark.parity]

STEPS = 20
START_BATCH = 10
EPOCH_STEPS = 7
EPOCH_START_BATCH = 5
CPU = torch.device("cpu")

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


def _patched(patched: bool) -> contextlib.AbstractContextManager[None]:
    return upstream_cpu_patch() if patched else contextlib.nullcontext()


def _run(factory: Factory, rank: int, world_size: int, seed: int, *, patched: bool = False) -> RunResult:
    model, optimizer = build_model(rank, world_size, seed)
    with _patched(patched):
        pipeline = factory(model, optimizer)
        try:
            return train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed), STEPS + 5)
        finally:
            if hasattr(pipeline, "close"):
                pipeline.close()


def _epochs(factory: Factory, rank: int, world_size: int, seed: int, *, patched: bool, reset: bool) -> list[Any]:
    """Two epochs of EPOCH_STEPS batches on one pipeline, each with a new iterator: [run 1,
    run 2, None]; with ``reset``, between them a call with a new iterator (the index of the call
    that raised StopIteration replaces the None) and then ``reset()``."""
    model, optimizer = build_model(rank, world_size, seed)
    with _patched(patched):
        pipeline = factory(model, optimizer)
        first = train_pipeline_run(pipeline, make_batches(rank, world_size, EPOCH_STEPS, seed), 20)
        after_end = None
        if reset:
            after_end = train_pipeline_run(pipeline, make_batches(rank, world_size, 1, seed + 1), 1).stop_iteration_call
            pipeline.reset()
        second = train_pipeline_run(pipeline, make_batches(rank, world_size, EPOCH_STEPS, seed + 2), 20)
        if hasattr(pipeline, "close"):
            pipeline.close()
    return [first, second, after_end]


def _prefix(run: RunResult, steps: int) -> RunResult:
    """The first ``steps`` outputs and losses of ``run`` (weights: only the final ones exist)."""
    return RunResult(run.outputs[:steps], run.losses[:steps], steps, None, {})


#: Stream objects a user may pass for the stages on CPU (the data-copy stage's stream; ``None``
#: is the compute stream). SparseDataDistUtil itself needs a stream with a ``.device``.
STAGE_STREAMS: dict[str, Callable[[], Any]] = {
    "torch.Stream(cpu)": lambda: torch.Stream(device="cpu"),
    "torch.cpu.Stream()": torch.cpu.Stream,
    "torch.cpu.current_stream()": torch.cpu.current_stream,
    "None": lambda: None,
}


def _staged_run(
    rank: int,
    world_size: int,
    seed: int,
    *,
    ours: bool,
    thread_map: Any = None,
    stage_stream: str = "torch.Stream(cpu)",
) -> RunResult:
    """The caller's loop: ``while (batch := progress(it)) is not None``, train on ``batch``.

    Stages: an H2D copy and SparseDataDistUtil's start_sparse_data_dist stage, with the stream
    objects a user writes on CPU: ``SparseDataDistUtil(data_dist_stream=torch.Stream(device="cpu"))``
    and ``stage_stream`` for the copy. Ours runs as shipped with any of them. Upstream needs
    test-only tweaks on CPU: a compute stream with a ``.device`` and ``upstream_cpu_patch`` for
    ``record_stream`` on CPU tensors (its pipelined forward records on the SDD stream).
    """
    model, optimizer = build_model(rank, world_size, seed)
    stages = sparse_data_dist_stages(model, STAGE_STREAMS[stage_stream]())
    with _patched(not ours):
        if ours:
            pipeline: Any = StagedTrainPipeline(stages, thread_map=thread_map)
        else:
            pipeline = upstream.StagedTrainPipeline(stages, compute_stream=torch.Stream(device="cpu"))
        batches = make_batches(rank, world_size, STEPS, seed)
        it = iter(batches)
        result = staged_pipeline_run(pipeline, model, optimizer, batches, iterator=it)
        assert pipeline.progress(it) is None, "a call after the end must return None too"
        if ours:
            pipeline.close()
    return result


def _all_runs(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    def run(factory: Factory, patched: bool = False) -> RunResult:
        return _run(factory, rank, world_size, seed, patched=patched)

    plain_model, plain_optimizer = build_model(rank, world_size, seed)
    out: dict[str, Any] = {
        "plain": plain_loop_run(plain_model, plain_optimizer, make_batches(rank, world_size, STEPS, seed)),
        "initial weights": local_state(build_model(rank, world_size, seed)[0]),
    }

    for stash in (False, True):
        kw = {"start_batch": START_BATCH, "stash_gradients": stash}
        out[f"SemiSync stash_gradients={stash}"] = (
            run(lambda m, o, kw=kw: upstream.TrainPipelineSemiSync(m, o, CPU, **kw), patched=True),
            {
                "default": run(lambda m, o, kw=kw: TrainPipelineSemiSync(m, o, CPU, **kw)),
                "io_thread": run(lambda m, o, kw=kw: TrainPipelineSemiSync(m, o, CPU, **kw, thread_map={"H2D": "io"})),
                "by_stream": run(lambda m, o, kw=kw: TrainPipelineSemiSync(m, o, CPU, **kw, thread_map="by_stream")),
                # EmbLookup(i+1) and EmbBackward(i) on threads of their own: the plan orders them
                # (checked mode caught them unordered on the default stream before it did)
                "per_task": run(lambda m, o, kw=kw: TrainPipelineSemiSync(m, o, CPU, **kw, thread_map="per_task")),
            },
        )
    out["SemiSync start_batch=900"] = run(lambda m, o: TrainPipelineSemiSync(m, o, CPU))

    out["Eval"] = (
        run(lambda m, o: upstream.EvalPipelineSparseDist(m, o, CPU)),
        {
            "default (loader thread)": run(lambda m, o: EvalPipelineSparseDist(m, o, CPU)),
            "main thread": run(lambda m, o: EvalPipelineSparseDist(m, o, CPU, thread_map="main")),
            "per_task": run(lambda m, o: EvalPipelineSparseDist(m, o, CPU, thread_map="per_task")),
        },
    )

    semi = {"start_batch": EPOCH_START_BATCH, "stash_gradients": True}
    out["epochs"] = {
        "SemiSync": (
            _epochs(lambda m, o: upstream.TrainPipelineSemiSync(m, o, CPU, **semi), rank, world_size, seed,
                    patched=True, reset=False),
            _epochs(lambda m, o: TrainPipelineSemiSync(m, o, CPU, **semi), rank, world_size, seed,
                    patched=False, reset=False),
        ),
        "Eval": (
            _epochs(lambda m, o: upstream.EvalPipelineSparseDist(m, o, CPU), rank, world_size, seed,
                    patched=False, reset=True),
            _epochs(lambda m, o: EvalPipelineSparseDist(m, o, CPU), rank, world_size, seed, patched=False, reset=True),
        ),
    }

    out["Staged"] = (
        _staged_run(rank, world_size, seed, ours=False),
        {
            **{
                f"copy stream {kind}": _staged_run(rank, world_size, seed, ours=True, stage_stream=kind)
                for kind in STAGE_STREAMS
            },
            "data_copy on an io thread": _staged_run(rank, world_size, seed, ours=True, thread_map={"data_copy": "io"}),
            "by_stream": _staged_run(rank, world_size, seed, ours=True, thread_map="by_stream"),
        },
    )

    # Last: clear_data_dist_inputs sets a class-wide flag of PipelinedForward in upstream's constructor.
    inplace = {"start_batch": START_BATCH, "enable_inplace_copy_batch": True, "execute_all_batches": False}
    clear = {"start_batch": START_BATCH, "clear_data_dist_inputs": True}
    out["options"] = {
        "SemiSync enable_inplace_copy_batch, execute_all_batches=False": (
            run(lambda m, o: upstream.TrainPipelineSemiSync(m, o, CPU, **inplace), patched=True),
            run(lambda m, o: TrainPipelineSemiSync(m, o, CPU, **inplace)),
        ),
        "SemiSync clear_data_dist_inputs": (
            run(lambda m, o: upstream.TrainPipelineSemiSync(m, o, CPU, **clear), patched=True),
            run(lambda m, o: TrainPipelineSemiSync(m, o, CPU, **clear, thread_map="by_stream")),
        ),
        "Eval clear_data_dist_inputs": (
            run(lambda m, o: upstream.EvalPipelineSparseDist(m, o, CPU, clear_data_dist_inputs=True)),
            run(lambda m, o: EvalPipelineSparseDist(m, o, CPU, clear_data_dist_inputs=True)),
        ),
    }
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_on_ranks(_all_runs, 4321, timeout_s=600)


def test_semi_sync_equals_upstream_and_the_plain_loop_before_start_batch(per_rank: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(per_rank):
        plain: RunResult = runs["plain"]
        assert_runs_equal(plain, runs["SemiSync start_batch=900"], what=f"rank {rank} SemiSync, never semi-sync")
        for stash in (False, True):
            reference, ours = runs[f"SemiSync stash_gradients={stash}"]
            assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
            for label, result in ours.items():
                what = f"rank {rank} SemiSync stash_gradients={stash} [{label}]"
                assert_runs_equal(reference, result, what=what)
                assert_runs_equal(_prefix(plain, START_BATCH), _prefix(result, START_BATCH), what=f"{what} vs plain")
            # batch start_batch + 1 is the first looked up before the previous update: it departs
            assert not torch.equal(ours["default"].outputs[START_BATCH + 1], plain.outputs[START_BATCH + 1])


def test_eval_sparse_dist_equals_upstream(per_rank: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(per_rank):
        reference, ours = runs["Eval"]
        assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
        assert reference.weights.keys() == runs["initial weights"].keys()
        assert all(torch.equal(w, runs["initial weights"][name]) for name, w in reference.weights.items())
        for label, result in ours.items():
            assert_runs_equal(reference, result, what=f"rank {rank} EvalPipelineSparseDist [{label}]")


def test_epochs_semi_sync_new_iterator_and_eval_reset(per_rank: list[dict[str, Any]]) -> None:
    """SemiSync: a new iterator after the end starts a new epoch whose context indices go on
    (the semi-sync phase, reached at batch 5, holds). Eval: the loader keeps its first iterator,
    so a new one still raises StopIteration at once, until ``reset()``."""
    for rank, runs in enumerate(per_rank):
        for name, (reference, ours) in runs["epochs"].items():
            assert [r.num_calls for r in reference[:2]] == [EPOCH_STEPS] * 2, name
            after_end = None if name == "SemiSync" else 0
            assert reference[2] == ours[2] == after_end, f"{name}: {reference[2]} vs {ours[2]}"
            for epoch in (0, 1):
                assert_runs_equal(reference[epoch], ours[epoch], what=f"rank {rank} {name} epoch {epoch}")


def test_options_that_change_the_plan(per_rank: list[dict[str, Any]]) -> None:
    """SemiSync's in-place copy raises StopIteration at the end of data when
    ``execute_all_batches=False``: upstream stops in the call that forwards batch N-3, after its
    forward; the plan stops there too. ``clear_data_dist_inputs`` adds a task."""
    for rank, runs in enumerate(per_rank):
        for name, (reference, ours) in runs["options"].items():
            expected = STEPS - 3 if "execute_all_batches=False" in name else STEPS
            assert reference.num_calls == expected == reference.stop_iteration_call, f"{name}: {reference.num_calls}"
            assert_runs_equal(reference, ours, what=f"rank {rank} {name}")


def test_staged_with_sparse_data_dist_stages_equals_upstream_and_the_plain_loop(per_rank: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(per_rank):
        reference, ours = runs["Staged"]
        assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
        assert_runs_equal(runs["plain"], reference, what=f"rank {rank} upstream Staged vs plain loop")
        for label, result in ours.items():
            assert_runs_equal(reference, result, what=f"rank {rank} StagedTrainPipeline [{label}]")
