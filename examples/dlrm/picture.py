"""A picture of what a run did: the last few measured steps as a Gantt chart, one row per thread.

``StepRecorder`` is an engine observer (``engine.instrument(recorder)``) that keeps every task run
(task, batch, thread, start, end) of the last ``keep`` steps the caller marks with
``recorder.step(start, end)``; ``save_gantt(recorder, path)`` draws them with matplotlib: a bar per
task run on its thread's row (a colour per task, labelled with the batch), the steps as shaded
spans. ``make run`` writes one (``--timeline``) and the summary names its path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TaskRun:
    task: str
    batch: int
    thread: str
    start: float
    end: float


class StepRecorder:
    """Keeps the task runs of the last ``keep`` steps (an engine Observer)."""

    def __init__(self, keep: int = 4) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._pending: list[TaskRun] = []
        self.steps: deque[tuple[float, float, list[TaskRun]]] = deque(maxlen=keep)

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        self._pending.append(TaskRun(task, batch, thread, start, end))  # list.append: atomic under the GIL

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        return None

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        return None

    def step(self, start: float, end: float) -> None:
        """The caller's step ran from ``start`` to ``end``: it owns the runs recorded so far
        (worker threads' runs between calls count to the next step)."""
        runs, self._pending = self._pending, []
        self.steps.append((start, end, runs))


def save_gantt(recorder: StepRecorder, path: Path, title: str) -> Path:
    """Draw the recorded steps into ``path`` (PNG); returns it. Raises ValueError with nothing recorded."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(recorder, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def gantt_figure(recorder: StepRecorder, title: str) -> Any:
    """The recorded steps as a matplotlib Figure: one row per thread, the steps shaded, a legend of
    the tasks below the axes' label. Raises ValueError with nothing recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(recorder.steps)
    runs = [r for _, _, rs in steps for r in rs]
    if not runs:
        raise ValueError("no task run was recorded: nothing to draw")
    t0 = min(min(s for s, _, _ in steps), min(r.start for r in runs))
    threads = list(dict.fromkeys(["default", *sorted({r.thread for r in runs} - {"default"})]))
    threads = [t for t in threads if any(r.thread == t for r in runs)]
    tasks = list(dict.fromkeys(r.task for r in runs))
    colours = plt.get_cmap("tab20")
    colour = {task: colours(k % 20) for k, task in enumerate(tasks)}
    # the legend below the axes, outside them and below their label: constrained layout makes room
    legend_rows = -(-len(tasks) // 6)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(threads) + 0.2 * legend_rows), layout="constrained")
    for k, (start, end, _) in enumerate(steps):
        ax.axvspan(1e3 * (start - t0), 1e3 * (end - t0), color="0.92" if k % 2 else "0.85", zorder=0)
    for r in runs:
        y = threads.index(r.thread)
        left, width = 1e3 * (r.start - t0), 1e3 * (r.end - r.start)
        ax.barh(y, width, left=left, height=0.6, color=colour[r.task], edgecolor="black", linewidth=0.3, zorder=2)
        if width > 0.4:
            ax.text(left + width / 2, y, str(r.batch), ha="center", va="center", fontsize=6, zorder=3)
    ax.set_yticks(range(len(threads)), threads)
    ax.invert_yaxis()
    ax.set_xlabel("ms (shaded: the steps, progress() calls of the caller; numbers: the batch each task ran for)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[t]) for t in tasks]
    fig.legend(handles, tasks, loc="outside lower center", ncol=min(6, len(tasks)), fontsize=7, frameon=False)
    return fig
