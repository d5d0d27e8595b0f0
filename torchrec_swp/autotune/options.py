"""``Autotune``: how a pipeline tunes itself (``autotune=Autotune(...)``, or ``autotune=True`` for
these defaults)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torchrec_swp.autosched.inputs import DEFAULT_COLD, DEFAULT_GIL, DEFAULT_WAKE
from torchrec_swp.sim import Cold, Wake

LOG = logging.getLogger("torchrec_swp.autotune")


def log_info(line: str) -> None:
    """One INFO line on logger ``torchrec_swp.autotune`` (``report=log_info``: every line there,
    nothing on stdout)."""
    LOG.info(line)


class PrintedReport:
    """The default ``report``: every line at INFO on logger ``torchrec_swp.autotune``, and each
    headline (the decision of each round, the data ending before it, the measured step) also on
    stdout, one line, flushed, as ``examples/dlrm/train.py`` prints its summary; the reasons
    (what binds, the change) stay in the log. Like every report, called on rank 0 only."""

    def __call__(self, line: str) -> None:
        LOG.info(line)

    def headline(self, line: str) -> None:
        LOG.info(line)
        print(line, file=sys.stdout, flush=True)

    def __repr__(self) -> str:
        return "torchrec_swp.autotune.options.PRINTED"


#: The default report (``PrintedReport``).
PRINTED = PrintedReport()


@dataclass(frozen=True)
class Autotune:
    """What a self-tuning pipeline does, in steps of ``progress()``:

    * ``warmup`` steps on the starting plan, not measured (first calls, caches, thread start);
    * ``steps`` steps profiled (every task's time and CPU, every call's cost);
    * then, in the next call, every rank's profile goes to rank 0, which searches
      (``torchrec_swp.autosched.overlap``: threads, lookahead, parallel loads, the input dist's
      comm group; nothing that changes a batch's numerics) and tells every rank the plan;
      each switches to it at that batch boundary, nothing lost or repeated. With ``background``
      (the default) the search runs in a process of its own at a low CPU priority
      (``autotune.search``) while the pipeline trains on its running plan, and the ranks take its
      result at the first poll after it ended (every few calls); past ``search_s`` seconds
      (None: no limit) it is stopped and the plan kept. ``background`` False: rank 0 searches on
      the training thread, every rank waiting (seconds, inside one step);
    * with ``rounds`` 2 (the default), once the switch has settled the running plan is profiled
      again (``steps`` steps) and searched from, its costs now measured as it runs
      them (a plan that overlaps the loader also changes what the other tasks cost: the
      collectives wait less, the caches stay warm); a plan predicted to win by more than the noise
      is switched to once more, and the prediction of the plan kept is the one reported;
    * with ``first_move`` (the default), where the draw runs on the calling thread, takes a
      tenth of the step or more and its thread either waits (computes under a quarter of its
      time: storage, a remote read) or computes (half of it or more: parsing, torch ops), round 1
      searches nothing first: it tries the draw on a thread of its own, 2 loads at once where the
      data splits its draws (for a draw that computes, also in 2 worker processes where the data
      can), against the running plan, in a trial that starts at once (``autotune.first_move``);
      the search follows from a plan that won (round 2), or, where the running plan stays, from
      its profile for a draw that waits (round 1), not at all for one that computes;
    * before any switch a search proposes (and after each search of a re-tune), the trial
      (``autotune.trial``): the running plan and the search's best ``candidates`` others run in
      turn (A, B, C, A, B, C ...), ``trial_steps`` steps measured per visit, until the
      measurements tell them apart at ``confidence`` (a t interval of the step ratio, paired by
      cycle) or after ``trial_cycles`` cycles; the measured best is kept, or a candidate not
      told apart from it, measured at most ``thread_margin`` (a share) slower, that runs fewer
      engine threads (None: the measured best alone; ``candidates`` 0: switch on the prediction
      alone);
    * ``verify`` steps later, the measured step is reported beside the prediction;
    * then every ``drift_every`` steps the mean step of the last ``verify`` (the time per batch:
      parallel loads deliver in bursts, which a median misses) is compared with the one
      measured when the plan was chosen: beyond ``drift`` (a share) at two checks in a row,
      the running plan is profiled, searched from and tried again, at most ``retunes`` times
      (``drift`` None: never). A re-tune costs a search (seconds on rank 0) and a trial.

    The starting plan is kept when no plan is predicted to be faster by more than ``noise``
    (a share: identical schedules move by up to 11% between runs on a shared 2-core machine,
    a single decision within 5% is noise). ``memory_cap_bytes``: at most this much held by the
    batches in flight (each measured when the profile ends). ``max_threads``,
    ``max_in_flight``, ``lookahead`` and ``loads``: the search's limits and choices (loads only
    where the data splits its draws, ``torchrec_swp.data.MapSource``). ``wake_s``: a blocked
    thread's wake-up latency on this machine (seconds; default ``autosched.inputs.DEFAULT_WAKE``,
    a ``sim.Wake`` by what the other threads do then); ``gil``: the share of CPU work holding the GIL
    (default: all of it, ``autosched.inputs.DEFAULT_GIL``; None: not modelled); ``cold``: how much
    more a thread computes after a stretch off the CPU (``sim.Cold``; default: this project's 2-core
    machines, ``autosched.inputs.DEFAULT_COLD``; None: not modelled).

    ``job_steps``: the steps the job will train in all, where the user knows it (None, the
    default: unknown). A job shorter than a tuning (``tuning_bound``) would end while it tunes,
    its cost paid (the profile, the search's CPU, the trial's slower plans) and its gain not:
    the pipeline then runs its own plan untouched, tunes nothing and says so (``too_short``).

    ``budget_steps``, ``budget_s``: the most time tuning may cost the job, in the starting plan's
    measured steps (the first profile's) or in seconds (None: no such bound; the smaller where
    both are given): the net time its searches and trials lose against the plans they start from
    (``autotune.budget``: a step is charged its period less the running plan's, a faster
    candidate earning back what a slower one lost). Where it is spent, the tuning stops at the next
    point where the ranks agree (a trial's cycle, a search's poll): a trial unfinished gives way to
    the plan it started from, a search is stopped, no later round or re-tune begins, and a line says
    so. The default, 50 steps, is 5% of a 1,000-step job.

    ``report``: where the tuner's lines go, on rank 0 only (the other ranks are quiet; every
    rank's ``autotune_decision`` holds the same decision). The default (``PRINTED``) prints each
    headline on stdout, one line per event, and logs every line at INFO on logger
    ``torchrec_swp.autotune``; a callable gets every line (e.g. ``report=print``,
    ``report=log_info``); None: nothing anywhere. Any of them may be given on any rank.
    """

    warmup: int = 10
    steps: int = 20
    verify: int = 25
    rounds: int = 2
    noise: float = 0.05
    memory_cap_bytes: float | None = None
    max_threads: int = 4
    max_in_flight: int = 6
    lookahead: tuple[int, ...] = (0, 1, 2, 3)
    loads: tuple[int, ...] = (1, 2, 3)
    wake_s: float | Wake = DEFAULT_WAKE
    gil: float | None = DEFAULT_GIL
    cold: Cold | None = DEFAULT_COLD
    report: Callable[[str], None] | None = PRINTED
    candidates: int = 3
    trial_steps: int = 6
    trial_cycles: int = 4
    confidence: float = 0.9
    thread_margin: float | None = 0.1
    drift: float | None = 0.25
    drift_every: int = 200
    retunes: int = 2
    background: bool = True
    search_s: float | None = 120.0
    job_steps: int | None = None
    first_move: bool = True
    budget_steps: int | None = 50
    budget_s: float | None = None

    def __post_init__(self) -> None:
        for name, low in (
            ("warmup", 0),
            ("steps", 2),
            ("verify", 1),
            ("rounds", 1),
            ("max_threads", 1),
            ("max_in_flight", 1),
            ("candidates", 0),
            ("trial_steps", 2),
            ("trial_cycles", 2),
            ("drift_every", 1),
            ("retunes", 0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                what = {
                    "steps": " (too few steps to profile)",
                    "trial_steps": " (too few steps to measure a visit)",
                    "trial_cycles": " (too few cycles for an interval)",
                }.get(name, "")
                raise ValueError(f"Autotune: {name} must be an int >= {low}{what}, got {v!r}")
        if isinstance(self.noise, bool) or not isinstance(self.noise, (int, float)) or not 0 <= self.noise < 1:
            raise ValueError(f"Autotune: noise must be a share in [0, 1), got {self.noise!r}")
        c = self.confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.5 <= c < 1:
            raise ValueError(f"Autotune: confidence must be a share in [0.5, 1), got {c!r}")
        m = self.thread_margin
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1):
            raise ValueError(
                f"Autotune: thread_margin must be a share in [0, 1) or None (the measured best), got {m!r}"
            )
        d = self.drift
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1):
            raise ValueError(f"Autotune: drift must be a share in (0, 1) or None (never re-tune), got {d!r}")
        j = self.job_steps
        if j is not None and (isinstance(j, bool) or not isinstance(j, int) or j < 1):
            raise ValueError(f"Autotune: job_steps must be an int >= 1 or None (unknown), got {j!r}")
        b = self.budget_steps
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"Autotune: budget_steps must be an int >= 1 or None (no bound), got {b!r}")
        s = self.budget_s
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0):
            raise ValueError(f"Autotune: budget_s must be a number of seconds > 0 or None (no bound), got {s!r}")
        if not isinstance(self.first_move, bool):
            raise ValueError(f"Autotune: first_move must be a bool, got {self.first_move!r}")
        if not isinstance(self.background, bool):
            raise ValueError(f"Autotune: background must be a bool, got {self.background!r}")
        t = self.search_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"Autotune: search_s must be a number of seconds > 0 or None (no limit), got {t!r}")
        cap = self.memory_cap_bytes
        if cap is not None and not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"Autotune: memory_cap_bytes must be a number > 0 or None, got {self.memory_cap_bytes!r}")
        if self.cold is not None and not isinstance(self.cold, Cold):
            raise ValueError(f"Autotune: cold must be a torchrec_swp.sim.Cold or None, got {self.cold!r}")
        if self.report is not None and not callable(self.report):
            raise ValueError(f"Autotune: report must be a callable taking a line, or None (quiet), got {self.report!r}")

    def trial_bound(self) -> tuple[int, int]:
        """The most steps and switches one trial takes with these options
        (``autotune.trial.trial_bound``, at the largest lookahead and loads the search may choose)."""
        from torchrec_swp.autotune.trial import trial_bound

        return trial_bound(
            self.candidates + 1, self.trial_steps, self.trial_cycles, max(self.lookahead), max(self.loads)
        )

    def tuning_bound(self, pipeline_depth: int) -> int:
        """The most ``progress()`` calls until a tuning with these options has ended (its plan
        kept, or chosen, switched to and its measured step reported), from a starting plan of
        ``pipeline_depth`` batches that does not run ahead, drift re-tunes aside: how many steps a
        run must have for the verification to fit. Per the tuner's phases
        (``autotune.tuner``): the warm-up and the profile; each round's trial (``trial_bound``);
        before a later round, the settling (a switch waits at most the largest lookahead), its
        profile and a quiet call; then the verification's settling and its steps. ``settle``
        bounds the tuner's settling over every plan the search may choose. A search in the
        background (``background``) adds the calls that train while it runs: as many as the
        job's steps take in its time (at most ``search_s`` a round). ``first_move``: the trial of
        a draw that waits, before round 1's search where that move lost (a draw that computes
        makes its first move round 1's trial, of at most ``candidates + 1`` plans)."""
        from torchrec_swp.autotune.trial import SETTLE

        lookahead, loads = max(self.lookahead), max(self.loads)
        settle = lookahead + max(self.max_in_flight, pipeline_depth) + loads + SETTLE
        trial = self.trial_bound()[0]
        later_round = settle + lookahead + self.steps + (lookahead + 1) + 1
        rounds = self.warmup + self.steps + 1 + self.rounds * trial + (self.rounds - 1) * later_round
        if self.first_move and self.candidates:  # its trial of two plans, where round 1 searches after it
            from torchrec_swp.autotune.trial import trial_bound

            rounds += trial_bound(2, self.trial_steps, self.trial_cycles, lookahead, loads)[0]
        return rounds + settle + self.verify + 1

    def too_short(self, pipeline_depth: int) -> str | None:
        """Why a job of ``job_steps`` steps is not tuned (None: it is, or its length is unknown):
        it ends before a tuning from a plan of ``pipeline_depth`` batches may have (``tuning_bound``)."""
        bound = self.tuning_bound(pipeline_depth)
        if self.job_steps is None or self.job_steps >= bound:
            return None
        return (
            f"keeps the plan, untuned: the job's {self.job_steps} steps (Autotune.job_steps) are fewer than a tuning "
            f"may take ({bound}), which would end with the job, its cost paid and its gain not"
        )

    @classmethod
    def of(cls, value: bool | Autotune | None, owner: str) -> Autotune | None:
        """The options of ``autotune=value`` (``True``: the defaults; False/None: no tuning)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise TypeError(f"{owner}: autotune must be a bool or torchrec_swp.Autotune(...), got {type(value).__name__}")
