"""A same-size resume is bit-identical on 3 and 4 ranks too, where a sum's order shows.

On 2 ranks a gradient's all-reduce adds 2 values, which any order adds alike; on 3 or more the
order shows in the last bits, and a resumed run's new DDP would start with another bucket layout
than the uninterrupted run's, so another order (``torchrec_swp.ddp_layout``). For SparseDist and
SemiSync (in its semi-sync phase from batch 2) on 3 and on 4 gloo ranks, through the example's
``train()`` (synthetic data, row-wise Adagrad on the tables, Adagrad on the MLPs):

* run A trains N steps;
* run B trains K steps and checkpoints, after its DDP has rebuilt its buckets;
* run C resumes B's checkpoint and trains the N - K steps left (in the same processes, to keep
  the test short: it builds a new model, DMP and DDP, as new processes do; new processes are
  ``test_checkpoint_resume.py``'s, on 2 ranks);

and B then C gives A's every loss on every rank, its final weights and optimizer state. Without
the saved layout C's weights differ from A's on both world sizes (checked by hand, 2026-12-02).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.ranks import run_on_ranks
from tests.dist.test_checkpoint_resume import _train  # the example's train() on an argv, errors in one line

N, K = 6, 3  # the DDP of a static graph rebuilds its buckets at step 3's forward: the cut is after it
SMALL = [
    "--batch-size", "16", "--num-sparse", "2", "--num-embeddings", "50", "--embedding-dim", "4",
    "--dense-arch", "8", "--over-arch", "8", "--optimizer", "adagrad", "--steps", str(N),
]  # fmt: skip
PIPELINES = {
    "SparseDist": ["--pipeline", "TrainPipelineSparseDist"],
    "SemiSync": ["--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2"],
}
WORLD_SIZES = (3, 4)


def _runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Runs A, B and C of each pipeline, by pipeline name."""
    results: dict[str, Any] = {}
    for name, argv in PIPELINES.items():
        base = [*SMALL, *argv]
        ckpt = ["--checkpoint-dir", str(Path(root) / name)]
        results[name] = {
            "A": _train(base),
            "B": _train([*base, *ckpt, "--checkpoint-every", str(K), "--stop-after", str(K)]),
            "C": _train([*base, *ckpt, "--resume"]),
        }
    return results


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"{w}ranks" for w in WORLD_SIZES])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[Any]]:
    world_size = request.param
    root = str(tmp_path_factory.mktemp(f"resume{world_size}"))
    return world_size, run_on_ranks(_runs, root, world_size=world_size, timeout_s=400)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", PIPELINES)
def test_same_size_resume_is_bit_identical(runs: tuple[int, list[Any]], name: str) -> None:
    world_size, results = runs
    for rank in range(world_size):
        a, b, c = (results[rank][name][run] for run in "ABC")
        assert (c["start_step"], c["steps"]) == (K, N - K), c
        losses = b["losses"] + c["losses"]
        mismatch = [step for step, (x, y) in enumerate(zip(a["losses"], losses)) if x != y]
        assert not mismatch, f"{name} rank {rank}: losses differ from step {mismatch[0]}: {a['losses']} vs {losses}"
        assert c["weights_sha256"] == a["weights_sha256"], f"{name} on {world_size} ranks: final weights differ"
        assert c["optimizers_sha256"] == a["optimizers_sha256"], f"{name} on {world_size} ranks: optimizers differ"
