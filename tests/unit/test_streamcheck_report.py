"""Checked mode (``SWP_STREAM_CHECK=1``) says what it found by itself, on stderr: the first
finding when it happens (once), and one line at exit. Each program runs in a fresh process, as a
user's script would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What the engine does with SWP_STREAM_CHECK=1 on the CPU: a checked pool on the process's checker;
# task "Fill" writes x on stream "side", task "Use" reads it on the default stream.
PROGRAM = """
import sys
import torch
from torchrec_swp.engine.streams import stream_pool_for

pool = stream_pool_for(torch.device("cpu"))
checker = pool.checker
x = torch.zeros(4)
with checker.task("Fill", 0), pool.context("side"):
    x.add_(1)
{sync}
with checker.task("Use", 0):
    y = x * 2
with checker.task("Use", 1):
    y.add_(x)  # a second read of x, another op: a second distinct finding if unordered
print("after the race", file=sys.stderr, flush=True)
"""
RACE = PROGRAM.format(sync="")
CLEAN = PROGRAM.format(sync='pool.wait("default", pool.record("side"))')


def _run(code: str, env_value: str = "1") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWP_STREAM_CHECK": env_value}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("program", ["race", "clean"])
def test_checked_mode_reports_by_itself(program: str) -> None:
    done = _run(RACE if program == "race" else CLEAN)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # stdout stays the program's
    pid = r"SWP_STREAM_CHECK, pid \d+"
    lines = done.stderr.splitlines()
    if program == "clean":
        assert lines[0] == "after the race"
        assert len(lines) == 2 and re.fullmatch(rf"stream check \({pid}\): clean, \d+ ops checked", lines[1]), lines
        assert int(lines[1].split(", ")[-1].split()[0]) >= 3
        return
    first = [i for i, line in enumerate(lines) if "first finding" in line]
    assert len(first) == 1, done.stderr  # once, though there are two
    assert re.match(
        rf"stream check \({pid}\): first finding: unsynchronised W/R: read of self \[4\] by aten.mul", lines[first[0]]
    )
    assert "task Use batch 0" in lines[first[0]] and "task Fill batch 0" in done.stderr
    assert "active_checker().check()" in done.stderr
    assert first[0] < lines.index("after the race")  # when it happened, not at exit
    assert re.fullmatch(rf"stream check \({pid}\): 2 finding\(s\) \(2 distinct\), \d+ ops checked", lines[-1]), lines


def test_the_findings_stay_available_to_check() -> None:
    done = _run(
        RACE
        + textwrap.dedent("""
        from torchrec_swp.streamcheck import StreamCheckError, active_checker
        try:
            active_checker().check()
        except StreamCheckError as e:
            print(str(e).splitlines()[0])
        """)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stream check: 2 distinct finding(s), 2 in all\n"
