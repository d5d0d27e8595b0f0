"""torchx component for the DLRM example: ``examples/dlrm/train.py`` on nnodes x nproc ranks.

    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --steps 100 --thread_map io
    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --pipeline TrainPipelineBase -- --batch-size 512
    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --data_source map --loads 4 --loader_latency_ms 20
    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --autotune True --loader_latency_ms 10
    .venv/bin/torchx run -s local_cwd examples/dlrm/component.py:dlrm --eval_every 25 --eval_batches 5

The named parameters are the common ones; anything after ``--`` goes to train.py unchanged (see
``python examples/dlrm/train.py --help``). It is ``dist.ddp`` with ``-j {nnodes}x{nproc}`` and the
script filled in, launched with ``python -m torch.distributed.run`` by the interpreter that runs
torchx, so it works without activating the venv (``dist.ddp`` itself runs ``torchrun`` from
PATH; so the component suits schedulers whose nodes see this interpreter at the same path, e.g.
local_cwd or Slurm with a shared file system, not a container image: see docs/cluster.md). Run it
from the repository root. ``max_retries`` is both the scheduler's retry count and torchrun's
``--max-restarts`` (``PET_MAX_RESTARTS``), as in ``launch.py``.
"""

import shlex
import sys
from typing import Optional  # torchx reads the annotations as written: `int | None` is not one it takes

from torchx import specs
from torchx.components.dist import ddp

# Relative to the repository root, where local_cwd runs the job (torchx loads this file from a
# copy of its source, so __file__ does not point here).
TRAIN = "examples/dlrm/train.py"


def dlrm(
    *script_args: str,
    nproc: int = 2,
    nnodes: int = 1,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    pipeline: str = "",
    impl: str = "ours",
    steps: int = 100,  # = train.STEPS
    thread_map: str = "",
    data_source: str = "",
    loads: int = 1,
    lookahead: Optional[int] = None,  # noqa: UP045 - see the import
    input_dist_group: bool = False,
    autotune: bool = False,
    loader_latency_ms: float = 0.0,
    loader_kind: str = "sleep",
    eval_every: int = 0,
    eval_batches: Optional[int] = None,  # noqa: UP045 - see the import
    eval_mode: str = "",
    input_dist_cache_mb: Optional[float] = None,  # noqa: UP045 - see the import
    json: str = "",
    cpu: int = 2,
    memMB: int = 4096,
) -> specs.AppDef:
    """Train TorchRec's DLRM on synthetic Criteo-like data with one of the 12 train pipelines.

    Args:
        script_args: further arguments for train.py (after --)
        nproc: ranks (processes) per node
        nnodes: nodes (one torchrun each; they meet through the c10d rendezvous on the first node)
        max_retries: restarts after a failure (the scheduler's retries and torchrun's --max-restarts)
        rdzv_port: port of the rendezvous on the first node (nnodes > 1)
        pipeline: pipeline class name, e.g. TrainPipelineSparseDist or TrainPipelineBase ("": train.py's default,
            TrainPipelineSparseDist, or TrainEvalHybridPipelineBase with eval_mode hybrid); TrainPipelinePEC on
            TorchRec 1.9 only
        impl: ours (torchrec_swp) or upstream (TorchRec)
        steps: batches per rank
        thread_map: ours: main, by_stream, per_task, io, or a JSON object {task: thread} ("": the plan's own)
        data_source: dataloader (torchdata's StatefulDataLoader) or map (torchrec_swp's MapSource); "": map with
            autotune, else dataloader
        loads: ours, with data_source map: batches loaded at once, on the pipeline's threads
        lookahead: ours: batches the source may draw ahead of the pipeline's depth (default: loads when loads > 1)
        input_dist_group: ours, the SparseDist family: a process group of its own for the sparse input dist
        autotune: ours: the pipeline tunes itself while it trains (threads, lookahead, loads, input dist group);
            torchx takes a bool as a value: --autotune True
        loader_latency_ms: the loader waits this long per batch (storage latency), or works this long (loader_kind)
        loader_kind: sleep (storage), gil (Python parsing holding the GIL), torch (torch ops), tail (a lognormal
            wait, loader_latency_ms its median)
        eval_every: evaluate after every N-th step and the last: validation AUC and NE on held-out batches (0: never)
        eval_batches: held-out batches per rank of each evaluation (default: train.py's, 10); with eval_every only
        eval_mode: pipeline (an EvalPipelineSparseDist beside the training pipeline) or hybrid (the training
            pipeline, TrainEvalHybridPipelineBase, in eval mode); "": train.py's default
        input_dist_cache_mb: ours, eval_mode pipeline: evaluations after the first reuse the held-out batches'
            input dist, kept under this many MiB per rank
        json: rank 0 writes the summary to this file ("" for none)
        cpu: CPUs of the job (a resource request; local_cwd does not enforce it)
        memMB: memory of the job in MB (a resource request; local_cwd does not enforce it)
    """
    args = [] if not pipeline else ["--pipeline", pipeline]
    args += [
        "--impl",
        impl,
        "--steps",
        str(steps),
        "--loader-latency-ms",
        str(loader_latency_ms),
    ]
    if loader_kind != "sleep":
        args += ["--loader-kind", loader_kind]
    if data_source:
        args += ["--data-source", data_source]
    if thread_map:
        args += ["--thread-map", thread_map]
    if loads != 1:
        args += ["--loads", str(loads)]
    if lookahead is not None:
        args += ["--lookahead", str(lookahead)]
    if input_dist_group:
        args += ["--input-dist-group"]
    if autotune:
        args += ["--autotune"]
    if eval_every:
        args += ["--eval-every", str(eval_every)]
    if eval_batches is not None:
        args += ["--eval-batches", str(eval_batches)]
    if eval_mode:
        args += ["--eval-mode", eval_mode]
    if input_dist_cache_mb is not None:
        args += ["--input-dist-cache-mb", str(input_dist_cache_mb)]
    if json:
        args += ["--json", json]
    env = {"OMP_NUM_THREADS": "1", "PET_MAX_RESTARTS": str(max_retries)}
    if max_retries:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a new store per restart (see launch.py)
    app = ddp(
        *args,
        *script_args,
        script=TRAIN,
        name="dlrm",
        j=f"{nnodes}x{nproc}",
        cpu=cpu,
        memMB=memMB,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
    )
    # dist.ddp runs "torchrun ..." through bash; run this interpreter's torch.distributed.run instead
    role = app.roles[0]
    command = role.args[-1]
    if not command.startswith("torchrun "):
        raise RuntimeError(f"unexpected dist.ddp command (torchx changed?): {command!r}")
    role.args[-1] = f"{shlex.quote(sys.executable)} -m torch.distributed.run " + command.removeprefix("torchrun ")
    return app
