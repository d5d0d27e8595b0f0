"""Count how 2-rank runs of a user's script end: exit codes, signals, abort messages.

    python benchmarks/exit_counts.py --runs 200 --pattern ours-default --pattern up-default
    python benchmarks/exit_counts.py --runs 50 --fresh --pattern ours-loads2   # fresh processes
    python benchmarks/exit_counts.py --runs 300 --torchrun --pattern ours-io-loads2-lookahead2-close

Each run is ``benchmarks/exit_user.py``'s script on 2 gloo ranks over loopback; a rank ends by the
interpreter's own finalization (no ``os._exit`` anywhere), and how it ended is counted: exit code,
or the signal that killed it (SIGABRT: -6), and the abort's message on its stderr ("terminate
called ..."). Two harnesses:

* fork (default): this process imports torch, TorchRec and the script (no torch op run, no thread
  started) and forks 2 children per run; each child runs the script's ``main()`` and then leaves
  by ``SystemExit``, through the normal finalization (atexit, thread shutdown, module teardown,
  native destructors), as a fresh process would. It saves the ~7 s of imports per run.
* ``--fresh``: 2 new interpreters per run (``python benchmarks/exit_user.py`` with RANK/WORLD_SIZE).
* ``--torchrun``: as a user runs it, ``python -m torch.distributed.run --standalone --nproc_per_node 2
  benchmarks/exit_user.py``; each rank's output in its own file (``--redirects 3``), how it ended
  from torchrun's failure summary (a rank it does not name ended with 0 when torchrun did).

``--cores DIR``: each rank runs in ``DIR/<pattern>/<run>-r<rank>`` (under torchrun both ranks in
``DIR/<pattern>/<run>``) with unlimited core size (a core of an aborted rank lands there, named
``core`` where the kernel's ``core_pattern`` is ``core``: under torchrun, of two aborted ranks the
last one's; ``gdb -batch -ex "thread apply all bt" python core``). ``--faulthandler``: each rank
dumps every Python thread's stack on a fatal signal (``faulthandler.enable(all_threads=True)``),
into its output.
Progress on stderr, one line per run that did not end with 0 on both ranks; the table at the end
(and ``--json``): per pattern and harness, runs, then every (rank, how it ended, message) seen.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "exit_user.py"
TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(rank: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip


def _ended(status: int) -> str:
    """How a child ended, from its wait status: "0", "1", ..., or "-6 SIGABRT"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"-{sig} {signal.Signals(sig).name}"
    return str(os.waitstatus_to_exitcode(status))


def _message(log: Path) -> str:
    """The line of a rank's stderr that says why it aborted (empty when none does)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    keys = ("terminate called", "what():", "Fatal Python error", "Segmentation fault", "Aborted", "Error")
    for line in text.splitlines():
        if any(k in line for k in keys):
            return line.strip()[:120]
    return ""


def _unlimited_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _child(pattern: str, rank: int, port: int, log: Path, core_dir: Path | None, extra: list[str], dump: bool) -> None:
    """In a forked child: become rank ``rank`` and run the script; never returns (SystemExit)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if core_dir is not None:
        core_dir.mkdir(parents=True, exist_ok=True)
        os.chdir(core_dir)
        _unlimited_cores()
    if dump:
        faulthandler.enable(all_threads=True)
    os.environ.update(_env(rank, port))
    import benchmarks.exit_user as script

    raise SystemExit(script.main(["--pattern", pattern, *extra]))


#: a rank in torchrun's failure summary, then how it ended: ``rank      : 0 (local_rank: 0)`` ...
#: ``exitcode  : -6 (pid: 123)``
_SUMMARY = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)", re.S)


def _torchrun_run(
    pattern: str, run: int, logs: Path, cores: Path | None, extra: list[str], dump: bool
) -> list[tuple[str, str, bool]]:
    """One run under torchrun (module docstring): for each rank (how it ended, its abort message,
    whether it printed its result)."""
    run_logs = logs / f"{pattern}-{run}"
    cwd = None if cores is None else cores / pattern / str(run)
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--redirects", "3", "--log-dir", str(run_logs), str(SCRIPT), "--pattern", pattern, *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if dump:
        env["PYTHONFAULTHANDLER"] = "1"  # all threads, on a fatal signal
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, cwd=cwd, timeout=TIMEOUT_S,
            preexec_fn=None if cwd is None else _unlimited_cores,
        )  # fmt: skip
        summary, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        summary, code = str(e.stdout or "") + str(e.stderr or ""), None
    (run_logs / "torchrun.log").parent.mkdir(parents=True, exist_ok=True)
    (run_logs / "torchrun.log").write_text(summary)
    failed = {int(r): c for r, c in _SUMMARY.findall(summary)}
    out = []
    for r in range(2):
        texts = sorted(run_logs.glob(f"**/attempt_*/{r}/*.log"))
        text = "".join(t.read_text(errors="replace") for t in texts)
        if code is None:
            ended = "hang (killed)"
        elif r in failed:
            c = int(failed[r])
            ended = f"{c} {signal.Signals(-c).name}" if c < 0 else str(c)
        else:
            ended = "0" if code == 0 else f"? (torchrun {code})"
        message = next((m for m in map(_message, texts) if m), "")
        out.append((ended, message, f"rank {r}: {pattern} trained" in text))
    return out


def one_run(
    pattern: str, run: int, harness: str, logs: Path, cores: Path | None, extra: list[str], dump: bool
) -> list[tuple[str, str, bool]]:
    """One 2-rank run: for each rank (how it ended, its abort message, whether it printed its result)."""
    if harness == "torchrun":
        return _torchrun_run(pattern, run, logs, cores, extra, dump)
    port = free_port()
    paths = [logs / f"{pattern}-{run}-r{r}.log" for r in range(2)]
    core_dirs = [None if cores is None else cores / pattern / f"{run}-r{r}" for r in range(2)]
    pids: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(2):
        if harness == "fresh":
            core_dir = core_dirs[r]
            if core_dir is not None:
                core_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **_env(r, port)}
            if dump:
                env["PYTHONFAULTHANDLER"] = "1"
            with open(paths[r], "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(SCRIPT), "--pattern", pattern, *extra], stdout=out, stderr=subprocess.STDOUT,
                    env=env, cwd=core_dir, preexec_fn=None if core_dir is None else _unlimited_cores,
                ))  # fmt: skip
                pids.append(procs[-1].pid)
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child leaves by SystemExit, out through main(): normal finalization
                _child(pattern, r, port, paths[r], core_dirs[r], extra, dump)
            pids.append(pid)
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(statuses) < 2:
        for pid in pids:
            if pid in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = status
        if len(statuses) < 2 and time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[pid] = os.waitpid(pid, 0)[1] | 0x10000  # marked: killed by us
        time.sleep(0.05)
    out = []
    for r, pid in enumerate(pids):
        status = statuses[pid]
        ended = "hang (killed)" if status & 0x10000 else _ended(status)
        text = paths[r].read_text(errors="replace") if paths[r].exists() else ""
        out.append((ended, _message(paths[r]), f"rank {r}: {pattern} trained" in text))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pattern", action="append", required=True, help="exit_user.PATTERNS; repeatable")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--fresh", action="store_true", help="fresh interpreters instead of forks")
    how.add_argument("--torchrun", action="store_true", help="under torchrun --standalone, as a user runs it")
    parser.add_argument("--faulthandler", action="store_true", help="dump every Python thread on a fatal signal")
    parser.add_argument("--cores", type=Path, default=None, help="keep cores of aborted ranks under this folder")
    parser.add_argument("--json", type=Path, default=None, help="append the summary rows to this JSON-lines file")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep each rank's output in this folder")
    parser.add_argument("--no-destroy", action="store_true", help="the script skips destroy_process_group()")
    args = parser.parse_args()
    harness = "torchrun" if args.torchrun else "fresh" if args.fresh else "fork"
    extra = ["--no-destroy"] if args.no_destroy else []
    script_kind = "no destroy_process_group()" if args.no_destroy else "destroy_process_group()"
    # imports only (torch, TorchRec, torchrec_swp, harness.parity): what the fork harness's children share
    import benchmarks.exit_user as script

    unknown = [p for p in args.pattern if p not in script.PATTERNS]
    if unknown:
        parser.error(f"unknown pattern {unknown[0]}; known: {', '.join(script.PATTERNS)}")
    logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="exit_counts."))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for pattern in args.pattern:
        seen: Counter[tuple[int, str, str, bool]] = Counter()
        bad_runs = 0
        start = time.monotonic()
        for run in range(args.runs):
            ranks = one_run(pattern, run, harness, logs, args.cores, extra, args.faulthandler)
            for r, (ended, message, printed) in enumerate(ranks):
                seen[(r, ended, message, printed)] += 1
            if any(e != "0" for e, _, _ in ranks):
                bad_runs += 1
                said = "; ".join(f"rank {r}: {e} {m!r} result {'printed' if p else 'missing'}"
                                 for r, (e, m, p) in enumerate(ranks))  # fmt: skip
                print(f"[{pattern} {harness}] run {run}: {said}", file=sys.stderr, flush=True)
            else:
                if args.keep_logs is None:
                    for r in range(2):
                        (logs / f"{pattern}-{run}-r{r}.log").unlink(missing_ok=True)
                    shutil.rmtree(logs / f"{pattern}-{run}", ignore_errors=True)
                if args.cores is not None:  # a clean run left no core: its folders go
                    for name in (str(run), f"{run}-r0", f"{run}-r1"):
                        shutil.rmtree(args.cores / pattern / name, ignore_errors=True)
            if (run + 1) % 10 == 0:
                rate = (time.monotonic() - start) / (run + 1)
                print(f"[{pattern} {harness}] {run + 1}/{args.runs} runs, {bad_runs} not clean, {rate:.1f} s/run",
                      file=sys.stderr, flush=True)  # fmt: skip
        row = {
            "pattern": pattern, "harness": harness, "script": script_kind, "runs": args.runs,
            "runs_not_clean": bad_runs,
            "endings": [{"rank": r, "ended": e, "message": m, "result_printed": p, "count": n}
                        for (r, e, m, p), n in sorted(seen.items())],
        }  # fmt: skip
        rows.append(row)
        if args.json is not None:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print("\n| pattern | harness | script | runs | runs not clean | rank | ended | message | result printed | count |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for e in row["endings"]:
            printed = "yes" if e["result_printed"] else "no"
            print(
                f"| {row['pattern']} | {row['harness']} | {row['script']} | {row['runs']} "
                f"| {row['runs_not_clean']} | {e['rank']} | {e['ended']} | {e['message'] or '-'} "
                f"| {printed} | {e['count']} |"
            )
    print(f"(logs of runs not clean: {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
