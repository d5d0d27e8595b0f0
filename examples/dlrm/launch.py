"""``make run``: the DLRM example through torchx on N nodes x K processes, with errors a person can read.

    .venv/bin/python examples/dlrm/launch.py [--nnodes N] [--nproc-per-node K] [--retries R]
                                             [--rdzv-port P] [train.py arguments]

1. Checks the arguments (the data source, ``--loads`` and ``--input-dist-group`` against the
   pipeline too), the plan file, the thread map and the checkpoint directory with
   ``train.py --check --world-size N*K`` (the parser the ranks use): a mistake ends here, with one
   line, before any process starts.
2. Runs, with this interpreter's bin first on PATH (torchx's ``dist.ddp`` runs ``torchrun`` from PATH)::

       torchx run -s local_cwd dist.ddp -j NxK --max_retries R --env PET_MAX_RESTARTS=R \\
           --rdzv_port P --script examples/dlrm/train.py -- ARGS

   ``dist.ddp`` starts one ``torchrun`` per node, which meet through the c10d rendezvous on
   ``$TORCHX_RANK0_HOST:P`` (the first node; on one machine, localhost) when N > 1, as they do
   across machines; each starts K ranks. On a CUDA device (``--device cuda``, or ``auto`` with a
   GPU) each node asks for K GPUs (``--gpu K``) and local_cwd gives each node its own GPUs.
   Retries: local_cwd ignores ``max_retries`` (torchx 0.7's local scheduler does not retry); the
   restarts happen in torchrun (``--max-restarts``, read from ``PET_MAX_RESTARTS``): when a rank
   dies, its node's ranks are stopped and all nodes start their ranks again, up to R times, and
   a train.py run with ``--resume`` goes on from the latest complete checkpoint. On Slurm and
   Kubernetes ``max_retries`` is the scheduler's own retry count (see docs/cluster.md).
3. If the job fails, ends with one line: the first ``error:`` line a rank printed (train.py
   prints what a user can fix that way), else which rank died how and whether restarts were left,
   with the checkpoint to resume from.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = "examples/dlrm/train.py"
#: torchx's dist.ddp default: the port of the rendezvous on the first node (multi-node jobs only).
RDZV_PORT = 29500


def launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch.py",
        description="Launch examples/dlrm/train.py through torchx; other arguments go to train.py.",
        add_help=False,
        allow_abbrev=False,  # an abbreviation is train.py's to read, not ours
    )
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (torchrun agents) (default: 1)")
    parser.add_argument("--nproc-per-node", type=int, default=2, metavar="K", help="ranks per node (default: 2)")
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="R",
        help="restart the ranks up to R times after a failure (torchrun --max-restarts; max_retries on a cluster)",
    )
    parser.add_argument(
        "--rdzv-port",
        type=int,
        default=RDZV_PORT,
        metavar="P",
        help=f"port of the c10d rendezvous on the first node when N > 1 (default: {RDZV_PORT})",
    )
    return parser


def torchx_command(
    train_args: list[str],
    *,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    retries: int = 0,
    rdzv_port: int = RDZV_PORT,
    gpus: bool = False,
) -> list[str]:
    """The torchx command line that runs train.py with ``train_args`` (see the module docstring)."""
    bin_dir = Path(sys.executable).parent
    command = [str(bin_dir / "torchx"), "run", "-s", "local_cwd"]
    if gpus:
        command += ["-cfg", "auto_set_cuda_visible_devices=True"]
    command += ["dist.ddp", "-j", f"{nnodes}x{nproc_per_node}", "--max_retries", str(retries)]
    env = f"PET_MAX_RESTARTS={retries}"
    if retries:
        # torchrun (torch 2.13) keeps one TCP store for all its restarts, and the restarted ranks can
        # read the dead ranks' gloo addresses from it ("Connection refused"): with the store not shared,
        # rank 0 hosts a new one for each attempt.
        env += ",TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    command += ["--env", env, "--rdzv_port", str(rdzv_port)]
    if gpus:
        command += ["--gpu", str(nproc_per_node)]
    return [*command, "--script", TRAIN, "--", *train_args]


def _uses_cuda(train_args: list[str]) -> bool:
    """What train.py's ``--device`` will resolve to on this machine."""
    device = "auto"
    for i, arg in enumerate(train_args):
        if arg == "--device" and i + 1 < len(train_args):
            device = train_args[i + 1]
        elif arg.startswith("--device="):
            device = arg.partition("=")[2]
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def _checkpoint_dir(train_args: list[str]) -> str | None:
    for i, arg in enumerate(train_args):
        if arg == "--checkpoint-dir" and i + 1 < len(train_args):
            return train_args[i + 1]
        if arg.startswith("--checkpoint-dir="):
            return arg.partition("=")[2]
    return None


class FailureReport:
    """Reads the job's output for what explains a failure (see ``line``)."""

    _ROOT_CAUSE = re.compile(r"Root Cause")
    _RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
    _EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.dead: tuple[int, int] | None = None  # (rank, exit code) of torchrun's root cause
        self._in_root_cause = False
        self._rank: int | None = None

    def feed(self, line: str) -> None:
        text = re.sub(r"^\S+/\d+ (\[\d+\]:)?", "", line)  # torchx's "train/0 [1]:" prefix
        if "error: rank" in text:
            self.errors.append(text[text.index("error: rank") :].strip())
        if self._ROOT_CAUSE.search(text):
            self._in_root_cause, self._rank = True, None
        elif self._in_root_cause:
            if (m := self._RANK.match(text)) is not None:
                self._rank = int(m.group(1))
            elif (m := self._EXITCODE.match(text)) is not None and self._rank is not None and self.dead is None:
                self.dead = (self._rank, int(m.group(1)))
                self._in_root_cause = False

    def line(self, code: int, retries: int, checkpoint_dir: str | None) -> str:
        """The one line ``make run failed: ...`` (without that prefix)."""
        if self.errors:
            return self.errors[0]
        if self.dead is None:
            return f"see the ranks' output above (torchx exited with status {code})"
        rank, exitcode = self.dead
        if exitcode < 0:
            try:
                how = f"was killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
            except ValueError:
                how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with status {exitcode} (its traceback is above)"
        if retries == 0:
            reason = f"rank {rank} {how}; no restarts were asked for (--retries 0)"
        else:  # torchrun gives up on failed ranks only once its restarts are used up
            done = f"{retries} restart{'s' if retries != 1 else ''}"
            reason = f"rank {rank} {how} after {done}: no restarts were left (--retries {retries})"
        latest = _latest_checkpoint(checkpoint_dir)
        if latest is not None:
            reason += f"; the latest complete checkpoint is {latest}: run again with --resume to continue from it"
        return reason


def _latest_checkpoint(checkpoint_dir: str | None) -> Path | None:
    if checkpoint_dir is None:
        return None
    pointer = ROOT / checkpoint_dir / "latest"
    try:
        return Path(checkpoint_dir) / pointer.read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    launch, train_args = launch_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if any(a in ("-h", "--help") for a in train_args):
        launch_parser().print_help()
        print("\ntrain.py's arguments:\n", flush=True)
        return subprocess.run([sys.executable, TRAIN, "--help"], cwd=ROOT, check=False).returncode
    for name in ("nnodes", "nproc_per_node"):
        if getattr(launch, name) < 1:
            print(f"launch.py: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if launch.retries < 0:
        print("launch.py: error: --retries must be >= 0", file=sys.stderr)
        return 2
    world_size = launch.nnodes * launch.nproc_per_node
    checked = subprocess.run(
        [sys.executable, TRAIN, "--check", "--world-size", str(world_size), *train_args], cwd=ROOT, check=False
    )
    if checked.returncode != 0:
        return checked.returncode  # train.py printed the usage and one error line, last
    command = torchx_command(
        train_args,
        nnodes=launch.nnodes,
        nproc_per_node=launch.nproc_per_node,
        retries=launch.retries,
        rdzv_port=launch.rdzv_port,
        gpus=_uses_cuda(train_args),
    )
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    print("$ torchx " + " ".join(command[1:]), flush=True)
    report = FailureReport()
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as job:
        assert job.stdout is not None
        for line in job.stdout:
            sys.stdout.write(line)
            report.feed(line)
        code = job.wait()
    if code != 0:
        reason = report.line(code, launch.retries, _checkpoint_dir(train_args))
        print(f"\nmake run failed: {reason}", file=sys.stderr, flush=True)
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
