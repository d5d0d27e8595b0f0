"""What the overlap search needs, from every rank's profile: calibrated costs and the machines.

``from_profiles(profiles)`` checks that the profiles belong together - one per rank of one world,
ranks 0 .. n-1, each of the same plan, each with its measured iterations (format 2) - and
returns the ``sim.Calibration`` of every rank (its thread CPU times, collectives taken from the
last rank's arrival on, the calling thread's overhead per step, each run's CPU work taken back to
what it costs warm: ``DEFAULT_COLD``) and the ``Machine``: which rank
runs where (by host name), each machine's cores, the wake-up latency and the GIL share given.

A rank whose profile is missing is a ProfileError naming the ranks missing, unless
``fill_missing``: then each missing rank is taken to cost what the lowest rank given costs (said
in ``Inputs.notes``, naming both), for a quick look from one rank's file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchrec_swp.autosched.overlap import Machine
from torchrec_swp.profiler.profile import Profile, ProfileError
from torchrec_swp.sim import Calibration, Cold, SimError, Wake, calibrate

#: A blocked thread's wake-up latency on the 2-core machines this project is measured on
#: (``torchrec_swp.sim.wake``, from ``benchmarks/sim_vs_real.py``'s io plans on 1 rank): 0.5 ms
#: while another thread of the process computes, 0.25 ms where none does but one just ended its
#: walk, 0.05 ms where none does. Seconds.
DEFAULT_WAKE = Wake(busy=0.5e-3, idle=0.05e-3, walk_end=0.25e-3)
#: A thread's CPU work after a stretch off the CPU costs more (``sim.cold``) on the 2-core machines
#: this project is measured on: 2 ms off the CPU make a thread cold, its first work then runs 1.45
#: times slower, the extra decaying by e every 3 ms of work (a burst pays at most 1.35 ms more).
#: Fitted by ``benchmarks/cold_fit.py`` to two full ``sim_vs_real`` recordings (1 rank: each
#: task's CPU time on a training thread that sleeps every step against two parallel loads, where it
#: never does): extra 0.45 in both, span 3.25 and 2.75 ms; the rule explains 79% of the squared
#: difference. None: not modelled.
DEFAULT_COLD = Cold(after=2e-3, extra=0.45, span=3e-3)
#: The share of a task's CPU work that holds its process's GIL: all of it. TorchRec's tasks are
#: Python between short kernels (the copy, the input dist's KJT work), and on this machine a
#: second Python thread doing them never ran beside the training thread's (``benchmarks/overlap.py``:
#: the plans moving the input dist's work to a thread of its own are the least efficient); what
#: threads overlap is the time off the CPU - a loader's wait, a collective's transfer.
DEFAULT_GIL = 1.0


@dataclass(frozen=True)
class Inputs:
    """The search's inputs from the profiles: costs, machines, and notes on what was assumed."""

    calibration: Calibration
    machine: Machine
    split_draws: bool
    batch_bytes: float
    notes: tuple[str, ...] = ()


def from_profiles(
    profiles: Sequence[Profile],
    *,
    wake: float | Wake = DEFAULT_WAKE,
    gil: float | None = None,
    cores: int | None = None,
    fill_missing: bool = False,
    cold: Cold | None = DEFAULT_COLD,
) -> Inputs:
    """Every rank's costs and the machines (module docstring). ``cores``: cores per machine when
    the profiles do not say; ``cold``: the cold-thread rule the costs are taken back to warm ones
    with (and simulate with). Raises ProfileError for profiles that do not belong together."""
    if not profiles:
        raise ProfileError("no profile given")
    world = {p.where.world_size for p in profiles}
    if len(world) != 1:
        raise ProfileError(f"the profiles come from worlds of different sizes {sorted(world)}")
    (size,) = world
    by_rank: dict[int, Profile] = {}
    for p in profiles:
        if p.where.rank in by_rank:
            raise ProfileError(f"two profiles of rank {p.where.rank}")
        if not 0 <= p.where.rank < size:
            raise ProfileError(f"a profile of rank {p.where.rank} in a world of {size}")
        by_rank[p.where.rank] = p
    notes: list[str] = []
    missing = [r for r in range(size) if r not in by_rank]
    if missing:
        if not fill_missing:
            raise ProfileError(
                f"profiles of {size} ranks needed, missing rank(s) {missing}: pass every rank's profile "
                "(collectives wait for the slowest rank)"
            )
        given = min(by_rank)
        notes.append(f"rank(s) {missing} taken to cost what rank {given} costs (their profiles were not given)")
        for r in missing:
            by_rank[r] = by_rank[given].with_where(rank=r)
    ordered = [by_rank[r] for r in range(size)]
    plans = {p.plan for p in ordered}
    if len(plans) != 1:
        raise ProfileError(f"the ranks profiled different plans: {sorted(p.name for p in plans)}")
    lacking = [p.where.rank for p in ordered if not p.records]
    if lacking:
        raise ProfileError(
            f"the profile of rank {lacking[0]} has no measured iterations (a format 1 file): "
            "profile again with this version"
        )
    hosts = list(dict.fromkeys(p.where.host for p in ordered))
    machines = tuple(hosts.index(p.where.host) for p in ordered)
    core_counts = {p.where.cores for p in ordered if p.where.cores is not None}
    machine_cores = min(core_counts) if core_counts else cores
    if len(core_counts) > 1:
        notes.append(f"machines report {sorted(core_counts)} cores: modelled with {machine_cores} each")
    overhead = [p.steps.overhead_s if p.steps is not None else p.unattributed_s for p in ordered]
    # the caller's own time between calls that is not CPU: waiting (StagedTrainPipeline's caller
    # trains there, its collectives included)
    waiting = [max(0.0, p.steps.gap_mean_s - p.steps.gap_cpu_mean_s) if p.steps is not None else 0.0 for p in ordered]
    if any(p.steps is None for p in ordered):
        notes.append("no progress() timings in a profile: its unattributed time per iteration stands for the overhead")
    try:
        cal = calibrate(
            ordered[0].plan,
            [p.records for p in ordered],
            cores=machine_cores,
            overhead=overhead,
            overhead_off=waiting,
            cold=cold,
        )
    except SimError as e:
        raise ProfileError(str(e)) from None
    return Inputs(
        calibration=cal,
        machine=Machine(cores=machine_cores, machines=machines, wake=wake, gil=gil),
        split_draws=all(p.where.split_draws for p in ordered),
        batch_bytes=max(p.where.batch_bytes for p in ordered),
        notes=tuple(notes),
    )
