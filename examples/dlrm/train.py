"""Train TorchRec's DLRM with any of TorchRec's train pipelines, torchrec_swp's or upstream's.

Launch on this machine's 2 CPU ranks (gloo) with ``make run ARGS="..."`` (checks the arguments,
launches through torchx, ends with one line saying what went wrong if anything did), or::

    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --steps 100 --thread_map io
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 examples/dlrm/train.py

(``torchx run -s local_cwd dist.ddp -j 1x2 --script examples/dlrm/train.py`` too, once the venv is
active: ``source .venv/bin/activate``; torchx's ``dist.ddp`` runs ``torchrun`` from PATH.)
``python examples/dlrm/train.py --check ARGS`` validates the arguments, the plan file and the
thread map without training.

Data: Criteo-like synthetic batches made on the fly (13 dense, ``--num-sparse`` sparse features;
``data.py``: drawn by TorchRec's ``RandomRecDataset``, made Criteo-like, the labels learnable),
or real Criteo TSV files with ``--criteo-tsv FILE ...``, handed out (``--data-source``, see
``loader.py``) by torchdata's StatefulDataLoader (``dataloader``, the default: ``--num-workers``
worker processes, 0: in the training process) or by ``torchrec_swp.data.MapSource`` over a
map-style dataset (``map``: the same batches in the same order, loaded on the pipeline's own
threads, ``--loads N`` at once); ``--loader-latency-ms`` makes each batch wait that long, like
storage would (with ``map``, inside each load, so parallel loads wait at once), or, with
``--loader-kind gil|torch|tail``, work that long in Python holding the GIL, in torch ops, or wait
a heavy-tailed time (``loader_work.py``).
Pipeline: ``--pipeline NAME`` (any of the 12, TrainPipelinePEC needs TorchRec 1.9; and the
experimental TrainEvalHybridPipelineBase), ``--impl ours|upstream``,
``--plan FILE`` (a plan text file replacing the default plan) and
``--thread-map`` (ours only: ``main``, ``by_stream``, ``per_task``, ``io``, or ``TASK=THREAD,...``
such as ``H2D=io``, or a JSON object). ``--thread-map io`` puts the stage-0 tasks (loading the
batch and copying it to the device) on their own thread, so the loader's waiting overlaps the
training. ``--profile-out FILE.json`` (ours) profiles every task and writes each rank's profile
(``FILE.rank0.json``, ``FILE.rank1.json``, ...), the input of ``python -m torchrec_swp.autosched
--profile 'FILE.rank*.json' --out PLAN``. ``--loads N`` (ours, with
``--data-source map``) splits the plan's batch load in two, ``N`` fetches at once on thread group
``load`` and the copy where it was (``torchrec_swp.plans.with_parallel_loads``, the pipelines' ``loads=``);
``--lookahead K`` lets the source draw ``K`` batches ahead (with ``--loads N``, default ``N``);
the thread map applies after the split and must leave ``Fetch`` a thread group of its own (one
that puts it with H2D or on the calling thread is refused). ``--input-dist-group`` gives the
sparse input dist a process group of its own (the SparseDist family's ``input_dist_group=True``;
with the input dist tasks on a thread of their own, e.g. ``--thread-map by_stream`` or
``InitPipelinedModules=dist,InputDistStart=dist,InputDistWait=dist``, it overlaps the forward and
backward collectives).

Devices: ``--device auto|cpu|cuda`` (auto: CUDA when torch sees a GPU). On CUDA each process
takes the GPU of its ``LOCAL_RANK``, the ranks talk over NCCL and the pipelines get the CUDA
device, so their plans run on real streams; on the CPU, gloo.

Long jobs: ``--checkpoint-dir DIR`` saves checkpoints through torch.distributed.checkpoint every
``--checkpoint-every N`` steps and at the end (model with its sharded tables, dense and fused
optimizer state, the pipeline's state with the loader's position; written atomically, see
``checkpoint.py``; either data source, any ``--loads``); ``--resume`` continues from the latest
one (or starts at step 0 when there is none yet, so a restarted job runs the same command).
``--stop-after N`` ends the run after step N (after its checkpoint), as a job's time limit
would. ``--kill-rank-at RANK:STEP`` is a fault drill: that rank kills itself with SIGKILL after
that step, on the launcher's first attempt only.

Validation: ``--eval-every N --eval-batches M`` evaluates after every N-th step and after the
last one on M held-out batches per rank (the synthetic data's held-out split, or ``--eval-tsv``
files with ``--criteo-tsv``): validation AUC and NE by ``torchrec.metrics``, through an
EvalPipelineSparseDist over the training pipeline's model (``evaluate.py``: how the model changes
hands without losing, repeating or holding up a batch). ``--eval-mode hybrid`` evaluates through
the training pipeline itself, a TrainEvalHybridPipelineBase switched to eval mode (picked when no
``--pipeline`` is named; another pipeline is refused); the training data is cut at each
evaluation so that no training batch is in flight at the switch (``evaluate.py``).
``--record-batches FILE`` writes which batch the model ran at each step, training or evaluating
(``record.py``).

Non-finite steps: ``--on-nonfinite skip|raise`` (ours: the pipelines' ``on_nonfinite=``) rolls a
step whose loss or gradients are not finite on some rank back on every rank (the fused embedding
rows its batch touched and their optimizer state, the dense parameters, gradients and optimizer
state), then trains on with the next batch (``skip``) or ends the run with one line naming the
batch (``raise``); ``off``, the default, is upstream's behaviour: the NaN goes into the weights.
``--poison-batch K`` gives each rank's ``K``-th batch (``--poison-rank R``: rank ``R``'s only)
NaN dense features, ``--drop-batch K`` takes each rank's ``K``-th batch out of its data (both
0-based counts of the batches a rank draws, ``data.EditedBatches``). ``--steps`` counts the
batches each rank draws, a rolled-back step's too: ``--steps N --poison-batch K --on-nonfinite
skip`` trains the very batches of ``--steps N-1 --drop-batch K`` and ends with the same weights;
the summary says which steps were rolled back.

Rank 0's first line says what runs where (pipeline, ranks as nodes x processes, backend, device),
then it prints the plan (ours), shows a progress bar with the loss and the QPS (examples per
second over all ranks), and a summary at the end; ``--json FILE`` also writes the summary.
A bad argument, plan or thread map ends the run with one line ``error: ...`` per rank.
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import functools
import gc
import hashlib
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from examples.dlrm import checkpoint
from examples.dlrm.checkpoint import CheckpointError, TrainState
from examples.dlrm.data import CriteoTsv, EditedBatches, SyntheticCriteo
from examples.dlrm.evaluate import EVAL_MODES, Evaluation, Evaluator, ValidationMetrics
from examples.dlrm.loader import (
    MapBatches,
    SyntheticBatches,
    TsvBatches,
    make_loader,
    shutdown_workers,
    workers_start_method,
)
from examples.dlrm.loader_work import KINDS, LoaderWork, calibrate
from examples.dlrm.model import OPTIMIZERS, SHARDINGS, DlrmSize, build_dlrm, describe_plan, sharding_plan
from harness.dlrm import (
    INFO,
    PIPELINES,
    PipelineUnavailable,
    make_runner,
    ours_takes,
    unknown_options,
    upstream_unavailable,
)
from torchrec_swp import NonFiniteStep
from torchrec_swp.autotune.report import missed
from torchrec_swp.data import GlobalMapSource, MapSource
from torchrec_swp.engine.transaction import MODES as NONFINITE_MODES
from torchrec_swp.engine.transaction import check_plan, ordered
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError, load_plan
from torchrec_swp.plans import default_plans

THREAD_MAPS = ("main", "by_stream", "per_task", "io")
#: The pipeline without --pipeline, and the one --eval-mode hybrid evaluates through.
DEFAULT_PIPELINE = "TrainPipelineSparseDist"
HYBRID_PIPELINE = "TrainEvalHybridPipelineBase"
#: Held-out batches per rank of each evaluation when --eval-every is given without --eval-batches.
EVAL_BATCHES = 10
DATA_SOURCES = ("dataloader", "map", "global")
Plan = PipelinePlan | PhasedPlan
#: Batches per rank, the same for ``make run``, this script and the torchx component.
STEPS = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = DlrmSize()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument(
        "--pipeline",
        choices=PIPELINES,
        metavar="NAME",
        help="one of: " + ", ".join(PIPELINES) + f" (default: {DEFAULT_PIPELINE}; with --eval-mode hybrid, "
        f"{HYBRID_PIPELINE})",
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
        "--loads",
        type=int,
        default=1,
        metavar="N",
        help="ours, with --data-source map: load N batches at once on the engine's threads (the plan's H2D split "
        "into Fetch on N lanes of thread group 'load', and H2D) (default: %(default)s)",
    )
    pipe.add_argument(
        "--lookahead",
        type=int,
        metavar="K",
        help="ours: the source may draw K batches ahead of the pipeline's depth (default: N with --loads N > 1, "
        "else the plan's)",
    )
    pipe.add_argument(
        "--input-dist-group",
        action="store_true",
        help="ours, the SparseDist family: a process group of its own for the sparse input dist "
        "(input_dist_group=True); put the input dist tasks on a thread of their own (e.g. --thread-map by_stream) "
        "for it to overlap",
    )
    pipe.add_argument(
        "--autotune",
        action="store_true",
        help="ours: the pipeline tunes itself while it trains (autotune=True): it profiles its first steps, searches "
        "threads, lookahead, parallel loads and the input dist's comm group on every rank's profile, switches at a "
        "batch boundary and says which plan, why, and its predicted vs measured step (reads through the map source "
        "unless --data-source says otherwise)",
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
    model.add_argument(
        "--steps",
        type=int,
        help=f"batches per rank, those each rank draws (a step --on-nonfinite skip rolls back counts) "
        f"(default: {STEPS}; with --autotune, {STEPS} more than its tuning takes at most, the "
        f"{SEARCH_STEPS} steps its searches may take in the background included; with "
        "--data-source global, what the epoch leaves for each rank)",
    )
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
        "--data-source",
        choices=DATA_SOURCES,
        default=None,
        help="dataloader: torchdata's StatefulDataLoader (--num-workers processes); map: torchrec_swp.data.MapSource "
        "over a map-style dataset, the same batches loaded on the pipeline's threads (--loads); global: "
        "torchrec_swp.data.GlobalMapSource over --epoch-batches batches in one order for all ranks, rank r of W "
        "taking batch s*W+r at step s, a position a checkpoint can resume on another number of ranks "
        "(default: map with --autotune, else dataloader)",
    )
    model.add_argument(
        "--epoch-batches",
        type=int,
        metavar="N",
        help="with --data-source global: the epoch's batches over all ranks (each rank trains N // W of them; "
        "the last N %% W are in no rank's share)",
    )
    model.add_argument(
        "--loader-latency-ms",
        type=float,
        default=0.0,
        help="each batch waits this long, like storage (with map: inside each load), or works this long "
        "(--loader-kind) (default: %(default)s)",
    )
    model.add_argument(
        "--loader-kind",
        choices=KINDS,
        default="sleep",
        help="what the loader does for --loader-latency-ms before each batch: sleep (storage; frees the GIL), gil "
        "(parses Criteo TSV rows in Python, holding the GIL: worker processes run it in parallel, threads do not), "
        "torch (torch ops on the ids), tail (a heavy-tailed wait: lognormal, the latency its median, p99 5.7x) "
        "(default: %(default)s)",
    )
    model.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    model.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="sgd: SGD on the tables and the MLPs; adagrad: row-wise Adagrad on the tables, Adagrad on the MLPs "
        "(both keep state) (default: %(default)s)",
    )
    model.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="mixed",
        help="mixed: tables alternately table-wise and row-wise; or all one way (default: %(default)s)",
    )
    model.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="worker processes that load the batches: the StatefulDataLoader's, or with --data-source map or global "
        "the MapSource's (processes=N: each of the --loads at once in a process of its own); 0: load in the "
        "training process (default: %(default)s)",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when torch sees a GPU, else cpu. cuda: NCCL, the GPU of LOCAL_RANK (default: %(default)s)",
    )
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
        help="ours: profile every task (TaskProfiler) and write each rank's profile, FILE's name with .rank<r> "
        "before its suffix (the input of python -m torchrec_swp.autosched --profile 'FILE.rank*.json')",
    )
    run.add_argument(
        "--timeline",
        type=Path,
        metavar="PNG",
        help="ours: draw rank 0's last 4 steps as a Gantt chart, one row per thread, into PNG "
        "(make run writes out/run/timeline.png)",
    )
    run.add_argument(
        "--check",
        action="store_true",
        help="only check the arguments, plan file, thread map and checkpoint directory, then exit",
    )
    run.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --check: the ranks the job will have, compared with a checkpoint's (launch.py passes it)",
    )
    val = parser.add_argument_group("validation (see evaluate.py)")
    val.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate after every N-th training step and after the last one: validation AUC and NE "
        "(torchrec.metrics) on held-out batches; 0: never (default: %(default)s)",
    )
    val.add_argument(
        "--eval-batches",
        type=int,
        metavar="M",
        help=f"held-out batches per rank that each evaluation runs over (default: {EVAL_BATCHES}; with --eval-tsv, "
        "at most M: what the files hold)",
    )
    val.add_argument(
        "--eval-tsv",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="with --criteo-tsv: held-out Criteo TSV files to evaluate on (synthetic data holds out its own split)",
    )
    val.add_argument(
        "--eval-mode",
        choices=tuple(EVAL_MODES),
        metavar="MODE",
        help="how the model is evaluated between steps: pipeline (an EvalPipelineSparseDist over the training "
        f"pipeline's model) or hybrid (the training pipeline itself, a {HYBRID_PIPELINE}, in eval mode) "
        f"(default: hybrid with --pipeline {HYBRID_PIPELINE}, else pipeline)",
    )
    val.add_argument(
        "--input-dist-cache-mb",
        type=float,
        metavar="MB",
        help="with --eval-mode pipeline: evaluations after the first reuse the held-out batches' input dist, kept "
        "under MB MiB per rank (the eval pipeline's input_dist_cache_mb; same AUC and NE; docs/input_dist_cache.md)",
    )
    val.add_argument(
        "--record-batches",
        type=Path,
        metavar="FILE",
        help="each rank appends a JSON line per batch the model runs (training or evaluating: which split, "
        "which batch, at which step) to FILE with .rank<r> before its suffix (see record.py)",
    )
    bad = parser.add_argument_group("non-finite steps (ours: on_nonfinite=)")
    bad.add_argument(
        "--on-nonfinite",
        choices=NONFINITE_MODES,
        default="off",
        help="ours: a step whose loss or gradients are not finite on some rank: off (upstream's behaviour: it is "
        "trained as it is, the NaN goes into the weights), skip (rolled back on every rank: the fused embedding "
        "rows its batch touched and their optimizer state, the dense parameters, gradients and optimizer state; "
        "training goes on with the next batch, and --steps still counts it), raise (rolled back, then the run "
        "ends with one line naming the batch) (default: %(default)s)",
    )
    bad.add_argument(
        "--poison-batch",
        type=int,
        metavar="K",
        help="ours: each rank's K-th batch gets NaN dense features (K counts the batches that rank draws from its "
        "data, from 0, so 0 <= K < --steps): its step has a NaN loss and NaN gradients. With --on-nonfinite off the "
        "run goes on and ends with NaN weights (upstream's behaviour); skip rolls that step back; raise ends the run",
    )
    bad.add_argument(
        "--poison-rank",
        type=int,
        metavar="R",
        help="ours, with --poison-batch: only rank R's K-th batch is poisoned (the step is rolled back on every rank)",
    )
    bad.add_argument(
        "--drop-batch",
        type=int,
        metavar="K",
        help="each rank's data without its K-th batch (0-based, 0 <= K < --steps; the ones after it move up): "
        "--steps N --drop-batch K trains the batches that --steps N+1 --poison-batch K --on-nonfinite skip keeps",
    )
    accumulation = parser.add_argument_group("gradient accumulation")
    accumulation.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="one optimizer step every N batches, their gradients accumulated: GradientAccumulationWrapper with "
        "num_steps=N around the pipeline (ours over ours: the window is in the plan; upstream's over upstream's); "
        "--steps still counts batches; 1: no wrapper (default: %(default)s)",
    )
    long = parser.add_argument_group("long jobs (see checkpoint.py)")
    long.add_argument("--checkpoint-dir", type=Path, metavar="DIR", help="save checkpoints into DIR")
    long.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="save every N steps (and at the end); 0: only at the end (default: %(default)s)",
    )
    long.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        metavar="K",
        help="keep the K newest checkpoints; 0: all (default: %(default)s)",
    )
    long.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (start at step 0 when there is none yet)",
    )
    long.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="end this run after step N (after its checkpoint), like a time limit",
    )
    long.add_argument(
        "--sample-log",
        type=Path,
        metavar="DIR",
        help="with --data-source global: each rank logs the sample ids of every batch it trains into DIR "
        "(python -m examples.dlrm.samples DIR checks that the epoch trained each sample once; see samples.py)",
    )
    long.add_argument(
        "--kill-rank-at",
        metavar="RANK:STEP",
        help="fault drill: rank RANK kills itself (SIGKILL) after step STEP, on the launcher's first attempt only",
    )
    args = parser.parse_args(argv)
    _pick_pipeline(parser, args)
    _check_global(parser, args)
    for name in ("steps", "batch_size", "num_sparse", "num_embeddings", "embedding_dim", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("num_workers", "checkpoint_every", "keep_checkpoints"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        parser.error("--stop-after must be >= 1")
    if args.world_size is not None and args.world_size < 1:
        parser.error("--world-size must be >= 1")
    if args.data_source is None:
        args.data_source = "map" if args.autotune and args.impl == "ours" else "dataloader"
    missing = [str(f) for f in args.criteo_tsv or [] if not Path(f).is_file()]
    if missing:
        parser.error(f"--criteo-tsv: no such file: {', '.join(missing)}")
    _check_long_job(parser, args)
    _check_eval(parser, args)
    _check_accumulation(parser, args)
    _check_device(parser, args)
    why = upstream_unavailable(args.pipeline, args.impl, args.device_value, args.upstream_cpu_patch)
    if why:
        parser.error(f"--impl upstream --pipeline {args.pipeline}: {why}")
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
    unknown = unknown_options(args.pipeline, args.impl, args.options)
    if unknown:
        parser.error(unknown)
    ours_only = {
        "--plan": args.plan,
        "--thread-map": args.thread_map,
        "--profile-out": args.profile_out,
        "--loads": args.loads != 1,
        "--lookahead": args.lookahead is not None,
        "--input-dist-group": args.input_dist_group,
        "--autotune": args.autotune,
        "--on-nonfinite": args.on_nonfinite != "off",
        "--poison-batch": args.poison_batch is not None,
        "--poison-rank": args.poison_rank is not None,
    }
    given = [flag for flag, value in ours_only.items() if value]
    if args.impl == "upstream" and given:
        parser.error(f"{', '.join(given)}: for our pipelines only (--impl ours)")
    _check_nonfinite(parser, args)
    if args.plan and not args.plan.is_file():
        parser.error(f"--plan: no such file: {args.plan}")
    try:
        args.plan_value = load_plan(str(args.plan)) if args.plan else None
    except PlanError as e:
        parser.error(f"--plan {args.plan}: {e}")
    _check_loads(parser, args)
    if args.input_dist_group and not ours_takes(args.pipeline, "input_dist_group"):
        parser.error(f"--input-dist-group: our {args.pipeline} takes no input_dist_group (the SparseDist family does)")
    try:
        _check_thread_map(args)
    except PlanError as e:
        parser.error(f"--thread-map: {e}")
    _check_undoable(parser, args)
    return args


def _check_nonfinite(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--on-nonfinite``, ``--poison-batch``, ``--poison-rank`` and ``--drop-batch`` hang together
    (``--impl upstream`` was refused the ours-only ones before)."""
    for flag, value in (("--poison-batch", args.poison_batch), ("--drop-batch", args.drop_batch)):
        if value is None:
            continue
        if args.data_source == "global":
            parser.error(
                f"{flag}: not with --data-source global, whose epoch deals its batches to the ranks by step "
                "(a rank's K-th batch depends on the number of ranks); use --data-source dataloader or map"
            )
        if not 0 <= value < args.steps:
            parser.error(
                f"{flag} {value}: out of range: each rank draws --steps {args.steps} batches, 0 to {args.steps - 1}"
            )
    if args.poison_rank is not None:
        if args.poison_batch is None:
            parser.error("--poison-rank: poisons rank R's batch of --poison-batch K: give --poison-batch")
        if args.poison_rank < 0:
            parser.error("--poison-rank must be >= 0")
        if args.world_size is not None and args.poison_rank >= args.world_size:
            last = args.world_size - 1
            parser.error(f"--poison-rank {args.poison_rank}: the job has {args.world_size} ranks, 0 to {last}")
    if "on_nonfinite" in args.options:
        parser.error("--option on_nonfinite: give --on-nonfinite MODE")
    kind = INFO[args.pipeline].kind
    if args.on_nonfinite != "off":
        if kind == "eval":
            parser.error(f"--on-nonfinite {args.on_nonfinite}: {args.pipeline} evaluates only: no step to roll back")
        if kind == "staged":
            parser.error(
                f"--on-nonfinite {args.on_nonfinite}: {args.pipeline}'s caller trains on the batch it hands out, "
                "outside the pipeline's step: nothing the pipeline could roll back"
            )
        if args.autotune:
            parser.error(
                f"--on-nonfinite {args.on_nonfinite}: not with --autotune (the tuner's plans are not checked to be "
                "undoable yet); choose one"
            )
    if args.poison_batch is not None and kind == "eval":
        parser.error(f"--poison-batch: {args.pipeline} evaluates only: no training step to poison")


def _check_accumulation(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--grad-accum N`` wraps a pipeline that steps the optimizer itself (not an eval pipeline,
    not StagedTrainPipeline, whose caller steps it), and not the hybrid that evaluates through the
    training pipeline. Checkpoints need no check: with N > 1 the model's DDP is built with
    ``static_graph=False`` (``build_dlrm``), so a run can resume inside a window (TorchRec's
    default, ``static_graph=True``, must all-reduce in the first backward after a resume, which
    only a window's last batch does)."""
    n = args.grad_accum
    if n < 1:
        parser.error("--grad-accum must be >= 1 (1: no accumulation)")
    if n == 1:
        return
    kind = INFO[args.pipeline].kind
    if kind != "train":
        why = "evaluates only" if kind == "eval" else "hands its batches to the caller, who steps the optimizer"
        parser.error(f"--grad-accum {n}: {args.pipeline} {why}: no optimizer step to accumulate for")
    if args.eval_every and args.eval_mode == "hybrid":
        parser.error(f"--grad-accum {n}: not with --eval-mode hybrid (the training pipeline evaluates too); "
                     "use --eval-mode pipeline")


def _check_undoable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With ``--on-nonfinite skip|raise``, the plan that will run (``--plan``, ``--thread-map``,
    ``--loads``, ``--lookahead`` applied) can be undone a batch at a time with the effects our
    TorchRec pipelines capture: the library's check (``transaction.check_plan``), before anything
    starts, with its message (the pipeline would raise it when built)."""
    if args.on_nonfinite == "off" or args.impl == "upstream" or INFO[args.pipeline].kind != "train":
        return  # (upstream's, the eval pipelines and StagedTrainPipeline were refused before)
    from torch import nn

    from torchrec_swp.integrations.torchrec.nonfinite import effects_for

    # what a TorchRec pipeline captures (``_swp_transaction``): its effects' names, and those with
    # nothing to capture whatever the model (a cache), the fused rows aside (the DLRM has fused tables)
    probe = nn.Linear(1, 1)
    effects, fused = effects_for(probe, torch.optim.SGD(probe.parameters(), lr=0.1), host=True)
    fused.close()
    empty = frozenset(n for n, e in effects.items() if e.empty and n != "fused_rows")
    plan = args.plan_value if args.plan_value is not None else default_plans()[args.pipeline]

    def check(p: PipelinePlan) -> PipelinePlan:
        p = ordered(p, empty)
        check_plan(p, effects, empty)
        return p

    try:
        keywords = {k: v for k, v in engine_keywords(args).items() if k != "autotune"}
        chosen = EngineOptions(thread_map=args.thread_map_value, **keywords).plan_for(plan, args.pipeline)
        chosen.each(check) if isinstance(chosen, PhasedPlan) else check(chosen)
    except (ValueError, PlanError) as e:
        parser.error(f"--on-nonfinite {args.on_nonfinite}: our {args.pipeline} cannot roll its steps back: {e}")


def _check_global(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--data-source global`` takes its length from ``--epoch-batches`` (``--steps`` follows from
    it: what the epoch leaves for each rank, on any number of ranks); ``--sample-log`` needs it."""
    if args.data_source != "global":
        given = [f for f, v in (("--epoch-batches", args.epoch_batches), ("--sample-log", args.sample_log)) if v]
        if given:
            parser.error(f"{', '.join(given)}: with --data-source global only")
        if args.steps is None:
            args.steps = STEPS + (tuning_steps(args.pipeline) if args.autotune and args.impl == "ours" else 0)
        return
    if args.epoch_batches is None or args.epoch_batches < 1:
        parser.error("--data-source global: give the epoch's length over all ranks, --epoch-batches N (N >= 1)")
    if args.steps is not None:
        parser.error("--steps: with --data-source global each rank trains what --epoch-batches leaves for it")
    if args.impl == "upstream":
        parser.error("--data-source global: for our pipelines only (--impl ours)")
    if args.eval_every:
        parser.error("--eval-every: not with --data-source global (yet): the evaluations follow --steps")
    args.steps = args.epoch_batches  # at most: one rank; train() sets what this world's share leaves


#: the steps that train while ``--autotune``'s two searches run in the background, allowed for:
#: 243 and 552 on 2 ranks with a loader of 8 ms (``benchmarks/tuning_cost.py --steps 1000``,
#: 2026-12-04; 6.4 s and 8.9 s of search), rounded up
SEARCH_STEPS = 1000


def tuning_steps(pipeline: str) -> int:
    """The most steps ``--autotune``'s tuning takes on ``pipeline`` with the defaults (both rounds,
    each trial at its bound, the verification), and ``SEARCH_STEPS`` for its searches: without
    ``--steps``, a run with ``--autotune`` trains that many besides ``STEPS``, so that the tuning
    ends and the chosen plan trains after it."""
    from torchrec_swp import Autotune

    plans = default_plans()
    depth = plans[pipeline].pipeline_depth if pipeline in plans else max(p.pipeline_depth for p in plans.values())
    return Autotune().tuning_bound(depth) + SEARCH_STEPS


def _check_thread_map(args: argparse.Namespace) -> None:
    """The thread map names tasks of the plan that will run (the given one, else the default)."""
    if args.thread_map_value is None:
        return
    plan = args.plan_value if args.plan_value is not None else default_plans().get(args.pipeline)
    if plan is not None and args.pipeline != "StagedTrainPipeline":
        plan.with_thread_map(args.thread_map_value)  # PlanError naming the culprit


def _check_loads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--loads`` and ``--lookahead`` fit the data source and the plan that will run."""
    if args.loads < 1:
        parser.error("--loads must be >= 1")
    if args.lookahead is not None and args.lookahead < 0:
        parser.error("--lookahead must be >= 0")
    if (args.loads == 1 and args.lookahead is None) or args.impl == "upstream":
        return
    if args.loads > 1 and args.data_source == "dataloader":
        parser.error(
            f"--loads {args.loads}: a StatefulDataLoader's iterator loads a whole batch per draw, so parallel "
            "loads gain nothing; use --data-source map"
        )
    info = INFO[args.pipeline]
    if info.kind == "staged":
        flags = [f for f, v in (("--loads", args.loads > 1), ("--lookahead", args.lookahead is not None)) if v]
        parser.error(f"{' and '.join(flags)}: StagedTrainPipeline's plan follows its stages (edit it with --plan)")
    plan = args.plan_value if args.plan_value is not None else default_plans()[args.pipeline]
    options = EngineOptions(thread_map=args.thread_map_value, **engine_keywords(args))
    try:
        options.plan_for(plan, args.pipeline)  # the library's own path: the same checks, the same errors
    except (ValueError, PlanError) as e:
        parser.error(str(e))


def engine_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """``--loads``, ``--lookahead``, ``--on-nonfinite`` and ``--autotune`` as our pipelines'
    constructor keywords (``loads=``, ``lookahead=``, ``on_nonfinite=``, ``autotune=``;
    EngineOptions); none for upstream's. The tuner's lines go to stdout on rank 0 as it decides."""
    if args.impl == "upstream":
        return {}
    keywords: dict[str, Any] = {"loads": args.loads} if args.loads != 1 else {}
    if args.lookahead is not None:
        keywords["lookahead"] = args.lookahead
    if args.on_nonfinite != "off":
        keywords["on_nonfinite"] = args.on_nonfinite
    if args.autotune:
        from torchrec_swp import Autotune

        # the run's length, which the user gave or tuning_steps() chose: a run shorter than a tuning is not tuned
        report = lambda line: tqdm.write(line, file=sys.stdout)  # noqa: E731
        keywords["autotune"] = Autotune(report=report, job_steps=args.steps)
    return keywords


def _pick_pipeline(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.pipeline``: the one named, else the default, or with ``--eval-mode hybrid`` the
    hybrid (``args.pipeline_picked`` says so); hybrid mode with another pipeline is refused."""
    args.pipeline_picked = args.pipeline is None and args.eval_mode == "hybrid"
    if args.pipeline is None:
        args.pipeline = HYBRID_PIPELINE if args.eval_mode == "hybrid" else DEFAULT_PIPELINE
    if args.eval_mode == "hybrid" and args.pipeline != HYBRID_PIPELINE:
        parser.error(
            f"--eval-mode hybrid evaluates through the training pipeline, which must be {HYBRID_PIPELINE} "
            f"(--pipeline {args.pipeline} has no eval mode); name it, leave --pipeline out, or use --eval-mode pipeline"
        )


def _check_eval(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The validation options hang together: held-out data to evaluate, a pipeline that trains."""
    if args.eval_every < 0:
        parser.error("--eval-every must be >= 0 (0: no evaluation)")
    if args.eval_batches is not None and args.eval_batches < 0:
        parser.error("--eval-batches must be >= 0")
    if not args.eval_every:
        given = [
            flag
            for flag, value in (
                ("--eval-batches", args.eval_batches is not None),
                ("--eval-tsv", args.eval_tsv),
                ("--eval-mode", args.eval_mode),
            )
            if value
        ]
        if args.input_dist_cache_mb is not None:
            given.append("--input-dist-cache-mb")
        if given:
            parser.error(f"{', '.join(given)}: no evaluation without --eval-every N")
        return
    if args.eval_batches is None:
        args.eval_batches = EVAL_BATCHES
    if args.eval_mode is None:
        args.eval_mode = "hybrid" if args.pipeline == HYBRID_PIPELINE else "pipeline"
    if args.eval_batches == 0:
        parser.error(f"--eval-every {args.eval_every}: no held-out data to evaluate on (--eval-batches 0)")
    if args.input_dist_cache_mb is not None:
        if args.eval_mode != "pipeline" or args.impl != "ours":
            parser.error(
                "--input-dist-cache-mb: the cache is our EvalPipelineSparseDist's (--eval-mode pipeline, --impl "
                f"ours), not --eval-mode {args.eval_mode} --impl {args.impl}"
            )
        if not 0 <= args.input_dist_cache_mb < float("inf"):
            parser.error(f"--input-dist-cache-mb must be a finite number >= 0, got {args.input_dist_cache_mb:g}")
    if args.eval_tsv and not args.criteo_tsv:
        parser.error("--eval-tsv: held-out Criteo files go with --criteo-tsv (synthetic data holds out its own split)")
    if args.criteo_tsv and not args.eval_tsv:
        parser.error(
            f"--eval-every {args.eval_every}: no held-out data to evaluate on: with --criteo-tsv, name held-out files "
            "with --eval-tsv FILE ..."
        )
    missing = [str(f) for f in args.eval_tsv or [] if not Path(f).is_file()]
    if missing:
        parser.error(f"--eval-tsv: no such file: {', '.join(missing)}")
    overlap = sorted({str(f) for f in args.eval_tsv or []} & {str(f) for f in args.criteo_tsv or []})
    if overlap:
        parser.error(f"--eval-tsv: {', '.join(overlap)} is training data too (--criteo-tsv): hold other files out")
    kind = INFO[args.pipeline].kind
    if kind != "train":
        what = "evaluates only" if kind == "eval" else "trains in the caller's loop (no model to hand over)"
        parser.error(f"--eval-every: {args.pipeline} {what}; evaluate beside a train pipeline")
    if args.eval_mode == "hybrid":
        # the training data reaches the pipeline cut at each evaluation (evaluate.Stretch)
        if args.data_source == "map":
            parser.error(
                "--eval-mode hybrid: --data-source map loads on the pipeline's threads, where the training data "
                "cannot be cut at the evaluations; use --data-source dataloader"
            )
        if args.autotune:
            parser.error("--eval-mode hybrid: --autotune is not supported (it would tune across the switches)")


def _check_long_job(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checkpoint options hang together, and the pipeline can be checkpointed."""
    args.kill_at = None
    if args.kill_rank_at is not None:
        rank, sep, step = args.kill_rank_at.partition(":")
        if not (sep and rank.isdigit() and step.isdigit() and int(step) >= 1):
            parser.error(f"--kill-rank-at must be RANK:STEP (e.g. 1:25), got {args.kill_rank_at!r}")
        args.kill_at = (int(rank), int(step))
    if args.checkpoint_dir is None:
        for flag, given in (("--checkpoint-every", args.checkpoint_every), ("--resume", args.resume)):
            if given:
                parser.error(f"{flag} needs --checkpoint-dir")
        return
    info = INFO[args.pipeline]
    if info.kind == "eval":
        parser.error(f"--checkpoint-dir: {args.pipeline} evaluates; checkpoints are for training")
    if args.impl == "upstream":
        parser.error(
            "--checkpoint-dir: upstream TorchRec's pipelines have no state_dict() (the batches in flight would be "
            "lost on resume); use --impl ours"
        )


def not_checkpointable(args: argparse.Namespace) -> str | None:
    """Why ``args.pipeline`` (ours) cannot be checkpointed, or None: it needs ``state_dict()`` and
    ``load_state_dict()``, which record and restore the batches in flight and the loader's position."""
    import torchrec_swp

    cls = getattr(torchrec_swp, args.pipeline, None)
    missing = [m for m in ("state_dict", "load_state_dict") if cls is None or not hasattr(cls, m)]
    if missing:
        return (
            f"--checkpoint-dir: torchrec_swp's {args.pipeline} has no {' / '.join(missing)}() (yet): "
            "it cannot record which batches are in flight"
        )
    return None


def _check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.device_value``: the device type to train on (the index is LOCAL_RANK's, set in main)."""
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        parser.error(
            f"--device cuda: torch sees no CUDA device here (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); use --device cpu"
        )
    args.device_value = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")


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
    if text is None or text in THREAD_MAPS:
        return text  # a strategy of the plan's (torchrec_swp.plan.threads), "io" included
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


def batches_for(args: argparse.Namespace, rank: int, world_size: int) -> SyntheticCriteo | CriteoTsv | EditedBatches:
    """This rank's batches: Criteo TSV files or synthetic data; as this rank draws them
    (``EditedBatches``) with ``--drop-batch`` or ``--poison-batch``."""
    batches = _split(args, rank, world_size, "train")
    poison = args.poison_batch if args.poison_rank in (None, rank) else None
    if args.drop_batch is None and poison is None:
        return batches
    return EditedBatches(batches, drop=args.drop_batch, poison=poison)


def held_out_for(args: argparse.Namespace, rank: int, world_size: int) -> SyntheticCriteo | CriteoTsv:
    """This rank's held-out batches (``--eval-batches`` of them): the synthetic data's ``val`` split,
    or the ``--eval-tsv`` files (at most that many: what they hold)."""
    return _split(args, rank, world_size, "val")


def _split(args: argparse.Namespace, rank: int, world_size: int, split: str) -> SyntheticCriteo | CriteoTsv:
    """This rank's batches of ``split``: ``train`` (``--steps`` of them, from ``--criteo-tsv`` or
    synthetic) or ``val`` (``--eval-batches``, from ``--eval-tsv`` or synthetic)."""
    size: DlrmSize = args.size
    files, count = (args.criteo_tsv, args.steps) if split == "train" else (args.eval_tsv, args.eval_batches)
    if split == "train" and args.drop_batch is not None:
        count += 1  # --steps of them once the dropped one is out
    shape = {"batch_size": size.batch_size, "num_embeddings": size.num_embeddings, "num_sparse": size.num_sparse}
    if split == "train" and args.data_source == "global":
        # one sequence for all ranks, which GlobalMapSource splits: rank 0's of a world of one
        rank, world_size, count = 0, 1, args.epoch_batches
    if files:
        return CriteoTsv(files, **shape, rank=rank, world_size=world_size, max_batches=count)
    return SyntheticCriteo(**shape, num_batches=count, rank=rank, seed=1000 + args.seed, split=split)


def evaluator_for(args: argparse.Namespace, runner: Any, rank: int, world_size: int, device: torch.device) -> Evaluator:
    """The run's evaluations (``--eval-every``) of ``runner``'s model on this rank's held-out batches,
    read by a StatefulDataLoader in the training process (the eval pipeline's loader thread runs it)."""
    held_out = held_out_for(args, rank, world_size)
    if len(held_out) == 0:
        files = ", ".join(map(str, args.eval_tsv))
        raise ValueError(
            f"--eval-tsv {files}: no held-out batch for rank {rank} (a batch needs {args.size.batch_size} x "
            f"{world_size} lines)"
        )
    work = loader_work_for(args, rank)
    dataset = TsvBatches(held_out, work) if isinstance(held_out, CriteoTsv) else SyntheticBatches(held_out, work)
    loader = make_loader(dataset, device=device)
    cache = {} if args.input_dist_cache_mb is None else {"input_dist_cache_mb": args.input_dist_cache_mb}
    mode = EVAL_MODES[args.eval_mode](args.impl, runner.pipeline, runner.model, runner.optimizer, device, **cache)
    metrics = ValidationMetrics(
        world_size=world_size, rank=rank, batch_size=args.size.batch_size, num_batches=len(held_out)
    )
    return Evaluator(
        every=args.eval_every,
        last_step=args.steps,
        mode=mode,
        batches=lambda: loader,
        metrics=metrics,
        world_size=world_size,
    )


def dataset_for(args: argparse.Namespace, rank: int, world_size: int) -> MapBatches | TsvBatches:
    """This rank's batches, for the StatefulDataLoader, with the loader's work (``--loader-kind``):
    Criteo TSV files read in order in the training process, or, with ``--num-workers``, batch by
    batch (``CriteoTsv.batch(k)``) in the workers, each reading its own."""
    batches, work = batches_for(args, rank, world_size), loader_work_for(args, rank)
    if isinstance(batches.source if isinstance(batches, EditedBatches) else batches, CriteoTsv):
        return MapBatches(batches, work) if args.num_workers else TsvBatches(batches, work)
    return SyntheticBatches(batches, work)


@functools.cache
def _loader_work(kind: str, ms: float, seed: int, rank: int) -> LoaderWork:
    return calibrate(kind, ms, seed=seed, rank=rank)


def loader_work_for(args: argparse.Namespace, rank: int) -> LoaderWork:
    """What this rank's loader does before each batch (``--loader-kind``, ``--loader-latency-ms``):
    calibrated once per process, the same for every loader of the run (training and held-out)."""
    return _loader_work(args.loader_kind, args.loader_latency_ms, args.seed, rank)


def data_source_for(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> StatefulDataLoader | MapSource | GlobalMapSource:
    """What ``--data-source`` names, over this rank's batches: a StatefulDataLoader (``iter()`` gives
    the iterator for ``progress()``) or a MapSource (its own iterator). Both have
    ``load_state_dict()`` for the position a checkpoint recorded."""
    if args.data_source in ("map", "global"):
        work = loader_work_for(args, rank)
        dataset = MapBatches(batches_for(args, rank, world_size), work, pin_memory=device.type == "cuda")
        processes = {"processes": args.num_workers, "context": workers_start_method()} if args.num_workers else {}
        if args.data_source == "global":
            return GlobalMapSource(dataset, rank=rank, world_size=world_size, **processes)
        return MapSource(dataset, **processes)
    return make_loader(dataset_for(args, rank, world_size), num_workers=args.num_workers, device=device)


def fingerprint(args: argparse.Namespace, world_size: int | None) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes from it (see checkpoint.py), in the
    order it is compared. Without ``world_size`` (``--check`` without ``--world-size``) the world
    size and the sharding plan, which depends on it, are left out."""
    size: DlrmSize = args.size
    found: dict[str, Any] = {}
    if world_size is not None:
        found["world_size"] = world_size
        plan = sharding_plan(size, world_size, optimizer=args.optimizer, sharding=args.sharding)
        found["plan"] = describe_plan(plan)
    found["model"] = {
        "num_sparse": size.num_sparse,
        "num_embeddings": size.num_embeddings,
        "embedding_dim": size.embedding_dim,
        "dense_arch": list(size.dense_arch),
        "over_arch": list(size.over_arch),
    }
    found["optimizer"] = args.optimizer
    found["data"] = {
        "source": "criteo-tsv" if args.criteo_tsv else "synthetic",
        "files": [str(p) for p in args.criteo_tsv or []],
        "batch_size": size.batch_size,
        "seed": args.seed,
        "num_workers": args.num_workers,
        "loader": args.data_source,  # the position's format: a StatefulDataLoader's state, or MapSource's index
    }
    if args.data_source == "global":
        found["data"]["epoch_batches"] = args.epoch_batches
    # the batches a rank draws (only where given: checkpoints of runs without them stay comparable)
    if args.drop_batch is not None:
        found["data"]["drop_batch"] = args.drop_batch
    if args.poison_batch is not None:
        found["data"]["poison_batch"] = args.poison_batch
        found["data"]["poison_rank"] = args.poison_rank
    found["pipeline"] = f"{args.impl} {args.pipeline}"
    if args.grad_accum > 1:  # (where given: checkpoints of runs without it stay comparable)
        found["grad_accum"] = args.grad_accum
    return found


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


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` say, in the default process group (on ``args.device_value``); return the
    run's summary on every rank (``losses`` are this rank's; the digests are the same everywhere).

    With ``--checkpoint-dir``: rank 0 checks the directory before the model is built (the same
    CheckpointError on every rank), a resume loads the model, the optimizers, the pipeline's state
    and the loader's position, and checkpoints are saved after the steps ``--checkpoint-every``
    names and after the last one.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    size: DlrmSize = args.size
    device: torch.device = args.device_value
    if args.poison_rank is not None and args.poison_rank >= world_size:  # (launch.py's --check said so already)
        raise ValueError(f"--poison-rank {args.poison_rank}: the job has {world_size} ranks, 0 to {world_size - 1}")
    fp = fingerprint(args, world_size) if args.checkpoint_dir else {}
    resume_from = None
    if args.checkpoint_dir:
        resume_from = checkpoint.check_on_ranks(
            args.checkpoint_dir, fp, resume=args.resume, why_not_resizable=not_resizable(args)
        )
        if (why := not_checkpointable(args)) is not None:
            raise CheckpointError(why)
    runner = make_runner(
        args.pipeline,
        args.impl,
        lambda: build_dlrm(
            rank,
            world_size,
            size,
            seed=args.seed,
            device=device,
            optimizer=args.optimizer,
            sharding=args.sharding,
            static_graph=args.grad_accum == 1,
        ),
        accumulate=args.grad_accum,
        plan=args.plan_value,
        thread_map=args.thread_map_value,
        options={
            **args.options,
            **engine_keywords(args),
            **({"input_dist_group": True} if args.input_dist_group else {}),
        },
        upstream_patch=args.upstream_cpu_patch,
        device=device,
    )
    state = TrainState(runner.model, runner.optimizer)
    loader = data_source_for(args, rank, world_size, device)
    evaluator = evaluator_for(args, runner, rank, world_size, device) if args.eval_every else None
    batch_log = None
    if args.record_batches:
        from examples.dlrm.record import BatchRecorder

        splits = {"train": batches_for(args, rank, world_size)}
        if args.eval_every:
            splits["val"] = held_out_for(args, rank, world_size)
        batch_log = BatchRecorder(rank_path(args.record_batches, rank), runner.model, splits)
    start_step = 0
    written_on: dict[str, Any] | None = None
    if resume_from is not None:
        step_dir, meta = resume_from
        written_on = checkpoint.written_on(meta)
        resized = written_on["world_size"] != world_size
        # on another world size every rank reads rank 0's object: its data position is global (the
        # same on every rank, checked when saved) and its batch number is every rank's
        saved = checkpoint.load(step_dir, state, from_rank=0 if resized else None)
        pipeline_state = saved["pipeline"]
        loader.load_state_dict(pipeline_state["loader"])
        if resized:
            runner.stepper.load_state_dict(pipeline_state, resized=True)
        else:
            runner.stepper.load_state_dict(pipeline_state)  # the exact path: this rank's own cut
        if evaluator is not None and "eval" in saved:
            evaluator.load_state_dict(saved["eval"])
        start_step = int(meta["step"])
    if args.data_source == "global":
        args.steps = start_step + len(loader)  # what the epoch leaves for this world's ranks
    sample_log = None
    if args.sample_log:
        from examples.dlrm.samples import SampleLog, clear_run

        if rank == 0:
            args.sample_log.mkdir(parents=True, exist_ok=True)
            clear_run(args.sample_log, start_step)
        dist.barrier()
        sample_log = SampleLog(
            args.sample_log,
            runner.model,
            batches_for(args, rank, world_size),
            rank=rank,
            world_size=world_size,
            start_step=start_step,
            batch_size=size.batch_size,
            tail_batches=loader.tail,
        )
    kind = INFO[args.pipeline].kind
    if rank == 0:
        if args.pipeline_picked:
            print(f"--eval-mode hybrid: training and evaluating through {args.impl} {args.pipeline}", flush=True)
        print(
            f"{args.impl} {args.pipeline} ({kind}) on {world_size} ranks ({_topology(world_size)}; "
            f"{dist.get_backend()}, {device.type}), {args.steps} steps, {size.describe()}{_data_note(args)}",
            flush=True,
        )
        if args.checkpoint_dir:
            every = f"every {args.checkpoint_every} steps and " if args.checkpoint_every else ""
            where = f"resuming from {resume_from[0]} (step {start_step})" if resume_from else "starting at step 0"
            print(f"checkpoints: {every}at the end into {args.checkpoint_dir}; {where}", flush=True)
            if written_on is not None and written_on["world_size"] != world_size:  # after a check that allowed it
                print(_resize_line(written_on, world_size, loader), flush=True)
        if evaluator is not None:
            print(_eval_note(args, world_size), flush=True)
        if args.grad_accum > 1:
            in_plan = getattr(runner.stepper, "window_in_plan", False)  # (upstream's wrapper has none)
            where = "the window in the plan" if in_plan else "its optimizer wrapper"
            print(
                f"gradient accumulation: one optimizer step every {args.grad_accum} batches "
                f"({args.impl} GradientAccumulationWrapper, {where})",
                flush=True,
            )
        if (note := _nonfinite_note(args)) is not None:
            print(note, flush=True)
        if args.impl == "ours":
            print(runner.pipeline.plan.format_schedule(runner.pipeline.plan.max_stage + 3))
    if rank == 0 and args.on_nonfinite != "off":
        _rollbacks_above_the_bar()
    profiler = None
    if args.profile_out:
        from torchrec_swp.profiler import TaskProfiler

        profiler = TaskProfiler(warmup=2).attach(runner.pipeline.engine)
    recorder = None
    last_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    if args.timeline and rank == 0 and args.impl == "ours" and profiler is None:
        from examples.dlrm.picture import StepRecorder

        recorder = StepRecorder(keep=4)
    it: Iterator[Any] = iter(loader)
    examples_per_step = size.batch_size * world_size
    interactive = sys.stdout.isatty()
    bar = tqdm(
        total=args.steps,
        initial=start_step,
        disable=rank != 0,
        unit="step",
        desc=args.pipeline,
        file=sys.stdout if interactive else _LineStream(sys.stdout),
        # piped (make run, logs): a line every 10% of the steps, however fast they go
        mininterval=0.2 if interactive else 0.0,
        miniters=None if interactive else max(1, args.steps // 10),
        dynamic_ncols=interactive,
        leave=interactive,  # piped: the 100% line is already printed; closing would print it again
    )
    step_s: list[float] = []
    losses: list[float] = []
    saved: list[int] = []
    evaluated: list[Evaluation] = []  # this run's evaluations
    postfix: dict[str, str] = {}
    trained = start_step
    data_ended = False
    # the steps rolled back so far (a resume's pipeline carries those of the runs before it)
    watch = args.on_nonfinite == "skip"
    rolled_back = carried = len(runner.pipeline.skipped_steps) if watch else 0
    start = time.perf_counter()

    def evaluate() -> None:
        assert evaluator is not None
        if batch_log is not None:
            batch_log.at("eval", trained)
        total = f"/{args.eval_batches}" if not args.eval_tsv else ""

        def shown(k: int) -> None:
            if rank == 0:
                bar.set_postfix({**postfix, "eval": f"{k}{total}"}, refresh=interactive)

        found = evaluator.run(trained, on_batch=shown)
        evaluated.append(found)
        if rank == 0:
            postfix["val_auc"] = f"{found.auc:.4f}"
            bar.set_postfix(postfix, refresh=interactive)
            bar.write(_eval_line(found, world_size))

    try:
        while trained < args.steps and (args.stop_after is None or trained < args.stop_after):
            if recorder is not None and trained == max(start_step, last_step - recorder.keep):
                runner.pipeline.engine.instrument(recorder)  # only the steps drawn pay for it
            if batch_log is not None:
                batch_log.at("train", trained + 1)
            if sample_log is not None:
                sample_log.at("train", trained + 1)
            data = it if evaluator is None else evaluator.training_data(it, trained)
            t0 = time.perf_counter()
            try:
                output = runner.step(data)
            except StopIteration:
                data_ended = True
                break
            step_s.append(time.perf_counter() - t0)
            if recorder is not None and trained >= last_step - recorder.keep:
                recorder.step(t0, t0 + step_s[-1])
            if watch and len(runner.pipeline.skipped_steps) > rolled_back:
                rolled_back += 1  # this step was rolled back (on every rank): its loss is of no step kept
                postfix["skipped"] = str(rolled_back)
            else:
                losses.append(float(output[0]))
            trained += 1
            if rank == 0:
                recent = step_s[-20:]
                postfix["loss"] = f"{statistics.fmean(losses[-20:]):.4f}" if losses else "-"
                postfix["qps"] = f"{examples_per_step * len(recent) / sum(recent):,.0f}"
                bar.set_postfix(postfix, refresh=False)
                bar.update()
            cut = None
            if evaluator is not None and evaluator.due(trained):
                if args.checkpoint_dir and _checkpoint_due(args, trained) and evaluator.shares_training_pipeline:
                    cut = runner.stepper.state_dict()  # before the held-out batches go through the pipeline
                evaluate()
            if args.checkpoint_dir and _checkpoint_due(args, trained):
                per_rank = {"pipeline": cut if cut is not None else runner.stepper.state_dict()}
                if evaluator is not None:
                    per_rank["eval"] = evaluator.state_dict()
                if args.data_source == "global":
                    _check_global_position(per_rank["pipeline"]["loader"], world_size)
                step_dir = checkpoint.save(
                    args.checkpoint_dir,
                    trained,
                    state,
                    per_rank,
                    fp,
                    keep=args.keep_checkpoints,
                    written_on=_written_on(fp, world_size),
                )
                saved.append(trained)
                if rank == 0:
                    bar.write(f"checkpoint: step {trained} saved to {step_dir}")
            if args.kill_at == (rank, trained) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                sys.stdout.flush()
                drill = f"fault drill: rank {rank} kills itself (SIGKILL) after step {trained}"
                print(drill, file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if data_ended and evaluator is not None and trained > start_step and not evaluator.evaluated_at(trained):
            evaluate()  # the data ended before --steps: the last step trained is the last one
    finally:
        bar.close()
        if evaluator is not None:
            evaluator.close()
        if batch_log is not None:
            batch_log.close()
        if sample_log is not None:
            sample_log.close()
        runner.close()
        shutdown_workers(it)
    wall = time.perf_counter() - start
    eval_s = sum(e.seconds for e in evaluated)
    skipped = _skipped_on_ranks(runner, args, world_size)
    timeline = None
    if recorder is not None and recorder.steps:
        from examples.dlrm.picture import save_gantt

        runner.pipeline.engine.instrument()
        title = f"ours {args.pipeline}, rank 0 of {world_size}: the last {len(recorder.steps)} steps"
        timeline = str(save_gantt(recorder, args.timeline, title))
    if profiler is not None:
        from torchrec_swp.autotune.agreement import machine

        host, cores = machine()
        draws = runner.pipeline.engine.draws
        profile = profiler.profile().with_where(
            rank=rank, world_size=world_size, host=host, cores=cores, split_draws=bool(draws and draws.splits)
        )
        path = rank_path(args.profile_out, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(str(path))
        if rank == 0:
            print(profile.format_table())
            every = rank_path(args.profile_out, "*")
            print(f"profiles written to {every}: python -m torchrec_swp.autosched --profile '{every}' --out PLAN")
    steady = step_s[len(step_s) // 10 :]  # the first steps build caches (and compile, for PT2)
    head, tail = losses[: max(1, len(losses) // 10)], losses[-max(1, len(losses) // 10) :]
    return {
        "pipeline": args.pipeline,
        "impl": args.impl,
        "thread_map": args.thread_map,
        "plan": str(args.plan) if args.plan else None,
        "ranks": world_size,
        "topology": _topology(world_size),
        "device": device.type,
        "size": size.describe(),
        "data": "criteo-tsv" if args.criteo_tsv else "synthetic",
        "data_source": args.data_source,
        "num_workers": args.num_workers,
        "loads": args.loads,
        "lookahead": args.lookahead,
        "input_dist_group": args.input_dist_group,
        "grad_accum": args.grad_accum,
        "autotune": _decision(runner) if args.autotune else None,
        "autotune_requested": args.autotune,
        "loader_latency_ms": args.loader_latency_ms,
        "loader_kind": args.loader_kind,
        "start_step": start_step,
        "steps": len(step_s),
        "total_steps": args.steps,
        "checkpoints_saved": saved,
        "wall_s": wall,
        "eval_s": eval_s,
        "qps": examples_per_step * len(step_s) / (wall - eval_s) if wall > eval_s else 0.0,
        "median_step_ms": 1e3 * statistics.median(steady) if steady else None,
        "p90_step_ms": 1e3 * sorted(steady)[int(0.9 * (len(steady) - 1))] if steady else None,
        "steady_qps": examples_per_step / statistics.median(steady) if steady else None,
        "loss_first": statistics.fmean(head) if losses else None,
        "loss_last": statistics.fmean(tail) if losses else None,
        "losses": losses,
        "step_ms": [round(1e3 * t, 3) for t in step_s],  # each step's time on rank 0, in order
        "on_nonfinite": args.on_nonfinite,
        "poison_batch": args.poison_batch,
        "poison_rank": args.poison_rank,
        "drop_batch": args.drop_batch,
        "skipped": skipped,
        "rolled_back": rolled_back - carried,  # of this run's steps (not in "losses")
        "timeline_png": timeline,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "eval_mode": args.eval_mode,
        "evaluations": [asdict(e) for e in evaluator.evaluations] if evaluator is not None else [],
        "val_auc": evaluator.last.auc if evaluator is not None and evaluator.last else None,
        "val_ne": evaluator.last.ne if evaluator is not None and evaluator.last else None,
        "input_dist_cache": evaluator.cache_stats() if evaluator is not None else None,
        "weights_sha256": _all_ranks_sha256(state.local_sha256("model")),
        "optimizers_sha256": _all_ranks_sha256(state.local_sha256("optimizers")),
    }


def _nonfinite_note(args: argparse.Namespace) -> str | None:
    """The header's line about non-finite steps and the edited data (None: nothing to say)."""
    parts = []
    if args.on_nonfinite == "skip":
        parts.append(
            "--on-nonfinite skip: a step not finite on some rank is rolled back on every rank and training goes on "
            "(--steps counts it)"
        )
    elif args.on_nonfinite == "raise":
        parts.append("--on-nonfinite raise: a step not finite on some rank is rolled back and ends the run")
    if args.poison_batch is not None:
        whose = "each rank's" if args.poison_rank is None else f"rank {args.poison_rank}'s"
        parts.append(f"{whose} batch {args.poison_batch} poisoned (NaN dense features)")
    if args.drop_batch is not None:
        parts.append(f"each rank's batch {args.drop_batch} dropped from its data")
    return "; ".join(parts) if parts else None


def _rollbacks_above_the_bar() -> None:
    """The pipeline's line about each rolled-back step (logger ``nonfinite.LOG``, at rank 0)
    printed above the progress bar, on stdout, instead of through logging's last resort (stderr)."""

    class AboveTheBar(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tqdm.write(f"rolled back: {record.getMessage()}", file=sys.stdout)

    from torchrec_swp.integrations.torchrec.nonfinite import LOG as log

    if not any(type(h).__name__ == "AboveTheBar" for h in log.handlers):
        log.addHandler(AboveTheBar())
        log.propagate = False


def _skipped_on_ranks(runner: Any, args: argparse.Namespace, world_size: int) -> list[dict[str, Any]]:
    """The steps rolled back (``--on-nonfinite``; a resume's include the runs' before it), the same
    on every rank (collective where there is a transaction): each step's batch in its epoch, its
    draw serial, and what was not finite on each rank (``not_finite[r]``, empty where rank r's
    step was finite)."""
    if args.impl != "ours" or args.on_nonfinite == "off":
        return []
    mine = [(v.batch, v.serial, list(v.what)) for v in runner.pipeline.skipped_steps]
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    return [
        {"batch": batch, "serial": serial, "not_finite": [ranks[k][2] for ranks in every]}
        for k, (batch, serial, _) in enumerate(every[0])
    ]


def _skipped_line(skipped: list[dict[str, Any]], shown: int = 5) -> str:
    """The summary's line: how many steps were rolled back, which batches, what was not finite where."""
    count = f"{len(skipped)} step{'s' if len(skipped) != 1 else ''}"
    if not skipped:
        return f"skipped: {count} (nothing was rolled back)"
    items = []
    for step in skipped[:shown]:
        per_rank = step["not_finite"]
        if all(what == per_rank[0] for what in per_rank):
            items.append(f"batch {step['batch']}: {', '.join(per_rank[0])}")
        else:
            where = "; ".join(f"rank {r}: {', '.join(what)}" for r, what in enumerate(per_rank) if what)
            items.append(f"batch {step['batch']}: {where}")
    more = f"; and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"skipped: {count} rolled back on every rank ({'; '.join(items)}{more})"


def rank_path(path: Path, rank: int | str) -> Path:
    """``path`` with ``.rank<rank>`` before its suffix: where rank ``rank`` writes its profile."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _decision(runner: Any) -> dict[str, Any] | None:
    """What the pipeline's tuner decided (the summary's ``autotune``): the plan it switched to
    (None: it kept its own), predicted and measured steps (ms), and why."""
    d = runner.pipeline.autotune_decision
    if d is None:
        return None
    ms = lambda s: None if s is None else 1e3 * s  # noqa: E731
    return {
        "switched": d.switched,
        "plan": d.plan,
        "input_dist_group": d.own_group,
        "start_measured_ms": ms(d.measured_start_s),
        "start_predicted_ms": ms(d.baseline_s),
        "predicted_ms": ms(d.predicted_s),
        "measured_ms": ms(d.measured_s),
        "why": list(d.why),
        # what tuning cost: the steps before the final plan, those spent trying plans, the switches
        "tuning_steps": d.tuning_steps,
        "trial_steps": d.trial_steps,
        "switches": d.switches,
        # and the net time its searches and trials lost against the plans they started from
        # (rank 0's; Autotune.budget_steps bounds it)
        "lost_s": d.lost_s,
        "tried": [
            {"predicted_ms": ms(t.predicted_s), "measured_ms": ms(t.measured_s), "steps": t.steps, "verdict": t.verdict}
            for t in d.tried
        ],
    }


def _eval_note(args: argparse.Namespace, world_size: int) -> str:
    """The header's line about the evaluations."""
    data = ", ".join(map(str, args.eval_tsv)) if args.eval_tsv else "the synthetic data's held-out split"
    batches = f"at most {args.eval_batches}" if args.eval_tsv else str(args.eval_batches)
    through = (
        f"the training pipeline in eval mode ({args.impl} {args.pipeline})"
        if args.eval_mode == "hybrid"
        else f"{args.impl} EvalPipelineSparseDist"
    )
    return (
        f"validation: every {args.eval_every} steps and after the last, {batches} held-out batches per rank x "
        f"{world_size} ranks ({data}), AUC and NE by torchrec.metrics, through {through} (--eval-mode {args.eval_mode})"
    )


def _eval_line(found: Evaluation, world_size: int) -> str:
    """What rank 0 prints after each evaluation."""
    return (
        f"eval after step {found.step}: validation AUC {found.auc:.4f}, NE {found.ne:.4f} "
        f"({found.batches} batches x {world_size} ranks, {found.examples:,} examples, {found.seconds:.2f}s)"
    )


def _data_note(args: argparse.Namespace) -> str:
    """What the header line says about the data source: nothing for the default one."""
    if args.data_source == "dataloader":
        return ""
    source = f"GlobalMapSource over {args.epoch_batches} batches" if args.data_source == "global" else "MapSource"
    return f", data: {source} ({args.loads} load{'s' if args.loads != 1 else ''} at once)"


def not_resizable(args: argparse.Namespace) -> str | None:
    """Why a checkpoint of this run's configuration cannot resume on another world size, or None.

    What DCP reshards (the tables, their fused optimizer's state, the replicated MLPs and their
    optimizer's state) moves to any number of ranks; what is ours must be global: the data
    position (``--data-source global``). The pipeline's own state of its batches in flight is
    the pipeline's to move or refuse (``load_state_dict(resized=True)``)."""
    if args.data_source != "global":
        return (
            f"--data-source {args.data_source} keeps a data position per rank, which another number of ranks "
            "cannot split; --data-source global keeps one that it can"
        )
    return None


def _written_on(fp: dict[str, Any], world_size: int) -> dict[str, Any]:
    """What a checkpoint records about the world that wrote it (meta.json's ``written_on``)."""
    import torchrec

    return {
        "world_size": world_size,
        "topology": _topology(world_size),
        "plan": fp["plan"],
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", "unknown"),
    }


def _resize_line(written_on: dict[str, Any], world_size: int, loader: Any) -> str:
    """Rank 0's line on a resume on another world size: from what, to what, what data is left."""
    left = f"{len(loader)} batches per rank left of the epoch"
    if getattr(loader, "tail", 0):
        batches = f"{loader.tail} batch{'es' if loader.tail != 1 else ''}"
        left += f"; the last {batches}, an incomplete step of {world_size}, in no rank's share"
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    return (
        f"resize: written on {written_on['world_size']} ranks ({written_on['topology'] or 'topology not recorded'}), "
        f"resumed on {ranks} "
        f"({_topology(world_size)}): tables and optimizer state resharded by DCP, the data position global ({left})"
    )


def _check_global_position(position: dict[str, Any], world_size: int) -> None:
    """Every rank cut at the same global position (collective); CheckpointError naming the ranks that
    did not, whose checkpoint could not resume on another world size."""
    positions: list[Any] = [None] * world_size
    dist.all_gather_object(positions, position)
    try:
        GlobalMapSource.agree(positions)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _checkpoint_due(args: argparse.Namespace, trained: int) -> bool:
    every = args.checkpoint_every
    return bool(every and trained % every == 0) or trained == args.steps or trained == args.stop_after


def _topology(world_size: int) -> str:
    """``"2 nodes x 2 processes"``, from the launcher's LOCAL_WORLD_SIZE (torchrun sets it)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    nodes = max(1, world_size // max(1, per_node))
    return f"{nodes} node{'s' if nodes != 1 else ''} x {per_node} process{'es' if per_node != 1 else ''}"


def _all_ranks_sha256(local: str) -> str:
    """SHA-256 over every rank's ``local`` digest, in rank order (collective)."""
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, local)
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _cache_line(c: dict[str, Any]) -> str:
    """The summary's line about the evaluations' input dist cache (rank 0's)."""
    if c["disabled"]:
        return f"input dist cache: off for this model ({c['disabled']})"
    seen = c["hits"] + c["misses"]
    per = f", {1e3 * c['saved_s'] / c['hits']:.2f} ms host time saved per reused batch" if c["hits"] else ""
    full = f"; {c['not_kept']} did not fit under the cap" if c["not_kept"] else ""
    return (
        f"input dist cache: {c['hits']} of {seen} held-out batches reused their input dist{per} "
        f"({c['entries']} kept, {c['bytes'] / 2**20:.2f} of {c['max_bytes'] / 2**20:g} MiB on rank 0{full})"
    )


def print_summary(s: dict[str, Any]) -> None:
    end = s["start_step"] + s["steps"]
    resumed = f" (steps {s['start_step'] + 1}..{end})" if s["start_step"] else ""
    ranks = f"{s['ranks']} rank{'s' if s['ranks'] != 1 else ''}"
    print(
        f"done: {s['steps']} steps{resumed} of {s['impl']} {s['pipeline']} in {s['wall_s']:.1f}s on {ranks}"
        + (f"; stopped at step {end} of {s['total_steps']}" if end < s["total_steps"] and s["steps"] else "")
    )
    if s["steps"]:
        print(
            f"  step time: median {s['median_step_ms']:.2f} ms, p90 {s['p90_step_ms']:.2f} ms "
            "(steps after the first 10%)\n"
            f"  QPS: {s['steady_qps']:,.0f} examples/s at the median step, {s['qps']:,.0f} over the whole run\n"
            f"  loss: {s['loss_first']:.4f} (first 10% of steps) -> {s['loss_last']:.4f} (last 10%)"
            + (" (the steps kept)" if s.get("rolled_back") else "")
        )
    if s.get("on_nonfinite", "off") != "off":
        print("  " + _skipped_line(s["skipped"]))
    elif bad := [k for k, loss in enumerate(s["losses"]) if not math.isfinite(loss)]:
        steps = f"{len(bad)} step{'s' if len(bad) != 1 else ''}"
        print(
            f"  not finite: the loss of {steps}, the first at batch {s['start_step'] + bad[0]} (--on-nonfinite off: "
            "trained as it was, upstream's behaviour; --on-nonfinite skip rolls such a step back)"
        )
    tuned = s.get("autotune")
    if tuned and tuned["switched"] and tuned["measured_ms"] is not None:
        if tuned["predicted_ms"] is None:  # the plan it started from, measured best in a later trial
            chosen = f"the chosen plan, without a prediction, measured {tuned['measured_ms']:.2f} ms"
        else:
            chosen = (
                f"the chosen plan predicted {tuned['predicted_ms']:.2f} ms, measured {tuned['measured_ms']:.2f} ms "
                f"({missed(tuned['predicted_ms'], tuned['measured_ms'])})"
            )
        print(f"  autotune: {tuned['start_measured_ms']:.2f} ms per step before the switch; {chosen}")
    if tuned and tuned.get("tuning_steps") is not None:
        print(
            f"  autotune cost: {tuned['tuning_steps']} steps before the final plan ({tuned['trial_steps']} trying "
            f"{len(tuned['tried'])} plans), {tuned['switches']} switches; its searches and trials "
            f"{'lost' if tuned['lost_s'] >= 0 else 'gained'} {abs(tuned['lost_s']):.2f} s net against the plans "
            "they started from"
        )
    elif tuned:
        print(f"  autotune: {tuned['why'][-1] if tuned['why'] else 'kept its plan'}")
    elif s.get("autotune_requested"):
        bound = tuning_steps(s["pipeline"])
        print(
            f"  autotune: no decision: the run ended after {s['total_steps']} steps, the pipeline still tuning "
            f"(a tuning takes up to {bound} steps here: give --steps {bound + STEPS}, or leave --steps out)"
        )
    if s.get("val_auc") is not None:
        last = s["evaluations"][-1]
        count = len(s["evaluations"])
        print(
            f"  validation: AUC {s['val_auc']:.4f}, NE {s['val_ne']:.4f} after step {last['step']} "
            f"({count} evaluation{'s' if count != 1 else ''}, {s['eval_s']:.1f}s of this run's time, not in the QPS)"
        )
    if cache := s.get("input_dist_cache"):
        print("  " + _cache_line(cache))
    print(f"  weights: sha256 {s['weights_sha256'][:16]} (all ranks' shards)")
    if s.get("timeline_png"):
        print(f"  timeline: {s['timeline_png']} (the last steps as a Gantt chart, one row per thread)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        if args.checkpoint_dir:
            try:
                checkpoint.check(
                    args.checkpoint_dir,
                    fingerprint(args, args.world_size),
                    resume=args.resume,
                    why_not_resizable=not_resizable(args),
                )
            except CheckpointError as e:
                print(f"train.py: error: --checkpoint-dir: {e}", file=sys.stderr)
                return 2
            if (why := not_checkpointable(args)) is not None:
                print(f"train.py: error: {why}", file=sys.stderr)
                return 2
        length = (
            f"an epoch of {args.epoch_batches} batches over all ranks"
            if args.data_source == "global"
            else f"{args.steps} steps"
        )
        print(
            f"ok: {args.impl} {args.pipeline}, {length}"
            + (f", plan {args.plan}" if args.plan else "")
            + (f", on_nonfinite {args.on_nonfinite}" if args.on_nonfinite != "off" else "")
        )
        return 0
    # a crash in native code (an abort, a segfault) prints every Python thread's stack to stderr
    faulthandler.enable()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates: its code, not ours.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
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
    backend = "gloo"
    if args.device_value.type == "cuda":
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= count:
            print(
                f"error: rank {os.environ['RANK']}: LOCAL_RANK {local_rank} but this node has {count} CUDA "
                f"device(s): launch at most {count} processes per node",
                file=sys.stderr,
            )
            return 2
        torch.cuda.set_device(local_rank)
        args.device_value = torch.device("cuda", local_rank)
        backend = "nccl"
    dist.init_process_group(backend)
    try:
        summary = train(args)
        # every rank done with its collectives before any tears gloo down: a rank destroying its
        # group while a peer still closes its connections was seen to abort (std::terminate)
        dist.barrier()
        # the model, its pipeline and the process groups they hold go now, while the interpreter is
        # whole (cycles through the engine's task functions would otherwise keep them to its exit)
        gc.collect()
    except (
        PipelineUnavailable,
        PlanError,
        CheckpointError,
        FileNotFoundError,
        ValueError,
        TypeError,
        NonFiniteStep,
    ) as e:
        # what a user can fix (a step rolled back with --on-nonfinite raise: which batch): one line, not a
        # traceback per rank
        print(f"error: rank {dist.get_rank()}: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        print_summary(summary)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # a normal return, through the interpreter's finalization: the pipeline was closed (its threads
    # joined, the groups it made destroyed), and a pipeline never closed is torn down by its exit
    # hook before finalization begins (torchrec_swp/integrations/torchrec/teardown.py)
    sys.exit(main())
