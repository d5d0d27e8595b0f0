"""Plan validation: reject, before anything runs, every plan that cannot run.

Rules (each violation raises PlanError naming the task or dependency):

1. A plan has at least one task; names are unique; fire order lists every task exactly once.
2. ``pipeline_depth`` is an int covering the stage span (``depth >= max_stage + 1``).
3. Every dependency names known tasks, has an int distance and is not a task on itself in
   the same batch. A negative distance orders a task after a later batch's instance of another
   (``c(b) after p(b + 1)``: one stage lower, earlier in the same iteration).
4. Every read data name has exactly one writer; a task does not read what it writes (of the
   same batch). Reads become deps ``reader(b) after writer(b)``; a read ``x@k`` becomes
   ``reader(b) after writer(b - k)`` and needs batch ``b - k`` still in flight when the reader
   runs: ``stage + k <= max_stage``.
5. The same-batch (distance 0) dependency graph has no cycle.
6. Every dependency is satisfiable by stages plus fire order: ``producer(b - k)`` runs at
   iteration ``b - k + s_p``, ``consumer(b)`` at ``b + s_c``; the producer's iteration must come
   first, or be the same iteration with the producer earlier in fire order.
7. The source (if any) is at stage 0, and every other stage-0 task depends on it, so that no
   task works on a batch that was never loaded. The output (if any) has a writer.
9. ``lookahead`` is an int >= 0 and ``loads`` an int >= 1; ``loads > 1`` needs a source that is
   the only task of its thread group, which is not the calling thread's (``default``): its
   lanes run nothing else, and the caller must not wait behind a load. The error shows the
   ``plan.with_loads(...)`` call that builds such a plan.
8. A task that runs only ``when`` batch ``b + 1`` exists (``has_next``) or does not (``last``)
   is above the source's stage (one stage above: after the source in fire order), so that the
   source was asked for ``b + 1`` before it runs. A task that runs only ``when=train`` is at the
   highest stage: the training mode is the step's that trains its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.task import MAIN_THREAD, Dep, When, parse_read

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PlanView


def validate_plan(plan: PlanView) -> tuple[Dep, ...]:
    """Check every rule above; return explicit and inferred deps merged (explicit first)."""
    sched = plan.schedule
    if not sched:
        raise PlanError(f"plan {plan.name} has no tasks", culprit=plan.name)
    _check_fire_order(plan)
    if plan.on_exhausted not in ("drain", "stop"):
        raise PlanError(f"on_exhausted must be 'drain' or 'stop', got {plan.on_exhausted!r}", culprit="on_exhausted")
    depth = plan.pipeline_depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise PlanError(f"pipeline_depth must be an int >= 1, got {depth!r}", culprit="pipeline_depth")
    top = max(sched, key=lambda t: sched[t].stage)
    if depth < sched[top].stage + 1:
        over = [t for t in plan.fire_order if sched[t].stage >= depth]
        # one task above the depth: its stage is the slip; several: the depth is
        raise PlanError(
            f"pipeline_depth {depth} is smaller than the stage span {sched[top].stage + 1} "
            f"(task {top} is at stage {sched[top].stage}"
            + (f"; {', '.join(over)} are above stage {depth - 1}" if len(over) > 1 else "") + ")",
            culprit=over[0] if len(over) == 1 else "pipeline_depth",
            also=("pipeline_depth",) if len(over) == 1 else tuple(over),
        )

    for dep in plan.explicit_deps:
        for role, task in (("consumer", dep.consumer), ("producer", dep.producer)):
            if task not in sched:
                raise PlanError(f"dependency {dep}: unknown {role} task {task!r}", culprit=str(dep))
        if isinstance(dep.distance, bool) or not isinstance(dep.distance, int):
            raise PlanError(f"dependency {dep}: distance must be an int", culprit=str(dep))
        if dep.distance == 0 and dep.consumer == dep.producer:
            raise PlanError(f"dependency {dep}: a task cannot depend on itself in the same batch", culprit=str(dep))

    inferred = _infer_io_deps(plan, Dep)
    merged = list(dict.fromkeys([*plan.explicit_deps, *inferred]))
    _check_acyclic(plan, [d for d in merged if d.distance == 0])
    _check_all_satisfiable(plan, merged)
    _check_source_and_output(plan, merged)
    _check_guards(plan)
    _check_loads(plan)
    return tuple(merged)


def _check_guards(plan: PlanView) -> None:
    top = max(s.stage for s in plan.schedule.values())
    for task, sched in plan.schedule.items():
        if sched.when is When.TRAIN and sched.stage != top:
            raise PlanError(
                f"task {task} runs when=train at stage {sched.stage}: the training mode is that of the step that "
                f"trains a batch, known only at the highest stage ({top})",
                culprit=task,
            )
        if not sched.when.needs_next:
            continue
        if plan.source is None:
            raise PlanError(f"task {task} runs when={sched.when}, which needs a source task", culprit=task)
        src_stage = plan.schedule[plan.source].stage
        if sched.stage <= src_stage or (
            sched.stage == src_stage + 1 and plan.fire_index(plan.source) > plan.fire_index(task)
        ):
            raise PlanError(
                f"task {task} runs when={sched.when} but the source {plan.source} has not looked for batch b+1 "
                f"when it runs: put it above the source's stage (and, one stage above, after the source in "
                "the fire order)",
                culprit=task,
            )


def _check_loads(plan: PlanView) -> None:
    for field, low in (("lookahead", 0), ("loads", 1)):
        value = getattr(plan, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise PlanError(f"{field} must be an int >= {low}, got {value!r}", culprit=field)
    if plan.loads == 1:
        return
    src = plan.source
    if src is None:
        raise PlanError(f"loads {plan.loads} needs a source task", culprit="loads")
    group = plan.schedule[src].thread_group
    others = [t for t, s in plan.schedule.items() if t != src and s.thread_group == group]
    if group != MAIN_THREAD and not others:
        return
    where = (
        f"runs on the calling thread ({MAIN_THREAD!r})"
        if group == MAIN_THREAD
        else f"shares thread group {group!r} with {', '.join(others)}"
    )
    raise PlanError(
        f"loads {plan.loads}: the source {src} {where}, but its lanes must run only the source: "
        f"build it with `{_loads_hint(plan)}` on the plan with one load, which moves {src} to a thread of its own",
        culprit=others[0] if others else src,
    )


def _loads_hint(plan: PlanView) -> str:
    """The call that gives ``plan``'s source ``plan.loads`` loads on a thread no other task uses
    (``PipelinePlan.with_loads``), as code."""
    used = {s.thread_group for t, s in plan.schedule.items() if t != plan.source}
    thread, k = "load", 0
    while thread in used:
        k += 1
        thread = f"load_{k}"
    lookahead = f", lookahead={plan.lookahead}" if plan.lookahead else ""
    return f"plan.with_loads({plan.loads}{lookahead}" + (f", thread={thread!r})" if thread != "load" else ")")


def _check_fire_order(plan: PlanView) -> None:
    seen: set[str] = set()
    for task in plan.fire_order:
        if task in seen:
            raise PlanError(f"task {task} appears twice in the fire order", culprit=task)
        if task not in plan.schedule:
            raise PlanError(f"fire order names unknown task {task!r}", culprit=str(task))
        seen.add(task)
    missing = [t for t in plan.schedule if t not in seen]
    if missing:
        raise PlanError(f"task {missing[0]} is scheduled but missing from the fire order", culprit=missing[0])


def _infer_io_deps(plan: PlanView, dep_type: type[Dep]) -> list[Dep]:
    writers: dict[str, str] = {}
    for task in plan.fire_order:
        for data in plan.tasks[task].writes:
            if data in writers:
                raise PlanError(f"data {data!r} is written by both {writers[data]} and {task}", culprit=task)
            writers[data] = task
    top = max(s.stage for s in plan.schedule.values())
    deps = []
    for task in plan.fire_order:
        io = plan.tasks[task]
        for read in io.reads:
            data, k = parse_read(read)
            if k == 0 and data in io.writes:
                raise PlanError(f"task {task} reads {data!r}, which it writes itself", culprit=task)
            if data not in writers:
                raise PlanError(f"task {task} reads {data!r}, which no task writes", culprit=task)
            stage = plan.schedule[task].stage
            if stage + k > top:
                raise PlanError(
                    f"task {task} (stage {stage}) reads {read!r} from batch b-{k}, which left the pipeline "
                    f"(highest stage {top}) before b reached stage {stage}",
                    culprit=task,
                )
            deps.append(dep_type(task, writers[data], k))
    return deps


def _check_acyclic(plan: PlanView, deps: list[Dep]) -> None:
    after: dict[str, list[str]] = {t: [] for t in plan.schedule}
    for d in deps:
        after[d.consumer].append(d.producer)
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    for root in plan.fire_order:
        if root in state:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = [root]
        state[root] = 1
        while stack:
            node, i = stack[-1]
            if i < len(after[node]):
                stack[-1] = (node, i + 1)
                nxt = after[node][i]
                if state.get(nxt) == 1:
                    cycle = path[path.index(nxt):] + [nxt]
                    raise PlanError(
                        "dependency cycle in one batch: " + " -> ".join(cycle) + " (read 'A -> B' as A after B)",
                        culprit=_backwards(plan, cycle) or nxt,
                        also=tuple(cycle[:-1]),
                    )
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                state[node] = 2
                stack.pop()
                path.pop()


def _backwards(plan: PlanView, cycle: list[str]) -> str | None:
    """Of a cycle ``a -> b -> ... -> a`` (``a`` after ``b``), its one dep that runs against stages and
    fire order (the producer later than the consumer), as text, where only one does: the slip."""
    key = lambda t: (plan.schedule[t].stage, plan.fire_index(t))  # noqa: E731
    against = [Dep(c, p) for c, p in zip(cycle, cycle[1:]) if key(p) > key(c)]
    return str(against[0]) if len(against) == 1 else None


def _check_all_satisfiable(plan: PlanView, deps: list[Dep]) -> None:
    """``_check_satisfiable`` for every dep; where several fail and all involve one task, its stage
    or place in the fire order is the slip, and the error names that task."""
    failed: list[tuple[Dep, PlanError]] = []
    for dep in deps:
        try:
            _check_satisfiable(plan, dep)
        except PlanError as e:
            failed.append((dep, e))
    if not failed:
        return
    dep, first = failed[0]
    if len(failed) == 1:  # a task whose stage alone, moved, would satisfy every dep is the slip
        fixable = [t for t in dict.fromkeys((dep.consumer, dep.producer)) if _movable(plan, t, deps)]
        if len(fixable) == 1:
            raise PlanError(
                f"task {fixable[0]} is at stage {plan.schedule[fixable[0]].stage}, where {first}",
                culprit=fixable[0],
                also=(str(dep),),
            )
        if len(fixable) == 2:  # nothing tells which of the two stages (or the dep itself) is the slip
            raise PlanError(
                f"{first} (a stage of either task, moved, would satisfy it: {fixable[0]}'s or {fixable[1]}'s)",
                culprit=first.culprit,
                also=(dep.consumer, dep.producer),
            )
    common = set.intersection(*({d.consumer, d.producer} for d, _ in failed))
    if len(failed) > 1 and len(common) == 1:
        (task,) = common
        raise PlanError(
            f"task {task} (stage {plan.schedule[task].stage}, fire position {plan.fire_index(task)}) breaks "
            f"{len(failed)} dependencies, the first: {first}",
            culprit=task,
            also=tuple(str(d) for d, _ in failed),
        )
    raise PlanError(str(first), culprit=first.culprit, also=(dep.consumer, dep.producer))


def _movable(plan: PlanView, task: str, deps: list[Dep]) -> bool:
    """Whether some other stage of ``task`` (within the depth) satisfies every dep."""
    stages = {t: s.stage for t, s in plan.schedule.items()}
    for stage in range(plan.pipeline_depth):
        if stage == stages[task]:
            continue
        moved = {**stages, task: stage}
        if all(_order_ok(plan, d, moved) for d in deps):
            return True
    return False


def _order_ok(plan: PlanView, dep: Dep, stages: dict[str, int]) -> bool:
    lead = stages[dep.consumer] - (stages[dep.producer] - dep.distance)
    return lead > 0 or (lead == 0 and plan.fire_index(dep.producer) < plan.fire_index(dep.consumer))


def _check_satisfiable(plan: PlanView, dep: Dep) -> None:
    s_c = plan.schedule[dep.consumer].stage
    s_p = plan.schedule[dep.producer].stage
    lead = s_c - (s_p - dep.distance)  # iterations between producer and consumer instances
    if lead > 0:
        return
    if lead < 0:
        raise PlanError(
            f"dependency {dep} cannot be satisfied: {dep.producer} (stage {s_p}) "
            f"works on batch {_batch(-dep.distance)} "
            f"at iteration b{s_p - dep.distance:+d}, after {dep.consumer} (stage {s_c}) works on batch b "
            f"at iteration b{s_c:+d}",
            culprit=str(dep),
        )
    if plan.fire_index(dep.producer) > plan.fire_index(dep.consumer):
        raise PlanError(
            f"dependency {dep} cannot be satisfied: both run in the same iteration, so {dep.producer} "
            f"must come before {dep.consumer} in the fire order",
            culprit=str(dep),
        )


def _check_source_and_output(plan: PlanView, deps: list[Dep]) -> None:
    sched = plan.schedule
    if plan.output is not None and plan.writer_of(plan.output) is None:
        raise PlanError(f"output {plan.output!r} is not written by any task", culprit=str(plan.output))
    src = plan.source
    if src is None:
        return
    if src not in sched:
        raise PlanError(f"source {src!r} is not a task of the plan", culprit=str(src))
    if sched[src].stage != 0:
        raise PlanError(f"source {src} must be at stage 0 (where a batch enters), not {sched[src].stage}", culprit=src)
    before: dict[str, set[str]] = {t: set() for t in sched}
    for d in deps:
        if d.distance == 0:
            before[d.consumer].add(d.producer)
    for task in plan.fire_order:
        if task == src or sched[task].stage != 0:
            continue
        seen, todo = set(), [task]
        while todo:
            for p in before[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        if src not in seen:
            raise PlanError(
                f"task {task} is at stage 0 but does not depend on the source {src}: "
                "it could run for a batch that was never loaded",
                culprit=task,
            )


def _batch(offset: int) -> str:
    return f"b{offset:+d}" if offset else "b"
