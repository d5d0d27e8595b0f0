"""A checkpoint resumes on another world size: every sample of the epoch trained once.

The DLRM example with ``--data-source global`` (``torchrec_swp.data.GlobalMapSource``: one order
of the epoch's 24 batches for all ranks, a global position) and ``--sample-log`` (each rank logs
the samples of every batch its model trained), stateful optimizers (row-wise Adagrad on the
tables, fused; Adagrad on the MLPs), for SparseDist with 2 parallel loads (threads ``load`` and
``load.1``, 2 batches of lookahead, a wait per batch: batches are drawn ahead of the cut) and
SemiSync in its semi-sync phase with 2 loads and stash_gradients (its looked-up embeddings of the
batch in flight are rank-local: dropped on another world size, the batch looked up again; its
stashed gradients were all-reduced: every rank saved the same, checked here, and they carry over):

* 2 -> 1: run B trains 3 steps on 2 ranks and checkpoints; run C1 resumes it on 1 rank;
* 1 -> 2: run D trains 4 steps on 1 rank and checkpoints; run E resumes it on 2 ranks;
* 2 -> 2: run C2 resumes B's checkpoint on 2 ranks: bit-identical to run A, 12 steps on 2 ranks
  uninterrupted (losses, weights, optimizer state);

each of B+C1, D+E and B+C2 trains every sample of the epoch exactly once (the sample logs,
``examples.dlrm.samples.check``). DCP's resharding itself: B's and D's checkpoints loaded on 1 and
on 2 ranks give the same full tables, fused optimizer state, MLPs and dense optimizer state,
tensor by tensor (gathered to rank 0). A checkpoint whose data position is per rank
(``--data-source map``) is refused on another world size in one line naming why.
"""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.dlrm.samples import check as check_samples
from harness.ranks import run_on_ranks
from tests.dist.test_checkpoint_resume import _train  # the example's train() on an argv, errors in one line

EPOCH, BATCH = 24, 32  # 24 batches: 12 steps on 2 ranks, 24 on 1; no tail at the cuts below
K2, K1 = 3, 4  # the cuts: after step 3 on 2 ranks (6 batches), after step 4 on 1 rank (4 batches)
SMALL = [
    "--batch-size", str(BATCH), "--num-sparse", "4", "--num-embeddings", "200", "--embedding-dim", "8",
    "--dense-arch", "16", "--over-arch", "16", "--optimizer", "adagrad",
    "--data-source", "global", "--epoch-batches", str(EPOCH), "--loads", "2", "--loader-latency-ms", "2",
]  # fmt: skip
PIPELINES = {
    "SparseDist": ["--pipeline", "TrainPipelineSparseDist"],
    # stash_gradients: the cut at 3 (or 4) leaves the last trained batch's gradients stashed, for the next step
    "SemiSync": [
        "--pipeline", "TrainPipelineSemiSync", "--option", "start_batch=2", "--option", "stash_gradients=True",
    ],
}
REPO = Path(__file__).resolve().parents[2]


def _shards(step_dir: str, argv: list[str]) -> dict[str, Any]:
    """Checkpoint ``step_dir`` loaded into a new model of ``argv`` on this world: this rank's pieces
    of every tensor of the model and optimizers, ``{name: (global size, [(offsets, tensor)])}``
    (``_whole`` puts every rank's together; no collective, as ranks may hold other names)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    from examples.dlrm import checkpoint, train
    from examples.dlrm.model import build_dlrm

    args = train.parse_args(argv)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, dense = build_dlrm(rank, world_size, args.size, seed=args.seed, optimizer=args.optimizer)
    state = checkpoint.TrainState(model, dense)
    checkpoint.load(Path(step_dir), state, from_rank=0)
    found: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, ShardedTensor):
            pieces = [(tuple(sh.metadata.shard_offsets), sh.tensor.detach().clone()) for sh in value.local_shards()]
            found[path] = (tuple(value.size()), pieces)
        elif isinstance(value, DTensor):
            raise TypeError(f"{path}: a DTensor; this test reads ShardedTensors")
        elif isinstance(value, torch.Tensor):
            found[path] = (tuple(value.shape), [((0,) * value.dim(), value.detach().clone())])

    walk(state.state_dict(), "")
    return found


def _objects(step_dir: str, world_size: int) -> list[Any]:
    """Every rank's own object (the pipeline's state) of the checkpoint in ``step_dir``."""
    import pickle

    import torch.distributed.checkpoint as dcp

    wanted: dict[str, Any] = {f"rank_{r}": b"" for r in range(world_size)}
    dcp.load(wanted, storage_reader=dcp.FileSystemReader(step_dir))
    return [pickle.loads(wanted[f"rank_{r}"]) for r in range(world_size)]


def _whole(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every tensor whole, from every rank's pieces (``_shards``); pieces of replicated tensors
    must agree, and every element must come from some rank."""
    whole: dict[str, torch.Tensor] = {}
    for name in sorted({n for found in ranks for n in found}):
        size = next(found[name][0] for found in ranks if name in found)
        out = torch.full(size, float("nan"))
        for found in ranks:
            for offsets, piece in found.get(name, (size, []))[1]:
                where = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                out[where] = piece.float()
        assert not out.isnan().any(), f"{name}: no rank holds some of it"
        whole[name] = out
    return whole


def _phase(rank: int, world_size: int, root: str, phase: str) -> dict[str, Any]:
    multiprocessing.set_start_method("fork", force=True)
    r = Path(root)
    results: dict[str, Any] = {}
    for name, pipeline in PIPELINES.items():
        base = [*SMALL, *pipeline]

        def run(label: str, ckpt: str, log: str, *extra: str, base: list[str] = base, name: str = name) -> None:
            argv = [*base, "--checkpoint-dir", str(r / name / ckpt), "--sample-log", str(r / name / log), *extra]
            try:
                results[f"{name}/{label}"] = _train(argv)
            except Exception as e:  # noqa: BLE001 - reported by the tests
                results[f"{name}/{label}"] = {"error": f"rank {rank}: {type(e).__name__}: {e}"}

        try:
            if phase == "two-first":
                results[f"{name}/A"] = _train(base)
                run("B", "b", "log-b", "--checkpoint-every", str(K2), "--stop-after", str(K2))
            elif phase == "one":
                results[f"{name}/objects-b"] = _objects(str(r / name / "b0" / f"step-{K2:06d}"), 2)
                results[f"{name}/full-b@1"] = _shards(str(r / name / "b0" / f"step-{K2:06d}"), base)
                run("C1", "b1", "log-b1", "--resume")
                run("D", "d", "log-d", "--checkpoint-every", str(K1), "--stop-after", str(K1))
                results[f"{name}/full-d@1"] = _shards(str(r / name / "d" / f"step-{K1:06d}"), base)
            else:
                results[f"{name}/full-b@2"] = _shards(str(r / name / "b0" / f"step-{K2:06d}"), base)
                results[f"{name}/full-d@2"] = _shards(str(r / name / "d0" / f"step-{K1:06d}"), base)
                run("C2", "b2", "log-b2", "--resume")
                run("E", "d2", "log-d2", "--resume")
        except Exception as e:  # noqa: BLE001
            results[f"{name}/{phase}"] = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    return results


def _copy(src: Path, *dsts: Path) -> None:
    for dst in dsts:
        shutil.copytree(src, dst)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    root = tmp_path_factory.mktemp("resize")
    first = run_on_ranks(_phase, str(root), "two-first", world_size=2, timeout_s=300)
    for name in PIPELINES:
        d = root / name
        if (d / "b").is_dir():  # B's checkpoint and log, once per resume
            _copy(d / "b", d / "b0", d / "b1", d / "b2")
            _copy(d / "log-b", d / "log-b1", d / "log-b2")
    one = run_on_ranks(_phase, str(root), "one", world_size=1, timeout_s=300)
    for name in PIPELINES:
        d = root / name
        if (d / "d").is_dir():
            _copy(d / "d", d / "d0", d / "d2")
            _copy(d / "log-d", d / "log-d2")
    two = run_on_ranks(_phase, str(root), "two", world_size=2, timeout_s=300)
    merged: dict[str, list[Any]] = {}
    for results in (first, one, two):
        for rank, found in enumerate(results):
            for key, value in found.items():
                merged.setdefault(key, [None] * len(results))
                merged[key][rank] = value
    return root, merged


def _ok(merged: dict[str, list[Any]], key: str) -> list[Any]:
    if key not in merged:
        errors = [v for k, vs in merged.items() for v in vs if isinstance(v, dict) and "error" in v]
        pytest.fail(f"{key}: not run ({errors[0]['error'] if errors else 'no result'})")
    for value in merged[key]:
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"{key}: {value['error']}")
    return merged[key]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize(
    "resize, first, then, log, steps",
    [
        ("2->1", "B", "C1", "log-b1", (K2, K2 + (EPOCH - 2 * K2))),
        ("1->2", "D", "E", "log-d2", (K1, K1 + (EPOCH - K1) // 2)),
        ("2->2", "B", "C2", "log-b2", (K2, EPOCH // 2)),
    ],
)
def test_every_sample_once_across_a_resize(
    runs: tuple[Path, dict[str, list[Any]]], name: str, resize: str, first: str, then: str, log: str, steps: tuple
) -> None:
    root, merged = runs
    before, after = _ok(merged, f"{name}/{first}"), _ok(merged, f"{name}/{then}")
    assert (before[0]["start_step"] + before[0]["steps"], after[0]["start_step"] + after[0]["steps"]) == steps
    assert after[0]["ranks"] == int(resize[-1])
    tally = check_samples(root / name / log)
    assert tally.epoch_samples == EPOCH * BATCH
    assert tally.exactly_once, tally.line()
    assert tally.once == EPOCH * BATCH


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", PIPELINES)
def test_resize_back_to_the_same_world_is_bit_identical(runs: tuple[Path, dict[str, list[Any]]], name: str) -> None:
    _, merged = runs
    a, b, c = _ok(merged, f"{name}/A"), _ok(merged, f"{name}/B"), _ok(merged, f"{name}/C2")
    for rank in range(2):
        losses = b[rank]["losses"] + c[rank]["losses"]
        assert losses == a[rank]["losses"], f"{name} rank {rank}: {losses} vs {a[rank]['losses']}"
    assert c[0]["weights_sha256"] == a[0]["weights_sha256"]
    assert c[0]["optimizers_sha256"] == a[0]["optimizers_sha256"]
    assert b[0]["weights_sha256"] != a[0]["weights_sha256"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("which", ["b", "d"])
def test_dcp_reshards_tables_and_optimizer_state(
    runs: tuple[Path, dict[str, list[Any]]], name: str, which: str
) -> None:
    _, merged = runs
    on_one, on_two = (_whole(_ok(merged, f"{name}/full-{which}@{w}")) for w in (1, 2))
    assert on_one.keys() == on_two.keys()
    tables = [k for k in on_one if "embedding_bags" in k and k.endswith(".weight")]
    accumulators = [k for k in on_one if k.startswith("/fused_optimizer") and "momentum" in k]
    assert len(tables) == 4 and len(accumulators) == 4, sorted(on_one)
    for key in on_one:
        assert torch.equal(on_one[key], on_two[key]), f"{name} {which}: {key} differs between 1 and 2 ranks"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_what_every_rank_saved_is_the_same_where_a_resize_reads_rank_0s(
    runs: tuple[Path, dict[str, list[Any]]],
) -> None:
    _, merged = runs
    for name in PIPELINES:
        rank0, rank1 = (o["pipeline"] for o in _ok(merged, f"{name}/objects-b")[0])
        position = {"consumed": 2 * K2, "total": EPOCH, "order": rank0["loader"]["order"]}
        assert rank0["loader"] == rank1["loader"] == position
        assert rank0["engine"]["batch_number"] == rank1["engine"]["batch_number"]
        if name == "SemiSync":
            stashed = [r["pipeline"]["stashed_gradients"] for r in (rank0, rank1)]
            assert stashed[0].keys() == stashed[1].keys() and stashed[0]
            assert all(torch.equal(stashed[0][k], stashed[1][k]) for k in stashed[0]), "stashed gradients differ"
            assert rank0["pipeline"]["looked_up"], "a batch in flight had its embeddings looked up at the cut"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_per_rank_position_is_refused_on_another_world_size(runs: tuple[Path, dict[str, list[Any]]]) -> None:
    root, _ = runs
    ckpt = root / "SparseDist" / "b0"
    argv = [a if a != "global" else "map" for a in SMALL if a not in ("--epoch-batches", str(EPOCH))]
    done = subprocess.run(
        [sys.executable, "examples/dlrm/train.py", "--check", "--world-size", "1", *argv, "--steps", "12",
         "--checkpoint-dir", str(ckpt), "--resume"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert f"checkpoint {ckpt}/step-{K2:06d} was written on 2 ranks (1 node x 2 processes), this run has 1" in line
    assert "--data-source map keeps a data position per rank" in line
