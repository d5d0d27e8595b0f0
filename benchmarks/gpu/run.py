"""Runs gpu-check's parts in ``.venv-gpu`` (``benchmarks/gpu_check.py`` starts it there).

    python -m benchmarks.gpu.run --parts abcd --out out/gpu_check --stack STACK.json --deadline EPOCH_S

Parts run in order, each in its own time limit (never past ``--deadline``); a part that needs
TorchRec is skipped when the stack is not usable, a part that would start too close to the
deadline is skipped too. After each part ``results.json`` and ``summary.md`` are rewritten and a
one-line summary is printed; at the end the markdown summary and the verdict. Exit status 1 if a
part failed or raised.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu import report
from benchmarks.gpu.env import NEEDS_TORCHREC, PARTS, parse_parts

PART_LIMIT_S = {"a": 120.0, "b": 360.0, "c": 240.0, "d": 150.0}
"""The most each part may take, in seconds (less where the deadline is nearer)."""

MIN_START_S = {"a": 20.0, "b": 60.0, "c": 60.0, "d": 45.0}
"""A part starts only with at least this much time left before the deadline."""


def _meta(command: list[str]) -> dict[str, Any]:
    import torch

    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": f"{platform.machine()}, {platform.node()}",
        "command": " ".join(command),
    }


def run_part(letter: str, out: Path, timeout_s: float) -> dict[str, Any]:
    """One part, its exceptions turned into an ``error`` result."""
    start = time.perf_counter()
    try:
        match letter:
            case "a":
                from benchmarks.gpu import streams

                return streams.run(out, timeout_s)
            case "b":
                from benchmarks.gpu import parity

                return parity.run(out, timeout_s)
            case "c":
                from benchmarks.gpu import bench

                return bench.run(out, timeout_s)
            case "d":
                from benchmarks.gpu import trace

                return trace.run(out, timeout_s)
            case _:
                raise ValueError(f"unknown part {letter!r}")
    except Exception as e:  # noqa: BLE001  (reported as this part's result)
        (out / f"part_{letter}.error.txt").write_text(traceback.format_exc())
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"status": "error", "seconds": time.perf_counter() - start, "reason": last[:300]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=parse_parts, default="".join(PARTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stack", type=Path, required=True, help="the stack status JSON written by gpu_check.py")
    parser.add_argument("--deadline", type=float, required=True, help="time.time() by which every part must be done")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stack = json.loads(args.stack.read_text())
    doc: dict[str, Any] = {"meta": _meta(sys.argv if argv is None else argv), "stack": stack, "parts": {}}
    for letter in args.parts:
        left = args.deadline - time.time()
        if letter in NEEDS_TORCHREC and not stack["ok"]:
            result = report.skipped(f"TorchRec's CUDA stack is not usable: {stack.get('error') or 'unknown'}")
        elif left < MIN_START_S[letter]:
            result = report.skipped(f"{left:.0f} s left of the time budget, {MIN_START_S[letter]:.0f} s needed")
        else:
            result = run_part(letter, args.out, min(PART_LIMIT_S[letter], left))
        doc["parts"][letter] = result
        report.write(doc, args.out)
        print(report.part_line(letter, result), flush=True)
    json_path, md_path = report.write(doc, args.out)
    print()
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    print(report.verdict(doc), flush=True)
    return report.exit_code(doc)


if __name__ == "__main__":
    sys.exit(main())
