"""The search's hard constraints, checked on a finished plan.

``check_constraints(plan, problem)`` returns every violation of these rules (empty: the plan
is admissible); ``ensure_constraints`` raises ConstraintError listing them:

1. ``tasks``: the same tasks as the problem's plan, with the same reads/writes, comm groups,
   source, output and ``on_exhausted``.
2. ``deps``: every dependency of the problem's plan is a dependency of the plan.
3. ``threads``: at most ``max_threads`` thread groups.
4. ``in_flight``: ``pipeline_depth <= max_in_flight``.
5. ``anchor``: every anchor on the default stream, at the highest stage.
6. ``happens_before``: a simulated run (fill, three steady iterations, drain) neither
   deadlocks nor lets a consumer run before its producer (``sim.check_happens_before``), device
   syncs included when the problem has device durations.

Validity of the plan itself (fire order, satisfiable dependencies, source) is PipelinePlan's
own check: a plan that exists is valid.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import DEFAULT_STREAM, PipelinePlan
from torchrec_swp.sim import SimError, check_happens_before, simulate


@dataclass(frozen=True, slots=True)
class Violation:
    """Rule ``rule`` is broken by ``culprit`` (a task, thread, dependency or field)."""

    rule: str
    culprit: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.message}"


class ConstraintError(ValueError):
    """A plan outside the search's hard constraints; ``violations`` lists every broken rule."""

    def __init__(self, plan: PipelinePlan, violations: list[Violation]) -> None:
        super().__init__(
            f"plan {plan.name} breaks {len(violations)} constraint(s):\n" + "\n".join(f"  {v}" for v in violations)
        )
        self.violations = tuple(violations)


def check_constraints(plan: PipelinePlan, problem: Problem, *, simulate_run: bool = True) -> list[Violation]:
    """Every violation of rules 1-6 (rule 6 only with ``simulate_run``)."""
    base = problem.plan
    out: list[Violation] = []
    if set(plan.fire_order) != set(base.fire_order):
        extra = sorted(set(plan.fire_order) ^ set(base.fire_order))
        return [Violation("tasks", extra[0], f"the plan's tasks differ from plan {base.name}'s: {extra}")]
    for t in base.fire_order:
        if plan.tasks[t] != base.tasks[t]:
            out.append(Violation("tasks", t, f"task {t} changed what it reads or writes, or its effects"))
        if plan.task(t).comm_group != base.task(t).comm_group:
            out.append(Violation("tasks", t, f"task {t} changed its comm group to {plan.task(t).comm_group}"))
    for field in ("source", "output", "on_exhausted"):
        if getattr(plan, field) != getattr(base, field):
            out.append(Violation("tasks", field, f"{field} is {getattr(plan, field)!r}, not {getattr(base, field)!r}"))
    missing = [d for d in base.deps if d not in set(plan.deps)]
    out.extend(Violation("deps", str(d), f"dependency {d} was dropped") for d in missing)
    if len(plan.thread_groups) > problem.max_threads:
        out.append(
            Violation(
                "threads",
                plan.thread_groups[problem.max_threads],
                f"{len(plan.thread_groups)} thread groups {list(plan.thread_groups)}, "
                f"at most {problem.max_threads} allowed",
            )
        )
    if plan.pipeline_depth > problem.max_in_flight:
        out.append(
            Violation(
                "in_flight",
                "pipeline_depth",
                f"{plan.pipeline_depth} batches in flight, at most {problem.max_in_flight} allowed",
            )
        )
    for a in sorted(problem.anchors):
        s = plan.task(a)
        if s.stream != DEFAULT_STREAM:
            out.append(Violation("anchor", a, f"anchor {a} is on stream {s.stream}, not {DEFAULT_STREAM}"))
        if s.stage != plan.max_stage:
            out.append(
                Violation("anchor", a, f"anchor {a} is at stage {s.stage}, not the highest stage {plan.max_stage}")
            )
    if simulate_run and not out:
        try:
            result = simulate(
                plan,
                problem.durations,
                plan.max_stage + 3,
                device_durations=problem.device_durations,
            )
            check_happens_before(result, plan)
        except SimError as e:
            out.append(Violation("happens_before", plan.name, str(e).splitlines()[0]))
    return out


def ensure_constraints(plan: PipelinePlan, problem: Problem) -> None:
    """Raise ConstraintError if ``check_constraints`` finds anything."""
    violations = check_constraints(plan, problem)
    if violations:
        raise ConstraintError(plan, violations)
