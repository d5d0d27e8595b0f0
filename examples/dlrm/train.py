"""Train TorchRec's DLRM with any of TorchRec's train pipelines, torchrec_swp's or upstream's.

Launch on this machine's 2 CPU ranks (gloo) with ``make run ARGS="..."`` (checks the arguments,
launches through torchx, ends with one line saying what went wrong if anything did), or::

    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --steps 100 --thread_map io
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 examples/dlrm/train.py

(``torchx run -s local_cwd dist.ddp -j 1x2 --script examples/dlrm/train.py`` too, once the venv is
active: ``source .venv/bin/activate``; torchx's ``dist.ddp`` runs ``torchrun`` from PATH.)
``python examples/dlrm/train.py --check ARGS`` validates the arguments, the plan file and the
thread map without training.

Data: Criteo-like synthetic batches made on the fly (13 dense, ``--num-sparse`` sparse features),
or real Criteo TSV files with ``--criteo-tsv FILE ...``; ``--loader-latency-ms`` makes the loader
wait that long per batch, like storage would. Pipeline: ``--pipeline NAME`` (any of the 11),
``--impl ours|upstream``, ``--plan FILE`` (a plan text file replacing the default plan) and
``--thread-map`` (ours only: ``main``, ``by_stream``, ``per_task``, ``io``, or ``TASK=THREAD,...``
such as ``H2D=io``, or a JSON object). ``--thread-map io`` puts the stage-0 tasks (loading the
batch and copying it to the device) on their own thread, so the loader's waiting overlaps the
training. ``--profile-out FILE`` (ours) profiles every task and writes rank 0's profile, the
input of ``python -m torchrec_swp.autosched --profile FILE --out PLAN``.

Rank 0 prints the plan (ours), shows a progress bar with the loss and the QPS (examples per
second over all ranks), and a summary at the end; ``--json FILE`` also writes the summary.
A bad argument, plan or thread map ends the run with one line ``error: ...`` per rank.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from tqdm import tqdm

from examples.dlrm.data import CriteoTsv, SyntheticCriteo, with_latency
from examples.dlrm.model import DlrmSize, build_dlrm
from examples.dlrm.pipelines import INFO, PIPELINES, PipelineUnavailable, make_runner
from torchrec_swp.catalog.torchrec import default_plans
from torchrec_swp.plan import PlanError, load_plan

THREAD_MAPS = ("main", "by_stream", "per_task", "io")
#: Batches per rank, the same for ``make run``, this script and the torchx component.
STEPS = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DlrmSize()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument(
        "--pipeline",
        choices=PIPELINES,
        default="TrainPipelineSparseDist",
        metavar="NAME",
        help="one of: " + ", ".join(PIPELINES) + " (default: %(default)s)",
    )
    pipe.add_argument(
        "--impl",
        choices=("ours", "upstream"),
        default="ours",
        help="torchrec_swp's pipeline or upstream TorchRec's (default: %(default)s)",
    )
    pipe.add_argument("--plan", type=Path, metavar="FILE", help="a plan text file replacing the default plan (ours)")
    pipe.add_argument(
        "--thread-map",
        metavar="MAP",
        help=f"ours: {', '.join(THREAD_MAPS)}, or TASK=THREAD[,TASK=THREAD...] (e.g. H2D=io), or a JSON object",
    )
    pipe.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a constructor option of the pipeline, VALUE a Python literal (repeatable), e.g. --option start_batch=5",
    )
    pipe.add_argument(
        "--upstream-cpu-patch",
        action="store_true",
        help="run an upstream pipeline that fails on CPU as shipped under the test-only patch",
    )
    model = parser.add_argument_group("model and data")
    model.add_argument("--steps", type=int, default=STEPS, help="batches per rank (default: %(default)s)")
    model.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="examples per batch and rank (default: %(default)s)"
    )
    model.add_argument(
        "--num-sparse", type=int, default=d.num_sparse, help="sparse features, one table each (default: %(default)s)"
    )
    model.add_argument(
        "--num-embeddings", type=int, default=d.num_embeddings, help="rows per table (default: %(default)s)"
    )
    model.add_argument("--embedding-dim", type=int, default=d.embedding_dim, help="(default: %(default)s)")
    model.add_argument(
        "--dense-arch",
        default=",".join(map(str, d.dense_arch)),
        help="hidden sizes of the bottom MLP (default: %(default)s)",
    )
    model.add_argument(
        "--over-arch",
        default=",".join(map(str, d.over_arch)),
        help="hidden sizes of the top MLP (default: %(default)s)",
    )
    model.add_argument(
        "--criteo-tsv",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="read real Criteo TSV files instead of synthetic data",
    )
    model.add_argument(
        "--loader-latency-ms",
        type=float,
        default=0.0,
        help="the loader waits this long for each batch (default: %(default)s)",
    )
    model.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    run = parser.add_argument_group("run")
    run.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per rank (default: %(default)s; 2 ranks share 2 cores here)",
    )
    run.add_argument("--json", type=Path, metavar="FILE", help="rank 0 also writes the summary here")
    run.add_argument(
        "--profile-out",
        type=Path,
        metavar="FILE",
        help="ours: profile every task (TaskProfiler) and write rank 0's profile here",
    )
    run.add_argument(
        "--check", action="store_true", help="only check the arguments, plan file and thread map, then exit"
    )
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "num_sparse", "num_embeddings", "embedding_dim", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.loader_latency_ms < 0:
        parser.error("--loader-latency-ms must be >= 0")
    try:
        args.size = DlrmSize(
            batch_size=args.batch_size,
            num_sparse=args.num_sparse,
            num_embeddings=args.num_embeddings,
            embedding_dim=args.embedding_dim,
            dense_arch=_sizes(args.dense_arch),
            over_arch=_sizes(args.over_arch),
        )
        args.options = dict(_option(o) for o in args.option)
        args.thread_map_value = thread_map_of(args.thread_map)
    except ValueError as e:
        parser.error(str(e))
    if args.impl == "upstream" and (args.plan or args.thread_map or args.profile_out):
        parser.error("--plan, --thread-map and --profile-out apply to our pipelines only (--impl ours)")
    if args.plan and not args.plan.is_file():
        parser.error(f"--plan: no such file: {args.plan}")
    try:
        args.plan_value = load_plan(str(args.plan)) if args.plan else None
    except PlanError as e:
        parser.error(f"--plan {args.plan}: {e}")
    try:
        _check_thread_map(args)
    except PlanError as e:
        parser.error(f"--thread-map: {e}")
    return args


def _check_thread_map(args: argparse.Namespace) -> None:
    """The thread map names tasks of the plan that will run (the given one, else the default)."""
    if args.thread_map_value is None:
        return
    plan = args.plan_value if args.plan_value is not None else default_plans().get(args.pipeline)
    if plan is not None and args.pipeline != "StagedTrainPipeline":
        plan.with_thread_map(args.thread_map_value)  # PlanError naming an unknown task or strategy


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"layer sizes must be comma-separated integers, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"layer sizes must be >= 1, got {text!r}")
    return sizes


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"--option must be KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(f'--option {key}: {value!r} is not a Python literal (quote strings: {key}="...")') from None


def thread_map_of(text: str | None) -> Any:
    """The ``thread_map`` argument for ``--thread-map``: a strategy, ``io``, ``TASK=THREAD,...``
    or a JSON object ``{task: thread}``."""
    if text is None or text in ("main", "by_stream", "per_task"):
        return text
    if text == "io":
        return lambda task: "io" if task.stage == 0 else task.thread_group
    if text.lstrip().startswith("{"):
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError:
            mapping = None
    else:
        pairs = [item.partition("=") for item in text.split(",") if item.strip()]
        ok = pairs and all(sep and task.strip() and thread.strip() for task, sep, thread in pairs)
        mapping = {task.strip(): thread.strip() for task, _, thread in pairs} if ok else None
    if not isinstance(mapping, dict) or not mapping or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(
            f"--thread-map must be one of {', '.join(THREAD_MAPS)}, TASK=THREAD[,TASK=THREAD...] "
            f"(e.g. H2D=io) or a JSON object {{task: thread}}, got {text!r}"
        )
    return mapping


def batches_for(args: argparse.Namespace, rank: int, world_size: int) -> Iterable[Any]:
    """This rank's batches: Criteo TSV files or synthetic data, with the loader latency."""
    size: DlrmSize = args.size
    if args.criteo_tsv:
        data: Iterable[Any] = CriteoTsv(
            args.criteo_tsv,
            batch_size=size.batch_size,
            num_embeddings=size.num_embeddings,
            num_sparse=size.num_sparse,
            rank=rank,
            world_size=world_size,
            max_batches=args.steps,
        )
    else:
        data = SyntheticCriteo(
            batch_size=size.batch_size,
            num_batches=args.steps,
            num_embeddings=size.num_embeddings,
            num_sparse=size.num_sparse,
            rank=rank,
            seed=1000 + args.seed,
        )
    return with_latency(data, args.loader_latency_ms / 1000)


class _LineStream:
    """A non-terminal stream for tqdm: each refresh becomes one line (logs have no carriage return)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self._stream.write(text + "\n")

    def flush(self) -> None:
        self._stream.flush()


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    size: DlrmSize = args.size
    runner = make_runner(
        args.pipeline,
        args.impl,
        lambda: build_dlrm(rank, world_size, size, seed=args.seed),
        plan=args.plan_value,
        thread_map=args.thread_map_value,
        options=args.options,
        upstream_patch=args.upstream_cpu_patch,
    )
    kind = INFO[args.pipeline].kind
    if rank == 0:
        print(
            f"{args.impl} {args.pipeline} ({kind}) on {world_size} ranks (gloo), {args.steps} steps, {size.describe()}"
        )
        if args.impl == "ours":
            print(runner.pipeline.plan.format_schedule(runner.pipeline.plan.max_stage + 3))
    profiler = None
    if args.profile_out:
        from torchrec_swp.profiler import TaskProfiler

        profiler = TaskProfiler(warmup=2).attach(runner.pipeline.engine)
    it: Iterator[Any] = iter(batches_for(args, rank, world_size))
    examples_per_step = size.batch_size * world_size
    interactive = sys.stdout.isatty()
    bar = tqdm(
        total=args.steps,
        disable=rank != 0,
        unit="step",
        desc=args.pipeline,
        file=sys.stdout if interactive else _LineStream(sys.stdout),
        mininterval=0.2 if interactive else 5.0,
        dynamic_ncols=interactive,
    )
    step_s: list[float] = []
    losses: list[float] = []
    start = time.perf_counter()
    try:
        while True:
            t0 = time.perf_counter()
            try:
                output = runner.step(it)
            except StopIteration:
                break
            step_s.append(time.perf_counter() - t0)
            losses.append(float(output[0]))
            if rank == 0:
                recent = step_s[-20:]
                bar.set_postfix(
                    loss=f"{statistics.fmean(losses[-20:]):.4f}",
                    qps=f"{examples_per_step * len(recent) / sum(recent):,.0f}",
                    refresh=False,
                )
                bar.update()
    finally:
        bar.close()
        runner.close()
    wall = time.perf_counter() - start
    if profiler is not None and rank == 0:
        profile = profiler.profile()
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        profile.save(str(args.profile_out))
        print(profile.format_table())
        print(f"profile written to {args.profile_out}: python -m torchrec_swp.autosched --profile {args.profile_out} --out PLAN")
    if rank != 0:
        return None
    steady = step_s[len(step_s) // 10 :]  # the first steps build caches (and compile, for PT2)
    head, tail = losses[: max(1, len(losses) // 10)], losses[-max(1, len(losses) // 10) :]
    return {
        "pipeline": args.pipeline,
        "impl": args.impl,
        "thread_map": args.thread_map,
        "plan": str(args.plan) if args.plan else None,
        "ranks": world_size,
        "size": size.describe(),
        "data": "criteo-tsv" if args.criteo_tsv else "synthetic",
        "loader_latency_ms": args.loader_latency_ms,
        "steps": len(step_s),
        "wall_s": wall,
        "qps": examples_per_step * len(step_s) / wall if wall else 0.0,
        "median_step_ms": 1e3 * statistics.median(steady) if steady else None,
        "p90_step_ms": 1e3 * sorted(steady)[int(0.9 * (len(steady) - 1))] if steady else None,
        "steady_qps": examples_per_step / statistics.median(steady) if steady else None,
        "loss_first": statistics.fmean(head) if losses else None,
        "loss_last": statistics.fmean(tail) if losses else None,
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"done: {s['steps']} steps of {s['impl']} {s['pipeline']} in {s['wall_s']:.1f}s on {s['ranks']} ranks")
    if s["steps"]:
        print(
            f"  step time: median {s['median_step_ms']:.2f} ms, p90 {s['p90_step_ms']:.2f} ms "
            "(steps after the first 10%)\n"
            f"  QPS: {s['steady_qps']:,.0f} examples/s at the median step, {s['qps']:,.0f} over the whole run\n"
            f"  loss: {s['loss_first']:.4f} (first 10% of steps) -> {s['loss_last']:.4f} (last 10%)"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        print(f"ok: {args.impl} {args.pipeline}, {args.steps} steps" + (f", plan {args.plan}" if args.plan else ""))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    # torch.fx warns once that is_fx_tracing() also covers export; TorchRec's code calls it.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    if "RANK" not in os.environ:
        print(
            "error: train.py runs under a launcher that sets RANK/WORLD_SIZE: make run, torchx or "
            "torch.distributed.run (see --help)",
            file=sys.stderr,
        )
        return 2
    dist.init_process_group("gloo")
    try:
        summary = train(args)
    except (PipelineUnavailable, PlanError, FileNotFoundError, ValueError, TypeError) as e:
        # what a user can fix: one line, not a traceback per rank
        print(f"error: rank {dist.get_rank()}: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    if summary is not None:
        print_summary(summary)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
