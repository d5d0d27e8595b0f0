"""The tuner's search: every rank's profile -> the decision and the plans to try (``search``),
run on the training thread or in a process of its own while the pipeline trains on
(``BackgroundSearch``; ``python -m torchrec_swp.autotune.search IN OUT`` is that process).

The search calibrates the multi-rank simulator from the profiles and scores tens of plans in it
(``autosched.overlap``): seconds of pure Python. On the training thread every rank waits for it
(rank 0 searches, the others wait in the broadcast of its result): a stall of seconds inside one
step, more than a short job gains. In a process of its own it holds neither the training
process's GIL nor its thread: the pipeline trains on its running plan, and the ranks take the
result at the first poll after it ended (``Tuner``: every ``POLL_EVERY`` calls one small broadcast
on a process group of the tuner's own). The process runs at the lowest CPU priority
(``lower_priority``), so that the job's threads preempt it whenever they run; past
``Autotune.search_s`` it is stopped and the plan kept. Where the job leaves no core idle the
lowest priority never runs: a search starved so (``STARVED_S``) starts again at a niceness that
takes a small, steady share. The lowest priority is not free: on the 2-core VMs we measure on, a
busy loop at ``SCHED_IDLE`` made a 2-rank job's median step 35-50% longer
(``notebook/2026-12-loaders.md``): a search costs the job time at any priority (at niceness 0 no
more than at ``SCHED_IDLE``, in two 1,000-step runs). It imports no torch: the plan, profile and
simulator layers are pure Python.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchrec_swp.autosched.inputs import from_profiles
from torchrec_swp.autosched.overlap import Space, search_overlap
from torchrec_swp.autotune.decision import Decision
from torchrec_swp.autotune.options import Autotune
from torchrec_swp.autotune.trial import pick
from torchrec_swp.catalog.transforms import DRAW_TASKS, with_lookahead
from torchrec_swp.plan import PipelinePlan, PlanError
from torchrec_swp.plan.task import MAIN_THREAD
from torchrec_swp.profiler import Profile, ProfileError

#: a draw whose thread computes at least this share of its time (thread CPU / wall) is CPU-bound:
#: where the model (which holds the GIL for all CPU work) predicts no gain, the plans that would win
#: if it released the GIL are tried and measured (``search``)
CPU_BOUND_DRAW = 0.5
#: a draw whose longest run in the profile is at least this many times its median has a heavy tail
#: (slow reads among quick ones): the mean costs the search ranks by do not see it, a run-ahead
#: hides it (``run_ahead``)
TAIL_RATIO = 3.0
#: the search process's niceness (``os.nice``) where ``SCHED_IDLE`` cannot be set
NICE = 19
#: a search at the lowest priority whose CPU time since it started is under ``STARVED_SHARE`` of one
#: core's, at a poll ``STARVED_S`` seconds or more after its start, is starved (the job keeps every
#: core busy: ``SCHED_IDLE`` would never run it): it is started again ``STARVED_NICE`` nice levels
#: below the job, where it takes about a tenth of a core beside one busy thread of the job (once;
#: Linux, where the process's CPU time can be read)
STARVED_S = 5.0
STARVED_SHARE = 0.1
STARVED_NICE = 10


@dataclass(frozen=True)
class Request:
    """What one search needs (picklable: it goes to the search's process): the tuner's options
    (without its report), the round, every rank's gathered profile (``{"profile", "trouble"}``),
    the starting plan's measured step, the tasks that may get a comm group of their own,
    whether a drift started the round, and, in a later round, the text of the plan round 1
    profiled (``starting``: a contender again where another plan runs now)."""

    options: Autotune
    round: int
    gathered: list[dict[str, Any]]
    measured: float | None
    own_group: tuple[str, ...]
    drift_round: bool
    processes: bool = False  # whether the data can fetch in worker processes (MapSource.use_processes)
    starting: str | None = None


@dataclass(frozen=True)
class Found:
    """What a search found: the decision, the plans to try (``[plan text, predicted step, own
    group, worker processes]``, the running plan first; none: the decision stands without a
    trial) and how long the search took (seconds, in the process that ran it)."""

    decision: Decision
    candidates: list[Any]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision.to_dict(), "candidates": self.candidates, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Found:
        return cls(Decision.from_dict(data["decision"]), data["candidates"], data["seconds"])


def draw_cpu_share(profiles: Sequence[Profile], source: str | None) -> float | None:
    """The share of the time every rank's ``source`` task spent on its thread's CPU (None: no
    source, or a profile without CPU times)."""
    if source is None:
        return None
    stats = [p.stats(source) for p in profiles]
    wall = sum(s.mean_s for s in stats)
    if wall <= 0 or any(s.cpu_mean_s is None for s in stats):
        return None
    return sum(s.cpu_mean_s or 0.0 for s in stats) / wall


def search(request: Request) -> Found:
    """Every rank's profile -> the decision (the profiled plan kept, with the reason, when
    anything is amiss or nothing wins by more than the noise) and the plans to try."""
    began = time.perf_counter()
    decision, candidates = _search(request)
    return Found(decision, candidates, time.perf_counter() - began)


def _search(request: Request) -> tuple[Decision, list[Any]]:
    o, measured, gathered = request.options, request.measured, request.gathered
    trouble = [g["trouble"] for g in gathered if g["trouble"]]
    if trouble:
        return Decision(None, measured_start_s=measured, why=(f"keeps the plan: cannot profile ({trouble[0]})",)), []
    try:
        profiles = [Profile.from_json(g["profile"]) for g in gathered]
        inputs = from_profiles(profiles, wake=o.wake_s, gil=o.gil, cold=o.cold)
        profiled = profiles[0].plan
        loads = o.loads if profiled.source in DRAW_TASKS and inputs.split_draws else (1,)
        space = Space(
            lookahead=o.lookahead,
            loads=loads,
            own_group=request.own_group,
            max_threads=o.max_threads,
            max_in_flight=o.max_in_flight,
            batch_bytes=inputs.batch_bytes,
            memory_cap_bytes=o.memory_cap_bytes,
            split_draws=inputs.split_draws,
            # the first round ranks plans it has not seen by their mean costs: the replay of
            # the profiled iterations predicts them closer on two ranks (benchmarks/
            # sim_vs_real.py) but its favourites there measured worse in benchmarks/overlap.py
            # (a thread of its own for H2D, 20% slower than predicted; notebook/2026-11-sim-vs-real.md,
            # "The tuner ranking by the replay"); a later round the plan it profiled and its
            # neighbours: the measured iterations in turn (the closer there)
            mode="mean" if request.round == 1 else "replay",
        )
        result = search_overlap(profiled, inputs.calibration, inputs.machine, space)
        freed, share = None, draw_cpu_share(profiles, profiled.source)
        if (
            result.speedup < 1 + o.noise
            and o.candidates > 0
            and o.gil is not None
            and request.round == 1
            and share is not None
            and share >= CPU_BOUND_DRAW
        ):  # the draw computes: whether its work holds the GIL only a measurement can tell
            released = from_profiles(profiles, wake=o.wake_s, gil=None, cold=o.cold)
            freed = search_overlap(profiled, released.calibration, released.machine, space)
            freed = freed if freed.speedup >= 1 + o.noise else None
    except (PlanError, ProfileError, ValueError) as e:
        return Decision(None, measured_start_s=measured, why=(f"keeps the plan: {e}",)), []
    why = tuple(result.why(start="the starting plan" if request.round == 1 else "the chosen plan"))
    tail = run_ahead(profiles, profiled, space)
    moved: list[bool] = []  # whether the tail moved a plan: its reason is said then

    def ahead(plan: PipelinePlan, step_s: float) -> PipelinePlan:
        if tail is None:
            return plan
        further = tail[0](plan, step_s)
        moved.append(further is not plan)
        return further

    margin = o.noise
    if freed is not None:
        assert share is not None
        why = (
            *why,
            f"the draw {profiled.source} computes {100 * share:.0f}% of its time: if that work holds the GIL "
            f"(Python parsing) no thread layout wins (x{result.speedup:.2f}), if it releases it (torch ops) "
            f"x{freed.speedup:.2f}; the profile cannot tell which, so the trial measures those plans"
            + (
                ", and the first with several loads also fetching in as many worker processes (which the GIL "
                "does not bind)"
                if request.processes
                else " (where none wins, only worker processes would load in parallel: "
                "torchrec_swp.data.MapSource(dataset, processes=k) with loads k, or a DataLoader with num_workers)"
            ),
        )
    searched = freed if freed is not None else result
    ranking = getattr(searched, "ranking", ())
    start = searched.start if hasattr(searched, "start") else None
    running = start.plan if start is not None else profiled
    # a later round: the plan the tuning started from is a contender again (round 1's measured
    # best may have been a moment's; a drift may favour it now), and a drift alone tries it
    starting = request.starting if request.starting not in (None, running.to_text()) else None
    tryable = o.candidates > 0 and (
        searched.speedup >= 1 + margin or (request.drift_round and (len(ranking) > 1 or starting is not None))
    )
    candidates: list[Any] = []
    if tryable:
        ranked = [searched.best, *ranking]
        plans = pick([s.plan for s in ranked], running, o.candidates)
        by_plan = {s.plan: s for s in reversed(ranked)}
        candidates = [[running.to_text(), searched.baseline, bool(start and start.candidate.own_group), 0]]
        if starting is not None:  # (second: the trim below keeps it; predicted where the search ranked it)
            known = next((sp for sp in ranked if sp.plan.to_text() == starting), None)
            candidates.append([starting, None if known is None else known.step, False, 0])
        for p in plans:  # (a run-ahead for a heavy tail may make two plans one: the first stays)
            text = ahead(p, by_plan[p].step).to_text()
            if all(text != c[0] for c in candidates):
                candidates.append([text, by_plan[p].step, by_plan[p].candidate.own_group, 0])
        candidates = candidates[: o.candidates + 1]
        if freed is not None and request.processes:
            candidates = with_processes(candidates, o.candidates)
        if len(candidates) < 2:
            candidates = []
    if result.speedup < 1 + margin:
        if tail is not None and any(moved):  # (the candidates' run-ahead)
            why = (*why, tail[1])
        return Decision(
            None,
            predicted_s=result.predicted,
            baseline_s=result.baseline,
            measured_start_s=measured,
            why=(
                *why,
                f"keeps the plan: the best change is predicted x{result.speedup:.2f}, "
                f"within the noise ({100 * margin:.0f}%)",
            ),
        ), candidates
    chosen = ahead(result.plan, result.predicted)
    if tail is not None and any(moved):
        why = (*why, tail[1])
    return Decision(
        chosen.to_text(),
        own_group=result.best.candidate.own_group,
        predicted_s=result.predicted,
        baseline_s=result.baseline,
        measured_start_s=measured,
        why=why,
    ), candidates


def run_ahead(
    profiles: Sequence[Profile], profiled: PipelinePlan, space: Space
) -> tuple[Callable[[PipelinePlan, float], PipelinePlan], str] | None:
    """Where the draw has a heavy tail on some rank (its longest run in the profile at least
    ``TAIL_RATIO`` times its median): what gives a plan whose draw runs on a thread of its own the
    run-ahead that covers the longest draw (``ceil(longest / the plan's predicted step)`` batches
    beyond its depth, the least of the search's lookahead choices that does, else the most its
    in-flight and memory limits allow, ``Space.holds``; never less than it had), and the reason;
    None: no heavy tail, or no run-ahead allowed."""
    source = profiled.source
    if source is None:
        return None
    stats = [p.stats(source) for p in profiles]
    worst = max(stats, key=lambda t: t.max_s / t.median_s if t.median_s > 0 else 0.0)
    if worst.median_s <= 0 or worst.max_s < TAIL_RATIO * worst.median_s:
        return None
    allowed = sorted(k for k in space.lookahead if space.holds(profiled.pipeline_depth, k))
    if not allowed or allowed[-1] == 0:
        return None

    def ahead(plan: PipelinePlan, step_s: float) -> PipelinePlan:
        if plan.source is None or plan.task(plan.source).thread_group == MAIN_THREAD or step_s <= 0:
            return plan
        if worst.max_s <= step_s:  # the longest draw fits in one step: its thread hides it already
            return plan
        need = math.ceil(worst.max_s / step_s)
        k = next((k for k in allowed if k >= need), allowed[-1])
        return with_lookahead(plan, k) if k > plan.lookahead else plan

    said = (
        f"the draw {source} has a heavy tail (its longest {1e3 * worst.max_s:.1f} ms, "
        f"{worst.max_s / worst.median_s:.1f}x its median {1e3 * worst.median_s:.1f} ms): a plan drawing on a thread "
        f"of its own runs as far ahead as covers the longest draw (at most {allowed[-1]})"
    )
    return ahead, said


def with_processes(candidates: list[Any], count: int) -> list[Any]:
    """``candidates`` (the running plan first) with, second, the first of several loads again,
    its draws fetched in as many worker processes: where the draw's Python holds the GIL, only
    processes load in parallel; at most ``count`` besides the running plan."""
    several = next((c for c in candidates[1:] if PipelinePlan.from_text(c[0]).loads > 1), None)
    if several is None:
        return candidates
    text, predicted, own, _ = several
    twin = [text, predicted, own, PipelinePlan.from_text(text).loads]
    return [candidates[0], twin, *candidates[1:]][: count + 1]


class BackgroundSearch:
    """One search in a process of its own (module docstring), started at once: ``ended`` says
    whether it has, ``result()`` waits for it (or, past ``limit_s`` seconds, stops it) and gives
    what it found, or a decision that keeps the plan and says why (the process failed, or ran out
    of time). ``cancel()`` stops it; so do the garbage collector and the interpreter's exit."""

    def __init__(self, request: Request, limit_s: float | None) -> None:
        self.limit_s = limit_s
        self.request = request
        self.restarted: str | None = None  # why the search started again at a higher priority
        self._dir = Path(tempfile.mkdtemp(prefix="swp-search-"))
        self._out = self._dir / "found.pickle"
        self._source = self._dir / "request.pickle"
        self._source.write_bytes(pickle.dumps(replace(request, options=replace(request.options, report=None))))
        self.started = time.perf_counter()
        try:
            self._running: list[subprocess.Popen[bytes]] = [self._launch(None)]
        except OSError:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _stop, self._running, self._dir)

    @property
    def _process(self) -> subprocess.Popen[bytes]:
        return self._running[0]

    def _launch(self, nice: int | None) -> subprocess.Popen[bytes]:
        """The search's process: at the lowest priority (``nice`` None), else ``nice`` levels
        below this process."""
        here = str(Path(__file__).resolve().parents[2])  # the directory holding torchrec_swp
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        command = [sys.executable, "-m", "torchrec_swp.autotune.search", str(self._source), str(self._out)]
        with open(self._dir / "stderr.txt", "wb") as err:
            return subprocess.Popen(
                [*command, *([] if nice is None else ["--nice", str(nice)])],
                close_fds=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )

    @property
    def ended(self) -> bool:
        """Whether the process has ended, or run past its time (``result()`` then stops it); a
        starved search (``STARVED_S``) starts again at a higher priority here."""
        if self._process.poll() is not None:
            return True
        if self.limit_s is not None and time.perf_counter() - self.started > self.limit_s:
            return True
        self._unless_starved()
        return False

    def _unless_starved(self) -> None:
        if self.restarted is not None or self.elapsed_s < STARVED_S:
            return
        cpu = cpu_seconds(self._process.pid)
        if cpu is None or cpu >= STARVED_SHARE * self.elapsed_s:
            return
        starved = f"the search got {cpu:.2f} s of CPU in its first {self.elapsed_s:.1f} s at the lowest priority"
        try:
            again = self._launch(STARVED_NICE)
        except OSError as e:  # the starved one runs on
            self.restarted = f"{starved}, and could not start again ({type(e).__name__}: {e})"
            return
        again_at = f"it started again {STARVED_NICE} nice levels below the job"
        self.restarted = f"{starved} (the job left no core idle): {again_at}"
        _kill(self._process)
        self._running[0] = again

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def result(self) -> Found:
        """What the search found (waiting for the process until it ends or its time is up)."""
        timeout = None if self.limit_s is None else max(0.0, self.limit_s - self.elapsed_s)
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.cancel()
            return self._kept(f"keeps the plan: the search did not end within {self.limit_s:g} s (Autotune.search_s)")
        try:
            if code == 0 and self._out.is_file():
                found = Found.from_dict(pickle.loads(self._out.read_bytes()))
                if self.restarted is None:
                    return found
                decision = replace(found.decision, why=(*found.decision.why, self.restarted))
                return Found(decision, found.candidates, found.seconds)
            err = (self._dir / "stderr.txt").read_text(errors="replace").strip().splitlines()
            last = err[-1] if err else "no output"
            return self._kept(f"keeps the plan: the search's process failed (exit code {code}: {last})")
        finally:
            self._finalizer()

    def cancel(self) -> None:
        """Stop the process (if it runs) and remove its files."""
        self._finalizer()

    def _kept(self, why: str) -> Found:
        whys = (why,) if self.restarted is None else (why, self.restarted)
        return Found(Decision(None, measured_start_s=self.request.measured, why=whys), [], self.elapsed_s)


class SearchedHere:
    """A search that could not start its process (``BackgroundSearch`` raised OSError: no
    interpreter to start, no processes left), run on the calling thread instead; it has ended."""

    ended = True

    def __init__(self, request: Request, error: OSError) -> None:
        found = search(request)
        why = f"the search's process could not start ({type(error).__name__}: {error}): searched on the training thread"
        self._found = Found(replace(found.decision, why=(*found.decision.why, why)), found.candidates, found.seconds)
        self.elapsed_s = found.seconds

    def result(self) -> Found:
        return self._found

    def cancel(self) -> None:
        pass


def start(request: Request, limit_s: float | None) -> BackgroundSearch | SearchedHere:
    """The search of ``request`` in a process of its own, or, where that process cannot start,
    done here."""
    try:
        return BackgroundSearch(request, limit_s)
    except OSError as e:
        return SearchedHere(request, e)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _stop(running: list[subprocess.Popen[bytes]], folder: Path) -> None:
    _kill(running[0])
    shutil.rmtree(folder, ignore_errors=True)


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, seconds) process ``pid`` has used, from Linux's
    ``/proc/PID/stat``; None where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def lower_priority(nice: int | None = None) -> None:
    """This process on the CPU only where nothing else wants it: Linux's ``SCHED_IDLE`` (where
    it can be set), else the lowest niceness (``NICE``); ``nice``: that many levels below its parent."""
    if nice is not None:
        os.nice(nice)
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(NICE)
    except OSError:
        pass


def _exit_with_parent(parent: int) -> None:
    """The search's process ends when the process that started it has (killed, or crashed): no
    search outlives its job."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """``python -m torchrec_swp.autotune.search REQUEST FOUND [--nice N]``: read the pickled
    ``Request``, search (at the lowest priority, or N nice levels below the parent), write the
    pickled ``Found`` (as a dict) to FOUND; a failure's traceback on stderr."""
    args = argv if argv is not None else sys.argv[1:]
    source, out, nice = args[0], args[1], int(args[3]) if args[2:3] == ["--nice"] else None
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    lower_priority(nice)
    try:
        request = pickle.loads(Path(source).read_bytes())
        found = search(request)
    except Exception:
        traceback.print_exc()
        return 1
    part = Path(out + ".part")
    part.write_bytes(pickle.dumps(found.to_dict()))
    part.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
