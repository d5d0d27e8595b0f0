"""The engine's own cost as work grows: trivial tasks, so every microsecond measured is the engine's.

    python benchmarks/engine_cost.py                                   # 10/30/100 tasks x 1/2/4/8 threads
    python benchmarks/engine_cost.py --baseline /tmp/main-engine       # and another engine, interleaved

The plan (``cost_plan``): ``n`` tasks ``T0 .. T{n-1}`` over 3 stages (the first third of the
tasks at stage 0, the next at stage 1, the rest at stage 2; ``T0``, the source, draws the batch),
a data chain (``Tk`` reads ``d{k-1}``, writes ``dk``; across stages that is the same batch one
iteration later), plus ``Forward(b)`` after ``Optimizer(b-1)``: the first task of stage 2 after the
last one of the batch before. Fire order: stage 2's tasks, then stage 1's, then stage 0's (the
oldest batch first, as upstream's ``progress()`` trains before it loads). Spread over ``t``
threads: contiguous blocks of the fire order, ``t`` blocks as equal as may be, the first on the
calling thread (it trains), the stage-0 tasks with the source in the last ones (they load): every
block boundary the chain crosses is a cross-thread wait, in the same iteration within a stage or
one iteration back across stages. Each task returns its batch number; the source never runs out.

Per plan: ``warmup`` steps, then ``steps`` timed ``step()`` calls (fill excluded), ``repeats``
times (each on a fresh engine); best and median microseconds per step, per task (step / n) and
per cross-thread hand-off: (step on ``t`` threads - step on one thread) / the ``wait``
instructions of one iteration of the compiled program (each the receiving end of a ``signal``;
the ``signal`` count is reported too).

``--baseline ROOT``: also time the ``torchrec_swp`` package under ``ROOT`` (an export of another
commit: ``mkdir /tmp/main-engine && git archive main torchrec_swp | tar -x -C /tmp/main-engine``),
in a second process, interleaved with this checkout's run by run so that both see the same load.

Writes ``OUT/engine_cost.json``, ``OUT/engine_cost.md`` and ``OUT/engine_cost.png`` (default ``out/bench``),
and with ``--svg FILE`` the same plot as SVG (``docs/engine_cost.svg``, the figure ``docs/benchmarks.md`` shows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import load_average, run_meta, write_report

TASKS = (10, 30, 100)
THREADS = (1, 2, 4, 8)
STAGES = 3


def cost_plan(tasks: int, threads: int) -> Any:
    """The benchmark's plan (module docstring) of ``tasks`` tasks spread over ``threads`` threads."""
    from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, PipelineTask, TaskSchedule

    if not 1 <= threads <= tasks:
        raise ValueError(f"threads must be between 1 and tasks ({tasks}), got {threads}")
    names = [f"T{k}" for k in range(tasks)]
    stage = {n: min(STAGES - 1, STAGES * k // tasks) for k, n in enumerate(names)}
    fire = sorted(names, key=lambda n: (-stage[n], names.index(n)))
    thread = {n: MAIN_THREAD if threads * i // tasks == 0 else f"w{threads * i // tasks}" for i, n in enumerate(fire)}
    top = [n for n in names if stage[n] == STAGES - 1]
    io = [PipelineTask(names[0], writes=("d0",))]
    io += [PipelineTask(n, reads=(f"d{k - 1}",), writes=(f"d{k}",)) for k, n in enumerate(names) if k]
    return PipelinePlan(
        schedule={n: TaskSchedule(stage[n], thread_group=thread[n]) for n in names},
        tasks=io,
        inter_iter_deps=[(top[0], top[-1])] if len(top) > 1 else [],
        fire_order=fire,
        source=names[0],
        output=f"d{tasks - 1}",
        name=f"cost{tasks}x{threads}",
    )


def sync_counts(tasks: int, threads: int) -> dict[str, int]:
    """``wait`` and ``signal`` instructions in one steady iteration of the compiled plan."""
    from torchrec_swp.compile import CompiledPlan, Signal, WaitTask

    program = CompiledPlan(cost_plan(tasks, threads)).steady
    instrs = [i for _, thread in program.threads for i in thread]
    return {
        "waits": sum(isinstance(i, WaitTask) for i in instrs),
        "signals": sum(isinstance(i, Signal) for i in instrs),
    }


def time_steps(tasks: int, threads: int, steps: int, warmup: int) -> float:
    """Seconds per ``step()`` of ``cost_plan(tasks, threads)`` over ``steps`` calls after ``warmup``."""
    from torchrec_swp.engine import Engine

    plan = cost_plan(tasks, threads)

    def source(b: int) -> int:
        return b

    def task(b: int, **_: Any) -> int:
        return b

    engine = Engine(plan, {t: source if t == plan.source else task for t in plan.fire_order}, name="swp-cost")
    try:
        for _ in range(warmup):
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps
    finally:
        engine.close()


def _serve() -> None:
    """A measuring process: one JSON request ``[tasks, threads, steps, warmup]`` per input line,
    one line with the seconds per step back."""
    for line in sys.stdin:
        tasks, threads, steps, warmup = json.loads(line)
        print(json.dumps(time_steps(tasks, threads, steps, warmup)), flush=True)


class _Server:
    """A ``_serve`` process importing ``torchrec_swp`` from ``root``."""

    def __init__(self, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--engine-root", str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def time_steps(self, tasks: int, threads: int, steps: int, warmup: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([tasks, threads, steps, warmup]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the measuring process for {self.proc.args[-1]} died (exit code {self.proc.wait()})")
        return float(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def steps_for(tasks: int, budget: int) -> int:
    """Timed steps per run: about ``budget`` task calls, at least 100 steps."""
    return max(100, budget // tasks)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    baseline = _Server(args.baseline) if args.baseline is not None else None
    rows = []
    try:
        for tasks in args.tasks:
            for threads in args.threads:
                if threads > tasks:
                    continue
                steps = steps_for(tasks, args.task_calls)
                ours: list[float] = []
                base: list[float] = []
                for _ in range(args.repeats):  # interleaved: both engines see the same load
                    ours.append(time_steps(tasks, threads, steps, args.warmup))
                    if baseline is not None:
                        base.append(baseline.time_steps(tasks, threads, steps, args.warmup))
                row: dict[str, Any] = {
                    "tasks": tasks,
                    "threads": threads,
                    "steps": steps,
                    **sync_counts(tasks, threads),
                }
                row["ours"] = _summary(ours, tasks)
                if baseline is not None:
                    row["baseline"] = _summary(base, tasks)
                rows.append(row)
                print(_line(row), flush=True)
    finally:
        if baseline is not None:
            baseline.close()
    for row in rows:  # per hand-off: what the threads add over one thread, per wait
        one = next((r for r in rows if r["tasks"] == row["tasks"] and r["threads"] == 1), None)
        for side in ("ours", "baseline"):
            if side in row and one is not None and row["waits"]:
                row[side]["handoff_us"] = (row[side]["best_us"] - one[side]["best_us"]) / row["waits"]
    return rows


def _summary(seconds: list[float], tasks: int) -> dict[str, Any]:
    best, median = 1e6 * min(seconds), 1e6 * statistics.median(seconds)
    return {"best_us": best, "median_us": median, "per_task_us": best / tasks, "runs_us": [1e6 * s for s in seconds]}


def _line(row: dict[str, Any]) -> str:
    text = f"{row['tasks']:>4} tasks {row['threads']} threads: ours {row['ours']['best_us']:8.1f} us/step"
    if "baseline" in row:
        text += f", baseline {row['baseline']['best_us']:8.1f} us/step"
    return text


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(report: dict[str, Any]) -> str:
    rows, meta = report["rows"], report["meta"]
    has_base = any("baseline" in r for r in rows)
    head = (
        "| tasks | threads | waits / signals per iteration | us per step, best (median) | us per task "
        "| us per hand-off |"
    )
    sep = "|---|---|---|---|---|---|"
    if has_base:
        head += " baseline: us per step, best (median) | baseline: us per task | baseline: us per hand-off |"
        sep += "---|---|---|"
    title = (
        f"Engine cost with trivial tasks ({meta['date']}; load average {meta['load_before']} before, "
        f"{meta['load_after']} after; best of {meta['repeats']} runs)."
    )
    lines = [title, "", head, sep]
    for r in rows:
        cells = [str(r["tasks"]), str(r["threads"]), f"{r['waits']} / {r['signals']}"]
        for side in ("ours", "baseline") if has_base else ("ours",):
            s = r[side]
            cells += [
                f"{s['best_us']:.1f} ({s['median_us']:.1f})",
                f"{s['per_task_us']:.2f}",
                _fmt(s.get("handoff_us")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    if has_base:
        lines += [
            "",
            f"baseline: the engine under `{meta['baseline']}`, timed in a second process, run by run interleaved.",
        ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {1: "#1f77b4", 2: "#ff7f0e", 4: "#2ca02c", 8: "#d62728"}
    for threads in sorted({r["threads"] for r in rows}):
        mine = [r for r in rows if r["threads"] == threads]
        x = [r["tasks"] for r in mine]
        color = colors.get(threads, "#555555")
        for side, style, label in (("ours", "-", "this checkout"), ("baseline", "--", "baseline")):
            if all(side in r for r in mine):
                axes[0].plot(
                    x,
                    [r[side]["best_us"] for r in mine],
                    style,
                    marker="o",
                    color=color,
                    label=f"{threads} thr, {label}",
                )
                axes[1].plot(x, [r[side]["per_task_us"] for r in mine], style, marker="o", color=color)
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("us per step (best)")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("us per task (best)")
    for ax in axes:
        ax.set_xlabel("trivial tasks per iteration")
        ax.set_xticks(sorted({r["tasks"] for r in rows}), [str(t) for t in sorted({r["tasks"] for r in rows})])
    axes[0].legend(fontsize=7)
    fig.suptitle("engine cost per step and per task (solid: this checkout, dashed: baseline)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=_ints, default=list(TASKS), help="comma-separated (default: 10,30,100)")
    parser.add_argument("--threads", type=_ints, default=list(THREADS), help="comma-separated (default: 1,2,4,8)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs per plan, each on a fresh engine (default: %(default)s)"
    )
    parser.add_argument("--task-calls", type=int, default=30_000, help="task calls per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per run (default: %(default)s)")
    parser.add_argument("--baseline", type=Path, default=None, help="a folder holding another torchrec_swp to time too")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    parser.add_argument(
        "--svg",
        type=Path,
        default=None,
        help="also draw the plot as SVG there (docs/engine_cost.svg: the docs' figure)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-root", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        if args.engine_root is not None:
            sys.path.insert(0, str(args.engine_root))
        _serve()
        return
    if args.repeats < 1 or args.task_calls < 1 or args.warmup < 0:
        parser.error("--repeats and --task-calls must be >= 1, --warmup >= 0")
    if args.baseline is not None and not (args.baseline / "torchrec_swp" / "engine").is_dir():
        parser.error(f"--baseline {args.baseline}: no torchrec_swp/engine there")
    load_before = load_average()
    rows = measure(args)
    meta = run_meta("engine_cost.py", argv, args, "repeats", "task_calls", "warmup")
    meta.update(
        baseline=None if args.baseline is None else str(args.baseline),
        load_before=load_before,
        load_after=load_average(),
    )
    report = {"meta": meta, "rows": rows}
    write_report(args.out, "engine_cost", report, markdown(report))
    plot(report, args.out / "engine_cost.png")
    print(f"wrote {args.out / 'engine_cost.png'}")
    if args.svg is not None:
        plot(report, args.svg)
        print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
