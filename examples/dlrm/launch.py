"""``make run``: the DLRM example on 2 CPU ranks through torchx, with errors a person can read.

    .venv/bin/python examples/dlrm/launch.py [train.py arguments]

1. Checks the arguments, the plan file and the thread map with ``train.py --check`` (the parser
   the ranks use): a mistake ends here, with one line, before any process starts.
2. Runs ``torchx run -s local_cwd dist.ddp -j 1x2 --script examples/dlrm/train.py -- ARGS``
   with this interpreter's bin first on PATH (torchx's ``dist.ddp`` runs ``torchrun`` from PATH),
   printing the job's output as it comes.
3. If the job fails, ends with one line: the first ``error:`` line a rank printed (train.py
   prints what a user can fix that way), or where to look.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "examples/dlrm/train.py"
NPROC = 2


def torchx_command(train_args: list[str]) -> list[str]:
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / "torchx"), "run", "-s", "local_cwd", "dist.ddp", "-j", f"1x{NPROC}", "--script", TRAIN, "--", *train_args]


def main(argv: list[str] | None = None) -> int:
    train_args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in train_args):
        return subprocess.run([sys.executable, TRAIN, "--help"], cwd=ROOT, check=False).returncode
    checked = subprocess.run([sys.executable, TRAIN, "--check", *train_args], cwd=ROOT, check=False)
    if checked.returncode != 0:
        return checked.returncode  # train.py's parser printed the usage and one error line, last
    command = torchx_command(train_args)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    print("$ torchx " + " ".join(command[1:]), flush=True)
    errors: list[str] = []
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as job:
        assert job.stdout is not None
        for line in job.stdout:
            sys.stdout.write(line)
            if "error: rank" in line:
                errors.append(line[line.index("error: rank") :].strip())
        code = job.wait()
    if code != 0:
        reason = errors[0] if errors else "see the ranks' output above (torchx exited with status %d)" % code
        print(f"\nmake run failed: {reason}", file=sys.stderr, flush=True)
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
