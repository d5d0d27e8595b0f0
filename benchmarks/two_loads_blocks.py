"""Whether two parallel loads on one rank run at one speed: the blocks of one configuration,
alone and among the others, in two or more recordings.

    python benchmarks/two_loads_blocks.py                       # TrainPipelineBase, 2 recordings
    python benchmarks/two_loads_blocks.py --pipeline TrainPipelineSparseDist --recordings 3

``benchmarks/sim_vs_real.py`` found the step of its ``2loads`` configuration on 1 rank falling
in two levels from block to block (recording 12, TrainPipelineBase: 7.6-8.3 and 11.9-13.8 ms),
the largest spread between its recordings (``notebook/2026-11-sim-vs-real.md``). This script
runs that configuration the way ``sim_vs_real`` does (its runner, its data: a map-style dataset
waiting ``--latency-ms`` per item; ``benchmarks.profiled.profile_blocks``: a warm-up, then
``--rounds`` rounds of one block of ``--block`` consecutive steps per configuration, the first
third untimed), in two settings per recording:

* **alone**: the ``2loads`` runner is the only pipeline in the rank;
* **among others**: every configuration of the pipeline (``sim_vs_real.configs_of``) is built
  in the rank and their blocks interleave, as in ``sim_vs_real``.

Each recording is a fresh rank process; the settings alternate their order between recordings.
Reported per setting and recording: the ``2loads`` block means (ms, in the order they ran),
their median, the largest over the smallest, whether they fall in two levels (a gap of more than
``LEVEL_GAP`` between neighbours when sorted), and whether the recordings' block medians agree
within ``AGREE`` (the bar of issue 49). Writes ``OUT/two_loads_blocks.json`` and ``.md``
(default ``out/bench``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rank_setup, run_ranks
from benchmarks.report import run_meta, write_report

#: two recordings agree when their block medians differ by at most this fraction
AGREE = 0.10
#: sorted block means with a step of more than this fraction between neighbours fall in two levels
LEVEL_GAP = 0.25
SETTINGS = ("alone", "among others")


def _recording(rank: int, world_size: int, args: argparse.Namespace, order: tuple[str, ...]) -> dict[str, list[float]]:
    """In the rank: each setting's ``2loads`` block means (s), the settings in ``order``."""
    rank_setup()
    from benchmarks.profiled import profile_blocks
    from benchmarks.sim_vs_real import _runner, configs_of

    total = args.warmup + args.rounds * args.block + 8
    out: dict[str, list[float]] = {}
    for setting in order:
        configs = ["2loads"] if setting == "alone" else configs_of(args.pipeline)
        built = [_runner(args.pipeline, c, rank, world_size, "small", total, args.latency_ms / 1000) for c in configs]
        runners, data = [b[0] for b in built], [b[1] for b in built]
        try:
            runs = profile_blocks(
                configs,
                runners,
                data,
                warmup=args.warmup,
                rounds=args.rounds,
                block=args.block,
                skip=args.block // 3,
                where=lambda r: {"rank": rank, "world_size": world_size},
            )
        finally:
            for r in runners:
                r.close()
        out[setting] = runs[configs.index("2loads")].block_means()
    return out


def levels(blocks_ms: list[float]) -> bool:
    """Whether the block means fall in two levels: a gap of more than ``LEVEL_GAP`` between
    neighbours when sorted."""
    ordered = sorted(blocks_ms)
    return any(b > a * (1 + LEVEL_GAP) for a, b in zip(ordered, ordered[1:]))


def summarize(recordings: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per setting: every recording's block means (ms), medians, spread, levels; and whether the
    recordings' medians agree within ``AGREE``."""
    out: dict[str, Any] = {}
    for setting in SETTINGS:
        rows = []
        for k, rec in enumerate(recordings):
            blocks = [1e3 * b for b in rec[setting]]
            rows.append(
                {
                    "recording": k + 1,
                    "blocks_ms": blocks,
                    "median_ms": statistics.median(blocks),
                    "max_over_min": max(blocks) / min(blocks),
                    "two_levels": levels(blocks),
                }
            )
        medians = [r["median_ms"] for r in rows]
        out[setting] = {
            "recordings": rows,
            "medians_max_over_min": max(medians) / min(medians),
            "agree": max(medians) / min(medians) <= 1 + AGREE,
        }
    return out


def markdown(summary: dict[str, Any], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    lines = [
        f"# Two parallel loads on 1 rank: {args.pipeline}, blocks of {args.block} steps, {args.rounds} rounds, "
        f"a loader waiting {args.latency_ms:g} ms",
        "",
        f"{meta['date']}: `{meta['command']}`",
        "",
        "| setting | recording | block means ms (in the order run) | median ms | largest / smallest | two levels |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        for r in summary[setting]["recordings"]:
            blocks = " ".join(f"{b:.1f}" for b in r["blocks_ms"])
            lines.append(
                f"| {setting} | {r['recording']} | {blocks} | {r['median_ms']:.2f} | {r['max_over_min']:.2f} | "
                f"{'yes' if r['two_levels'] else 'no'} |"
            )
    lines.append("")
    for setting in SETTINGS:
        s = summary[setting]
        said = "agree" if s["agree"] else "do not agree"
        lines.append(
            f"- {setting}: the recordings' block medians {said} within {AGREE:.0%} "
            f"(largest / smallest {s['medians_max_over_min']:.3f})"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="TrainPipelineBase", help="(default: %(default)s)")
    parser.add_argument("--recordings", type=int, default=2, help="fresh rank processes (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=8, help="blocks per configuration (default: %(default)s)")
    parser.add_argument("--block", type=int, default=60, help="consecutive steps per block (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="loader latency (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="(default: %(default)s)")
    args = parser.parse_args(argv)
    from benchmarks.sim_vs_real import configs_of

    if "2loads" not in configs_of(args.pipeline):
        parser.error(f"--pipeline {args.pipeline}: its draw does not split, so it has no parallel loads")
    if min(args.recordings, args.rounds, args.block) < 2 or args.block < 6:
        parser.error("--recordings and --rounds must be >= 2, --block >= 6")
    recordings = []
    for k in range(args.recordings):
        order = SETTINGS if k % 2 == 0 else SETTINGS[::-1]
        print(f"[two_loads_blocks] recording {k + 1}/{args.recordings} ({', then '.join(order)})", flush=True)
        recordings.append(run_ranks(_recording, args, order, world_size=1))
    summary = summarize(recordings)
    meta = run_meta("two_loads_blocks.py", argv, args, "pipeline", "recordings", "rounds", "block", "latency_ms")
    write_report(args.out, "two_loads_blocks", {"meta": meta, **summary}, markdown(summary, args, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
