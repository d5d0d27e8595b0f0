"""The first move: a draw that waits, run ahead on a thread of its own, tried before any search.

A draw whose thread spends most of its time off the CPU (storage, a remote read, a queue: its
thread CPU time far below its wall time, ``WAITING_DRAW``) and takes a good share of the step
(``WAITING_SHARE``) is hidden by running it ahead on a thread of its own, several at once where
the data splits its draws: the move that ``with_parallel_loads`` makes by hand, and that every
search of this project has chosen or bettered for such a loader (``benchmarks/overlap.py``, the
sleeping and heavy-tailed loaders). It needs no model: the tuner tries it at once against the
running plan (``Tuner``, round 1), where a search would take seconds of CPU before anything
changes (``notebook/2026-12-loaders.md``: a 60-step job ended before the search had). The
trial's measurements decide; the search (round 2, or round 1 where the move lost) goes on
from the plan kept.

A draw that computes (Python parsing, torch ops) is not moved so: whether a thread helps it
depends on the GIL, which only the search and its trial can weigh (``autotune.search``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from torchrec_swp.autotune.options import Autotune
from torchrec_swp.catalog.transforms import DRAW_TASKS, with_parallel_loads
from torchrec_swp.plan import MAIN_THREAD, PlanError
from torchrec_swp.profiler import Profile, ProfileError

#: a draw whose thread computes less than this share of its time (thread CPU / wall, every rank's
#: together) waits
WAITING_DRAW = 0.25
#: ... and is worth moving first where its mean time is at least this share of the measured step
WAITING_SHARE = 0.1
#: the loads the first move runs where the data splits its draws (if the options allow them)
FIRST_LOADS = 2
#: the thread the moved draw runs on (the search's ``autosched.overlap.LOAD_THREAD``)
THREAD = "load"


def first_move(
    gathered: Sequence[dict[str, Any]], measured: float | None, options: Autotune
) -> tuple[list[Any], str] | None:
    """From every rank's gathered profile (``{"profile", "trouble"}``) and the running plan's
    measured step: the trial's candidates (``[plan text, predicted step, own group, worker
    processes]``, the running plan first, then the moved one) and the line saying why; None where
    the draw does not wait, takes too small a share of the step, already runs off the calling
    thread, or ``options`` leave no room (``loads``, ``lookahead``, ``max_threads``,
    ``max_in_flight``, ``memory_cap_bytes``).
    Pure: rank 0 calls it, every rank takes its answer."""
    if measured is None or measured <= 0 or any(g.get("trouble") for g in gathered):
        return None
    try:
        profiles = [Profile.from_json(g["profile"]) for g in gathered]
        plan = profiles[0].plan
        source = plan.source
        if source not in DRAW_TASKS or plan.loads != 1 or plan.task(source).thread_group != MAIN_THREAD:
            return None
        stats = [p.stats(source) for p in profiles]
    except (PlanError, ProfileError, KeyError, ValueError):
        return None
    if any(s.cpu_mean_s is None for s in stats):
        return None
    wall = sum(s.mean_s for s in stats)
    share = sum(s.cpu_mean_s or 0.0 for s in stats) / wall if wall > 0 else 1.0
    draw = statistics.fmean(s.mean_s for s in stats)
    if share >= WAITING_DRAW or draw < WAITING_SHARE * measured:
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
        moved = with_parallel_loads(plan, k, lookahead=ahead, thread=THREAD)
    except (PlanError, ValueError):
        return None
    several = f"{k} loads at once" if k > 1 else "one load"
    line = (
        f"the draw {source} waits: its thread computes {100 * share:.0f}% of its {1e3 * draw:.2f} ms "
        f"({100 * draw / measured:.0f}% of the {1e3 * measured:.2f} ms step), so it first tries the draw on a "
        f"thread of its own, {several}, {ahead} ahead, against the running plan, before any search"
    )
    return [[plan.to_text(), None, False, 0], [moved.to_text(), None, False, 0]], line
