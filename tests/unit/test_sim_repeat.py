"""``benchmarks/sim_repeat.py``: how far ``sim_vs_real``'s measured ratios repeat between runs,
beside the predictions' errors, worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.sim_repeat import counts, errors, main, summary


def report(default_ms: float, configs: dict[str, tuple[float, float]], ranks: int = 2) -> dict[str, Any]:
    """A sim_vs_real report of one pipeline: ``configs`` maps a config to (measured, predicted) ms."""
    rows = [{"ranks": ranks, "pipeline": "P", "config": "default", "measured_ms": default_ms}]
    for c, (measured, predicted) in configs.items():
        rows.append(
            {"ranks": ranks, "pipeline": "P", "config": c, "measured_ms": measured, "from_default_ms": predicted}
        )
    return {"meta": {"date": "d"}, "rows": rows}


def test_two_runs_each_judged_against_the_other_relative_to_its_own_default() -> None:
    a = report(10.0, {"io": (8.0, 8.8)})
    b = report(20.0, {"io": (18.0, 16.0)})  # a slower machine state: only the ratio to default counts
    got = errors([a, b])
    key = (2, "P", "io")
    assert got["prediction_vs_own_run"][key] == pytest.approx([8.8 / 8 - 1, 16 / 18 - 1])
    assert got["run_vs_other_runs"][key] == pytest.approx([0.8 / 0.9 - 1, 0.9 / 0.8 - 1])
    assert got["prediction_vs_other_runs"][key] == pytest.approx([0.88 / 0.9 - 1, 0.8 / 0.8 - 1])


def test_with_three_runs_the_others_are_their_geometric_mean() -> None:
    runs = [report(10.0, {"io": (m, 10.0)}) for m in (8.0, 9.0, 12.0)]
    got = errors(runs)["run_vs_other_runs"][(2, "P", "io")]
    assert got == pytest.approx(
        [0.8 / math.sqrt(0.9 * 1.2) - 1, 0.9 / math.sqrt(0.8 * 1.2) - 1, 1.2 / math.sqrt(0.8 * 0.9) - 1]
    )


def test_identical_runs_repeat_exactly_and_a_config_missing_from_one_is_left_out() -> None:
    a = report(10.0, {"io": (8.0, 8.0), "2loads": (6.0, 7.0)})
    b = report(10.0, {"io": (8.0, 8.0)})
    got = errors([a, b])
    assert list(got["run_vs_other_runs"]) == [(2, "P", "io")]
    assert got["run_vs_other_runs"][(2, "P", "io")] == [0.0, 0.0]


def test_counts_and_their_groups_by_ranks() -> None:
    assert counts([0.05, -0.12, 0.2, -0.1]) == {
        "n": 4,
        "within": 2,
        "far": 1,
        "mean_abs": pytest.approx(0.1175),
        "worst": 0.2,
    }
    a = {"rows": report(10.0, {"io": (8.0, 8.0)})["rows"] + report(10.0, {"io": (5.0, 6.0)}, ranks=1)["rows"]}
    b = {"rows": report(10.0, {"io": (8.0, 8.0)})["rows"] + report(10.0, {"io": (6.0, 6.0)}, ranks=1)["rows"]}
    s = summary(errors([a, b]))
    assert s["run_vs_other_runs"]["2"]["within"] == 2
    assert s["run_vs_other_runs"]["1"] == {
        "n": 2,
        "within": 0,
        "far": 2,
        "mean_abs": pytest.approx((1 / 6 + 0.2) / 2),
        "worst": pytest.approx(0.2),
    }
    assert s["run_vs_other_runs"]["all"]["n"] == 4


def test_one_report_or_nothing_in_common_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        errors([report(10.0, {"io": (8.0, 8.0)})])
    with pytest.raises(ValueError, match="share no predicted configuration"):
        errors([report(10.0, {"io": (8.0, 8.0)}), report(10.0, {"2loads": (8.0, 8.0)})])


def test_the_command_writes_both_reports_and_refuses_a_file_that_is_not_one(tmp_path: Path, capsys: Any) -> None:
    paths = []
    for i, m in enumerate((8.0, 9.0)):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(report(10.0, {"io": (m, 8.5)})))
        paths.append(str(p))
    main([*paths, "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "sim_repeat.json").read_text())
    assert data["rows"][0]["run_vs_other_runs"] == pytest.approx([0.8 / 0.9 - 1, 0.9 / 0.8 - 1])
    assert "| run vs the other runs | all | 0/2 (0%) | 0 |" in (tmp_path / "out" / "sim_repeat.md").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        main([paths[0], str(bad), "--out", str(tmp_path / "out2")])
    assert "not a sim_vs_real report" in capsys.readouterr().err
