"""The first move: before any search, the plans that a draw on the calling thread calls for.

A search calibrates the simulator and scores tens of plans: seconds of CPU that a job pays before
anything changes (``notebook/2026-12-loaders.md``: a 60-step job ended before the search had; a
2-rank job on 2 cores lost 13% over 1,000 steps to a search that found nothing). For the draw,
a profile already says what to try, by its thread's CPU time against its wall time:

* **a draw that waits** (its thread computes under ``WAITING_DRAW`` of its time: storage, a remote
  read, a queue) is hidden by running it ahead on a thread of its own, several at once where the
  data splits its draws: the move ``with_parallel_loads`` makes by hand, which every search of
  this project chose or bettered for such a loader (``benchmarks/overlap.py``, the sleeping and
  heavy-tailed loaders). Where it loses, round 1 searches from the profile it took;
* **a draw that computes** (``CPU_BOUND_DRAW`` of its time or more: Python parsing, torch ops):
  a thread helps only where its work releases the GIL, worker processes only where a core is
  free, and the profile cannot tell which. The search's model, which holds the GIL for all CPU
  work, predicts nothing for it, and round 1's search then proposes the plans that would win
  without the GIL and their twins in worker processes (``autotune.search``): the first move tries
  those at once (2 loads on threads, and in 2 worker processes where the data can fetch in them
  and the draw is long enough to pay a process's hand-off, ``PROCESS_MIN_DRAW_S``).
  Where both lose, nothing is searched: the plan stays.

Each is a trial against the running plan that starts at the call after the profile
(``Tuner``, round 1); the search of round 2 goes on from a plan that won. A draw between the two
(a quarter to half its time computing), or one under ``WAITING_SHARE`` of the step, is left to
the search.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchrec_swp.autotune.options import Autotune
from torchrec_swp.autotune.search import CPU_BOUND_DRAW, draw_cpu_share
from torchrec_swp.catalog.transforms import DRAW_TASKS, with_parallel_loads
from torchrec_swp.plan import MAIN_THREAD, PlanError
from torchrec_swp.profiler import Profile, ProfileError

#: a draw whose thread computes less than this share of its time (thread CPU / wall, every rank's
#: together) waits; one that computes ``search.CPU_BOUND_DRAW`` (a half) of it or more computes
WAITING_DRAW = 0.25
#: either is worth moving first where its mean time is at least this share of the measured step
WAITING_SHARE = 0.1
#: the loads the first move runs where the data splits its draws (if the options allow them), and
#: the worker processes it tries them in for a draw that computes
FIRST_LOADS = 2
#: the thread the moved draw runs on (the search's ``autosched.overlap.LOAD_THREAD``)
THREAD = "load"
#: the shortest draw (mean, seconds) tried in worker processes: a fetch there costs a hand-off of
#: about 0.65 ms on this project's machines (``MapSource(processes=1)`` of a 64x16 tensor, median of
#: 300, 2026-12-05: 0.66 ms with no work, 1.16 against 0.51 ms with 0.5 ms of Python), which a
#: draw of a fraction of a millisecond cannot win back (a 0.4 ms draw ran 3.6-4.0 ms steps in 2
#: processes against 1 ms on its thread)
PROCESS_MIN_DRAW_S = 2e-3


@dataclass(frozen=True)
class FirstMove:
    """What the first move tries: the trial's ``candidates`` (``[plan text, predicted step, own
    group, worker processes]``, the running plan first), the line saying why, and whether round 1
    searches where the running plan measures best (``then_search``: a draw that waits; a draw that
    computes keeps the plan)."""

    candidates: list[Any]
    why: str
    then_search: bool


def first_move(
    gathered: Sequence[dict[str, Any]], measured: float | None, options: Autotune, processes: bool = False
) -> FirstMove | None:
    """From every rank's gathered profile (``{"profile", "trouble"}``), the running plan's
    measured step and whether the data can fetch in worker processes
    (``torchrec_swp.data.MapSource.use_processes``): the first move (module docstring), or None
    where the draw is between waiting and computing, takes too small a share of the step, already
    runs off the calling thread, or ``options`` leave no room (``loads``, ``lookahead``,
    ``max_threads``, ``max_in_flight``, ``memory_cap_bytes``, ``candidates``). Pure: rank 0
    calls it, every rank takes its answer."""
    if measured is None or measured <= 0 or options.candidates < 1 or any(g.get("trouble") for g in gathered):
        return None
    try:
        profiles = [Profile.from_json(g["profile"]) for g in gathered]
        plan = profiles[0].plan
        source = plan.source
        if source not in DRAW_TASKS or plan.loads != 1 or plan.task(source).thread_group != MAIN_THREAD:
            return None
        share = draw_cpu_share(profiles, source)
        draw = statistics.fmean(p.stats(source).mean_s for p in profiles)
    except (PlanError, ProfileError, KeyError, ValueError):
        return None
    if share is None:
        return None
    waits = share < WAITING_DRAW
    if not (waits or share >= CPU_BOUND_DRAW) or draw < WAITING_SHARE * measured:
        return None
    splits = all(p.where.split_draws for p in profiles)
    o = options
    k = FIRST_LOADS if splits and FIRST_LOADS in o.loads else 1
    ahead = next((a for a in sorted(o.lookahead) if a >= k), max(o.lookahead))
    depth = plan.pipeline_depth
    batch = max(p.where.batch_bytes for p in profiles)
    if (
        ahead < 1
        or depth + ahead > o.max_in_flight
        or (o.memory_cap_bytes is not None and (depth + ahead) * batch > o.memory_cap_bytes)
        or len(set(plan.thread_groups) | {THREAD}) + k - 1 > o.max_threads
    ):
        return None
    try:
        moved = with_parallel_loads(plan, k, lookahead=ahead, thread=THREAD).to_text()
    except (PlanError, ValueError):
        return None
    several = f"{k} loads at once" if k > 1 else "one load"
    its = (
        f"its thread computes {100 * share:.0f}% of its {1e3 * draw:.2f} ms "
        f"({100 * draw / measured:.0f}% of the {1e3 * measured:.2f} ms step)"
    )
    running = [plan.to_text(), None, False, 0]
    if waits:
        why = (
            f"the draw {source} waits: {its}, so it first tries the draw on a thread of its own, {several}, "
            f"{ahead} ahead, against the running plan, before any search"
        )
        return FirstMove([running, [moved, None, False, 0]], why, then_search=True)
    candidates = [running, [moved, None, False, 0]]
    in_processes = ""
    if processes and splits and k > 1 and draw >= PROCESS_MIN_DRAW_S:
        candidates.insert(1, [moved, None, False, k])  # (first: where the GIL binds, only processes load in parallel)
        in_processes = f", on threads and in {k} worker processes"
    candidates = candidates[: o.candidates + 1]
    why = (
        f"the draw {source} computes: {its}; a thread helps it only where its work releases the GIL "
        f"(torch ops, not Python parsing), which no profile tells, so it first tries the draw on a thread of its own, "
        f"{several}, {ahead} ahead{in_processes}, against the running plan; where none wins the plan stays, "
        "unsearched (the search's model, holding the GIL for all CPU work, would propose these same plans)"
    )
    return FirstMove(candidates, why, then_search=False)
