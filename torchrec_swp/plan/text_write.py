"""Plan -> text: a plan's table (``plan_to_text``) and a phased plan's (``phased_to_text``), in
the form ``torchrec_swp.plan.text_words`` describes; ``text_read`` reads them back unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrec_swp.plan.task import PipelineTask, TaskSchedule, When
from torchrec_swp.plan.text_words import COLUMNS, DECLARATIONS, NONE

if TYPE_CHECKING:
    from torchrec_swp.plan.view import PhasedView, PlanView


def _cells(task: str, s: TaskSchedule, io: PipelineTask) -> list[str]:
    flags = (["anchor"] if io.anchor else []) + (["noop_on=" + "+".join(io.noop_on)] if io.noop_on else [])
    return [
        task,
        str(s.stage),
        s.stream,
        s.thread_group,
        s.comm_group or NONE,
        NONE if s.when is When.ALWAYS else s.when.value,
        ",".join(io.reads) or NONE,
        ",".join(io.writes) or NONE,
        ",".join(io.effects) or NONE,
        ",".join(flags) or NONE,
    ]


def plan_to_text(plan: PlanView) -> str:
    lines = [
        f"plan {plan.name}",
        f"depth {plan.pipeline_depth}",
        f"source {plan.source or NONE}",
        f"output {plan.output or NONE}",
        f"exhausted {plan.on_exhausted}",
    ]
    if plan.lookahead:
        lines.append(f"lookahead {plan.lookahead}")
    if plan.loads != 1:
        lines.append(f"loads {plan.loads}")
    scheduled = plan.scheduled()
    rows = [_cells(t.name, t.schedule, t.io) for t in scheduled]
    for kind, cell in DECLARATIONS.items():
        used = dict.fromkeys(r[COLUMNS.index(cell)] for r in rows) if rows else {}
        lines.append(f"{kind} " + (" ".join(n for n in used if n != NONE) or NONE))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines.append("#    " + "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip())
    lines.extend("task " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    lines.extend(f"dep {d}" for d in plan.explicit_deps)
    return "\n".join(lines) + "\n"


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
