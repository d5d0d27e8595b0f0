"""benchmarks/tuning_cost.py runs (2 gloo ranks, a short run): every contender trains the same
losses in every round, the table has a row per contender with its walls, and the tuner's first
line says it searches in the background (or, told the job's length, that it does not tune)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tuning_cost

pytestmark = [pytest.mark.multiprocess]


def test_the_benchmark_runs_every_contender_fresh_with_the_same_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tuning_cost.main(["--steps", "6", "--rounds", "2", "--latency-ms", "1", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "tuning_cost.json").read_text())
    assert found["same_losses"] is True
    assert list(found["rows"]) == list(tuning_cost.CONTENDERS)
    for row in found["rows"].values():
        assert len(row["walls_s"]) == 2 and all(w > 0 for w in row["walls_s"])
    (first, *_) = found["rows"]["ours+autotune"]["lines"]
    assert "searches in a process of its own" in first, first
    (said,) = found["rows"]["ours+autotune+len"]["lines"]  # 6 steps: fewer than a tuning takes
    assert "keeps the plan, untuned: the job's 6 steps (Autotune.job_steps)" in said, said
    table = capsys.readouterr().out
    assert "Same losses at every step in every run: yes" in table and "| ours+autotune |" in table


def test_an_unknown_contender_is_refused_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tuning_cost.main(["--contenders", "ours,theirs"])
    assert "unknown contenders theirs" in capsys.readouterr().err
