"""The text form of a plan: one readable table, rows in fire order, with an exact round trip.

    plan TrainPipelineSparseDist
    depth 3
    source H2D
    output output
    exhausted drain
    lookahead 1
    loads 2
    #    task            stage  stream     thread   comm   when   reads          writes          flags
    task ZeroGrad        2      default    default  -      -      -              -               -
    task InputDistStart  1      data_dist  default  world  -      batch,context  -               -
    task H2D             0      memcpy     default  -      -      -              batch,context   -
    task Forward         2      default    default  world  -      batch,context  losses,output   anchor
    dep Forward <- OptimizerStep @1

Task rows are in fire order; ``-`` is an empty cell. ``when`` is a ``When`` (``first``,
``not_first``, ``fill``, ``has_next``, ``last``, ``train``, ``never``); a read ``x@1`` comes from the
previous batch. ``flags`` holds ``anchor`` and ``noop_on=DEVICE[+DEVICE...]``, comma-separated. Only explicit deps are
written (inferred ones follow from reads/writes). ``lookahead`` and ``loads`` lines are written only
when they differ from 0 and 1. ``#`` starts a comment; blank lines are
ignored. Rows of the older form ``task NAME stage=2 stream=... reads=a,b`` are read too.

A phased plan (``PhasedPlan``) is ``phases NAME``, a ``clock CLOCK`` line where its clock is not
the default ``index``, a ``cycle FIRST PERIOD`` line where its phases repeat, then ``phase START``
lines, each followed by one plan.

``PipelinePlan(**plan_args_from_text(plan_to_text(p))) == p`` (what ``PipelinePlan.from_text``
does) and the text comes back unchanged from a plan read so (likewise for phased plans). This
module reads and writes text only: it makes the plan's constructor arguments and reads a plan's
attributes, so that the plan classes import it and not the other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrec_swp.plan.errors import PlanError
from torchrec_swp.plan.task import Dep, PipelineTask, TaskSchedule, When

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PhasedView, PlanView

_NONE = "-"
COLUMNS = ("task", "stage", "stream", "thread", "comm", "when", "reads", "writes", "flags")
_OLD_KEYS = ("stage", "stream", "thread", "comm", "reads", "writes", "noop_on", "when")


def _cells(task: str, s: TaskSchedule, io: PipelineTask) -> list[str]:
    flags = (["anchor"] if io.anchor else []) + (["noop_on=" + "+".join(io.noop_on)] if io.noop_on else [])
    return [
        task,
        str(s.stage),
        s.stream,
        s.thread_group,
        s.comm_group or _NONE,
        _NONE if s.when is When.ALWAYS else s.when.value,
        ",".join(io.reads) or _NONE,
        ",".join(io.writes) or _NONE,
        ",".join(flags) or _NONE,
    ]


def plan_to_text(plan: PlanView) -> str:
    lines = [
        f"plan {plan.name}",
        f"depth {plan.pipeline_depth}",
        f"source {plan.source or _NONE}",
        f"output {plan.output or _NONE}",
        f"exhausted {plan.on_exhausted}",
    ]
    if plan.lookahead:
        lines.append(f"lookahead {plan.lookahead}")
    if plan.loads != 1:
        lines.append(f"loads {plan.loads}")
    rows = [_cells(t.name, t.schedule, t.io) for t in plan.scheduled()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines.append("#    " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip())
    lines.extend("task " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    lines.extend(f"dep {d}" for d in plan.explicit_deps)
    return "\n".join(lines) + "\n"


def plan_args_from_text(text: str) -> dict[str, Any]:
    """The constructor arguments of the PipelinePlan ``text`` describes."""
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
                case "plan" | "depth" | "source" | "output" | "exhausted" | "lookahead" | "loads":
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
                case "phases" | "phase":
                    raise PlanError("this is a phased plan: read it with PhasedPlan.from_text or plan.load_plan")
                case _:
                    raise PlanError(f"unknown keyword {word!r}")
        except PlanError as e:
            raise PlanError(f"line {lineno}: {e} (in {raw.strip()!r})", culprit=e.culprit or raw.strip()) from None
    for key in ("plan", "depth"):
        if key not in header:
            raise PlanError(f"plan text has no '{key}' line", culprit=key)
    depth, lookahead, loads = (_int(header, key, default) for key, default in (("depth", 0), ("lookahead", 0), ("loads", 1)))
    exhausted = header.get("exhausted", "drain")
    return {
        "schedule": schedule,
        "intra_iter_deps": [d for d in deps if d.distance == 0],
        "inter_iter_deps": [d for d in deps if d.distance != 0],
        "pipeline_depth": depth,
        "tasks": tasks,
        "source": _opt(header.get("source")),
        "output": _opt(header.get("output")),
        "on_exhausted": exhausted,
        "name": header["plan"],
        "lookahead": lookahead,
        "loads": loads,
    }


def _int(header: dict[str, str], key: str, default: int) -> int:
    try:
        return int(header.get(key, default))
    except ValueError:
        raise PlanError(f"{key} must be an int, got {header[key]!r}", culprit=key) from None


def phased_to_text(phased: PhasedView) -> str:
    lines = [f"phases {phased.name}"]
    if phased.clock != "index":
        lines.append(f"clock {phased.clock}")
    if phased.cycle is not None:
        lines.append(f"cycle {phased.cycle[0]} {phased.cycle[1]}")
    for start, plan in phased.phases:
        lines.append(f"phase {start}")
        lines.append(plan_to_text(plan).rstrip("\n"))
    return "\n".join(lines) + "\n"


def phased_args_from_text(text: str) -> tuple[str, str, tuple[int, int] | None, list[tuple[int, dict[str, Any]]]]:
    """The name, clock, cycle and phases ``(start, plan constructor arguments)`` of the
    PhasedPlan ``text`` describes."""
    name: str | None = None
    clock = "index"
    cycle: tuple[int, int] | None = None
    phases: list[tuple[int, list[str]]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        word, _, rest = raw.split("#", 1)[0].strip().partition(" ")
        if word == "phases":
            if name is not None or phases:
                raise PlanError(f"line {lineno}: 'phases' must come first, once", culprit="phases")
            name = rest.strip()
        elif word == "clock" and not phases:
            clock = rest.strip()
        elif word == "cycle" and not phases:
            try:
                first, period = (int(v) for v in rest.split())
            except ValueError:
                raise PlanError(
                    f"line {lineno}: a cycle line reads 'cycle FIRST PERIOD', got {raw.strip()!r}"
                ) from None
            cycle = (first, period)
        elif word == "phase":
            try:
                phases.append((int(rest), []))
            except ValueError:
                raise PlanError(f"line {lineno}: a phase line reads 'phase START', got {raw.strip()!r}") from None
        elif phases:
            phases[-1][1].append(raw)
        elif word:
            raise PlanError(f"line {lineno}: expected 'phases NAME' or 'phase START', got {raw.strip()!r}")
    if name is None:
        raise PlanError("phased plan text has no 'phases' line", culprit="phases")
    return name, clock, cycle, [(start, plan_args_from_text("\n".join(body))) for start, body in phases]


def is_phased_text(text: str) -> bool:
    first = next((ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()), "")
    return first.startswith("phases ")


def _opt(value: str | None) -> str | None:
    return None if value in (None, "", _NONE) else value


def _split(value: str) -> tuple[str, ...]:
    return () if value == _NONE else tuple(x for x in value.split(",") if x)


def _parse_task(rest: str) -> tuple[str, TaskSchedule, PipelineTask]:
    fields = rest.split()
    if len(fields) > 1 and fields[1].partition("=")[0] in _OLD_KEYS and "=" in fields[1]:
        return _parse_old_task(fields)
    if len(fields) != len(COLUMNS):
        raise PlanError(
            f"a task row has {len(COLUMNS)} columns ({' '.join(COLUMNS)}; '-' for none), got {len(fields)}",
            culprit=fields[0] if fields else "task",
        )
    name, stage, stream, thread, comm, when, reads, writes, flags = fields
    anchor, noop_on = False, ()
    for flag in _split(flags):
        if flag == "anchor":
            anchor = True
        elif flag.startswith("noop_on="):
            noop_on = tuple(flag.removeprefix("noop_on=").split("+"))
        else:
            raise PlanError(f"unknown flag {flag!r} of task {name} (flags: anchor, noop_on=DEVICE)", culprit=name)
    return name, _schedule(name, stage, stream, thread, _opt(comm), when), PipelineTask(
        name, reads=_split(reads), writes=_split(writes), noop_on=noop_on, anchor=anchor
    )


def _parse_old_task(fields: list[str]) -> tuple[str, TaskSchedule, PipelineTask]:
    name, *pairs = fields
    kv: dict[str, str] = {}
    for f in pairs:
        key, sep, value = f.partition("=")
        if not sep or key not in _OLD_KEYS or key in kv:
            raise PlanError(f"bad task field {f!r}", culprit=name)
        kv[key] = value
    sched = _schedule(
        name, kv.get("stage", "0"), kv.get("stream", "default"), kv.get("thread", "default"), kv.get("comm"),
        kv.get("when", _NONE),
    )
    split = lambda v: tuple(x for x in v.split(",") if x)  # noqa: E731
    io = PipelineTask(
        name, reads=split(kv.get("reads", "")), writes=split(kv.get("writes", "")), noop_on=split(kv.get("noop_on", ""))
    )
    return name, sched, io


def _schedule(name: str, stage: str, stream: str, thread: str, comm: str | None, when: str) -> TaskSchedule:
    if comm is not None and "," in comm:
        raise PlanError(f"task {name} names several comm groups ({comm}); a task belongs to one", culprit=name)
    try:
        stage_int = int(stage)
    except ValueError:
        raise PlanError(f"stage must be an int, got {stage!r}", culprit=name) from None
    return TaskSchedule(
        stage=stage_int,
        stream=stream,
        thread_group=thread,
        comm_group=comm,
        when=When.ALWAYS if when == _NONE else when,  # type: ignore[arg-type]
    )


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
