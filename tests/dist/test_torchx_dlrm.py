"""The DLRM example launched through torchx on 2 CPU ranks, as the README launches it, for a few steps.

* ``dist.ddp`` with the script (the README's command): ours and upstream's TrainPipelineSparseDist
  on the same synthetic data end with the same losses (the summaries of rank 0 are equal), ours
  loading in the training process, upstream through 2 StatefulDataLoader workers (the same batches);
* the example's own component (``examples/dlrm/component.py:dlrm``) with the loader on its own
  thread, reading a small Criteo TSV file written by the test.

torchx runs ``torchrun`` found on PATH: the venv's bin (this interpreter's) goes first.
The Criteo reader itself is also tested in-process (single process, fast).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.dlrm.data import NUM_DENSE, NUM_SPARSE, CriteoTsv

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--batch-size",
    "32",
    "--num-embeddings",
    "200",
    "--embedding-dim",
    "8",
    "--dense-arch",
    "16",
    "--over-arch",
    "16",
]
STEPS = 6


def _torchx(args: list[str], tmp_path: Path) -> dict[str, Any]:
    """Run ``torchx run -s local_cwd ARGS`` from the repository root; return rank 0's summary."""
    summary = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [str(bin_dir / "torchx"), "run", "-s", "local_cwd", *args, "--json", str(summary)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"torchx failed ({done.returncode}):\n{' '.join(cmd)}\n{output[-4000:]}"
    assert "Job finished: SUCCEEDED" in output, output[-4000:]
    return json.loads(summary.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dist_ddp_runs_ours_and_upstream_with_equal_losses(tmp_path: Path) -> None:
    base = ["dist.ddp", "-j", "1x2", "--script", "examples/dlrm/train.py", "--", "--steps", str(STEPS), *SMALL]
    ours = _torchx([*base, "--impl", "ours"], tmp_path)
    upstream = _torchx([*base, "--impl", "upstream", "--num-workers", "2"], tmp_path)
    for summary in (ours, upstream):
        assert summary["ranks"] == 2 and summary["steps"] == STEPS, summary
        assert 0.0 < summary["loss_last"] < 2.0, summary
    assert (ours["num_workers"], upstream["num_workers"]) == (0, 2)
    assert ours["losses"] == upstream["losses"]
    assert ours["weights_sha256"] == upstream["weights_sha256"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_component_with_loader_thread_on_criteo_tsv(tmp_path: Path) -> None:
    data = tmp_path / "day_0.tsv"
    _write_criteo(data, lines=2 * 32 * STEPS + 5)  # the 5 extra lines make an incomplete round
    summary = _torchx(
        [
            "examples/dlrm/component.py:dlrm",
            "--steps",
            str(STEPS + 10),  # more than the file holds: the data ends first
            "--thread_map",
            "io",
            "--loader_latency_ms",
            "2",
            "--",
            *SMALL,
            "--criteo-tsv",
            str(data),
        ],
        tmp_path,
    )
    assert summary["data"] == "criteo-tsv" and summary["thread_map"] == "io"
    assert summary["steps"] == STEPS, summary


# ----------------------------------------------------------------------------- in-process
def _write_criteo(path: Path, lines: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(lines):
        dense = [str(rng.randint(-2, 500)) if rng.random() > 0.1 else "" for _ in range(NUM_DENSE)]
        sparse = [f"{rng.getrandbits(32):08x}" if rng.random() > 0.1 else "" for _ in range(NUM_SPARSE)]
        rows.append("\t".join([str(rng.randint(0, 1)), *dense, *sparse]))
    path.write_text("\n".join(rows) + "\n")


def test_criteo_tsv_reader_shares_rounds_between_ranks(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    _write_criteo(path, lines=4 * 10 + 7)
    per_rank = [list(CriteoTsv([path], batch_size=4, num_embeddings=100, rank=r, world_size=2)) for r in range(2)]
    assert [len(b) for b in per_rank] == [5, 5]  # 47 lines: 5 rounds of 2 x 4, the last 7 dropped
    fields = path.read_text().splitlines()[4].split("\t")  # rank 1's first example
    batch = per_rank[1][0]
    assert batch.labels[0].item() == int(fields[0])
    expected_dense = [torch.log1p(torch.tensor(float(max(int(x), 0)))).item() if x else 0.0 for x in fields[1:14]]
    assert torch.allclose(batch.dense_features[0], torch.tensor(expected_dense))
    first = batch.sparse_features["cat_0"]
    assert first.lengths()[0].item() == (1 if fields[14] else 0)
    if fields[14]:
        assert first.values()[0].item() == int(fields[14], 16) % 100


def test_criteo_tsv_reader_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.tsv"
    _write_criteo(path, lines=3)
    path.write_text(path.read_text() + "1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:4: 3 tab-separated fields"):
        list(CriteoTsv([path], batch_size=4, num_embeddings=100))
