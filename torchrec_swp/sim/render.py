"""Renderings of a SimResult: a text Gantt chart and a Chrome/Perfetto trace."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchrec_swp.sim.result import SimResult


def format_timeline(result: SimResult, width: int = 100) -> str:
    """One row per lane, time scaled so that the makespan spans ``width`` columns.

    An interval prints as ``[Task b]`` (cut to its width; ``#`` when one column wide), idle
    time as ``.``; each row ends with the lane's busy time and utilisation. The header gives
    makespan and steady iteration time.
    """
    if width < 10:
        raise ValueError(f"width must be >= 10, got {width}")
    makespan = result.makespan
    steady = result.steady_iteration_time
    scale = width / makespan if makespan > 0 else 0.0
    w_lane = max(4, *(len(lane) for lane in result.lanes))
    busy = result.busy
    head = f"plan {result.plan.name}: makespan {makespan:g}, steady iteration time " + (
        f"{steady:g}" if steady is not None else "- (no steady iteration)"
    )
    axis = "0".ljust(width - len(f"{makespan:g}")) + f"{makespan:g}"
    out = [head, f"{'time':<{w_lane}}  {axis}"]
    for lane in result.lanes:
        row = ["."] * width
        for i in result.timeline:
            if i.lane != lane or i.duration <= 0:
                continue
            a = min(round(i.start * scale), width - 1)
            n = max(1, round(i.end * scale) - a)
            text = "#" if n == 1 else "[" + f"{i.task} {i.batch}".ljust(n - 2)[: n - 2] + "]"
            row[a : a + n] = text[: width - a]
        share = f" ({100 * busy[lane] / makespan:.0f}%)" if makespan > 0 else ""
        out.append(f"{lane:<{w_lane}}  {''.join(row)}  busy {busy[lane]:g}{share}")
    return "\n".join(out)


def to_chrome_trace(result: SimResult, us_per_unit: float = 1.0) -> dict[str, Any]:
    """A Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one track per lane, one
    complete ("X") event per interval named ``"Task b"``. A simulated time unit is
    ``us_per_unit`` microseconds."""
    tid = {lane: k for k, lane in enumerate(result.lanes)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"sim {result.plan.name}"}},
        *({"name": "thread_name", "ph": "M", "pid": 0, "tid": k, "args": {"name": lane}} for lane, k in tid.items()),
    ]
    for i in result.timeline:
        events.append(
            {
                "name": f"{i.task} {i.batch}",
                "cat": "cpu" if i.lane.startswith("cpu:") else "device",
                "ph": "X",
                "pid": 0,
                "tid": tid[i.lane],
                "ts": i.start * us_per_unit,
                "dur": i.duration * us_per_unit,
                "args": {"task": i.task, "batch": i.batch, "iteration": i.iteration},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
