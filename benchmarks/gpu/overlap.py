"""How much of the pipeline's H2D and input-dist device work overlaps compute, read off a
torch.profiler Chrome trace. Pure Python (the trace is a list of event dicts).

Attribution: the engine wraps each task in ``record_function("## Task batch ##")`` (a
``user_annotation`` event on the CPU thread that ran it). Every CUDA launch (a ``cuda_runtime``
or ``cuda_driver`` event) inside such a range on the same thread belongs to that task, and so
does the device work it launched (``kernel``, ``gpu_memcpy``, ``gpu_memset`` events with the
same ``correlation``), whatever stream it ran on: NCCL's collectives run on NCCL's own stream.
TorchRec labels its own steps the same way (``## forward 3 ##``, inside our tasks' ranges), so
only labels naming one of the plan's tasks count.

Categories:

* ``compute``: all device work on the compute stream, the stream that carries most of the
  Forward and Backward tasks' device time (attributed to a task or not);
* ``h2d``: device work of the H2D task on any other stream;
* ``input_dist``: device work of InputDistStart and InputDistWait on any other stream.

Per category: busy time (the union of its intervals) and, for h2d and input_dist, the time
during which they ran while compute ran too (the intersection of the unions), both per step.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LABEL = re.compile(r"^## (?P<task>\S+) (?P<batch>-?\d+) ##$")
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
COMPUTE_TASKS = ("Forward", "Backward")
H2D_TASKS = ("H2D",)
INPUT_DIST_TASKS = ("InputDistStart", "InputDistWait")
PLAN_TASKS = frozenset(
    {*COMPUTE_TASKS, *H2D_TASKS, *INPUT_DIST_TASKS, "ZeroGrad", "WaitBatch", "OptimizerStep", "Dequeue"}
)
"""TrainPipelineSparseDist's tasks: the labels that count unless the caller names others."""

Interval = tuple[float, float]


@dataclass(frozen=True)
class DeviceSpan:
    """One piece of device work: which task launched it (None: outside every task), on which
    stream, when (microseconds, the trace's clock)."""

    task: str | None
    batch: int | None
    stream: int
    start: float
    end: float
    name: str


def _stream(event: Mapping[str, Any]) -> int:
    args = event.get("args") or {}
    return int(args.get("stream", event.get("tid", -1)))


def device_spans(events: Iterable[Mapping[str, Any]], tasks: Collection[str] = PLAN_TASKS) -> list[DeviceSpan]:
    """Every device event of the trace with the task (and batch) that launched it; only labels
    naming one of ``tasks`` count."""
    labels: dict[Any, list[tuple[float, float, str, int]]] = {}
    launches: list[Mapping[str, Any]] = []
    device: list[Mapping[str, Any]] = []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat == "user_annotation" and (m := LABEL.match(str(e.get("name", "")))) and m["task"] in tasks:
            start = float(e["ts"])
            labels.setdefault(e.get("tid"), []).append(
                (start, start + float(e.get("dur", 0)), m["task"], int(m["batch"]))
            )
        elif cat in LAUNCH_CATEGORIES:
            launches.append(e)
        elif cat in DEVICE_CATEGORIES:
            device.append(e)
    for spans in labels.values():
        spans.sort()
    starts = {tid: [s[0] for s in spans] for tid, spans in labels.items()}
    owner: dict[Any, tuple[str, int]] = {}
    for e in launches:
        correlation = (e.get("args") or {}).get("correlation")
        spans = labels.get(e.get("tid"))
        if correlation is None or not spans:
            continue
        ts = float(e["ts"])
        i = bisect.bisect_right(starts[e.get("tid")], ts) - 1
        # labels on one thread do not nest (a thread runs one task at a time): the last one
        # starting before the launch either contains it or none does
        if i >= 0 and spans[i][0] <= ts <= spans[i][1]:
            owner[correlation] = (spans[i][2], spans[i][3])
    out = []
    for e in device:
        task, batch = owner.get((e.get("args") or {}).get("correlation"), (None, None))
        start = float(e["ts"])
        out.append(DeviceSpan(task, batch, _stream(e), start, start + float(e.get("dur", 0)), str(e.get("name", ""))))
    return out


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersection(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two unions (each sorted and disjoint, as ``merge`` gives)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def compute_stream(spans: Sequence[DeviceSpan]) -> int | None:
    """The stream carrying most of Forward's and Backward's device time (None if they launched nothing)."""
    time_on: dict[int, float] = {}
    for s in spans:
        if s.task in COMPUTE_TASKS:
            time_on[s.stream] = time_on.get(s.stream, 0.0) + s.end - s.start
    return max(time_on, key=lambda k: time_on[k]) if time_on else None


def overlap_summary(
    events: Iterable[Mapping[str, Any]], steps: int, tasks: Collection[str] = PLAN_TASKS
) -> dict[str, Any]:
    """Busy and overlapped device time per step (microseconds) of h2d, input_dist and compute.

    ``tasks``: the plan's task names (labels of other names are ignored).
    ``overlap_us_per_step[c]``: time per step during which category ``c`` ran while compute ran;
    ``overlap_share[c]``: that over ``c``'s busy time (None where ``c`` was never busy).
    ``on_compute_stream_us_per_step``: h2d or input_dist work that ran on the compute stream itself
    (it cannot overlap compute; a plan that moves them off it should leave none).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    spans = device_spans(events, tasks)
    stream = compute_stream(spans)
    groups: dict[str, tuple[str, ...]] = {"h2d": H2D_TASKS, "input_dist": INPUT_DIST_TASKS}
    compute = merge((s.start, s.end) for s in spans if s.stream == stream)
    busy = {"compute": length(compute) / steps}
    overlap: dict[str, float] = {}
    share: dict[str, float | None] = {}
    streams: dict[str, list[int]] = {"compute": [] if stream is None else [stream]}
    on_compute: dict[str, float] = {}
    for name, members in groups.items():
        mine = [s for s in spans if s.task in members]
        off = merge((s.start, s.end) for s in mine if s.stream != stream)
        streams[name] = sorted({s.stream for s in mine if s.stream != stream})
        busy[name] = length(off) / steps
        overlap[name] = intersection(off, compute) / steps
        share[name] = overlap[name] / busy[name] if busy[name] > 0 else None
        on_compute[name] = length(merge((s.start, s.end) for s in mine if s.stream == stream)) / steps
    attributed = sum(s.end - s.start for s in spans if s.task is not None)
    total = sum(s.end - s.start for s in spans)
    return {
        "steps": steps,
        "device_events": len(spans),
        "attributed_share": attributed / total if total > 0 else None,
        "streams": streams,
        "busy_us_per_step": busy,
        "overlap_us_per_step": overlap,
        "overlap_share": share,
        "on_compute_stream_us_per_step": on_compute,
    }
