"""Our drop-ins of TorchRec's ``experimental_pipelines.py`` against upstream's, on 2 gloo ranks:
TrainEvalHybridPipelineBase, TrainPipelineSparseDistT and TrainPipelineSparseDistBwdOpt (in
TorchRec 1.8.0 and 1.9.2 alike; upstream runs them on CPU as shipped).

Same sharded model (fresh, same seed) and data for every run: outputs, losses, final weights,
batch counts and the call that raises StopIteration must be equal bit for bit, with the default
plan and with thread maps (and, where the draws are the same, loads and lookahead). The hybrid
trains, switches to eval mode over held-out batches until StopIteration, and trains on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import experimental_pipelines as upstream

import torchrec_swp
from harness.parity import RunResult, assert_runs_equal, build_model, local_state, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess]

STEPS = 20
CPU = torch.device("cpu")
SITE = "sparse.ebc"  # BwdOpt's site: the EmbeddingBagCollection with the table-wise tables

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


def _close(pipeline: Any) -> None:
    if hasattr(pipeline, "close"):
        pipeline.close()


def _synchronous_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """DDP's averaging all-reduce of a gradient bucket, done before it returns. (No annotations: DDP
    compares them with its classes, and this module's are strings.)"""
    grads = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(grads)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grads)
    return done


def _model(rank: int, world_size: int, seed: int, synchronous_ddp: bool = False) -> tuple[torch.nn.Module, Any]:
    """The harness's model; with ``synchronous_ddp`` its DDP all-reduces each gradient bucket before
    backward goes on. BwdOpt's hook steps the optimizer in the middle of backward, while DDP's
    all-reduce, asynchronous by default, writes the dense gradients in place (TorchRec's DDP uses
    ``gradient_as_bucket_view``): the step reads them racing gloo's threads, upstream's as ours. Tried
    here: upstream's own losses change (from step 2 on) when one rank reaches backward 50 ms after
    the other, and ours under ``thread_map="by_stream"`` differed from upstream's at step 4."""
    model, optimizer = build_model(rank, world_size, seed)
    if synchronous_ddp:
        model._dmp_wrapped_module.register_comm_hook(None, _synchronous_allreduce)
    return model, optimizer


def _train(factory: Factory, rank: int, world_size: int, seed: int, synchronous_ddp: bool = False) -> RunResult:
    model, optimizer = _model(rank, world_size, seed, synchronous_ddp)
    pipeline = factory(model, optimizer)
    try:
        return train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed), STEPS + 5)
    finally:
        _close(pipeline)


# ------------------------------------------------------------------ SparseDistT and BwdOpt
T_CASES: dict[str, Factory] = {
    "default": lambda m, o: torchrec_swp.TrainPipelineSparseDistT(m, o, CPU),
    "main": lambda m, o: torchrec_swp.TrainPipelineSparseDistT(m, o, CPU, thread_map="main"),
    "by_stream": lambda m, o: torchrec_swp.TrainPipelineSparseDistT(m, o, CPU, thread_map="by_stream"),
    "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineSparseDistT(
        m, o, CPU, thread_map="io", loads=2, lookahead=2
    ),
    "inplace": lambda m, o: torchrec_swp.TrainPipelineSparseDistT(m, o, CPU, enable_inplace_copy_batch=True),
}
BWD_OPT_CASES: dict[str, Factory] = {
    "default": lambda m, o: torchrec_swp.TrainPipelineSparseDistBwdOpt(m, o, CPU, SITE),
    "io_thread": lambda m, o: torchrec_swp.TrainPipelineSparseDistBwdOpt(m, o, CPU, SITE, thread_map={"H2D": "io"}),
    "by_stream": lambda m, o: torchrec_swp.TrainPipelineSparseDistBwdOpt(m, o, CPU, SITE, thread_map="by_stream"),
    "per_task": lambda m, o: torchrec_swp.TrainPipelineSparseDistBwdOpt(m, o, CPU, SITE, thread_map="per_task"),
    "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineSparseDistBwdOpt(
        m, o, CPU, SITE, thread_map="io", loads=2, lookahead=2
    ),
}


def _t_and_bwd_opt(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    model, _ = build_model(rank, world_size, seed)
    return {
        "initial": local_state(model),
        "T": (
            _train(lambda m, o: upstream.TrainPipelineSparseDistT(m, o, CPU), rank, world_size, seed),
            {label: _train(f, rank, world_size, seed) for label, f in T_CASES.items()},
        ),
        "T inplace upstream": _train(
            lambda m, o: upstream.TrainPipelineSparseDistT(m, o, CPU, enable_inplace_copy_batch=True),
            rank,
            world_size,
            seed,
        ),
        "BwdOpt": (
            _train(lambda m, o: upstream.TrainPipelineSparseDistBwdOpt(m, o, CPU, SITE), rank, world_size, seed, True),
            {label: _train(f, rank, world_size, seed, True) for label, f in BWD_OPT_CASES.items()},
        ),
    }


def test_sparse_dist_t_and_bwd_opt_equal_upstream_bit_for_bit() -> None:
    for rank, runs in enumerate(run_on_ranks(_t_and_bwd_opt, 2024, timeout_s=600)):
        for name in ("T", "BwdOpt"):
            reference, ours = runs[name]
            assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
            for label, result in ours.items():
                expected = runs["T inplace upstream"] if label == "inplace" else reference
                assert_runs_equal(expected, result, what=f"rank {rank} {name} [{label}]")
            # trained: the dense weights (stepped by the optimizer, BwdOpt's inside backward) moved
            moved = [k for k, w in reference.weights.items() if "dense" in k and not torch.equal(w, runs["initial"][k])]
            assert moved, f"rank {rank} {name}: the optimizer never stepped"


# ------------------------------------------------------------------ TrainEvalHybridPipelineBase
TRAIN_FIRST = 5  # progress() calls in training mode before switching to eval
TRAIN_BATCHES = 12
EVAL_BATCHES = 5

HYBRID_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "io_thread": {"thread_map": {"Fetch": "io", "H2D": "io"}},
    "by_stream": {"thread_map": "by_stream"},
    "per_task": {"thread_map": "per_task"},
}


def _hybrid_run(cls: type, rank: int, world_size: int, seed: int, options: dict[str, Any]) -> list[RunResult]:
    """Train TRAIN_FIRST calls, evaluate until StopIteration, train on until StopIteration (the end of
    the training data), evaluate again. The test model returns only its predictions in eval mode: a
    custom_model_fwd gives the (losses, output) pair the pipelines unpack."""
    model, optimizer = build_model(rank, world_size, seed)

    def forward(batch: Any) -> Any:
        out = model(batch)
        return out if isinstance(out, tuple) else (torch.zeros(()), out)

    pipeline = cls(model, optimizer, CPU, custom_model_fwd=forward, **options)
    train = make_batches(rank, world_size, TRAIN_BATCHES, seed)
    held_out = make_batches(rank, world_size, EVAL_BATCHES, seed + 1)
    train_it = iter(train)
    try:
        runs = [train_pipeline_run(pipeline, train, TRAIN_FIRST, iterator=train_it)]
        model.eval()
        runs.append(train_pipeline_run(pipeline, held_out, EVAL_BATCHES + 5, iterator=iter(held_out)))
        model.train()
        runs.append(train_pipeline_run(pipeline, train, TRAIN_BATCHES + 5, iterator=train_it))
        model.eval()
        runs.append(train_pipeline_run(pipeline, held_out, EVAL_BATCHES + 5))
        return runs
    finally:
        _close(pipeline)


def _hybrid(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    return {
        "upstream": _hybrid_run(upstream.TrainEvalHybridPipelineBase, rank, world_size, seed, {}),
        "ours": {
            label: _hybrid_run(torchrec_swp.TrainEvalHybridPipelineBase, rank, world_size, seed, options)
            for label, options in HYBRID_CASES.items()
        },
        # training only (no switch of iterators, where drawing ahead would differ): loads and lookahead
        "training only": (
            _train(lambda m, o: upstream.TrainEvalHybridPipelineBase(m, o, CPU), rank, world_size, seed),
            _train(
                lambda m, o: torchrec_swp.TrainEvalHybridPipelineBase(m, o, CPU, thread_map="io", loads=2, lookahead=2),
                rank,
                world_size,
                seed,
            ),
        ),
    }


def test_train_eval_hybrid_equals_upstream_across_the_switches() -> None:
    for rank, runs in enumerate(run_on_ranks(_hybrid, 99, timeout_s=600)):
        first, evaluated, rest, again = runs["upstream"]
        # upstream's schedule: the 2 training batches in flight at the switch are evaluated, then
        # the held-out ones; back in training mode the pipeline fills again from the training data
        assert (first.num_calls, first.stop_iteration_call) == (TRAIN_FIRST, None)
        assert (evaluated.num_calls, evaluated.stop_iteration_call) == (EVAL_BATCHES + 2, EVAL_BATCHES + 2)
        assert rest.num_calls == TRAIN_BATCHES - TRAIN_FIRST - 2 == rest.stop_iteration_call
        # eval mode trained nothing, training did
        assert evaluated.losses == [] and all(torch.equal(w, evaluated.weights[k]) for k, w in first.weights.items())
        assert any(not torch.equal(w, rest.weights[k]) for k, w in evaluated.weights.items())
        # after the end of the training data, a new eval iterator fills the pipeline again
        assert (again.num_calls, again.stop_iteration_call) == (EVAL_BATCHES, EVAL_BATCHES)
        for label, ours in runs["ours"].items():
            phases = ("train", "eval", "train again", "eval again")
            for phase, (a, b) in zip(phases, zip(runs["upstream"], ours, strict=True)):
                assert_runs_equal(a, b, what=f"rank {rank} TrainEvalHybridPipelineBase [{label}] {phase}")
        reference, loaded = runs["training only"]
        assert reference.num_calls == STEPS
        assert_runs_equal(reference, loaded, what=f"rank {rank} TrainEvalHybridPipelineBase [io_loads_lookahead]")
