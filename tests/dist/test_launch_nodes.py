"""``make run`` on 2 nodes x 2 processes through torchx, and the checks before any launch.

``launch.py --nnodes 2 --nproc-per-node 2`` runs ``torchx run -s local_cwd dist.ddp -j 2x2``: two
torchrun agents (the "nodes", here both on this machine) meet through the c10d rendezvous on the
first node's port, as they do across machines, and start 2 gloo ranks each. Rank 0's first line
says how many ranks there are, as nodes x processes; the 4 ranks train the DLRM example.

A CUDA device that is not there, and parallel loads asked of the StatefulDataLoader, stop
``make run`` before torchx starts; a bad line of a Criteo TSV file, met by a parallel load of the
map source inside one rank, ends it with one line naming the file and line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--batch-size", "16", "--num-sparse", "4", "--num-embeddings", "100", "--embedding-dim", "8",
    "--dense-arch", "8", "--over-arch", "8", "--steps", "3",
]  # fmt: skip


def _launch(argv: list[str], timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """``launch.py ARGV``; past ``timeout_s`` its whole process group (torchx, torchrun, ranks) is killed."""
    with subprocess.Popen(
        [sys.executable, "examples/dlrm/launch.py", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"launch.py {' '.join(argv)} did not end within {timeout_s} s:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_of_two_processes_train_as_four_ranks(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    done = _launch(
        ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-port", str(_free_port()), *SMALL, "--json", str(summary)]
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " dist.ddp -j 2x2 " in done.stdout
    # rank 0's lines carry torchx's prefix of its node and local rank: its first one is the header
    header = next(line for line in done.stdout.splitlines() if " ranks (" in line)
    prefix = re.match(r"^\S+/\d+ \[\d+\]:", header)
    assert prefix is not None, header
    first = next(line for line in done.stdout.splitlines() if line.startswith(prefix.group(0)))
    assert first == header
    assert "ours TrainPipelineSparseDist (train) on 4 ranks (2 nodes x 2 processes; gloo, cpu)" in header
    result = json.loads(summary.read_text())
    assert (result["ranks"], result["topology"], result["steps"]) == (4, "2 nodes x 2 processes", 3)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_stops_before_anything_starts() -> None:
    done = _launch(["--device", "cuda", *SMALL], timeout_s=60)
    assert done.returncode == 2 and "$ torchx" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: --device cuda: torch sees no CUDA device here"), last


def test_launch_options_are_checked_first() -> None:
    from examples.dlrm.launch import main

    assert main(["--nnodes", "0"]) == 2
    assert main(["--retries", "-1"]) == 2


@pytest.mark.slow
def test_parallel_loads_from_the_dataloader_stop_before_anything_starts() -> None:
    done = _launch(["--loads", "2", *SMALL], timeout_s=60)
    assert done.returncode == 2 and "$ torchx" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: --loads 2: a StatefulDataLoader's iterator loads a whole batch"), last
    assert last.endswith("use --data-source map"), last


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_bad_criteo_line_read_by_parallel_loads_ends_make_run_with_one_line(tmp_path: Path) -> None:
    from examples.dlrm.data import write_sample_tsv

    data = tmp_path / "day_0.tsv"
    write_sample_tsv(data, lines=2 * 16 * 3)  # 3 rounds of 2 ranks x 16 lines
    lines = data.read_text().splitlines(keepends=True)
    lines[84] = "1\t2\t3\n"  # line 85: rank 1's share of the last round (lines 81-96)
    data.write_text("".join(lines))
    done = _launch([*SMALL, "--criteo-tsv", str(data), "--data-source", "map", "--loads", "2"])
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"make run failed: error: rank 1: ValueError: {data}:85: 3 tab-separated fields; a Criteo TSV line has "
        "40 (label, 13 integers, 26 hex ids)"
    ), last
