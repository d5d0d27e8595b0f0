"""A pipeline never closed ends cleanly: its exit hook stops its threads and destroys the process
groups it made before the interpreter's finalization (``integrations/torchrec/teardown.py``).

Two fresh interpreters run ``tests/dist/never_closed.py`` (TrainPipelineSparseDist with
``loads=2`` and its lookahead, an input dist group and the exhaustion sync, never closed, no
``destroy_process_group()``); each must exit with 0 and report, from an exit hook that runs after
the pipeline's and before finalization, that the teardown ran, no engine thread is alive, the
groups the pipeline made are destroyed and the default group is not.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist" / "never_closed.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_pipeline_never_closed_is_torn_down_by_its_exit_hook_before_finalization() -> None:
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    ranks = [
        subprocess.Popen([sys.executable, str(SCRIPT)], env={**env, "RANK": str(r)}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in ranks]
    for r, (p, out) in enumerate(zip(ranks, outputs)):
        assert p.returncode == 0, f"rank {r} ended with {p.returncode}:\n{out[-3000:]}"
        assert f"rank {r}: trained 8, threads ['swp-TrainPipelineSparseDist-load'" in out, out[-3000:]
        lines = [line for line in out.splitlines() if line.startswith("exit check: ")]
        assert len(lines) == 1, out[-3000:]
        report = ast.literal_eval(lines[0].removeprefix("exit check: "))
        assert report == {
            "finalizing": False,
            "teardown_done": True,
            "threads_alive": [],
            "made_groups_known": [False, False],
            "default_group_known": True,
        }, f"rank {r}: {report}"
