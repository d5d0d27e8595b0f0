"""What the engine is for: a data loader that waits on storage, overlapped with training - against
the ways a user of upstream TorchRec would hide that wait.

    python benchmarks/overlap.py                    # 2 ranks then 1 rank; latencies 5, 10, 20 ms (21 min on 2026-11-29)
    python benchmarks/overlap.py --quick            # latencies 5 and 20 ms, fewer steps (3 min before the memory pass)
    python benchmarks/overlap.py --ranks 1 --latencies-ms 10 --steps 300
    python benchmarks/overlap.py --loaders sleep,gil,torch,tail --latencies-ms 5,20   # the loader matrix

Each batch arrives ``latency`` ms after it is asked for (a sleep, like a read from storage), or,
with ``--loaders``, after ``latency`` ms of another kind of loader work
(``examples/dlrm/loader_work.py``): ``gil``, Python parsing Criteo TSV rows (holds the GIL: two
threads do not run it in parallel, worker processes do); ``torch``, torch ops on the ids (release
the GIL inside each op); ``tail``, a heavy-tailed wait (lognormal, p99 5.7x the median, seeded by
item: every contender waits the same for item ``k``). The work is calibrated once per rank before
the contenders exist (rows or op rounds per batch), then the same for every contender. The
contenders train their own copy of the same DLRM on the same batches, interleaved so that they
share the machine's load: after ``--warmup`` steps interleaved call by call, in rounds where each
runs ``--block`` consecutive steps (the order rotating every round), the first ``--skip`` of
which are not timed. (Call by call, a loader that works in the background - a prefetch thread,
DataLoader workers - fills its queue while the other contenders train and then looks faster than
it can sustain; after a block's untimed half its queue has drained to what it sustains: a queue
of ``q`` batches ahead lasts ``q * latency / (latency - step)`` steps.) The contenders:

* ``upstream``: TorchRec's pipeline; the loader's ``next()`` runs in ``progress()``;
* ``upstream+async_copy``: TorchRec 1.9's ``async_inplace_copy=True`` (and
  ``enable_inplace_copy_batch=True``) as shipped - on a CPU device it turns itself off;
* ``upstream+async_copy(forced)``: the same with its CPU check lifted: the copy goes to a worker
  thread, ``next()`` stays on the training thread;
* ``upstream+thread``: a background thread prefetching ``--thread-depth`` batches into a queue;
* ``upstream+dataloader``: a ``torch.utils.data.DataLoader`` (``--loader-workers`` worker
  processes, ``--prefetch-factor``) over a dataset whose items wait the same latency;
* ``ours``: our pipeline, default plan (upstream's schedule);
* ``ours+io``: the stage-0 tasks (``next()`` and the copy of the next batch) on thread ``io``;
* ``ours+io+dist``: besides, every other task of the batches ahead of the one being trained on
  thread ``dist`` (for SparseDist: the input dist of the next batch): loading, copying and input
  dist all off the training thread;
* ``ours+io+ahead``: ``ours+io`` whose plan declares ``lookahead 2``: the io thread loads up to
  two batches beyond the pipeline's depth, ahead of the step being trained (a prefetch queue
  of depth 2 inside the plan);
* ``ours+1load``: the plan edit ``plans.with_parallel_loads(plan, 1, lookahead=2)``: the draw
  alone (a Fetch task) on a thread of its own, two batches ahead, H2D copying where it was, over
  the plain iterator (what ``upstream+thread``'s prefetch thread does, inside the plan);
* ``ours+2loads``: the plan edit ``plans.with_parallel_loads(plan, 2)``: a Fetch task draws the
  items on two threads at once (``loads 2``, ``lookahead 2``), H2D copies them where it was; the
  data is ``torchrec_swp.data.MapSource`` over the very dataset the DataLoader's two workers read
  (the same loader concurrency as ``upstream+dataloader``);
* ``ours+2loads+dist``: besides, the input dist of the batches ahead on thread ``dist``;
* ``ours+2procs``: ``ours+2loads`` whose ``MapSource`` fetches each item in one of 2 worker
  processes (``MapSource(processes=2)``): for a loader whose work holds the GIL, the same
  worker processes as ``upstream+dataloader``'s, the engine's two loads waiting on them;
* ``ours+autotune``: our pipeline with ``autotune=True`` over a ``MapSource`` of the same dataset
  (our own loading, nothing hand-picked): after the interleaved warm-up it runs its tuning alone
  in one block (profile, decision on both ranks' profiles, the switch, a second round, the
  verification), then is timed like every contender with the plan it chose;
* ``ours+thread``, ``ours+io+thread``: the default plan and ``ours+io`` reading the same
  prefetch thread as ``upstream+thread``;
* ``ours+dataloader``, ``ours+io+dataloader``: the default plan and ``ours+io`` reading the same
  DataLoader as ``upstream+dataloader``.

(``--contenders`` picks some; the async-copy rows need TrainPipelineSparseDist.) Every contender
must give the same loss at every step. Reported per loader and latency: mean step (the throughput: with a
background loader steps alternate between short and long, and the median can fall anywhere
between) and median step, QPS at the mean, ratios to upstream, each peer against the best of
ours with the same kind of loader (ahead / equal / behind), and, for ours, the efficiency
against the **lower bound**: an iteration cannot take less than its busiest thread's task time
(an observer, ``StepAccounting``, attached to our engines during the timed steps; a source's
time counts divided by its parallel loads, which share it); efficiency = bound / step, both means.

``ours+autotune`` is compared with the best hand-picked contender of ours twice: by the mean
steps of all rounds, and **without the winner's curse** (``held_out``): the best chosen on the
even rounds judged against it on the odd ones, and the other way round. Where several plans of
ours hit the same bound (compute binds), the fastest of them by the same rounds' means is the
luckiest, and a plan as fast as they are falls short of it by that luck alone. The held-out
ratio comes with its 90% interval, the judged rounds paired: what the run can tell apart.
Beside it, the run's own noise (``halves_noise``): how far each contender's even and odd rounds
lie apart.

Then a memory pass: each contender alone in new rank processes for ``--memory-steps`` steps at
the first latency; its peak RSS per rank (the largest rank's ``ru_maxrss``; for DataLoader
contenders also the largest worker's) goes into its rows: running ahead holds more batches.

``--ranks 2,1`` (default) runs it on 2 gloo ranks, then on 1: with 2 ranks on the 2 cores the
ranks share the cores and wait for each other in every collective; 1 rank has both cores and no
peer, so the per-rank bound is not confounded by the other rank.

Writes ``OUT/overlap.json`` and ``OUT/overlap.md`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    Contender,
    StepAccounting,
    interleave,
    percentile,
    rank_setup,
    release,
    size_arg,
    step_stats,
)
from benchmarks.report import add_train_pipeline_arg, run_meta, write_report
from examples.dlrm.loader_work import KINDS, LoaderWork, calibrate
from harness.dlrm_data import SIZES, batches
from torchrec_swp.data import MapSource

CONTENDERS = (
    "upstream",
    "upstream+async_copy",
    "upstream+async_copy(forced)",
    "upstream+thread",
    "upstream+dataloader",
    "ours",
    "ours+io",
    "ours+io+dist",
    "ours+io+ahead",
    "ours+1load",
    "ours+2loads",
    "ours+2loads+dist",
    "ours+autotune",
    "ours+2procs",
    "ours+thread",
    "ours+io+thread",
    "ours+dataloader",
    "ours+io+dataloader",
)
PEERS = tuple(c for c in CONTENDERS if c.startswith("upstream"))
OURS = tuple(c for c in CONTENDERS if c.startswith("ours"))
ASYNC_COPY = ("upstream+async_copy", "upstream+async_copy(forced)")
#: the seed of the heavy-tailed loader's draws (``--loaders tail``): the same waits in every run
LOADER_SEED = 49
#: the held-out ratio's interval (``held_out``)
HELD_OUT_CONFIDENCE = 0.9


def io_map(task: Any) -> str:
    """``+io``: the stage-0 tasks on thread ``io`` (a Fetch of parallel loads keeps its lanes)."""
    return "io" if task.stage == 0 and task.name != "Fetch" else task.thread_group


def io_dist_map(pipeline: str) -> Callable[[Any], str]:
    """``+io+dist``: the stage-0 tasks on thread ``io``, and every other task below the
    pipeline's highest stage (working on a batch ahead of the one being trained: for SparseDist
    the input dist) on thread ``dist``. (On one thread with the loading, the input dist's
    collectives would wait behind the loader's latency, and with them - their tickets follow
    fire order - the training thread's.)"""
    from torchrec_swp.catalog.torchrec import default_plans

    plan = default_plans()[pipeline]
    top = max(p.max_stage for p in getattr(plan, "plans", (plan,)))

    def io_dist(task: Any) -> str:
        if task.name == "Fetch":  # parallel loads: the lanes stay the source's own
            return task.thread_group
        return "io" if task.stage == 0 else "dist" if task.stage < top else task.thread_group

    return io_dist


class _Closing:
    """An iterator that also closes what feeds it (a prefetch thread, DataLoader workers)."""

    def __init__(self, it: Iterator[Any], close: Callable[[], None]) -> None:
        self.it, self.close = it, close

    def __iter__(self) -> _Closing:
        return self

    def __next__(self) -> Any:
        return next(self.it)


def _contender(
    label: str, rank: int, world_size: int, size_name: str, n: int, latency: LoaderWork, args: argparse.Namespace
) -> Contender:
    """Build contender ``label``: ``upstream`` or ``ours``, then ``+`` options: ``async_copy``,
    ``async_copy(forced)`` (upstream), ``io``, ``dist`` (ours' thread map), ``thread`` or
    ``dataloader`` (the loader). ``latency``: the loader's work before each batch, the same for
    every contender (item ``k`` waits or works the same whoever loads it)."""
    from benchmarks.peers import ThreadPrefetcher, async_copy_runner, dataloader
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    impl, *options = label.split("+")
    size = SIZES[size_name]
    build = lambda: build_dlrm(rank, world_size, size)
    if "2loads" in options or "autotune" in options or "2procs" in options:
        from benchmarks.peers import latency_dataset

        processes = 2 if "2procs" in options else 0
        data = MapSource(latency_dataset(size, rank, n + tuning_steps(args.pipeline), latency), processes=processes)
    elif "dataloader" in options:
        it = dataloader(size, rank, n, latency, num_workers=args.loader_workers, prefetch_factor=args.prefetch_factor)
        data: Iterator[Any] = _Closing(it, getattr(it, "_shutdown_workers", lambda: None))
    elif "thread" in options:
        prefetch = ThreadPrefetcher(batches(size, rank, n, latency), depth=args.thread_depth)
        data = _Closing(prefetch, prefetch.close)
    else:
        data = batches(size, rank, n, latency)
    if impl == "upstream" and any(o.startswith("async_copy") for o in options):
        runner = async_copy_runner(build, forced="async_copy(forced)" in options)
    elif impl == "upstream":
        runner = make_runner(args.pipeline, "upstream", build, upstream_patch=True)
    elif "autotune" in options:
        from torchrec_swp import Autotune

        # its warm-up spans the interleaved warm-up of every contender; it profiles its own block
        # no drift watch: the rounds interleave the contenders in blocks, and the load each
        # leaves behind (DataLoader workers, prefetch threads) is not a drift of this job's step;
        # a re-tune's search in a timed block would be measured as steps
        tuning = Autotune(report=lambda line: None, warmup=args.warmup + TUNING_WARMUP, drift=None, **TUNING)
        runner = make_runner(args.pipeline, "ours", build, options={"autotune": tuning})
    else:
        thread_map = io_dist_map(args.pipeline) if "dist" in options else io_map if "io" in options else None
        runner = make_runner(args.pipeline, "ours", build, plan=_plan(args.pipeline, options), thread_map=thread_map)
    return Contender(label, runner, data)


#: ``ours+autotune``'s tuning (``Autotune``'s counts), run alone before the rounds: warm-up,
#: profile, decision, then enough steps for the verification to end. The search on the training
#: thread: the block then has a bound in steps (``tuning_steps``), and what is timed afterwards, the
#: plan chosen, is the same wherever it was searched (``benchmarks/tuning_cost.py`` times the search
#: in the background, as a job lives it). No budget: the search on the training thread would spend
#: the default one at once and stop the trial it proposes (what tuning costs: ``tuning_cost.py``).
TUNING = {"steps": 25, "verify": 20, "background": False, "budget_steps": None}
#: its own warm-up steps after the interleaved warm-up, before it profiles
TUNING_WARMUP = 5


def tuning_steps(pipeline: str) -> int:
    """Calls of ``ours+autotune``'s block, enough for both rounds, their trials and the
    verification (``Autotune.tuning_bound``, counted from the block's own warm-up)."""
    from torchrec_swp import Autotune, plans

    depth = plans.default_plans()[pipeline].pipeline_depth
    return Autotune(warmup=TUNING_WARMUP, **TUNING).tuning_bound(depth)


def _tune(c: Contender) -> dict[str, Any]:
    """Run ``ours+autotune``'s tuning alone, after every contender's warm-up (consecutive steps:
    the profile is of its own steps, not of the others', and taken once the other contenders'
    loaders - DataLoader workers starting up, prefetch threads filling their queues - are quiet);
    its decision. It ends once the tuning has (the plan kept, or chosen and verified: the same
    call on every rank, the decision being every rank's), at most ``tuning_steps`` steps."""
    for _ in range(tuning_steps(c.runner.info.name)):
        c.losses.append(float(c.runner.step(c.batches)[0]))
        d = c.runner.pipeline.autotune_decision
        if d is not None and d.decided and (d.measured_s is not None or not d.switched):
            break
    d = c.runner.pipeline.autotune_decision
    plan = c.runner.pipeline.plan
    return {
        "switched": bool(d and d.switched),
        "change": [line for line in (d.why if d else ()) if line.startswith("the change: ")],
        "why": list(d.why) if d else ["the data ended before the decision"],
        "threads": list(plan.thread_groups),
        "lookahead": plan.lookahead,
        "loads": plan.loads,
        "processes": 0 if d is None else d.processes,
        "input_dist_group": bool(d and d.own_group),
        "predicted_ms": None if d is None or d.predicted_s is None else 1e3 * d.predicted_s,
        "verified_ms": None if d is None or d.measured_s is None else 1e3 * d.measured_s,
        # the trial: every plan tried with its predicted and measured step, and what tuning cost
        "tried": []
        if d is None
        else [
            {
                "plan": _describe(t.plan, t.processes),
                "predicted_ms": None if t.predicted_s is None else 1e3 * t.predicted_s,
                "measured_ms": None if t.measured_s is None else 1e3 * t.measured_s,
                "steps": t.steps,
                "verdict": t.verdict,
            }
            for t in d.tried
        ],
        "trial_steps": 0 if d is None else d.trial_steps,
        "switches": 0 if d is None else d.switches,
        "tuning_steps": None if d is None else d.tuning_steps,
    }


def _describe(text: str, processes: int = 0) -> str:
    from torchrec_swp.autotune.trial import describe
    from torchrec_swp.plan import PipelinePlan

    return describe(PipelinePlan.from_text(text), processes)


def _plan(pipeline: str, options: list[str]) -> Any:
    """The plan of ``ours+...``: the default one, declaring a lookahead (``ahead``) or split for
    two parallel loads (``2loads``) or for one on a thread of its own (``1load``); None: the default
    plan as it is."""
    from torchrec_swp.catalog.torchrec import default_plans
    from torchrec_swp.catalog.transforms import with_parallel_loads

    if "2loads" in options or "2procs" in options:
        return with_parallel_loads(default_plans()[pipeline], 2)
    if "1load" in options:
        return with_parallel_loads(default_plans()[pipeline], 1, lookahead=2)
    if "ahead" in options:
        plan = default_plans()[pipeline]
        return plan.replace(lookahead=2) if hasattr(plan, "replace") else plan
    return None


def interleave_blocks(
    contenders: list[Contender], rounds: int, block: int, skip: int, accounts: dict[str, StepAccounting], tick: Any
) -> dict[str, list[Any]]:
    """``rounds`` rounds; in each, every contender runs ``block`` consecutive steps (the order
    rotating every round), of which the first ``skip`` are not timed: a contender whose loader
    works in the background (a prefetch thread, DataLoader workers) filled its queue while the
    others ran, and would look faster than it can sustain. Each contender's ``times`` get the
    timed steps, ``losses`` every step; for ours, ``accounts[label]`` (attached to its engine)
    turns each timed step into a StepRecord, returned by label."""
    records: dict[str, list[Any]] = {label: [] for label in accounts}
    n = len(contenders)
    for round_ in range(rounds):
        for k in range(n):
            c = contenders[(round_ + k) % n]
            acc = accounts.get(c.label)
            for step in range(block):
                start = time.perf_counter()
                output = c.runner.step(c.batches)
                took = time.perf_counter() - start
                if acc is not None:
                    record = acc.take(took)
                    if step >= skip:
                        records[c.label].append(record)
                if step >= skip:
                    c.times.append(took)
                c.losses.append(float(output[0]))
                tick()
    return records


def _same_prefix(a: list[float], b: list[float]) -> bool:
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _stats(times: list[float], examples_per_step: int, per_round: int) -> dict[str, Any]:
    """Mean and median step (ms), QPS at the mean step (the throughput), P90 and P99, and each
    round's mean step (``rounds_ms``: ``per_round`` timed steps a round)."""
    mean = statistics.fmean(times)
    rounds = [1e3 * statistics.fmean(times[k : k + per_round]) for k in range(0, len(times), per_round)]
    return {
        **step_stats(times, examples_per_step),
        "mean_ms": 1e3 * mean,
        "p99_ms": 1e3 * percentile(times, 0.99),
        "qps": examples_per_step / mean,
        "rounds_ms": rounds,
    }


def held_out(r: dict[str, Any], picked: list[str], against: str) -> dict[str, Any] | None:
    """``against`` and the best of ``picked`` without the winner's curse: the best chosen on one
    half of the rounds (even, then odd) and both judged on the other half, where the choice saw
    none of the noise. The best of several contenders by the same rounds' means is, on average,
    faster there than it is (its luck chose it); where they are as fast as one another (compute
    binds), that luck is what ``against`` would be compared with. ``ratio``: the geometric mean
    of the two halves' ``best / against`` mean steps (above 1: ``against`` is faster). None with
    fewer than 2 rounds.

    ``low``, ``high``: its ``HELD_OUT_CONFIDENCE`` interval, from the judged rounds paired (each
    round's ``log(best / against)``, the two contenders a few seconds apart: the machine's slow
    spells fall on both), the two halves' t intervals of the mean combined; None below 2 judged
    rounds per half. What a run can tell apart: where it spans 0.95 and 1.05 alike, the run
    cannot say whether ``against`` is 5% behind or 5% ahead."""
    rounds = {label: r[label].get("rounds_ms") or [] for label in [*picked, against]}
    n = min(len(v) for v in rounds.values())
    if n < 2 or not picked:
        return None
    halves = (range(0, n, 2), range(1, n, 2))
    picks, ratios, paired = [], [], []
    for chosen_on, judged_on in (halves, halves[::-1]):
        best = min(picked, key=lambda label: statistics.fmean(rounds[label][i] for i in chosen_on))
        judged = statistics.fmean(rounds[best][i] for i in judged_on)
        picks.append(best)
        ratios.append(judged / statistics.fmean(rounds[against][i] for i in judged_on))
        paired.append([math.log(rounds[best][i] / rounds[against][i]) for i in judged_on])
    ratio = math.sqrt(ratios[0] * ratios[1])
    low = high = None
    if all(len(p) >= 2 for p in paired):
        from torchrec_swp.autotune.trial import t_quantile

        # the mean of the halves' logs: each half's variance of its mean, a quarter each
        se = math.sqrt(sum(statistics.variance(p) / len(p) for p in paired)) / 2
        half = t_quantile(HELD_OUT_CONFIDENCE, sum(len(p) - 1 for p in paired)) * se
        low, high = ratio * math.exp(-half), ratio * math.exp(half)
    return {"picks": picks, "ratios": ratios, "ratio": ratio, "low": low, "high": high}


def halves_noise(r: dict[str, Any], labels: list[str]) -> dict[str, Any] | None:
    """How far one contender's two halves of the rounds (even, odd) lie apart in this run: per
    contender ``|log(even mean / odd mean)|`` as a percentage; the median and the largest (with
    its contender). The same plan on the same machine in the same run: the noise of a half's mean
    step. None with fewer than 2 rounds."""
    spread = {}
    for label in labels:
        rounds = r[label].get("rounds_ms") or []
        if len(rounds) >= 2:
            even, odd = statistics.fmean(rounds[0::2]), statistics.fmean(rounds[1::2])
            spread[label] = 100 * abs(math.log(even / odd))
    if not spread:
        return None
    worst = max(spread, key=spread.__getitem__)
    return {"median_pct": statistics.median(spread.values()), "largest_pct": spread[worst], "largest": worst}


def _case(
    rank: int, world_size: int, size_name: str, latency: LoaderWork, args: argparse.Namespace, tick: Any
) -> dict[str, Any]:
    size = SIZES[size_name]
    rounds = -(-args.steps // (args.block - args.skip))  # enough rounds to time at least --steps steps
    total = args.warmup + rounds * args.block
    latency_ms = latency.ms
    contenders: list[Contender] = []
    accounts: dict[str, StepAccounting] = {}
    try:
        for label in args.contenders:
            contenders.append(_contender(label, rank, world_size, size_name, total + 4, latency, args))
        interleave(contenders, args.warmup, tick)
        tuned = {c.label: _tune(c) for c in contenders if c.label == "ours+autotune"}
        for c in contenders:
            c.times.clear()
            if c.label.startswith("ours"):
                plan = c.runner.pipeline.engine.plan
                lanes = {plan.task(plan.source).thread_group: plan.loads} if plan.source else {}
                accounts[c.label] = StepAccounting(lanes=lanes)
                c.runner.pipeline.engine.instrument(accounts[c.label])
        records = interleave_blocks(contenders, rounds, args.block, args.skip, accounts, tick)
        threads = {c.label: c.runner.pipeline.engine.plan.thread_groups for c in contenders if c.label in accounts}
    finally:
        for c in contenders:
            if c.label in accounts:
                c.runner.pipeline.engine.instrument()
            if isinstance(c.batches, (_Closing, MapSource)):
                c.batches.close()
        release(*contenders)
    examples = size.batch_size * world_size
    stats = {c.label: _stats(c.times, examples, args.block - args.skip) for c in contenders}
    bounds = {
        label: {
            "bound_ms": 1e3 * statistics.fmean(max(r.busy.values(), default=0.0) for r in recs),
            "busy_ms": {t: 1e3 * statistics.fmean(r.busy.get(t, 0.0) for r in recs) for t in threads[label]},
        }
        for label, recs in records.items()
    }
    out: dict[str, Any] = {
        "size": size_name,
        "ranks": world_size,
        "latency_ms": latency_ms,
        "loader": latency.kind,
        "loader_work": latency.describe(),
        **stats,
        # every step's loss, over the steps all trained (the tuning ran ahead of the others)
        "same_losses": all(_same_prefix(c.losses, contenders[0].losses) for c in contenders),
        "losses_differ": [c.label for c in contenders if not _same_prefix(c.losses, contenders[0].losses)],
        "bounds": bounds,
        "efficiency": {label: b["bound_ms"] / stats[label]["mean_ms"] for label, b in bounds.items()},
        "autotune": tuned.get("ours+autotune"),
    }
    picked = [label for label in args.contenders if label in OURS and label != "ours+autotune"]
    if "ours+autotune" in stats:
        out["held_out"] = held_out(out, picked, "ours+autotune")
    out["halves_noise"] = halves_noise(out, list(args.contenders))
    if "upstream" in stats:
        out["latency_share_of_upstream_step"] = latency_ms / stats["upstream"]["mean_ms"]
    return out


def _memory_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    """The memory pass: contender ``args.memory_label`` alone in new rank processes, for
    ``args.memory_steps`` steps at the first latency; peak RSS (MiB) of this rank's process and
    of its largest child (DataLoader workers; 0 without). Running ahead holds more batches."""
    rank_setup()
    import resource

    work = calibrate(args.loaders[0], args.latencies_ms[0], seed=LOADER_SEED, rank=rank)
    c = _contender(args.memory_label, rank, world_size, args.sizes[0], args.memory_steps + 4, work, args)
    try:
        for _ in range(args.memory_steps):
            c.runner.step(c.batches)
    finally:
        if isinstance(c.batches, (_Closing, MapSource)):
            c.batches.close()  # the workers are joined: their peak counts in RUSAGE_CHILDREN
        release(c)
    return {
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rank_setup()
    from tqdm import tqdm

    # the work of each loader kind, calibrated once on this rank before any contender exists
    works = {(k, ms): calibrate(k, ms, seed=LOADER_SEED, rank=rank) for k in args.loaders for ms in args.latencies_ms}
    cases = [(s, works[k, ms]) for s in args.sizes for k in args.loaders for ms in args.latencies_ms]
    rounds = -(-args.steps // (args.block - args.skip))
    per_case = args.warmup + len(args.contenders) * rounds * args.block
    bar = tqdm(total=per_case * len(cases), disable=rank != 0, unit="step", mininterval=1.0, file=sys.stdout)
    out = []
    try:
        for size_name, latency in cases:
            bar.set_description(f"{world_size} rank(s), {size_name}, loader {latency.kind} {latency.ms:g} ms")
            out.append(_case(rank, world_size, size_name, latency, args, bar.update))
    finally:
        bar.close()
    return out


# ----------------------------------------------------------------------------- report
def _verdict(ratio: float, tolerance: float) -> str:
    return "ahead" if ratio > 1 + tolerance else "behind" if ratio < 1 - tolerance else "equal"


def comparisons(r: dict[str, Any], labels: list[str], tolerance: float) -> list[tuple[str, str, float, str]]:
    """``(ours, peer, speed-up, verdict)``: each peer against the best of ours that uses the same
    kind of loader (plain iterator, prefetch thread, DataLoader), and the best peer against the
    best of ours over everything (each pair once)."""

    def loader(label: str) -> str:
        # two parallel loads draw as many items at once as the DataLoader's two workers
        return (
            "dataloader"
            if "dataloader" in label or "2loads" in label or "2procs" in label or "autotune" in label
            else "thread"
            if "thread" in label or "1load" in label
            else "plain"
        )

    out = []
    ours = [o for o in labels if o in OURS]
    for peer in (p for p in labels if p in PEERS):
        same = [o for o in ours if loader(o) == loader(peer)]
        if same:
            best = min(same, key=lambda o: r[o]["mean_ms"])
            ratio = r[peer]["mean_ms"] / r[best]["mean_ms"]
            out.append((best, peer, ratio, _verdict(ratio, tolerance)))
    peers = [p for p in labels if p in PEERS]
    if peers and ours:
        best_peer = min(peers, key=lambda p: r[p]["mean_ms"])
        best_ours = min(ours, key=lambda o: r[o]["mean_ms"])
        ratio = r[best_peer]["mean_ms"] / r[best_ours]["mean_ms"]
        out.append((best_ours, best_peer, ratio, _verdict(ratio, tolerance)))
    return list(dict.fromkeys(out))


def _autotune_lines(r: dict[str, Any], labels: list[str]) -> list[str]:
    """What ``ours+autotune`` chose, and where it stands against the best hand-picked of ours
    and the best peer (mean steps)."""
    t = r.get("autotune")
    if t is None or "ours+autotune" not in labels:
        return []
    mean = r["ours+autotune"]["mean_ms"]
    picked = [o for o in labels if o in OURS and o != "ours+autotune"]
    peers = [p for p in labels if p in PEERS]
    out = [
        "- ours+autotune chose "
        + (
            f"threads {t['threads']}, lookahead {t['lookahead']}, loads {t['loads']}"
            + (f" in {t['processes']} worker processes" if t.get("processes") else "")
            + (", the input dist in its own comm group" if t["input_dist_group"] else "")
            + f" (the search proposed: {'; '.join(c.removeprefix('the change: ') for c in t['change'])}): "
            + (
                f"predicted {t['predicted_ms']:.2f} ms, measured {mean:.2f} ms in the rounds "
                f"({100 * (t['predicted_ms'] / mean - 1):+.0f}%)"
                if t["predicted_ms"] is not None
                else f"no prediction of its own (the trial measured it best), measured {mean:.2f} ms in the rounds"
            )
            if t["switched"]
            else f"to keep its plan ({t['why'][-1]})"
        )
    ]
    for x in t.get("tried", []):
        out.append(
            f"  - tried {x['plan']}: predicted "
            + ("-" if x["predicted_ms"] is None else f"{x['predicted_ms']:.2f} ms")
            + ", measured "
            + ("-" if x["measured_ms"] is None else f"{x['measured_ms']:.2f} ms")
            + f" over {x['steps']} steps ({x['verdict']})"
        )
    if t.get("tuning_steps") is not None:
        out.append(
            f"- tuning took {t['tuning_steps']} steps before the final plan ({t['trial_steps']} in trials, "
            f"{t['switches']} switches)"
        )
    if picked:
        best = min(picked, key=lambda o: r[o]["mean_ms"])
        out.append(f"- ours+autotune vs the best hand-picked of ours ({best}): {r[best]['mean_ms'] / mean:.2f}x")
        h = r.get("held_out")
        if h is not None:
            out.append(
                "- ours+autotune vs the best hand-picked of ours chosen on the other half of the rounds (without the "
                f"winner's curse): {h['picks'][0]} (chosen on the even rounds) {h['ratios'][0]:.2f}x on the odd ones, "
                f"{h['picks'][1]} {h['ratios'][1]:.2f}x on the even ones: **{h['ratio']:.2f}x**"
                + (
                    ""
                    if h.get("low") is None
                    else f" ({100 * HELD_OUT_CONFIDENCE:.0f}% interval {h['low']:.2f}-{h['high']:.2f}x, rounds paired)"
                )
            )
    if peers:
        best = min(peers, key=lambda p: r[p]["mean_ms"])
        out.append(f"- ours+autotune vs the best peer ({best}): {r[best]['mean_ms'] / mean:.2f}x")
    return out


def _sleep(r: dict[str, Any]) -> str:
    """A result's loader, written before ``--loaders``: a sleep."""
    return f"sleep {r['latency_ms']:g} ms"


def _markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    labels = [c for c in CONTENDERS if c in meta["contenders"]]
    lines = [
        f"# Overlap: {meta['pipeline']} with a loader that waits or works, against upstream's ways to hide it",
        "",
        f"{meta['date']}; `{meta['command']}`",
        (
            f"{meta['warmup']} warm-up steps interleaved call by call, then rounds of {meta['block']} consecutive "
            f"steps per contender ({meta['skip']} untimed), at least {meta['steps']} timed steps each; DataLoader: "
            f"{meta['loader_workers']} workers, prefetch_factor {meta['prefetch_factor']}; prefetch thread depth "
            f"{meta['thread_depth']}. Compared by the **mean** step (throughput: QPS over all ranks = examples / "
            "mean step): with a background loader, steps alternate between waiting and not (two DataLoader workers "
            "finish together) and the median can fall anywhere between. `bound`: the busiest thread's task time per "
            "step of our contender (mean over its timed steps); `eff` = bound / mean step."
        ),
    ]
    for r in results:
        share = r.get("latency_share_of_upstream_step")
        lines += [
            "",
            f"## {r['ranks']} rank(s), {r['size']} DLRM, loader {r.get('loader_work') or _sleep(r)}"
            + (f" ({100 * share:.0f}% of upstream's step)" if share else ""),
            "",
            "| contender | mean ms | median ms | p99 ms | QPS | vs upstream | bound ms (busiest thread) | eff "
            "| peak RSS MiB/rank |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        up = r.get("upstream")
        for label in labels:
            s = r[label]
            vs = f"{up['mean_ms'] / s['mean_ms']:.2f}x" if up else "-"
            b = r["bounds"].get(label)
            bound = "-"
            if b is not None:
                busiest = max(b["busy_ms"], key=b["busy_ms"].get)
                bound = f"{b['bound_ms']:.2f} ({busiest})"
            eff = f"{r['efficiency'][label]:.2f}" if label in r["efficiency"] else "-"
            m = r.get("memory", {}).get(label)
            rss = "-"
            if m is not None:
                worker = f" (+ worker {m['worker_rss_mib']:,.0f})" if "dataloader" in label else ""
                rss = f"{m['rss_mib']:,.0f}{worker}"
            lines.append(
                f"| {label} | {s['mean_ms']:.2f} | {s['median_ms']:.2f} | {s.get('p99_ms', math.nan):.2f} "
                f"| {s['qps']:,.0f} "
                f"| {vs} | {bound} | {eff} | {rss} |"
            )
        lines.append("")
        for ours, peer, ratio, verdict in comparisons(r, labels, meta["tolerance"]):
            lines.append(f"- {ours} vs {peer}: {ratio:.2f}x, **{verdict}**")
        lines += _autotune_lines(r, labels)
        noise = r.get("halves_noise")
        if noise is not None:
            lines.append(
                f"- the noise: one contender's mean step over the even rounds and over the odd ones differ by a median "
                f"{noise['median_pct']:.1f}% (largest {noise['largest_pct']:.1f}%, {noise['largest']})"
            )
        lines.append(
            "- same losses at every step: "
            + ("yes" if r["same_losses"] else f"NO ({', '.join(r['losses_differ'])})")
            + f" ('equal' = within +-{100 * meta['tolerance']:.0f}%)"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_pipeline_arg(parser)
    parser.add_argument(
        "--quick", action="store_true", help="latencies 5,20 ms; rounds of 40 steps (20 untimed), 40 timed, 10 warm-up"
    )
    parser.add_argument(
        "--latencies-ms", type=lambda s: [float(x) for x in s.split(",")], default=None, help="(default: 5,10,20)"
    )
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 1], help="(default: 2,1)")
    parser.add_argument(
        "--loaders",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=["sleep"],
        help="comma-separated kinds of the loader's per-batch work, each as long as a latency: "
        + ", ".join(KINDS)
        + " (examples/dlrm/loader_work.py; default: sleep)",
    )
    parser.add_argument(
        "--contenders",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(CONTENDERS),
        help="comma-separated, of: " + ", ".join(CONTENDERS),
    )
    parser.add_argument(
        "--sizes", type=size_arg, default=["small"], help=f"comma-separated, of {', '.join(SIZES)} (default: small)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps at least (default: 200, --quick 40)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 20, --quick 10)")
    parser.add_argument(
        "--block", type=int, default=None, help="steps of a contender per round (default: 40, --quick 40)"
    )
    parser.add_argument("--skip", type=int, default=None, help="untimed steps per block (default: half the block)")
    parser.add_argument("--loader-workers", type=int, default=2, help="DataLoader workers (default: %(default)s)")
    parser.add_argument(
        "--prefetch-factor", type=int, default=2, help="DataLoader prefetch_factor (default: %(default)s)"
    )
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=30,
        help="the memory pass: each contender alone, in new processes, this many steps; its peak RSS per rank "
        "(the largest rank's) goes into its rows (0: no memory pass; default: %(default)s)",
    )
    parser.add_argument("--thread-depth", type=int, default=2, help="prefetch thread queue (default: %(default)s)")
    parser.add_argument(
        "--tolerance", type=float, default=0.03, help="a speed-up within 1 +- this is 'equal' (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    args.latencies_ms = args.latencies_ms or ([5.0, 20.0] if args.quick else [5.0, 10.0, 20.0])
    args.steps = args.steps or (40 if args.quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    args.block = args.block or 40
    args.skip = args.skip if args.skip is not None else args.block // 2
    if [k for k in args.loaders if k not in KINDS] or not args.loaders:
        parser.error(f"--loaders: choose among {', '.join(KINDS)}, got {args.loaders}")
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose among {', '.join(CONTENDERS)}")
    if args.pipeline != "TrainPipelineSparseDist":
        args.contenders = [c for c in args.contenders if c not in ASYNC_COPY]
    if (
        args.steps < 1
        or args.warmup < 0
        or any(x < 0 for x in args.latencies_ms)
        or any(r < 1 for r in args.ranks)
        or args.loader_workers < 1
        or args.prefetch_factor < 1
        or args.thread_depth < 1
        or not 0 <= args.skip < args.block
    ):
        parser.error(
            "--steps, --ranks, --loader-workers, --prefetch-factor, --thread-depth >= 1; --warmup, latencies >= 0; "
            "0 <= --skip < --block"
        )
    from harness.dlrm import not_exported

    if args.pipeline in not_exported():
        parser.error(not_exported()[args.pipeline])

    from harness.ranks import run_on_ranks

    results = []
    for world_size in args.ranks:
        rows = run_on_ranks(_rank, args, world_size=world_size, timeout_s=7200.0)[0]
        if args.memory_steps:
            memory = {}
            for label in args.contenders:
                print(f"memory pass: {label} alone on {world_size} rank(s), {args.memory_steps} steps", flush=True)
                per_rank = run_on_ranks(
                    _memory_rank,
                    argparse.Namespace(**vars(args), memory_label=label),
                    world_size=world_size,
                    timeout_s=600.0,
                )
                memory[label] = {k: max(m[k] for m in per_rank) for k in per_rank[0]}
            for row in rows:
                row["memory"] = memory
        results += rows
    meta = run_meta(
        "overlap.py",
        argv,
        args,
        "pipeline",
        "contenders",
        "loaders",
        "steps",
        "warmup",
        "block",
        "skip",
        "loader_workers",
        "prefetch_factor",
        "thread_depth",
        "tolerance",
    )
    write_report(args.out, "overlap", {"meta": meta, "results": results}, _markdown(results, meta))


if __name__ == "__main__":
    main()
