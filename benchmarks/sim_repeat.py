"""How far ``benchmarks/sim_vs_real.py``'s judge repeats itself: two or more of its reports of the
same configurations, compared.

    python benchmarks/sim_repeat.py out/a/sim_vs_real.json out/b/sim_vs_real.json [more ...]

A prediction from the default's profile is judged against the measured step of a plan it did
not run. What it has to hit is that plan's step *relative to the default's* (the prediction
starts from the default's costs): ``measured(config) / measured(default)``. This script asks
whether that ratio repeats from one run of the benchmark to the next, on the same code and
machine - the bar no predictor can be judged beyond. Per configuration run in every report, and
per report:

* **prediction vs its run**: the report's own ``from_default`` error (what ``sim_vs_real`` counts);
* **run vs the other runs**: the report's ratio against the geometric mean of the other reports'
  ratios (leave one out), as an error: how far one run's measurement lands from the others';
* **prediction vs the other runs**: the report's prediction, as a ratio to its own default's
  measured step, against the same mean of the others': the prediction judged on measurements it
  did not share a machine state with.

Each is counted as ``sim_vs_real`` counts (within ``TOLERANCE``, over 15%, mean |error|, worst),
per number of ranks and over all. Writes ``OUT/sim_repeat.json`` and ``.md`` (default
``out/bench``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import run_meta, write_report
from benchmarks.sim_vs_real import TOLERANCE

#: an error beyond this is counted apart (``sim_vs_real``'s "none worse than" bar)
FAR = 0.15
#: the comparisons, in the report's order, and their titles
COMPARISONS = {
    "prediction_vs_own_run": "prediction vs its run",
    "run_vs_other_runs": "run vs the other runs",
    "prediction_vs_other_runs": "prediction vs the other runs",
}

Key = tuple[int, str, str]  # (ranks, pipeline, config)


def _by_key(report: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    return {(r["ranks"], r["pipeline"], r["config"]): r for r in report["rows"]}


def errors(reports: list[dict[str, Any]]) -> dict[str, dict[Key, list[float]]]:
    """Per comparison (``COMPARISONS``), per configuration other than ``default`` that every report
    ran and predicted, one error per report (in the reports' order)."""
    if len(reports) < 2:
        raise ValueError(f"comparing runs needs at least 2 reports, got {len(reports)}")
    tables = [_by_key(r) for r in reports]
    keys = [
        k
        for k in tables[0]
        if k[2] != "default"
        and all(k in t and "from_default_ms" in t[k] and (k[0], k[1], "default") in t for t in tables)
    ]
    if not keys:
        raise ValueError("the reports share no predicted configuration (same pipelines, ranks and configs?)")

    def ratio(t: dict[Key, dict[str, Any]], k: Key, field: str = "measured_ms") -> float:
        return t[k][field] / t[(k[0], k[1], "default")]["measured_ms"]

    out: dict[str, dict[Key, list[float]]] = {c: {} for c in COMPARISONS}
    for k in keys:
        for c in COMPARISONS:
            out[c][k] = []
        for i, t in enumerate(tables):
            others = [ratio(u, k) for j, u in enumerate(tables) if j != i]
            rest = math.exp(statistics.fmean(math.log(x) for x in others))
            out["prediction_vs_own_run"][k].append(t[k]["from_default_ms"] / t[k]["measured_ms"] - 1)
            out["run_vs_other_runs"][k].append(ratio(t, k) / rest - 1)
            out["prediction_vs_other_runs"][k].append(ratio(t, k, "from_default_ms") / rest - 1)
    return out


def counts(errs: list[float]) -> dict[str, Any]:
    """``errs`` counted: how many, within ``TOLERANCE``, over ``FAR``, mean |error|, worst (signed)."""
    return {
        "n": len(errs),
        "within": sum(abs(e) <= TOLERANCE for e in errs),
        "far": sum(abs(e) > FAR for e in errs),
        "mean_abs": statistics.fmean(abs(e) for e in errs),
        "worst": max(errs, key=abs),
    }


def summary(table: dict[str, dict[Key, list[float]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per comparison, per number of ranks (``"all"``, ``"1"``, ``"2"``...): ``counts`` over every
    configuration and report."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for c, by_key in table.items():
        ranks = sorted({k[0] for k in by_key}, reverse=True)
        groups = {"all": list(by_key), **{str(w): [k for k in by_key if k[0] == w] for w in ranks}}
        out[c] = {g: counts([e for k in ks for e in by_key[k]]) for g, ks in groups.items()}
    return out


def _markdown(table: dict[str, dict[Key, list[float]]], meta: dict[str, Any]) -> str:
    s = summary(table)
    lines = [
        "# How far sim_vs_real's judge repeats itself",
        "",
        f"{meta['date']}; `{meta['command']}`",
        "",
        "Reports: " + ", ".join(f"`{p}` ({d})" for p, d in zip(meta["reports"], meta["dates"], strict=True)) + ".",
        "",
        "Errors per configuration and report: a prediction from the default's profile against its own run's "
        "measured step (what `sim_vs_real` counts); one run's measured step relative to its default against the "
        "geometric mean of the other runs' (how far the measurement itself repeats); the prediction against the "
        "other runs' mean.",
        "",
        f"| comparison | ranks | within {100 * TOLERANCE:.0f}% | over {100 * FAR:.0f}% | mean error | worst |",
        "|---|---|---|---|---|---|",
    ]
    for c, title in COMPARISONS.items():
        for g, v in s[c].items():
            lines.append(
                f"| {title} | {g} | {v['within']}/{v['n']} ({100 * v['within'] / v['n']:.0f}%) | {v['far']} "
                f"| {100 * v['mean_abs']:.1f}% | {100 * v['worst']:+.1f}% |"
            )
    lines += [
        "",
        "| ranks | pipeline | config | " + " | ".join(COMPARISONS.values()) + " |",
        "|---|---|---|" + "---|" * len(COMPARISONS),
    ]
    for k in table["run_vs_other_runs"]:
        cells = [" ".join(f"{100 * e:+.0f}%" for e in table[c][k]) for c in COMPARISONS]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+", help="sim_vs_real.json of two or more runs")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if len(args.reports) < 2:
        parser.error("give at least 2 reports")
    reports = []
    for p in args.reports:
        try:
            reports.append(json.loads(p.read_text()))
        except (OSError, ValueError) as e:
            parser.error(f"cannot read {p}: {e}")
        if "rows" not in reports[-1]:
            parser.error(f"{p} is not a sim_vs_real report (no rows)")
    try:
        table = errors(reports)
    except ValueError as e:
        parser.error(str(e))
    meta = run_meta("sim_repeat.py", argv, args)
    meta.update(reports=[str(p) for p in args.reports], dates=[r.get("meta", {}).get("date", "?") for r in reports])
    data = {
        "meta": meta,
        "summary": summary(table),
        "rows": [
            {"ranks": k[0], "pipeline": k[1], "config": k[2], **{c: table[c][k] for c in table}}
            for k in table[next(iter(table))]
        ],
    }
    write_report(args.out, "sim_repeat", data, _markdown(table, meta))


if __name__ == "__main__":
    main()
