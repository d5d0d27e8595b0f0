"""benchmarks/two_loads_blocks.py runs (1 rank, a short run): every recording has one block mean
per round in each setting, and the summary's levels and agreement follow from the block means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import two_loads_blocks
from benchmarks.two_loads_blocks import levels, summarize

pytestmark = [pytest.mark.multiprocess]


def test_the_benchmark_records_the_blocks_alone_and_among_others(tmp_path: Path) -> None:
    args = ["--rounds", "2", "--block", "6", "--warmup", "2", "--latency-ms", "1", "--out", str(tmp_path)]
    two_loads_blocks.main(args)
    found = json.loads((tmp_path / "two_loads_blocks.json").read_text())
    for setting in two_loads_blocks.SETTINGS:
        rows = found[setting]["recordings"]
        assert [r["recording"] for r in rows] == [1, 2]
        assert all(len(r["blocks_ms"]) == 2 and min(r["blocks_ms"]) > 0 for r in rows), rows
    text = (tmp_path / "two_loads_blocks.md").read_text()
    assert "| alone | 1 |" in text and "| among others | 2 |" in text


def test_levels_and_agreement_come_from_the_block_means() -> None:
    assert levels([7.6, 8.3, 11.9, 13.8]) and not levels([5.1, 5.2, 5.7, 6.2])
    one, other = {"alone": [0.005, 0.0052], "among others": [0.008, 0.012]}, {
        "alone": [0.0054, 0.0056],
        "among others": [0.0079, 0.0081],
    }
    summary = summarize([one, other])
    assert summary["alone"]["agree"] and summary["alone"]["medians_max_over_min"] == pytest.approx(5.5 / 5.1)
    assert not summary["among others"]["agree"]  # medians 10.0 and 8.0 ms
    assert summary["among others"]["recordings"][0]["two_levels"]


def test_a_pipeline_without_parallel_loads_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        two_loads_blocks.main(["--pipeline", "StagedTrainPipeline"])
    assert "its draw does not split" in capsys.readouterr().err
