"""The compact text form of a plan, with an exact round trip.

    plan TrainPipelineSparseDist
    depth 3
    source H2D
    output output
    exhausted drain
    task ZeroGrad stage=2 stream=default thread=default
    task H2D stage=0 stream=memcpy thread=default writes=batch,context
    task InputDistStart stage=1 stream=data_dist thread=default comm=world reads=batch,context
    dep Forward <- OptimizerStep @1

Task lines are in fire order. Only explicit deps are written (inferred ones follow from
reads/writes). ``#`` starts a comment; blank lines are ignored.
``plan_from_text(plan_to_text(p)) == p`` and ``plan_to_text(plan_from_text(t)) == t`` for text
produced by plan_to_text.
"""

from __future__ import annotations

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.plan import Dep, PipelinePlan
from torchrec_swp.plan.task import PipelineTask, TaskSchedule

_NONE = "-"


def plan_to_text(plan: PipelinePlan) -> str:
    lines = [
        f"plan {plan.name}",
        f"depth {plan.pipeline_depth}",
        f"source {plan.source or _NONE}",
        f"output {plan.output or _NONE}",
        f"exhausted {plan.on_exhausted}",
    ]
    for t in plan.scheduled():
        s, io = t.schedule, t.io
        parts = [f"task {t.name}", f"stage={s.stage}", f"stream={s.stream}", f"thread={s.thread_group}"]
        if s.comm_group is not None:
            parts.append(f"comm={s.comm_group}")
        if io.reads:
            parts.append("reads=" + ",".join(io.reads))
        if io.writes:
            parts.append("writes=" + ",".join(io.writes))
        if io.noop_on:
            parts.append("noop_on=" + ",".join(io.noop_on))
        if io.pure:
            parts.append("pure")
        lines.append(" ".join(parts))
    lines.extend(f"dep {d}" for d in plan.explicit_deps)
    return "\n".join(lines) + "\n"


def plan_from_text(text: str) -> PipelinePlan:
    header: dict[str, str] = {}
    schedule: dict[str, TaskSchedule] = {}
    tasks: list[PipelineTask] = []
    deps: list[Dep] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        try:
            match word:
                case "plan" | "depth" | "source" | "output" | "exhausted":
                    if word in header:
                        raise PlanError(f"'{word}' given twice")
                    header[word] = rest.strip()
                case "task":
                    name, sched, io = _parse_task(rest)
                    if name in schedule:
                        raise PlanError(f"duplicate task name {name}", culprit=name)
                    schedule[name] = sched
                    tasks.append(io)
                case "dep":
                    deps.append(_parse_dep(rest))
                case _:
                    raise PlanError(f"unknown keyword {word!r}")
        except PlanError as e:
            raise PlanError(f"line {lineno}: {e} (in {raw.strip()!r})", culprit=e.culprit or raw.strip()) from None
    for key in ("plan", "depth"):
        if key not in header:
            raise PlanError(f"plan text has no '{key}' line", culprit=key)
    try:
        depth = int(header["depth"])
    except ValueError:
        raise PlanError(f"depth must be an int, got {header['depth']!r}", culprit="depth") from None
    exhausted = header.get("exhausted", "drain")
    return PipelinePlan(
        schedule=schedule,
        intra_iter_deps=[d for d in deps if d.distance == 0],
        inter_iter_deps=[d for d in deps if d.distance > 0],
        pipeline_depth=depth,
        tasks=tasks,
        source=_opt(header.get("source")),
        output=_opt(header.get("output")),
        on_exhausted=exhausted,  # type: ignore[arg-type]
        name=header["plan"],
    )


def _opt(value: str | None) -> str | None:
    return None if value in (None, "", _NONE) else value


def _parse_task(rest: str) -> tuple[str, TaskSchedule, PipelineTask]:
    name, *fields = rest.split()
    kv: dict[str, str] = {}
    pure = False
    for f in fields:
        if f == "pure":
            pure = True
            continue
        key, sep, value = f.partition("=")
        if not sep or key not in ("stage", "stream", "thread", "comm", "reads", "writes", "noop_on") or key in kv:
            raise PlanError(f"bad task field {f!r}", culprit=name)
        kv[key] = value
    if "," in kv.get("comm", ""):
        raise PlanError(f"task {name} names several comm groups ({kv['comm']}); a task belongs to one", culprit=name)
    try:
        stage = int(kv.get("stage", "0"))
    except ValueError:
        raise PlanError(f"stage must be an int, got {kv['stage']!r}", culprit=name) from None
    sched = TaskSchedule(
        stage=stage,
        stream=kv.get("stream", "default"),
        thread_group=kv.get("thread", "default"),
        comm_group=kv.get("comm"),
    )
    split = lambda v: tuple(x for x in v.split(",") if x)  # noqa: E731
    io = PipelineTask(
        name,
        reads=split(kv.get("reads", "")),
        writes=split(kv.get("writes", "")),
        pure=pure,
        noop_on=split(kv.get("noop_on", "")),
    )
    return name, sched, io


def _parse_dep(rest: str) -> Dep:
    parts = rest.split()
    if len(parts) not in (3, 4) or parts[1] != "<-" or (len(parts) == 4 and not parts[3].startswith("@")):
        raise PlanError("a dep line reads 'dep CONSUMER <- PRODUCER [@DISTANCE]'")
    distance = 0
    if len(parts) == 4:
        try:
            distance = int(parts[3][1:])
        except ValueError:
            raise PlanError(f"bad distance {parts[3]!r}") from None
    return Dep(parts[0], parts[2], distance)
