"""Resuming from a checkpoint is bit-identical to never stopping, for the DLRM example's pipelines.

For each pipeline (SparseDist, SparseDist with H2D on an io thread, SemiSync in its semi-sync
phase, Prefetch, Fused, Staged) and the StatefulDataLoader with 0 and 2 worker processes, on 2
gloo ranks, with stateful optimizers (row-wise Adagrad on the tables, fused; Adagrad on the MLPs):

* run A trains N steps without checkpoints;
* run B trains k steps, checkpoints (``--checkpoint-every k --stop-after k``) and ends, with
  batches in flight;
* run C, in new processes, resumes from B's checkpoint and trains the N - k steps left;

and every step's loss of B then C equals A's on every rank, and so do the final weights and the
optimizers' state (SHA-256 over every rank's shards). Runs A and B of all configurations share one
launch of 2 ranks and the runs C another (new processes), through the example's own ``train()``.

Needs the pipelines' ``state_dict()`` / ``load_state_dict()`` (the lead's contract): without them
every configuration fails with the example's message saying so.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from harness.ranks import run_on_ranks

N, K = 8, 3
SMALL = [
    "--batch-size", "32", "--num-sparse", "4", "--num-embeddings", "200", "--embedding-dim", "8",
    "--dense-arch", "16", "--over-arch", "16", "--optimizer", "adagrad", "--steps", str(N),
]  # fmt: skip
PIPELINES: dict[str, list[str]] = {
    "SparseDist": ["--pipeline", "TrainPipelineSparseDist"],
    "SparseDist-H2D-io": ["--pipeline", "TrainPipelineSparseDist", "--thread-map", "H2D=io"],
    # the semi-sync phase (embeddings one step stale) from batch 2: the cut at K is inside it
    "SemiSync": ["--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2"],
    "Prefetch": ["--pipeline", "PrefetchTrainPipelineSparseDist"],
    "Fused": ["--pipeline", "TrainPipelineFusedSparseDist"],
    "Staged": ["--pipeline", "StagedTrainPipeline"],
}
CONFIGS = [(name, workers) for name in PIPELINES for workers in (0, 2)]


def _config_id(name: str, workers: int) -> str:
    return f"{name}-{workers}workers"


def _train(argv: list[str]) -> dict[str, Any]:
    """The example's ``train()`` on ``argv`` (in this rank's process group); argparse's and the
    example's errors come back as one RuntimeError naming them."""
    from examples.dlrm import train

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = train.parse_args(argv)
    except SystemExit:
        raise RuntimeError(stderr.getvalue().strip().splitlines()[-1]) from None
    return train.train(args)


def _runs(rank: int, world_size: int, root: str, phase: str) -> dict[str, Any]:
    """Phase "first": runs A and B of every configuration; "resume": runs C. Returns, by config
    id, ``{"A": summary, "B": summary}`` or ``{"C": summary}``, or ``{"error": message}``."""
    # The harness spawns its ranks, whose loader workers would then be spawned too, each importing
    # TorchRec anew (seconds apiece); torchrun's ranks fork them, as they do here.
    multiprocessing.set_start_method("fork", force=True)
    results: dict[str, Any] = {}
    for name, workers in CONFIGS:
        cid = _config_id(name, workers)
        base = [*SMALL, *PIPELINES[name], "--num-workers", str(workers)]
        ckpt = ["--checkpoint-dir", str(Path(root) / cid)]
        try:
            if phase == "first":
                results[cid] = {
                    "A": _train(base),
                    "B": _train([*base, *ckpt, "--checkpoint-every", str(K), "--stop-after", str(K)]),
                }
            else:
                results[cid] = {"C": _train([*base, *ckpt, "--resume"])}
        except Exception as e:  # noqa: BLE001 - reported per configuration by the tests below
            results[cid] = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("resume")
    first = run_on_ranks(_runs, str(root), "first", timeout_s=400)
    resumed = run_on_ranks(_runs, str(root), "resume", timeout_s=400)
    return first, resumed


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, workers", CONFIGS, ids=[_config_id(*c) for c in CONFIGS])
def test_resume_is_bit_identical(
    runs: tuple[list[dict[str, Any]], list[dict[str, Any]]], name: str, workers: int
) -> None:
    cid = _config_id(name, workers)
    first, resumed = runs
    for rank in range(2):
        for phase in (first[rank][cid], resumed[rank][cid]):
            if "error" in phase:
                pytest.fail(f"{cid}: {phase['error']}")
        a, b, c = first[rank][cid]["A"], first[rank][cid]["B"], resumed[rank][cid]["C"]
        assert (a["start_step"], a["steps"]) == (0, N), a
        assert (b["start_step"], b["steps"], b["checkpoints_saved"]) == (0, K, [K]), b
        assert (c["start_step"], c["steps"], c["checkpoints_saved"]) == (K, N - K, [N]), c
        losses = b["losses"] + c["losses"]
        mismatch = [step for step, (x, y) in enumerate(zip(a["losses"], losses)) if x != y]
        assert not mismatch, f"{cid} rank {rank}: losses differ from step {mismatch[0]}: {a['losses']} vs {losses}"
        assert c["weights_sha256"] == a["weights_sha256"], f"{cid}: final weights differ"
        assert c["optimizers_sha256"] == a["optimizers_sha256"], f"{cid}: final optimizer state differs"
        assert b["weights_sha256"] != a["weights_sha256"]  # B stopped early: the digests tell runs apart
