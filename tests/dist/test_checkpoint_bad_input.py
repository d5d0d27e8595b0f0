"""Checkpoints that cannot be used are refused with one clear line, and nothing is overwritten.

One launch of 2 gloo ranks writes real checkpoints of the DLRM example (DCP, sharded tables,
Adagrad state) through ``examples/dlrm/checkpoint.py``, trained by a plain loop (no pipeline state
is needed here), and interrupts two saves on purpose:

* after DCP wrote every file, before rank 0 wrote the MANIFEST and renamed the directory into place
  (an exception that nothing in ``save`` catches leaves the disk as a kill at that moment would);
* inside DCP's write on rank 1 (a full disk): DCP stops the save on every rank.

Both leave ``latest`` on the previous complete checkpoint; the next save removes their leftovers.
Then, in this process, ``train.py --check`` (what ``make run`` runs before starting any process)
meets: another world size, sharding plan, model or data source; a torn file, a missing file, a
missing MANIFEST, a ``latest`` naming nothing; checkpoints without ``--resume``; a directory that
cannot be written. Each ends with one ``train.py: error:`` line naming the problem, and the checkpoint
directory is byte for byte what it was. Two of them also go through ``launch.py`` (nothing starts),
and the ranks' own check (``check_on_ranks``, for jobs launched without it) gives every rank the
same error.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.ranks import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--batch-size", "16", "--num-sparse", "4", "--num-embeddings", "100", "--embedding-dim", "8",
    "--dense-arch", "8", "--over-arch", "8", "--optimizer", "adagrad", "--steps", "10",
]  # fmt: skip


class _Killed(BaseException):
    """Stands for a kill: a BaseException, so that nothing in ``save`` handles it."""


def _write(rank: int, world_size: int, root: str) -> dict[str, str]:
    """Checkpoints 2 (complete), 4 (interrupted before its MANIFEST), 6 (interrupted in DCP's
    write), 8 (complete) into ``root/ckpt``; rank 0 copies the directory after 4 and after 6.
    Returns what ``check_on_ranks`` raised on this rank for a run of world size 3."""
    import torch.distributed.checkpoint as dcp

    from examples.dlrm import checkpoint, train
    from examples.dlrm.checkpoint import CheckpointError, TrainState
    from examples.dlrm.model import build_dlrm

    args = train.parse_args(SMALL)
    fingerprint = train.fingerprint(args, world_size)
    model, optimizer = build_dlrm(rank, world_size, args.size, optimizer=args.optimizer)
    state = TrainState(model, optimizer)
    dataset = train.dataset_for(args, rank, world_size)
    directory, copies = Path(root) / "ckpt", Path(root)

    def step(k: int) -> None:
        optimizer.zero_grad()
        loss, _ = model(dataset[k])
        loss.backward()
        optimizer.step()

    def save(k: int) -> None:
        checkpoint.save(directory, k, state, {"pipeline": {"trained": k}}, fingerprint)

    for k in range(2):
        step(k)
    save(2)
    for k in range(2, 4):
        step(k)
    write_manifest = checkpoint._write_manifest
    if rank == 0:

        def killed(*_: Any) -> None:
            raise _Killed

        checkpoint._write_manifest = killed  # type: ignore[assignment]
    try:
        save(4)
    except _Killed:
        pass
    finally:
        checkpoint._write_manifest = write_manifest
    if rank == 0:
        shutil.copytree(directory, copies / "interrupted-commit", symlinks=True)
    for k in range(4, 6):
        step(k)
    write_data = dcp.FileSystemWriter.write_data
    if rank == 1:

        def full_disk(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError(28, "No space left on device (simulated)")

        dcp.FileSystemWriter.write_data = full_disk  # type: ignore[method-assign]
    try:
        save(6)
    except CheckpointError as e:
        assert "rank 1: OSError: [Errno 28] No space left on device (simulated)" in str(e), e
    else:
        raise AssertionError("the save with a full disk on rank 1 did not fail")
    finally:
        dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    if rank == 0:
        shutil.copytree(directory, copies / "interrupted-write", symlinks=True)
    for k in range(6, 8):
        step(k)
    save(8)
    try:
        checkpoint.check_on_ranks(directory, {**fingerprint, "world_size": 3}, resume=True)
    except CheckpointError as e:
        return {"check_on_ranks": str(e)}
    return {"check_on_ranks": "no error"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("bad_input")
    return root, run_on_ranks(_write, str(root))


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its SHA-256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _check(argv: list[str]) -> tuple[int, str]:
    """``train.py --check ARGV`` in this process: its exit code and what it printed to stderr."""
    from examples.dlrm import train

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = train.main(["--check", *argv])
    return code, stderr.getvalue()


def _copy(written: tuple[Path, Any], name: str) -> Path:
    root, _ = written
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(root / "ckpt", target, symlinks=True)
    return target


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("copy", ["interrupted-commit", "interrupted-write"])
def test_an_interrupted_save_leaves_the_previous_checkpoint_the_latest(
    written: tuple[Path, Any], copy: str
) -> None:
    from examples.dlrm import checkpoint, train

    directory = written[0] / copy
    assert (directory / "latest").read_text() == "step-000002\n"
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == [{"interrupted-commit": ".tmp-step-000004", "interrupted-write": ".tmp-step-000006"}[copy]]
    assert not (directory / leftovers[0] / "MANIFEST").exists()
    if copy == "interrupted-commit":  # every rank's DCP file was written: only the rename was missing
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "MANIFEST"} - {
            p.name for p in (directory / leftovers[0]).iterdir()
        } == {"MANIFEST"}
    fingerprint = train.fingerprint(train.parse_args(SMALL), 2)
    found = checkpoint.check(directory, fingerprint, resume=True)
    assert found is not None and found[0].name == "step-000002" and found[1]["step"] == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_next_save_completes_and_removes_the_leftovers(written: tuple[Path, Any]) -> None:
    directory = written[0] / "ckpt"
    assert (directory / "latest").read_text() == "step-000008\n"
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-000002", "step-000008"]
    from examples.dlrm import checkpoint, train

    found = checkpoint.check(directory, train.fingerprint(train.parse_args(SMALL), 2), resume=True)
    assert found is not None and found[0].name == "step-000008"
    assert checkpoint.verify(directory / "step-000002")["step"] == 2


BAD_INPUT = {
    # name: (extra train.py arguments, how the copy is damaged, the message)
    "world size": (
        ["--world-size", "4"],
        None,
        "was written on 2 ranks, this run has 4: --data-source dataloader keeps a data position per rank",
    ),
    "plan": (
        ["--world-size", "2", "--sharding", "row_wise"],
        None,
        'from another plan: plan.t_cat_0 is "table_wise on rank 0" in the checkpoint, '
        '"row_wise on ranks 0,1" in this run',
    ),
    "model": (
        ["--embedding-dim", "16"],
        None,
        "from another model: model.embedding_dim is 8 in the checkpoint, 16 in this run",
    ),
    "optimizer": (["--optimizer", "sgd"], None, 'from another optimizer: optimizer is "adagrad" in the checkpoint'),
    # the position saved is a StatefulDataLoader's state; the map source's is an index
    "data source": (
        ["--data-source", "map"],
        None,
        'from another data: data.loader is "dataloader" in the checkpoint, "map" in this run',
    ),
    "torn file": ([], "truncate __1_0.distcp", "step-000008 is torn: __1_0.distcp has 1000 bytes, its manifest says"),
    "missing file": ([], "delete __0_0.distcp", "step-000008 is partial: __0_0.distcp is missing"),
    "no manifest": ([], "delete MANIFEST", "step-000008 is incomplete: it has no MANIFEST"),
    "latest names nothing": ([], "latest -> step-000099", "names {dir}/step-000099, which does not exist"),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", BAD_INPUT)
def test_a_bad_checkpoint_is_refused_with_one_line_and_left_as_it_was(written: tuple[Path, Any], case: str) -> None:
    extra, damage, message = BAD_INPUT[case]
    directory = _copy(written, f"case-{case.replace(' ', '-')}")
    step_dir = directory / "step-000008"
    if damage == "truncate __1_0.distcp":
        os.truncate(step_dir / "__1_0.distcp", 1000)
    elif damage is not None and damage.startswith("delete "):
        (step_dir / damage.removeprefix("delete ")).unlink()
    elif damage == "latest -> step-000099":
        (directory / "latest").write_text("step-000099\n")
    before = _snapshot(directory)
    code, err = _check(["--resume", "--checkpoint-dir", str(directory), *SMALL, *extra])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: --checkpoint-dir: "), err
    assert message.format(dir=directory) in lines[0], lines[0]
    assert _snapshot(directory) == before


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoints_are_not_replaced_without_resume(written: tuple[Path, Any]) -> None:
    directory = _copy(written, "no-resume")
    before = _snapshot(directory)
    code, err = _check(["--checkpoint-dir", str(directory), *SMALL])
    assert code == 2
    assert f"{directory} already holds checkpoints (latest: step-000008): pass --resume" in err
    assert _snapshot(directory) == before


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_ranks_own_check_gives_every_rank_the_same_error(written: tuple[Path, Any]) -> None:
    _, results = written
    messages = {result["check_on_ranks"] for result in results}
    assert len(messages) == 1 and "was written on 2 ranks, this run has 3: the caller did not say" in messages.pop()


def _launch(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "examples/dlrm/launch.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_make_run_finds_an_unwritable_directory_before_any_process_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = _launch(["--checkpoint-dir", str(blocker / "ckpt"), *SMALL])
    assert done.returncode == 2
    assert "$ torchx" not in done.stdout  # nothing was launched
    last = done.stderr.strip().splitlines()[-1]
    expected = f"checkpoint directory {blocker / 'ckpt'} is not writable: Not a directory"
    assert last == f"train.py: error: --checkpoint-dir: {expected}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_make_run_compares_the_world_size_of_its_nodes_and_processes(written: tuple[Path, Any]) -> None:
    directory = _copy(written, "launch-world-size")
    before = _snapshot(directory)
    done = _launch(
        ["--nnodes", "2", "--nproc-per-node", "2", "--resume", "--checkpoint-dir", str(directory), *SMALL]
    )
    assert done.returncode == 2 and "$ torchx" not in done.stdout
    assert "was written on 2 ranks, this run has 4: --data-source dataloader" in done.stderr.strip().splitlines()[-1]
    assert _snapshot(directory) == before
