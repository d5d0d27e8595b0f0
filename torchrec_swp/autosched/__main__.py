"""``python -m torchrec_swp.autosched --profile RANK0 [--profile RANK1 ...] --out Q``: search a plan.

Reads every rank's profile (``TaskProfiler`` / ``Profile.save``, one file per rank: collectives
wait for the slowest rank, so the search needs them all; ``--fill-missing`` takes the ranks not
given to cost what the lowest rank given costs, and says so), says which ranks' profiles it read
and each one's step, prints the lowest rank's table, runs the overlap search
(``torchrec_swp.autosched.overlap``: threads, lookahead, parallel loads, the input dist's comm
group - changes that keep every batch's numerics) with a progress bar, writes the best plan's text
to ``Q`` (load it with ``PipelinePlan.load(Q)`` or pass ``plan=Q`` to a pipeline) and says why it
wins. ``--reorder`` first runs the beam search over fire order and stages (the old barrier
model's, which may change what a task sees of shared state: check the losses; one rank's model,
each task costing its slowest rank's median), and ``--exact`` besides solves that with CP-SAT
and reports the gap.
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Sequence

from tqdm import tqdm

from torchrec_swp.autosched.beam import beam_search
from torchrec_swp.autosched.inputs import DEFAULT_GIL, DEFAULT_WAKE, from_profiles
from torchrec_swp.autosched.overlap import Space, search_overlap
from torchrec_swp.autosched.periodic import solve_periodic
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.catalog.transforms import DRAW_TASKS, INPUT_DIST_TASKS
from torchrec_swp.plan import PlanError
from torchrec_swp.profiler import Profile, ProfileError


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_swp.autosched",
        description="Search a plan for a profiled run from every rank's profile; write the plan and say why it wins.",
    )
    p.add_argument(
        "--profile",
        action="append",
        required=True,
        help="a rank's profile file, or a glob matching every rank's (quote it), e.g. 'out/run.profile.rank*.json'",
    )
    p.add_argument("--out", required=True, help="where to write the plan text")
    p.add_argument("--fill-missing", action="store_true", help="ranks without a profile cost what rank 0 costs")
    p.add_argument("--max-threads", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=6, help="batches in flight at most (depth + lookahead)")
    p.add_argument("--lookahead", type=_ints, default=(0, 1, 2, 3), help="lookahead choices (default: 0,1,2,3)")
    p.add_argument(
        "--loads",
        type=_ints,
        default=(1, 2, 3),
        help="parallel loads choices, where the data splits draws (default: 1,2,3)",
    )
    p.add_argument(
        "--input-dist-group",
        action="store_true",
        help="the pipeline will be built with input_dist_group=True: the input dist may take its own comm group",
    )
    p.add_argument("--memory-cap-mib", type=float, default=None, help="at most this much held by the batches in flight")
    p.add_argument(
        "--wake-us",
        type=float,
        default=None,
        help=(
            "a blocked thread's wake-up latency, whatever the other threads do (default: "
            f"{DEFAULT_WAKE.busy * 1e6:g} while another thread computes, {DEFAULT_WAKE.walk_end * 1e6:g} where one "
            f"just ended its walk, {DEFAULT_WAKE.idle * 1e6:g} otherwise: torchrec_swp.sim.wake)"
        ),
    )
    p.add_argument(
        "--gil",
        type=float,
        default=DEFAULT_GIL,
        help="share of a task's CPU work holding its process's GIL (default: %(default)s; 0: not modelled)",
    )
    p.add_argument("--reorder", action="store_true", help="also move fire order and stages first (may change numerics)")
    p.add_argument("--exact", action="store_true", help="with --reorder: also solve with CP-SAT and report the gap")
    p.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT time limit in seconds")
    p.add_argument("--name", help="name of the proposed plan (default: the profiled plan's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.exact and not args.reorder:
        parser.error("--exact solves the reordering search: give --reorder too")
    paths = [
        p for pattern in args.profile for p in (sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern])
    ]
    if not paths:
        print(f"error: no profile file matches {' '.join(args.profile)}", file=sys.stderr)
        return 2
    try:
        files = sorted(((Profile.load(path), path) for path in paths), key=lambda pp: pp[0].where.rank)
        profiles = [profile for profile, _ in files]
        inputs = from_profiles(
            profiles,
            wake=DEFAULT_WAKE if args.wake_us is None else args.wake_us * 1e-6,
            gil=args.gil or None,
            cores=None,
            fill_missing=args.fill_missing,
        )
    except (OSError, ProfileError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = profiles[0]
    plan = first.plan
    ms, unit = 1e3, " ms"
    ranks = [p.where.rank for p in profiles]
    machine = inputs.machine
    world = first.where.world_size
    print(f"profiles of rank(s) {ranks} of {world}; machines {machine.machines}, {machine.cores} cores each")
    for profile, path in files:
        it = f"{profile.iterations} iterations, {profile.iteration_s * ms:.3f}{unit} median"
        print(f"  rank {profile.where.rank}: {path} ({it})")
    for note in inputs.notes:
        print(f"note: {note}")
    print()
    print(f"rank {first.where.rank}'s profile:")
    print(first.format_table())
    print()
    loads = args.loads if plan.source in DRAW_TASKS and inputs.split_draws else (1,)
    if loads != args.loads and any(k > 1 for k in args.loads):
        why = (
            f"its source {plan.source} does the copy too (profile a plan split with plans.with_parallel_loads)"
            if plan.source not in DRAW_TASKS
            else "the profiled data does not split a draw (torchrec_swp.data.MapSource does)"
        )
        print(f"note: no parallel loads: {why}")
    try:
        space = Space(
            lookahead=args.lookahead,
            loads=loads,
            own_group=INPUT_DIST_TASKS if args.input_dist_group else (),
            max_threads=args.max_threads,
            max_in_flight=args.max_in_flight,
            batch_bytes=inputs.batch_bytes,
            memory_cap_bytes=None if args.memory_cap_mib is None else args.memory_cap_mib * 2**20,
            split_draws=inputs.split_draws,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.reorder:
        problem = Problem.from_profiles(profiles, max_threads=args.max_threads, max_in_flight=args.max_in_flight)
        found = beam_search(problem, beam_width=8, funnel=2, max_passes=5)
        print(f"reordered (beam search, barrier model; each task at its slowest median of rank(s) {ranks}):")
        print(found.format(ms, unit))
        if args.exact:
            try:
                exact = solve_periodic(problem, time_limit_s=args.time_limit, hint=found.plan)
            except RuntimeError as e:
                print(f"exact mode: {e}", file=sys.stderr)
            else:
                print(exact.format(ms, unit))
                print(f"beam vs CP-SAT: {100 * (found.predicted / exact.iteration - 1):+.2f}%")
        plan = found.plan
    with tqdm(total=1, desc="overlap search", unit="plan", disable=args.quiet, file=sys.stderr) as bar:

        def on_progress(done: int, best: float) -> None:
            bar.total = max(bar.total or 1, done)
            bar.n = done
            bar.set_postfix_str(f"best {best * ms:.3f}{unit}", refresh=False)
            bar.refresh()

        try:
            result = search_overlap(plan, inputs.calibration, inputs.machine, space, on_progress=on_progress)
        except PlanError as e:
            bar.close()
            print(f"error: {e}", file=sys.stderr)
            return 1
    out = result.plan if args.name is None else result.plan.replace(name=args.name)
    out.save(args.out)
    print(result.format(ms, unit))
    if result.best.candidate.own_group:
        print("build the pipeline with input_dist_group=True: this plan gives the input dist a comm group of its own")
    if result.plan.loads > 1:
        print("feed it a data source that splits draws (torchrec_swp.data.MapSource) for the parallel loads to overlap")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
