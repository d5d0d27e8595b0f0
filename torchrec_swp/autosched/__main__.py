"""``python -m torchrec_swp.autosched --profile P --out Q``: search a plan for a profiled run.

Reads a profile (``TaskProfiler`` / ``Profile.save``), prints the lower bounds of the profiled
plan (which one binds), runs the beam search with a progress bar, writes the best plan's text
to ``Q`` (load it with ``PipelinePlan.load(Q)`` or pass ``plan=Q`` to a pipeline) and prints its
predicted iteration time and efficiency. ``--exact`` also runs CP-SAT and reports the gap.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tqdm import tqdm

from torchrec_swp.autosched.beam import beam_search
from torchrec_swp.autosched.bounds import plan_bounds
from torchrec_swp.autosched.cpsat import solve_periodic
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import PlanError
from torchrec_swp.profiler import Profile, ProfileError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_swp.autosched",
        description="Search a plan for a profiled run; print bounds, prediction and efficiency; write the plan.",
    )
    p.add_argument("--profile", required=True, help="profile file written by TaskProfiler (Profile.save)")
    p.add_argument("--out", required=True, help="where to write the plan text")
    p.add_argument("--max-threads", type=int, default=4)
    p.add_argument("--max-in-flight", type=int, default=5)
    p.add_argument(
        "--anchors",
        default="",
        help="comma-separated task names to keep at the highest stage on the default stream, besides the plan's anchors",
    )
    p.add_argument("--beam-width", type=int, default=8)
    p.add_argument("--funnel", type=int, default=2)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--exact", action="store_true", help="also solve with CP-SAT and report the gap")
    p.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT time limit in seconds")
    p.add_argument("--name", help="name of the proposed plan (default: the profiled plan's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        profile = Profile.load(args.profile)
        problem = Problem.from_profile(
            profile,
            max_threads=args.max_threads,
            max_in_flight=args.max_in_flight,
            anchor_names=frozenset(a.strip() for a in args.anchors.split(",") if a.strip()),
        )
    except (OSError, ProfileError, PlanError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ms, unit = 1e3, " ms"
    print(profile.format_table())
    print()
    print(f"profiled plan {profile.plan.name}:")
    print(plan_bounds(profile.plan, problem.durations).format(ms, unit))
    print()

    with tqdm(total=1, desc="beam search", unit="level", disable=args.quiet, file=sys.stderr) as bar:

        def on_level(done: int, total: int, best: float) -> None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(f"best {best * ms:.3f}{unit}", refresh=False)
            bar.refresh()

        try:
            result = beam_search(
                problem, beam_width=args.beam_width, funnel=args.funnel, max_passes=args.passes, on_level=on_level
            )
        except PlanError as e:
            bar.close()
            print(f"error: {e}", file=sys.stderr)
            return 1
    plan = result.plan if args.name is None else result.plan.replace(name=args.name)
    plan.save(args.out)
    print(result.format(ms, unit))
    print(result.bounds.format(ms, unit))
    if args.exact:
        try:
            exact = solve_periodic(problem, time_limit_s=args.time_limit, hint=result.plan)
        except RuntimeError as e:
            print(f"exact mode: {e}", file=sys.stderr)
        else:
            print(exact.format(ms, unit))
            print(f"beam vs CP-SAT: {100 * (result.predicted / exact.iteration - 1):+.2f}%")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
