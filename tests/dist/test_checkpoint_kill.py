"""``kill -9`` of one rank under torchx: the job restarts from the last complete checkpoint and ends
with the weights of an uninterrupted run; with no restarts left it ends with one clear line.

``make run`` (``examples/dlrm/launch.py``) launches the DLRM example on 2 CPU ranks through
``torchx run -s local_cwd dist.ddp`` with ``--retries 1`` (torchrun's ``--max-restarts``; torchx's
local scheduler does not retry), checkpoints every 4 steps and ``--resume``. This test finds rank
1's process among the job's (by its ``RANK=1`` environment) and sends it SIGKILL once the first
checkpoint is complete; torchrun stops rank 0, starts both again, and they resume from the
latest checkpoint. The final weights (SHA-256 over both ranks' shards) and the losses of the
resumed steps equal those of a run that was never killed. Then a job whose rank 1 is killed
again after its one restart ends with exactly one ``make run failed:`` line naming the rank,
the signal and the checkpoint to resume from, well within its time limit.

Needs the pipelines' ``state_dict()`` (the lead's contract); without it ``make run`` refuses
``--checkpoint-dir`` before starting, and these tests fail saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
STEPS = 16
SMALL = [
    "--batch-size", "32", "--num-sparse", "4", "--num-embeddings", "200", "--embedding-dim", "8",
    "--dense-arch", "16", "--over-arch", "16", "--optimizer", "adagrad", "--steps", str(STEPS),
]  # fmt: skip


class Job:
    """``launch.py ARGS`` running in the background; ``output`` collects what it prints."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "examples/dlrm/launch.py", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the job did not end within {timeout_s} s:\n{self.output[-4000:]}") from None
        self._reader.join(10)
        return code

    def rank_pid(self, rank: int) -> int | None:
        """The process of ``rank`` among the job's (the first, breadth-first: a rank's loader workers
        have its environment too)."""
        for pid in _descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"examples/dlrm/train.py" in cmdline and f"RANK={rank}".encode() in environ:
                return pid
        return None

    def kill_all(self) -> None:
        for pid in reversed(_descendants(self.proc.pid)):
            _kill(pid)
        self.proc.kill()


def _descendants(root: int) -> list[int]:
    """The processes under ``root``, breadth-first (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        for child in sorted(children.get(queue.pop(0), [])):
            found.append(child)
            queue.append(child)
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_for(what: str, condition: Callable[[], T | None], job: Job, timeout_s: float = 120.0) -> T:
    """Polls ``condition`` until it gives a value; fails (and ends the job) if the job ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := condition()) is not None:
            return value
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}:\n{job.output[-4000:]}")
        time.sleep(0.02)
    job.kill_all()
    raise AssertionError(f"no {what} within {timeout_s} s:\n{job.output[-4000:]}")


def _other(pid: int | None, old: int) -> int | None:
    return pid if pid != old else None


def _latest(directory: Path) -> str | None:
    try:
        return (directory / "latest").read_text().strip() or None
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_with_the_same_weights(tmp_path: Path) -> None:
    reference = Job([*SMALL, "--json", str(tmp_path / "reference.json")])
    assert reference.wait(150) == 0, reference.output[-4000:]
    expected = json.loads((tmp_path / "reference.json").read_text())

    directory = tmp_path / "ckpt"
    job = Job(
        [
            "--retries", "1", *SMALL, "--checkpoint-dir", str(directory), "--checkpoint-every", "4", "--resume",
            "--loader-latency-ms", "100", "--json", str(tmp_path / "killed.json"),
        ]
    )  # fmt: skip
    at_kill = _wait_for("first checkpoint", lambda: _latest(directory), job)
    victim = _wait_for("rank 1", lambda: job.rank_pid(1), job)
    _kill(victim)
    assert job.wait(150) == 0, job.output[-4000:]
    assert f"failed (exitcode: -9) local_rank: 1 (pid: {victim})" in job.output, job.output[-4000:]
    resumed = json.loads((tmp_path / "killed.json").read_text())
    start = resumed["start_step"]
    assert start >= int(at_kill.removeprefix("step-")), (at_kill, resumed)
    assert f"resuming from {directory}/step-{start:06d} (step {start})" in job.output
    assert resumed["steps"] == STEPS - start
    assert resumed["losses"] == expected["losses"][start:]
    assert resumed["weights_sha256"] == expected["weights_sha256"]
    assert resumed["optimizers_sha256"] == expected["optimizers_sha256"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_with_no_restarts_left_the_job_ends_with_one_line(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    job = Job(
        [
            "--retries", "1", *SMALL, "--checkpoint-dir", str(directory), "--checkpoint-every", "4", "--resume",
            "--loader-latency-ms", "100",
        ]
    )  # fmt: skip
    start = time.monotonic()
    _wait_for("first checkpoint", lambda: _latest(directory), job)
    first = _wait_for("rank 1", lambda: job.rank_pid(1), job)
    _kill(first)
    second = _wait_for("rank 1 restarted", lambda: _other(job.rank_pid(1), first), job)
    _kill(second)
    code = job.wait(120)
    assert code != 0
    failed = [line for line in job.lines if line.startswith("make run failed:")]
    checkpoint = directory / (_latest(directory) or "?")
    assert failed == [
        "make run failed: rank 1 was killed by signal 9 (SIGKILL) after 1 restart: no restarts were left "
        f"(--retries 1); the latest complete checkpoint is {checkpoint}: run again with --resume to continue from it\n"
    ], job.output[-4000:]
    assert time.monotonic() - start < 120
