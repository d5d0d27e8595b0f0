"""Part (a): the CUDA tests of the stream pool and of the engine on real streams (tests/gpu),
run by pytest in a subprocess; outcomes read back from its JUnit XML report.

On a CUDA machine every one of them must pass: a skip there proves nothing, so it fails the part.
"""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from benchmarks.gpu.env import ROOT

TEST_FILES = ("tests/gpu/test_stream_pool_cuda.py", "tests/gpu/test_engine_streams_cuda.py")
JUNIT_NAME = "streams.junit.xml"
LOG_NAME = "streams.log"


def parse_junit(text: str) -> list[dict[str, Any]]:
    """``[{name, outcome, seconds, message}]`` per test case of a pytest JUnit XML report."""
    tests = []
    for case in ET.fromstring(text).iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or "").splitlines()[0][:200] if found.get("message") else ""
                break
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        tests.append(
            {
                "name": f"{module}::{case.get('name')}" if module else str(case.get("name")),
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    return tests


def status_of(tests: list[dict[str, Any]]) -> str:
    """passed only if there were tests and every one passed (a skip on a CUDA machine fails)."""
    return "passed" if tests and all(t["outcome"] == "passed" for t in tests) else "failed"


def run(out: Path, timeout_s: float) -> dict[str, Any]:
    junit = out / JUNIT_NAME
    junit.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
        f"--junitxml={junit}", *TEST_FILES,
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        captured = (x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        output = "".join(captured) + f"\ntimed out after {timeout_s:.0f} s"
    (out / LOG_NAME).write_text(output)
    seconds = time.perf_counter() - start
    if not junit.exists():
        tail = output.strip().splitlines()[-1] if output.strip() else "no output"
        return {"status": "error", "seconds": seconds, "reason": f"pytest wrote no report: {tail}", "log": LOG_NAME}
    tests = parse_junit(junit.read_text())
    return {"status": status_of(tests), "seconds": seconds, "tests": tests, "junit": JUNIT_NAME, "log": LOG_NAME}
