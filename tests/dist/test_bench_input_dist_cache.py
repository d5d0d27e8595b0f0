"""benchmarks/input_dist_cache.py runs (2 gloo ranks, a short run): every contender gave
upstream's outputs in every evaluation, the cached one reused every batch after the first
evaluation, and the table says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import input_dist_cache

pytestmark = [pytest.mark.multiprocess]


def test_the_benchmark_compares_equal_outputs_and_reports_the_reuse(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    input_dist_cache.main(["--batches", "3", "--evaluations", "2", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "input_dist_cache.json").read_text())
    for rank in found["ranks"]:
        assert rank["same_outputs"] is True
        assert [row["label"] for row in rank["rows"]] == list(input_dist_cache.KINDS)
        for kind, cache in rank["cache"].items():
            assert (cache["entries"], cache["hits"], cache["misses"]) == (3, 2 * 3, 3), kind
        assert rank["cache"]["ours, cached"]["carried"] == 9
        assert rank["cache"]["ours, cached, own agreement"]["carried"] == 0
    table = capsys.readouterr().out
    assert "| ours, cached |" in table and "same outputs as upstream in every evaluation: yes" in table
