"""Our Fused, EvalFused and Prefetch pipelines against upstream's and a plain loop, on 2 gloo ranks.

Upstream's three pipelines fail on CPU as shipped, so the upstream references run under
``upstream_cpu_patch`` (plus, for Prefetch, the tweak of ``_UpstreamPrefetchOnCpu`` below); ours
run as shipped. Same sharded model (fresh, same seed) and data for every run: outputs, losses,
final weights, batch counts and the call that raises StopIteration must be equal bit for bit,
with the default plan and with thread maps that move tasks to other threads.

* Training pipelines also equal ``plain_loop_run``. For Fused that rests on its fused-TBE
  assumption, which the test model meets: its tables use the FUSED kernel, updated in backward,
  so the lookup of batch i, issued at the start of the call (on a GPU it may overlap the dense
  optimizer step of batch i-1), already sees batch i-1's table update.
* Eval pipelines train nothing and return the model's output; neither calls ``model.eval()``.
  The test puts the model in eval mode, where TestSparseNN returns only its predictions, so a
  ``custom_model_fwd`` supplies the ``(losses, output)`` pair pipelines unpack. They also equal
  a plain no-grad forward loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import PrefetchTrainPipelineContext

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import (
    RunResult,
    assert_runs_equal,
    build_model,
    local_state,
    make_batches,
    plain_loop_run,
    record_losses,
    train_pipeline_run,
)
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.pipelines.fused import EvalPipelineFusedSparseDist, TrainPipelineFusedSparseDist
from torchrec_swp.integrations.torchrec.pipelines.prefetch import PrefetchTrainPipelineSparseDist

pytestmark = pytest.mark.parity

STEPS = 20
CPU = torch.device("cpu")

Factory = Callable[[nn.Module, torch.optim.Optimizer], Any]


class _UpstreamPrefetchOnCpu(upstream.PrefetchTrainPipelineSparseDist):
    """Upstream's Prefetch pipeline with the smallest test-only tweak that lets it run on CPU.

    Upstream's ``prefetch_embeddings`` returns at once when the pipeline has no data_dist stream
    (always so on CPU), and the forward then raises "Invalid PrefetchPipelinedForward usage".
    For the duration of ``_prefetch`` only, the pipeline's data_dist stream is the CPU's current
    stream: a dummy whose context and ``wait_stream`` do nothing (``upstream_cpu_patch`` turns
    the ``record_stream`` calls on CPU tensors into no-ops).
    """

    def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        self._data_dist_stream = torch.cpu.current_stream()
        try:
            super()._prefetch(context)
        finally:
            self._data_dist_stream = None


def _eval_fwd(model: nn.Module) -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    return lambda batch: (torch.zeros(()), model(batch))


# Upstream's Fused with execute_all_batches=False stops when loading the next batch fails, so
# it trains two batches fewer; every other case trains them all.
TRAINED = {"Fused.execute_all_batches=False": STEPS - 2}

# (name, train or eval, upstream factory, our factories by label)
CASES: list[tuple[str, str, Factory, dict[str, Factory]]] = [
    (
        "Fused",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU),
            "io_thread": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
        },
    ),
    (
        "Fused.emb_lookup_stream=new",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU, emb_lookup_stream="new"),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, emb_lookup_stream="new"),
            "by_stream": lambda m, o: TrainPipelineFusedSparseDist(
                m, o, CPU, emb_lookup_stream="new", thread_map="by_stream"
            ),
        },
    ),
    (
        "Fused.emb_lookup_stream=current",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU, emb_lookup_stream="current"),
        {"default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, emb_lookup_stream="current")},
    ),
    (
        "Fused.embedding_lookup_after_data_dist",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU, embedding_lookup_after_data_dist=True),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, embedding_lookup_after_data_dist=True),
            "io_thread": lambda m, o: TrainPipelineFusedSparseDist(
                m, o, CPU, embedding_lookup_after_data_dist=True, thread_map={"H2D": "io"}
            ),
        },
    ),
    (
        "Fused.embedding_lookup_after_data_dist+enqueue_batch_after_forward",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(
            m, o, CPU, embedding_lookup_after_data_dist=True, enqueue_batch_after_forward=True
        ),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(
                m, o, CPU, embedding_lookup_after_data_dist=True, enqueue_batch_after_forward=True
            )
        },
    ),
    (
        "Fused.clear_data_dist_inputs",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU, clear_data_dist_inputs=True),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, clear_data_dist_inputs=True),
            "per_task": lambda m, o: TrainPipelineFusedSparseDist(
                m, o, CPU, clear_data_dist_inputs=True, thread_map="per_task"
            ),
        },
    ),
    (
        "Fused.execute_all_batches=False",
        "train",
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU, execute_all_batches=False),
        {
            "default": lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, execute_all_batches=False),
            "io_thread": lambda m, o: TrainPipelineFusedSparseDist(
                m, o, CPU, execute_all_batches=False, thread_map={"H2D": "io"}
            ),
        },
    ),
    (
        "EvalFused",
        "eval",
        lambda m, o: upstream.EvalPipelineFusedSparseDist(m, o, CPU, custom_model_fwd=_eval_fwd(m)),
        {
            "default": lambda m, o: EvalPipelineFusedSparseDist(m, o, CPU, custom_model_fwd=_eval_fwd(m)),
            "io_thread": lambda m, o: EvalPipelineFusedSparseDist(
                m, o, CPU, custom_model_fwd=_eval_fwd(m), thread_map={"H2D": "io"}
            ),
        },
    ),
    (
        "EvalFused.enable_embedding_lookup_prefetch",
        "eval",
        lambda m, o: upstream.EvalPipelineFusedSparseDist(
            m, o, CPU, custom_model_fwd=_eval_fwd(m), enable_embedding_lookup_prefetch=True
        ),
        {
            "default": lambda m, o: EvalPipelineFusedSparseDist(
                m, o, CPU, custom_model_fwd=_eval_fwd(m), enable_embedding_lookup_prefetch=True
            ),
            "io_thread": lambda m, o: EvalPipelineFusedSparseDist(
                m,
                o,
                CPU,
                custom_model_fwd=_eval_fwd(m),
                enable_embedding_lookup_prefetch=True,
                thread_map={"H2D": "io"},
            ),
        },
    ),
    (
        "Prefetch",
        "train",
        lambda m, o: _UpstreamPrefetchOnCpu(m, o, CPU),
        {
            "default": lambda m, o: PrefetchTrainPipelineSparseDist(m, o, CPU),
            "io_thread": lambda m, o: PrefetchTrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
            "by_stream": lambda m, o: PrefetchTrainPipelineSparseDist(m, o, CPU, thread_map="by_stream"),
        },
    ),
]


def _plain_eval_run(model: nn.Module, batches: Sequence[Any]) -> RunResult:
    """The non-pipelined eval reference: ``model(batch)`` under no_grad, per batch."""
    outputs = []
    with record_losses(model) as losses, torch.no_grad():
        for batch in batches:
            outputs.append(model(batch).detach().clone())
    return RunResult(outputs, losses, len(outputs), len(batches), local_state(model))


def _model(rank: int, world_size: int, seed: int, mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build_model(rank, world_size, seed)
    if mode == "eval":
        model.eval()
    return model, optimizer


Trace = list[list[str]]


def _trace_calls(pipeline: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> Trace:
    """Per ``progress()`` call, the upstream helpers it called, in order, with the index of the
    batch each worked on (``"H2D -"``: no batch loaded). Patches the instances by name, as user
    code does; only meaningful when every task runs on the calling thread."""
    trace: Trace = []

    def wrap(obj: Any, name: str, label: Callable[..., str]) -> None:
        original = getattr(obj, name)

        def logged(*args: Any) -> Any:
            result = original(*args)
            trace[-1].append(label(*args, result=result))
            return result

        setattr(obj, name, logged)

    progress = pipeline.progress
    pipeline.progress = lambda it: (trace.append([]), progress(it))[1]
    wrap(pipeline, "enqueue_batch", lambda it, result: f"H2D {pipeline.contexts[-1].index}" if result else "H2D -")
    wrap(pipeline, "start_sparse_data_dist", lambda batch, ctx, result: f"InputDistStart {ctx.index}")
    wrap(pipeline, "wait_sparse_data_dist", lambda ctx, result: f"InputDistWait {ctx.index}")
    if hasattr(pipeline, "start_embedding_lookup"):
        wrap(pipeline, "start_embedding_lookup", lambda batch, ctx, result: f"EmbLookup {ctx.index}")
    if hasattr(pipeline, "_prefetch"):
        wrap(pipeline, "_prefetch", lambda ctx, result: f"EmbPrefetch {ctx.index}")
    wrap(pipeline, "dequeue_batch", lambda result: "Dequeue")
    wrap(optimizer, "zero_grad", lambda result: "ZeroGrad")
    wrap(optimizer, "step", lambda result: "OptimizerStep")
    model.register_forward_pre_hook(lambda *_: trace[-1].append("Forward"))
    return trace


def _comparable(trace: Trace) -> Trace:
    """``trace`` without what legitimately differs: the engine loads batch 1 before waiting for
    batch 0's input dist in the first call (upstream after; no collective is involved), and it
    does not call ``enqueue_batch`` again once the data is exhausted (upstream's extra calls
    load nothing)."""
    return [[e for e in call if e != "H2D -" and not (i == 0 and e.startswith("H2D"))] for i, call in enumerate(trace)]


def _run(factory: Factory, rank: int, world_size: int, seed: int, mode: str, trace: bool) -> tuple[RunResult, Trace]:
    model, optimizer = _model(rank, world_size, seed, mode)
    pipeline = factory(model, optimizer)
    calls = _trace_calls(pipeline, model, optimizer) if trace else []
    try:
        return train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed), STEPS + 5, model=model), calls
    finally:
        if hasattr(pipeline, "close"):
            pipeline.close()


def _all_cases(rank: int, world_size: int, seed: int) -> dict[str, dict[str, Any]]:
    plain = {
        ("train", n): plain_loop_run(*build_model(rank, world_size, seed), make_batches(rank, world_size, n, seed))
        for n in {STEPS, *TRAINED.values()}
    }
    eval_model = _model(rank, world_size, seed, "eval")[0]
    plain["eval", STEPS] = _plain_eval_run(eval_model, make_batches(rank, world_size, STEPS, seed))
    out = {}
    for name, mode, up, ours in CASES:
        with upstream_cpu_patch():
            reference, reference_calls = _run(up, rank, world_size, seed, mode, trace=True)
        runs = {label: _run(f, rank, world_size, seed, mode, trace=label == "default") for label, f in ours.items()}
        out[name] = {
            "plain": plain[mode, TRAINED.get(name, STEPS)],
            "upstream": reference,
            "ours": {label: result for label, (result, _) in runs.items()},
            "calls": (reference_calls, runs["default"][1]),
        }
    return out


EPOCH_CASES: dict[str, tuple[Factory, Factory]] = {
    "Fused": (
        lambda m, o: upstream.TrainPipelineFusedSparseDist(m, o, CPU),
        lambda m, o: TrainPipelineFusedSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
    ),
    "Prefetch": (
        lambda m, o: _UpstreamPrefetchOnCpu(m, o, CPU),
        lambda m, o: PrefetchTrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
    ),
}


def _epochs(factory: Factory, rank: int, world_size: int, seed: int) -> list[RunResult]:
    """Two epochs of 7 batches: after StopIteration, a new iterator starts a new epoch."""
    model, optimizer = build_model(rank, world_size, seed)
    pipeline = factory(model, optimizer)
    try:
        return [train_pipeline_run(pipeline, make_batches(rank, world_size, 7, seed + e), 10) for e in range(2)]
    finally:
        if hasattr(pipeline, "close"):
            pipeline.close()


def _all_runs(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    epochs = {}
    for name, (up, ours) in EPOCH_CASES.items():
        with upstream_cpu_patch():
            reference = _epochs(up, rank, world_size, seed)
        epochs[name] = (reference, _epochs(ours, rank, world_size, seed))
    return {"cases": _all_cases(rank, world_size, seed), "epochs": epochs}


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_on_ranks(_all_runs, 1234, timeout_s=600)


@pytest.mark.multiprocess
def test_fused_eval_fused_and_prefetch_equal_upstream_and_plain_loop(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(r["cases"] for r in per_rank):
        for name, runs in results.items():
            trained = runs["upstream"].num_calls
            assert trained == TRAINED.get(name, STEPS), f"{name}: upstream returned {trained} outputs"
            assert_runs_equal(runs["plain"], runs["upstream"], what=f"rank {rank} {name} [upstream vs plain loop]")
            for label, result in runs["ours"].items():
                assert_runs_equal(runs["upstream"], result, what=f"rank {rank} {name} [{label}]")
            upstream_calls, our_calls = map(_comparable, runs["calls"])
            for call, (a, b) in enumerate(zip(upstream_calls, our_calls, strict=True)):
                assert a == b, f"rank {rank} {name}: progress() call {call} called\n  upstream: {a}\n  ours:     {b}"


@pytest.mark.multiprocess
def test_new_epoch_with_a_new_iterator(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(r["epochs"] for r in per_rank):
        for name, (reference, ours) in results.items():
            for epoch, (a, b) in enumerate(zip(reference, ours, strict=True)):
                assert a.num_calls == 7, f"{name}: upstream returned {a.num_calls} outputs in epoch {epoch}"
                assert_runs_equal(a, b, what=f"rank {rank} {name} epoch {epoch}")
