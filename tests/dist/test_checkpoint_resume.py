"""Resuming from a checkpoint is bit-identical to never stopping, for the DLRM example's pipelines.

For each pipeline (SparseDist, SparseDist with H2D on an io thread, SemiSync in its semi-sync
phase with and without stash_gradients, Prefetch, Fused, Staged) and the StatefulDataLoader with 0
and 2 worker processes, and for the map source (``--data-source map``: ``torchrec_swp.data.MapSource``)
alone and with 2 loads at once (SparseDist, SemiSync; synthetic data and a Criteo TSV file), on 2
gloo ranks, with stateful optimizers (row-wise Adagrad on the tables, fused; Adagrad on the MLPs):

* run A trains N steps without checkpoints;
* run B trains k steps, checkpoints (``--checkpoint-every k --stop-after k``) and ends, with
  batches in flight;
* run C, in new processes, resumes from B's checkpoint and trains the N - k steps left;

and every step's loss of B then C equals A's on every rank, and so do the final weights and the
optimizers' state (SHA-256 over every rank's shards). With 2 loads (and a wait per batch) later
batches are already claimed from the map source when B's cut is taken: the cut must record the
position before the first untrained one; one configuration resumes with 1 load (the position does
not depend on how many loads drew it). The map source's runs A also equal the StatefulDataLoader's
on the same data (losses and weights). Runs A and B of all configurations share one launch of 2
ranks and the runs C another (new processes), through the example's own ``train()``.

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

from examples.dlrm.data import write_sample_tsv
from harness.ranks import run_on_ranks

N, K = 8, 3
BATCH = 32
SMALL = [
    "--batch-size", str(BATCH), "--num-sparse", "4", "--num-embeddings", "200", "--embedding-dim", "8",
    "--dense-arch", "16", "--over-arch", "16", "--optimizer", "adagrad", "--steps", str(N),
]  # fmt: skip
PIPELINES: dict[str, list[str]] = {
    "SparseDist": ["--pipeline", "TrainPipelineSparseDist"],
    "SparseDist-H2D-io": ["--pipeline", "TrainPipelineSparseDist", "--thread-map", "H2D=io"],
    # the semi-sync phase (embeddings one step stale) from batch 2: the cut at K is inside it
    "SemiSync": ["--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2"],
    # stash_gradients: batch 2 stashes its gradients and skips the step, batch 3 steps on them;
    # the cut at K=3 leaves batch 2's gradients stashed, which batch 3's step after the resume needs
    "SemiSync-stash": [
        "--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2", "--option", "stash_gradients=True",
    ],
    "Prefetch": ["--pipeline", "PrefetchTrainPipelineSparseDist"],
    "Fused": ["--pipeline", "TrainPipelineFusedSparseDist"],
    "Staged": ["--pipeline", "StagedTrainPipeline"],
    # the map source; "{tsv}" is a Criteo TSV file the fixture writes
    "SparseDist-map": ["--pipeline", "TrainPipelineSparseDist", "--data-source", "map"],
    "SparseDist-map-2loads": [
        "--pipeline", "TrainPipelineSparseDist", "--data-source", "map", "--loads", "2", "--loader-latency-ms", "2",
    ],
    "SparseDist-map-2loads-resumed-with-1": [
        "--pipeline", "TrainPipelineSparseDist", "--data-source", "map", "--loads", "2", "--loader-latency-ms", "2",
    ],
    "SemiSync-map-2loads": [
        "--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2", "--data-source", "map", "--loads", "2",
    ],
    "SparseDist-tsv": ["--pipeline", "TrainPipelineSparseDist", "--criteo-tsv", "{tsv}"],
    "SparseDist-tsv-map-2loads": [
        "--pipeline", "TrainPipelineSparseDist", "--criteo-tsv", "{tsv}", "--data-source", "map", "--loads", "2",
        "--lookahead", "3",
    ],
}  # fmt: skip
#: What run C adds to its configuration's arguments.
RESUMED_WITH = {"SparseDist-map-2loads-resumed-with-1": ["--loads", "1"]}
#: Map-source configurations and the StatefulDataLoader one on the same data: their runs A are equal.
SAME_DATA = {
    "SparseDist-map": "SparseDist",
    "SparseDist-map-2loads": "SparseDist",
    "SemiSync-map-2loads": "SemiSync",
    "SparseDist-tsv-map-2loads": "SparseDist-tsv",
}
# worker processes: the StatefulDataLoader over synthetic data only
CONFIGS = [
    (name, workers)
    for name, argv in PIPELINES.items()
    for workers in ((0,) if "--data-source" in argv or "--criteo-tsv" in argv else (0, 2))
]


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


def _runs(rank: int, world_size: int, root: str, phase: str, configs: list[tuple[str, int]]) -> dict[str, Any]:
    """Phase "first": runs A and B of each configuration of ``configs`` (``CONFIGS``); "resume":
    runs C. Returns, by config id, ``{"A": summary, "B": summary}`` or ``{"C": summary}``, or
    ``{"error": message}``."""
    # The harness spawns its ranks, whose loader workers would then be spawned too, each importing
    # TorchRec anew (seconds apiece); torchrun's ranks fork them, as they do here.
    multiprocessing.set_start_method("fork", force=True)
    results: dict[str, Any] = {}
    tsv = str(Path(root) / "day_0.tsv")
    for name, workers in configs:
        cid = _config_id(name, workers)
        base = [*SMALL, *(a.format(tsv=tsv) for a in PIPELINES[name]), "--num-workers", str(workers)]
        ckpt = ["--checkpoint-dir", str(Path(root) / cid)]
        try:
            if phase == "first":
                results[cid] = {
                    "A": _train(base),
                    "B": _train([*base, *ckpt, "--checkpoint-every", str(K), "--stop-after", str(K)]),
                }
            else:
                results[cid] = {"C": _train([*base, *ckpt, "--resume", *RESUMED_WITH.get(name, [])])}
        except Exception as e:  # noqa: BLE001 - reported per configuration by the tests below
            results[cid] = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("resume")
    write_sample_tsv(root / "day_0.tsv", lines=2 * BATCH * N + 5)  # N rounds of 2 ranks, and an incomplete one
    first = run_on_ranks(_runs, str(root), "first", CONFIGS, timeout_s=400)
    resumed = run_on_ranks(_runs, str(root), "resume", CONFIGS, timeout_s=400)
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
        if name in RESUMED_WITH:
            assert (b["loads"], c["loads"]) == (2, 1), (b["loads"], c["loads"])
        losses = b["losses"] + c["losses"]
        mismatch = [step for step, (x, y) in enumerate(zip(a["losses"], losses)) if x != y]
        assert not mismatch, f"{cid} rank {rank}: losses differ from step {mismatch[0]}: {a['losses']} vs {losses}"
        assert c["weights_sha256"] == a["weights_sha256"], f"{cid}: final weights differ"
        assert c["optimizers_sha256"] == a["optimizers_sha256"], f"{cid}: final optimizer state differs"
        assert b["weights_sha256"] != a["weights_sha256"]  # B stopped early: the digests tell runs apart


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SAME_DATA)
def test_the_map_source_trains_on_the_dataloaders_batches(
    runs: tuple[list[dict[str, Any]], list[dict[str, Any]]], name: str
) -> None:
    first, _ = runs
    mapped, loaded = _config_id(name, 0), _config_id(SAME_DATA[name], 0)
    for rank in range(2):
        for cid in (mapped, loaded):
            if "error" in first[rank][cid]:
                pytest.fail(f"{cid}: {first[rank][cid]['error']}")
        a, reference = first[rank][mapped]["A"], first[rank][loaded]["A"]
        assert (a["data_source"], reference["data_source"]) == ("map", "dataloader")
        assert a["losses"] == reference["losses"], f"{name} rank {rank}: losses differ from {SAME_DATA[name]}'s"
        assert a["weights_sha256"] == reference["weights_sha256"], f"{name}: final weights differ"
