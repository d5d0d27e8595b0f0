"""What the newer benchmark scripts share: the ``--pipeline`` option, the machine's load average,
and writing the results (``OUT/<stem>.json`` and ``OUT/<stem>.md``, the markdown printed)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import write_json


def load_average() -> str:
    """The machine's load average over 1, 5 and 15 minutes ("n/a" where the OS has none)."""
    with contextlib.suppress(OSError):
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "n/a"


def write_report(out: Path, stem: str, data: Any, markdown: str) -> None:
    """Write ``data`` as JSON and ``markdown`` next to it, print the markdown and where both went."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", data)
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out / f'{stem}.json'}, {out / f'{stem}.md'}")


def add_train_pipeline_arg(parser: argparse.ArgumentParser) -> None:
    """``--pipeline``: one of the train pipelines that do not compile (default SparseDist)."""
    from harness.dlrm import INFO

    parser.add_argument(
        "--pipeline",
        default="TrainPipelineSparseDist",
        choices=[n for n, i in INFO.items() if i.kind == "train" and not i.compiles],
        help="(default: %(default)s)",
    )


def run_meta(script: str, argv: list[str] | None, args: argparse.Namespace, *keys: str) -> dict[str, Any]:
    """When and how a benchmark ran: date, the command line, and the options named by ``keys``."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
        **{k: getattr(args, k) for k in keys},
    }
