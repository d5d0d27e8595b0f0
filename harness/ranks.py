"""Run a function on several ranks, each in a fresh process, on loopback: ``run_on_ranks``.

What tests, benchmarks and examples all use to stand in for a cluster on one machine: gloo over
loopback by default (``backend="nccl"`` on a CUDA machine, rank ``r`` on ``cuda:r``). A failing
rank comes back as one ``RankError`` naming it, a hanging one is killed at the timeout, and the
children exit when the parent dies. ``harness.parity`` builds the models and compares runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrec_swp.streamcheck import process_checker, stream_check_requested

__all__ = ["RankError", "run_on_ranks"]

# --------------------------------------------------------------------------------------------
# Running a function on several gloo ranks
# --------------------------------------------------------------------------------------------

_POLL_S = 0.2
"""How often the parent checks on its children while waiting for results, in seconds."""

_FAILURE_GRACE_S = 1.0
#: A rank still running this long before the deadline writes its threads' stacks to its stderr.
_DUMP_BEFORE_S = 10.0
"""How long the parent keeps listening after a rank failed, to tell causes from consequences, in seconds."""

_EXIT_GRACE_S = 30.0
"""How long ranks that have reported may take to exit (within the overall timeout), in seconds."""

_PARENT_WATCH_S = 1.0
"""How often a child checks that its parent is still alive, in seconds."""


class RankError(RuntimeError):
    """A rank failed: it raised, or its process died without reporting a result.

    ``rank`` is the rank blamed for it. The message starts with that rank's report (its full
    traceback if it raised) and goes on with the other ranks that failed meanwhile.
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago (rank 0 binds it for the store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _exit_when_orphaned(parent_pid: int) -> None:
    """Ends this process as soon as the process that ran ``run_on_ranks`` (``parent_pid``) is gone,
    so a killed test run leaves no ranks behind. A rank is forked by the fork server, its parent
    in the process tree, which exits when the caller does: either one gone ends the rank."""
    forked_by = os.getppid()
    while True:
        time.sleep(_PARENT_WATCH_S)
        if os.getppid() != forked_by or not _alive(parent_pid):
            os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: What a rank's process imports first anyway, imported once by the fork server every rank is
#: forked from (``_context``) instead of by each rank: 7 s of CPU per process on the 2-core
#: machines with TorchRec 1.9 (torch alone 2.5 s), a few hundred processes in ``make test``.
#: A module missing here is imported by the rank as before (the fork server skips what it cannot
#: import).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "fbgemm_gpu",
    "torchrec",
    "torchrec.distributed",
    "torchrec.distributed.train_pipeline",
    "torchrec_swp",
    "torchrec_swp.integrations.torchrec",
    "harness.ranks",
    "harness.parity",
)


def _context() -> Any:
    """The multiprocessing context ranks start in: a fork server that has imported ``_PRELOAD``
    (started on first use, one per calling process). A rank starts from that clean state, as a
    spawned one would, without importing it again; it takes the caller's environment of the
    moment (``_rank_main``), not the server's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    parent_pid: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Queue[tuple[int, bool, Any]],
    group_may_break: bool,
    backend: str = "gloo",
    dump_after_s: float | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    """Body of one child: joins the process group (gloo, or nccl on ``cuda:rank``), runs ``fn``
    and reports to the parent. A rank still running after ``dump_after_s`` (shortly before the
    parent's deadline) writes every thread's stack to its stderr: what a hang waits on.

    ``results`` gets ``(rank, True, pickled result)`` or ``(rank, False, traceback text)``.
    The result is pickled here, with the plain pickler, so that tensors travel as bytes
    (not as shared-memory handles that die with this process) and so that an unpicklable
    result is reported as this rank's error.
    """
    # this rank leads a process group of its own: what it starts (DataLoader workers, ...) is in
    # it, and the parent kills the group at the end, so nothing outlives a rank that crashed
    os.setpgid(0, 0)
    if environ is not None:  # the caller's, at the call (the fork server's is that of its start)
        os.environ.clear()
        os.environ.update(environ)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    if dump_after_s is not None:
        faulthandler.dump_traceback_later(dump_after_s)
    # Keep gloo on the loopback interface instead of whatever the host name resolves to.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        if backend == "nccl":
            # cuBLAS is deterministic only with a fixed workspace, read when its handle is made
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one host: NCCL's bootstrap on loopback too
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
        )
        # On CUDA some kernels have no deterministic twin: warn there instead of failing the run.
        torch.use_deterministic_algorithms(True, warn_only=backend != "gloo")
        # One intra-op thread per rank: the machine's cores are shared by all ranks, and a fixed
        # thread count keeps CPU reductions identical from run to run.
        torch.set_num_threads(1)
        torch.manual_seed(0)
        random.seed(0)
        if stream_check_requested():
            # installed before any test code patches torch (upstream_cpu_patch restores what it
            # found on exit, which would drop a checker installed inside it)
            process_checker()
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, payload))
    faulthandler.cancel_dump_traceback_later()
    if group_may_break:
        # fn may have left the process group unusable (a peer failed on purpose): flush the
        # report and leave without the collective goodbye.
        results.close()
        results.join_thread()
        os._exit(0)
    # Leave together: rank 0 hosts the TCP store that the others still use while shutting down.
    dist.barrier()
    dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 300.0,
    group_may_break: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` new ranks; returns results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function) and so must ``fn``'s
    result (keep tensors on the CPU). Each rank starts with deterministic algorithms, one
    intra-op thread and seeded RNGs. ``group_may_break=True`` is for tests that break the
    process group on purpose (a rank failing mid-collective): ranks then exit without the final
    barrier. ``backend="nccl"`` runs rank ``r`` on ``cuda:r`` (needs ``world_size`` GPUs), with
    deterministic algorithms in warn-only mode.

    Raises:
        RankError: a rank raised (the message holds its full traceback) or exited without
            reporting. A rank that died silently is blamed before one that raised, as its peers'
            errors are then mostly consequences; the message lists them all. All ranks are killed.
        TimeoutError: ``timeout_s`` passed before every rank reported; the message names the
            ranks that had not finished, and all ranks are killed.

    No child process outlives this call, nor anything a rank started (each rank leads a process
    group, killed at the end).
    """
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                port,
                os.getpid(),
                fn,
                args,
                results,
                group_may_break,
                backend,
                _dump_after(timeout_s),
                dict(os.environ),
            ),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.start()
        values = _collect(procs, results, deadline, timeout_s)
        _await_exit(procs, deadline)
        return values
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join()
                _kill_group(proc.pid)
        results.close()
        results.cancel_join_thread()


def _dump_after(timeout_s: float) -> float | None:
    """When a rank dumps its stacks: shortly before the deadline (``_DUMP_BEFORE_S``), if there is time."""
    return timeout_s - _DUMP_BEFORE_S if timeout_s > 2 * _DUMP_BEFORE_S else None


def _kill_group(pgid: int) -> None:
    """Kill what is left of a rank's process group (its own children: loader workers, ...)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _collect(
    procs: list[BaseProcess], results: Queue[tuple[int, bool, Any]], deadline: float, timeout_s: float
) -> list[Any]:
    """Reads one report per rank; raises on a failure, a silent death, or the deadline.

    After the first failure it keeps listening for ``_FAILURE_GRACE_S`` so that the report can
    blame the right rank: when one rank dies, its peers soon fail too ("Connection reset by
    peer"), and their errors may arrive before the death is noticed.
    """
    world_size = len(procs)
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> traceback, in arrival order
    deaths: dict[int, int] = {}  # rank -> exit code, for ranks that exited without reporting
    exited_at_last_poll: set[int] = set()
    give_up_at = deadline
    while len(values) + len(errors) + len(deaths) < world_size and time.monotonic() < give_up_at:
        try:
            rank, ok, payload = results.get(timeout=min(give_up_at - time.monotonic(), _POLL_S))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank in values or rank in errors or rank in deaths or proc.exitcode is None:
                    continue
                # A report is flushed before its process exits, so a rank that was already gone at
                # the previous poll and has still not reported has died without reporting.
                if rank in exited_at_last_poll:
                    deaths[rank] = proc.exitcode
                exited_at_last_poll.add(rank)
        else:
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        if (errors or deaths) and give_up_at == deadline:
            give_up_at = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
    if errors or deaths:
        raise _rank_error(errors, deaths, world_size)
    if len(values) < world_size:
        pending = [rank for rank in range(world_size) if rank not in values]
        raise TimeoutError(f"ranks {pending} of {world_size} had not finished after {timeout_s} s; killed all ranks")
    return [values[rank] for rank in range(world_size)]


def _rank_error(errors: dict[int, str], deaths: dict[int, int], world_size: int) -> RankError:
    """Blames the first rank that died silently, else the first that raised; lists the others after it."""
    reports = [
        (rank, f"rank {rank} of {world_size} exited with code {code} without reporting a result")
        for rank, code in deaths.items()
    ]
    reports += [(rank, f"rank {rank} of {world_size} raised:\n{tb}") for rank, tb in errors.items()]
    message = "\n\n".join([reports[0][1]] + [f"then {report}" for _, report in reports[1:]])
    return RankError(reports[0][0], message)


def _await_exit(procs: list[BaseProcess], deadline: float) -> None:
    """Waits for ranks that have reported to exit; a hang or a failing exit is an error too."""
    exit_by = min(deadline, time.monotonic() + _EXIT_GRACE_S)
    for proc in procs:
        proc.join(max(0.0, exit_by - time.monotonic()))
    world_size = len(procs)
    alive = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    if alive:
        raise TimeoutError(f"ranks {alive} of {world_size} reported but did not exit in time; killed all ranks")
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0:
            raise RankError(
                rank, f"rank {rank} of {world_size} exited with code {proc.exitcode} after reporting its result"
            )
