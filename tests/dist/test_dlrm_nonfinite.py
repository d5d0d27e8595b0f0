"""The DLRM example's non-finite steps (``--on-nonfinite``, ``--poison-batch``, ``--drop-batch``) on 2 gloo ranks.

A run of ``S`` steps whose batch ``K`` is poisoned (NaN dense features) under ``--on-nonfinite
skip`` rolls that step back on every rank and ends with the weights (the ``weights:`` line, and the
optimizers' digest) and the losses of the steps it kept of the run of ``S - 1`` steps whose data
lacks batch ``K`` (``--drop-batch K``): on every rank's batch ``K``, and on rank 1's only
(``--poison-rank 1``, read through the map source with 2 loads and a lookahead: a batch is poisoned
by its index, whoever draws it when). The summary says which step was rolled back, and what was not
finite where; ``--on-nonfinite raise`` ends the run with one line (per rank) naming the batch, the
line ``make run`` ends with. The same with ``--grad-accum 3`` (GradientAccumulationWrapper, the
window in the plan): the poisoned batch opens a window, which closes as if it had never been seen.
Small sizes and ``S = 8`` steps: about 40 s on 2 cores, 30 s more for the accumulation. The
argument checks are in ``tests/unit/test_dlrm_nonfinite_args.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from examples.dlrm.launch import FailureReport
from tests.dist.test_torchx_dlrm import SMALL

pytestmark = [pytest.mark.multiprocess, pytest.mark.every_release]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "examples/dlrm/train.py"
S, K = 8, 3  # steps of the poisoned runs, the batch poisoned (and dropped)
#: Row-wise Adagrad on the tables and Adagrad on the MLPs: optimizer state that a rollback must restore too.
COMMON = ["--optimizer", "adagrad", *SMALL, "--device", "cpu"]


def _ranks(args: list[str], name: str, tmp: Path) -> tuple[dict[str, Any], str]:
    """``train.py ARGS`` on 2 gloo ranks (torch.distributed.run); rank 0's summary and the output."""
    summary = tmp / f"{name}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN]
    cmd += [*args, *COMMON, "--json", str(summary)]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{' '.join(cmd)}\n{output[-4000:]}"
    return json.loads(summary.read_text()), output


@cache
def _runs(tmp: Path) -> dict[str, tuple[dict[str, Any], str]]:
    poison = ["--steps", str(S), "--poison-batch", str(K), "--on-nonfinite", "skip"]
    mapped = ["--data-source", "map", "--loads", "2", "--lookahead", "2"]
    return {
        "dropped": _ranks(["--steps", str(S - 1), "--drop-batch", str(K)], "dropped", tmp),
        "poisoned": _ranks(poison, "poisoned", tmp),
        "rank 1": _ranks([*poison, "--poison-rank", "1", *mapped], "rank1", tmp),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    return _runs(tmp_path_factory.mktemp("dlrm_nonfinite"))


def _weights_line(output: str) -> str:
    (line,) = [x.strip() for x in output.splitlines() if x.strip().startswith("weights: sha256 ")]
    return line


@pytest.mark.parametrize("run", ["poisoned", "rank 1"])
def test_a_rolled_back_step_trains_what_the_data_without_its_batch_trains(
    runs: dict[str, tuple[dict[str, Any], str]], run: str
) -> None:
    (summary, output), (reference, reference_output) = runs[run], runs["dropped"]
    assert _weights_line(output) == _weights_line(reference_output)
    assert summary["weights_sha256"] == reference["weights_sha256"]
    assert summary["optimizers_sha256"] == reference["optimizers_sha256"]
    # --steps counts the batches drawn; the losses are those of the steps kept, the reference's
    assert (summary["steps"], reference["steps"]) == (S, S - 1)
    assert summary["losses"] == reference["losses"] and summary["rolled_back"] == 1
    assert reference["skipped"] == [] and reference["on_nonfinite"] == "off"


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], str]]:
    tmp = tmp_path_factory.mktemp("dlrm_nonfinite_accumulated")
    window = ["--grad-accum", "3"]  # calls 0 (warm-up), 1-2, 3-5, 6-8: batch K = 3 opens a window
    poison = ["--steps", str(S), "--poison-batch", str(K), "--on-nonfinite", "skip", *window]
    return {
        "dropped": _ranks(["--steps", str(S - 1), "--drop-batch", str(K), *window], "accumulated_dropped", tmp),
        "poisoned": _ranks(poison, "accumulated_poisoned", tmp),
    }


def test_a_rolled_back_micro_batch_leaves_its_window_as_the_data_without_it(
    accumulated: dict[str, tuple[dict[str, Any], str]], runs: dict[str, tuple[dict[str, Any], str]]
) -> None:
    (summary, output), (reference, reference_output) = accumulated["poisoned"], accumulated["dropped"]
    assert "one optimizer step every 3 batches (ours GradientAccumulationWrapper, the window in the plan)" in output
    assert _weights_line(output) == _weights_line(reference_output)
    assert (summary["optimizers_sha256"], summary["grad_accum"]) == (reference["optimizers_sha256"], 3)
    assert summary["losses"] == reference["losses"] and summary["rolled_back"] == 1
    # and the windows changed the training: not the run without accumulation
    assert summary["weights_sha256"] != runs["poisoned"][0]["weights_sha256"]


def test_the_summary_says_which_step_was_rolled_back_and_what_was_not_finite_where(
    runs: dict[str, tuple[dict[str, Any], str]],
) -> None:
    summary, output = runs["poisoned"]
    (step,) = summary["skipped"]
    assert (step["batch"], step["serial"]) == (K, K)
    assert all("the losses" in what for what in step["not_finite"]), step
    assert re.search(rf"^  skipped: 1 step rolled back on every rank \(batch {K}: the losses, ", output, re.M), output
    assert re.search(rf"^rolled back: TrainPipelineSparseDist: batch {K} of the epoch", output, re.M), output
    # rank 1's batch only: every rank rolls the step back; rank 0's loss was finite
    summary, output = runs["rank 1"]
    (step,) = summary["skipped"]
    assert step["batch"] == K
    assert "the losses" not in step["not_finite"][0] and "the losses" in step["not_finite"][1], step
    assert f"skipped: 1 step rolled back on every rank (batch {K}: rank 0: " in output
    assert "rank 1's batch 3 poisoned (NaN dense features)" in output


def test_raise_ends_the_run_with_one_line_naming_the_batch() -> None:
    # the ranks straight from torch.distributed.run (torchx adds 10 s here); the line make run ends
    # with is the one launch.py's FailureReport reads from their output (through torchx: a rank's
    # error line in tests/dist/test_launch_nodes.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN]
    cmd += ["--steps", str(S), "--poison-batch", str(K), "--on-nonfinite", "raise", *COMMON]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: rank")]
    # one line per rank that got to print it (torchrun stops the others once a rank has exited)
    assert 1 <= len(errors) <= 2, output[-3000:]
    for line in errors:
        assert re.fullmatch(
            rf"error: rank [01]: NonFiniteStep: batch {K} of the epoch \(drawn #{K}\) rolled back on every rank: "
            r"not finite: the losses, .*",
            line,
        ), line
    assert 'examples/dlrm/train.py", line' not in output  # no traceback of the example's
    report = FailureReport()
    for line in output.splitlines():
        report.feed(line)
    assert report.line(done.returncode, 0, None) in errors
