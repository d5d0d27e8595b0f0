"""The schedules of TorchRec 1.8.0's training pipelines, as PipelinePlans (pure data, no torch).

Each function returns the plan one pipeline's ``progress()`` follows, given the constructor
options that change its schedule. Task names are the vocabulary of seed 001; where seed 001's
table and upstream's real ``progress()`` disagree, the plan follows upstream and says so in a
comment marked ``UPSTREAM:``.

Comm groups: every task that issues a collective on the model's process group is in comm group
``world`` (seed 001 marks only InputDistStart; upstream's InputDistWait launches the tensor
all-to-all, Forward the embedding output dist, Backward its gradient all-to-all and DDP's
all-reduce). On one thread this changes nothing; once a thread_map spreads them over threads,
the turnstile keeps every rank issuing them in fire order.
"""

from __future__ import annotations

from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule

WORLD = "world"

# What each task reads and writes in its batch's slot. The engine hands these values over; no
# task looks a batch up by position.
_IO = {
    "LoadBatch": PipelineTask("LoadBatch", writes=("host_batch",), doc="next(dataloader_iter)"),
    "H2D": PipelineTask("H2D", writes=("batch", "context"), doc="load a batch and copy it to the device"),
    "InputDistStart": PipelineTask("InputDistStart", reads=("batch", "context"), doc="start input dist (splits all-to-all)"),
    "InputDistWait": PipelineTask("InputDistWait", reads=("context",), doc="wait splits, launch tensor all-to-all"),
    "ClearDataDistInputs": PipelineTask("ClearDataDistInputs", reads=("context",), doc="free input-dist inputs early"),
    "ZeroGrad": PipelineTask("ZeroGrad", doc="optimizer.zero_grad() when training"),
    "WaitBatch": PipelineTask("WaitBatch", reads=("batch", "context"), doc="set module context, wait for the batch"),
    "Forward": PipelineTask("Forward", reads=("batch", "context"), writes=("losses", "output")),
    "Backward": PipelineTask("Backward", reads=("losses", "context"), doc="backward and embedding sync"),
    "OptimizerStep": PipelineTask("OptimizerStep", reads=("context",)),
    "Dequeue": PipelineTask("Dequeue", reads=("context",), doc="pop the batch from batches/contexts"),
    "InputTransform": PipelineTask("InputTransform", reads=("batch",), writes=("model_input",)),
    "EmbLookup": PipelineTask("EmbLookup", reads=("batch", "context"), doc="start_embedding_lookup"),
    "EmbPrefetch": PipelineTask("EmbPrefetch", reads=("context",), doc="embedding cache prefetch"),
    "EmbBackward": PipelineTask("EmbBackward", reads=("context",), doc="backward of the detached embeddings"),
    "Synchronize": PipelineTask("Synchronize", doc="device-wide synchronize()"),
}


def _plan(
    name: str,
    schedule: dict[str, TaskSchedule],
    fire_order: list[str],
    *,
    intra: list[tuple[str, str]],
    inter: list[tuple[str, str] | tuple[str, str, int]],
    source: str,
    depth: int,
    on_exhausted: str = "drain",
    io: dict[str, PipelineTask] | None = None,
) -> PipelinePlan:
    table = {**_IO, **(io or {})}
    return PipelinePlan(
        schedule=schedule,
        intra_iter_deps=intra,
        inter_iter_deps=inter,
        pipeline_depth=depth,
        fire_order=fire_order,
        tasks=[table[t] for t in schedule],
        source=source,
        output="output",
        on_exhausted=on_exhausted,  # type: ignore[arg-type]
        name=name,
    )


def train_pipeline_base_plan() -> PipelinePlan:
    """TrainPipelineBase: H2D of batch i+1 overlaps the optimizer of batch i.

    UPSTREAM: seed 001 has one H2D task. Upstream's progress() pulls batch i+1 from the
    dataloader first (``_next_batch``, before zero_grad) and copies it to the device only after
    backward (``_copy_batch_to_gpu``), so the plan has two stage-0 tasks: LoadBatch (the source)
    and H2D. Base does not pop a deque, so there is no Dequeue task.
    """
    s = TaskSchedule
    return _plan(
        "TrainPipelineBase",
        {
            "LoadBatch": s(0),
            "ZeroGrad": s(1),
            "WaitBatch": s(1),
            "Forward": s(1, comm_group=WORLD),
            "Backward": s(1, comm_group=WORLD),
            "H2D": s(0, "memcpy"),
            "OptimizerStep": s(1),
        },
        ["LoadBatch", "ZeroGrad", "WaitBatch", "Forward", "Backward", "H2D", "OptimizerStep"],
        intra=[("WaitBatch", "ZeroGrad"), ("Forward", "WaitBatch"), ("Backward", "Forward"), ("OptimizerStep", "Backward")],
        inter=[("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")],
        source="LoadBatch",
        depth=2,
        io={
            # a copy to the device the batch is already on is skipped there (compiled as an alias)
            "H2D": PipelineTask("H2D", reads=("host_batch",), writes=("batch",), noop_on=("cpu",)),
            "WaitBatch": PipelineTask("WaitBatch", reads=("batch",)),
            "Forward": PipelineTask("Forward", reads=("batch",), writes=("losses", "output")),
            "Backward": PipelineTask("Backward", reads=("losses",)),
            "OptimizerStep": PipelineTask("OptimizerStep"),
        },
    )


def sparse_dist_plan(
    *,
    enqueue_batch_after_forward: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    name: str = "TrainPipelineSparseDist",
) -> PipelinePlan:
    """TrainPipelineSparseDist: H2D(i+2) || InputDist(i+1) || forward/backward(i).

    Options change the plan: ``enqueue_batch_after_forward`` fires H2D after Forward;
    ``execute_all_batches=False`` stops at the first missing batch instead of draining;
    ``clear_data_dist_inputs`` adds ClearDataDistInputs after WaitBatch.

    UPSTREAM: seed 001 omits the bookkeeping at the end of progress(); upstream pops the
    trained batch with ``dequeue_batch()``, which is the Dequeue task here.
    """
    s = TaskSchedule
    schedule = {
        "ZeroGrad": s(2),
        "WaitBatch": s(2),
        "InputDistStart": s(1, "data_dist", comm_group=WORLD),
        "H2D": s(0, "memcpy"),
        "Forward": s(2, comm_group=WORLD),
        "InputDistWait": s(1, "data_dist", comm_group=WORLD),
        "Backward": s(2, comm_group=WORLD),
        "OptimizerStep": s(2),
        "Dequeue": s(2),
    }
    fire = ["ZeroGrad", "WaitBatch", "InputDistStart", "H2D", "Forward", "InputDistWait", "Backward", "OptimizerStep", "Dequeue"]
    if enqueue_batch_after_forward:
        fire.remove("H2D")
        fire.insert(fire.index("Forward") + 1, "H2D")
    if clear_data_dist_inputs:
        schedule["ClearDataDistInputs"] = s(2, "data_dist")
        fire.insert(fire.index("WaitBatch") + 1, "ClearDataDistInputs")
    return _plan(
        name,
        schedule,
        fire,
        intra=[
            ("InputDistWait", "InputDistStart"),
            ("WaitBatch", "InputDistWait"),
            ("Forward", "InputDistWait"),
            ("WaitBatch", "ZeroGrad"),
            ("Forward", "WaitBatch"),
            ("Backward", "Forward"),
            ("OptimizerStep", "Backward"),
            ("Dequeue", "OptimizerStep"),
            *([("ClearDataDistInputs", "WaitBatch")] if clear_data_dist_inputs else []),
        ],
        # ZeroGrad(i) clears what OptimizerStep(i-1) consumed: order only by fire order otherwise
        inter=[("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")],
        source="H2D",
        depth=3,
        on_exhausted="drain" if execute_all_batches else "stop",
    )


def pt2_plan() -> PipelinePlan:
    """TrainPipelinePT2: no pipelining; every task on the default stream for the same batch.

    UPSTREAM: the model is compiled in the 4th progress() call (``_iter == compile_on_iter``
    with ``_iter`` counting from 0), not the 3rd as seed 001 says; that happens inside Forward.
    """
    s = TaskSchedule
    return _plan(
        "TrainPipelinePT2",
        {
            "LoadBatch": s(0),
            "H2D": s(0),
            "InputTransform": s(0),
            "ZeroGrad": s(0),
            "Forward": s(0, comm_group=WORLD),
            "Backward": s(0, comm_group=WORLD),
            "OptimizerStep": s(0),
        },
        ["LoadBatch", "H2D", "InputTransform", "ZeroGrad", "Forward", "Backward", "OptimizerStep"],
        intra=[("ZeroGrad", "InputTransform"), ("Forward", "ZeroGrad"), ("Backward", "Forward"), ("OptimizerStep", "Backward")],
        inter=[("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")],
        source="LoadBatch",
        depth=1,
        io={
            # a copy to the device the batch is already on is skipped there (compiled as an alias)
            "H2D": PipelineTask("H2D", reads=("host_batch",), writes=("batch",), noop_on=("cpu",)),
            "Forward": PipelineTask("Forward", reads=("model_input",), writes=("losses", "output")),
            "Backward": PipelineTask("Backward", reads=("losses",)),
            "OptimizerStep": PipelineTask("OptimizerStep"),
        },
    )


def sparse_dist_lite_plan() -> PipelinePlan:
    """TrainPipelineSparseDistLite: only H2D overlaps; input dist runs on the default stream in
    the critical path (upstream sets ``_data_dist_stream = None``), two batches in flight."""
    s = TaskSchedule
    return _plan(
        "TrainPipelineSparseDistLite",
        {
            "ZeroGrad": s(1),
            "WaitBatch": s(1),
            "InputDistStart": s(1, comm_group=WORLD),
            "InputDistWait": s(1, comm_group=WORLD),
            "Forward": s(1, comm_group=WORLD),
            "Backward": s(1, comm_group=WORLD),
            "H2D": s(0, "memcpy"),
            "OptimizerStep": s(1),
            "Dequeue": s(1),
        },
        ["ZeroGrad", "WaitBatch", "InputDistStart", "InputDistWait", "Forward", "Backward", "H2D", "OptimizerStep", "Dequeue"],
        intra=[
            ("WaitBatch", "ZeroGrad"),
            ("InputDistStart", "WaitBatch"),
            ("InputDistWait", "InputDistStart"),
            ("Forward", "InputDistWait"),
            ("Backward", "Forward"),
            ("OptimizerStep", "Backward"),
            ("Dequeue", "OptimizerStep"),
        ],
        inter=[("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")],
        source="H2D",
        depth=2,
    )


def fused_sparse_dist_plan(
    *,
    emb_lookup_stream: str = "data_dist",
    embedding_lookup_after_data_dist: bool = False,
    enqueue_batch_after_forward: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    train: bool = True,
    name: str = "TrainPipelineFusedSparseDist",
) -> PipelinePlan:
    """TrainPipelineFusedSparseDist: EmbLookup(i) on its own stream at the start of progress(),
    overlapping the tail of the previous optimizer step.

    ``emb_lookup_stream``: ``"data_dist"`` (upstream's default: the lookup runs on the data_dist
    stream itself), ``"new"`` (a stream of its own, named ``emb_lookup``) or ``"current"`` (the
    default stream). ``train=False`` is EvalPipelineFusedSparseDist: no backward or optimizer,
    and H2D always before Forward.

    UPSTREAM: seed 001 names the lookup's stream ``emb_lookup`` whatever the option; with the
    default option upstream submits it to data_dist, and the plan says so. Upstream's forward
    waits for data_dist, not for the lookup stream.
    """
    s = TaskSchedule
    lookup_stream = {"data_dist": "data_dist", "new": "emb_lookup", "current": "default"}[emb_lookup_stream]
    schedule = {
        "EmbLookup": s(2, lookup_stream, comm_group=WORLD),
        "ZeroGrad": s(2),
        "WaitBatch": s(2),
        "InputDistStart": s(1, "data_dist", comm_group=WORLD),
        "H2D": s(0, "memcpy"),
        "Forward": s(2, comm_group=WORLD),
        "InputDistWait": s(1, "data_dist", comm_group=WORLD),
        "Backward": s(2, comm_group=WORLD),
        "OptimizerStep": s(2),
        "Dequeue": s(2),
    }
    fire = list(schedule)
    if not train:
        for task in ("Backward", "OptimizerStep"):
            del schedule[task]
            fire.remove(task)
    if enqueue_batch_after_forward and train:
        fire.remove("H2D")
        fire.insert(fire.index("Forward") + 1, "H2D")
    if embedding_lookup_after_data_dist:
        fire.remove("EmbLookup")
        fire.insert(fire.index("Forward"), "EmbLookup")
    if clear_data_dist_inputs:
        schedule["ClearDataDistInputs"] = s(2, "data_dist")
        fire.insert(fire.index("WaitBatch") + 1, "ClearDataDistInputs")
    intra = [
        ("InputDistWait", "InputDistStart"),
        ("EmbLookup", "InputDistWait"),
        ("WaitBatch", "ZeroGrad"),
        ("Forward", "EmbLookup"),
        ("Forward", "WaitBatch"),
        ("Dequeue", "Forward"),
    ]
    inter: list[tuple[str, str] | tuple[str, str, int]] = []
    if train:
        intra += [("Backward", "Forward"), ("OptimizerStep", "Backward"), ("Dequeue", "OptimizerStep")]
        # the fused TBE updates embeddings in backward: the next lookup must follow it
        inter += [("EmbLookup", "Backward"), ("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")]
    if clear_data_dist_inputs:
        intra.append(("ClearDataDistInputs", "WaitBatch"))
    return _plan(
        name,
        schedule,
        fire,
        intra=intra,
        inter=inter,
        source="H2D",
        depth=3,
        on_exhausted="drain" if execute_all_batches else "stop",
    )


def eval_fused_sparse_dist_plan(
    *,
    enable_embedding_lookup_prefetch: bool = False,
    emb_lookup_stream: str = "data_dist",
    embedding_lookup_after_data_dist: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
) -> PipelinePlan:
    """EvalPipelineFusedSparseDist: Fused without backward/optimizer; forward under no_grad.

    With ``enable_embedding_lookup_prefetch`` the lookup of batch i+1 runs in the input-dist
    stage, right after its InputDistWait (seed 001 does not cover this mode).
    UPSTREAM: ``enqueue_batch_after_forward`` is accepted and ignored; H2D fires before Forward.
    """
    plan = fused_sparse_dist_plan(
        emb_lookup_stream=emb_lookup_stream,
        embedding_lookup_after_data_dist=embedding_lookup_after_data_dist and not enable_embedding_lookup_prefetch,
        execute_all_batches=execute_all_batches,
        clear_data_dist_inputs=clear_data_dist_inputs,
        train=False,
        name="EvalPipelineFusedSparseDist",
    )
    if not enable_embedding_lookup_prefetch:
        return plan
    fire = [t for t in plan.fire_order if t != "EmbLookup"]
    fire.insert(fire.index("InputDistWait") + 1, "EmbLookup")
    return plan.replace(schedule={**plan.schedule, "EmbLookup": plan.schedule["EmbLookup"].replace(stage=1)}, fire_order=fire)


def semi_sync_plan(
    *, phase: str = "semi_sync", execute_all_batches: bool = True, clear_data_dist_inputs: bool = False
) -> PipelinePlan:
    """TrainPipelineSemiSync: H2D(i+3) -> InputDist(i+2) -> EmbLookup(i+1) -> fwd/bwd/opt(i).

    Two plans with the same tasks and stages, switched by the pipeline when the batch being
    forwarded reaches ``start_batch``:

    * ``phase="sync"``: EmbLookup(i+1) after the optimizer of batch i and a device-wide
      synchronize(): batch i+1's embeddings see batch i's update (a dep on EmbBackward @1).
    * ``phase="semi_sync"``: EmbLookup(i+1) before Backward(i): it sees updates up to batch i-1
      (a dep on EmbBackward @2), and its all-to-all overlaps batch i's backward.

    UPSTREAM: seed 001 lists the tasks stage by stage. Upstream's real order starts with
    InputDistStart(i+2), pops batch i right after Forward(i) (Dequeue), zeroes gradients last,
    and in the semi-sync phase issues EmbLookup(i+1) before Backward(i). ``execute_all_batches=False``
    stops at the first missing batch; upstream's SemiSync copy never raises, so only its in-place
    copy (``enable_inplace_copy_batch``) stops, and otherwise the pipeline passes True.
    ``clear_data_dist_inputs`` adds ClearDataDistInputs(i), upstream's first call in progress().
    """
    s = TaskSchedule
    schedule = {
        "InputDistStart": s(1, "data_dist", comm_group=WORLD),
        "Forward": s(3, comm_group=WORLD),
        "Dequeue": s(3),
        "H2D": s(0, "memcpy"),
        "EmbLookup": s(2, comm_group=WORLD),
        "InputDistWait": s(1, "data_dist", comm_group=WORLD),
        "Backward": s(3, comm_group=WORLD),
        "EmbBackward": s(3, comm_group=WORLD),
        "OptimizerStep": s(3),
        "ZeroGrad": s(3),
    }
    intra = [
        ("InputDistWait", "InputDistStart"),
        ("EmbLookup", "InputDistWait"),
        ("Forward", "EmbLookup"),
        ("Dequeue", "Forward"),
        ("Backward", "Forward"),
        ("EmbBackward", "Backward"),
        ("OptimizerStep", "EmbBackward"),
        ("ZeroGrad", "OptimizerStep"),
    ]
    inter: list[tuple[str, str] | tuple[str, str, int]] = [("Forward", "ZeroGrad"), ("Forward", "OptimizerStep")]
    if phase == "sync":
        fire = ["InputDistStart", "Forward", "Dequeue", "H2D", "InputDistWait", "Backward", "EmbBackward",
                "OptimizerStep", "ZeroGrad", "Synchronize", "EmbLookup"]
        schedule["Synchronize"] = s(3)
        intra.append(("Synchronize", "ZeroGrad"))
        inter += [("EmbLookup", "EmbBackward"), ("EmbLookup", "Synchronize")]
    elif phase == "semi_sync":
        fire = ["InputDistStart", "Forward", "Dequeue", "H2D", "EmbLookup", "InputDistWait", "Backward",
                "EmbBackward", "OptimizerStep", "ZeroGrad"]
        inter.append(("EmbLookup", "EmbBackward", 2))
    else:
        raise ValueError(f"phase must be 'sync' or 'semi_sync', got {phase!r}")
    if clear_data_dist_inputs:
        schedule["ClearDataDistInputs"] = s(3, "data_dist")
        fire.insert(0, "ClearDataDistInputs")
    return _plan(
        f"TrainPipelineSemiSync_{phase}",
        schedule,
        fire,
        intra=intra,
        inter=inter,
        source="H2D",
        depth=4,
        on_exhausted="drain" if execute_all_batches else "stop",
    )


def prefetch_sparse_dist_plan(*, execute_all_batches: bool = True) -> PipelinePlan:
    """PrefetchTrainPipelineSparseDist: H2D and InputDistStart(i+2), InputDistWait and the
    embedding cache prefetch (i+1) on a prefetch stream, forward/backward/optimizer (i).

    UPSTREAM: seed 001 says this pipeline uses the deprecated ``_batch_i/_ip1/_ip2`` window; in
    1.8.0 it uses the ``batches``/``contexts`` deques and pops with ``dequeue_batch()`` (the
    Dequeue task). With ``execute_all_batches=False`` upstream refills on every call and drops
    the last four batches; the plan stops at the first missing batch, like TrainPipelineSparseDist.
    """
    s = TaskSchedule
    return _plan(
        "PrefetchTrainPipelineSparseDist",
        {
            "ZeroGrad": s(2),
            "WaitBatch": s(2),
            "H2D": s(0, "memcpy"),
            "InputDistWait": s(1, "data_dist", comm_group=WORLD),
            "Forward": s(2, comm_group=WORLD),
            "EmbPrefetch": s(1, "prefetch"),
            "Backward": s(2, comm_group=WORLD),
            "OptimizerStep": s(2),
            "InputDistStart": s(0, "data_dist", comm_group=WORLD),
            "Dequeue": s(2),
        },
        ["ZeroGrad", "WaitBatch", "H2D", "InputDistWait", "Forward", "EmbPrefetch", "Backward", "OptimizerStep",
         "InputDistStart", "Dequeue"],
        intra=[
            ("InputDistWait", "InputDistStart"),
            ("EmbPrefetch", "InputDistWait"),
            ("WaitBatch", "EmbPrefetch"),
            ("WaitBatch", "ZeroGrad"),
            ("Forward", "WaitBatch"),
            ("Backward", "Forward"),
            ("OptimizerStep", "Backward"),
            ("Dequeue", "OptimizerStep"),
        ],
        # EmbPrefetch(i+1) refills the cache Forward(i) reads from
        inter=[("EmbPrefetch", "Forward"), ("Forward", "OptimizerStep"), ("ZeroGrad", "OptimizerStep")],
        source="H2D",
        depth=3,
        on_exhausted="drain" if execute_all_batches else "stop",
    )


def eval_sparse_dist_plan(*, clear_data_dist_inputs: bool = False) -> PipelinePlan:
    """EvalPipelineSparseDist: a background loader thread copies batch i+2 while the calling
    thread runs input dist (i+1) and forward (i). The loader is a thread group of the plan.

    UPSTREAM: seed 001 draws two stages with input dist in the forward stage and says pipelined
    modules are re-initialised on every call. Upstream starts the input dist of batch i+1 in the
    call that forwards batch i, so there are three stages (depth 3), and initialises the
    pipelined modules only on the first call. It also starts batch 0's input dist twice; the
    plan starts it once. ``clear_data_dist_inputs`` adds ClearDataDistInputs after WaitBatch.
    """
    s = TaskSchedule
    schedule = {
        "H2D": s(0, "memcpy", thread_group="loader"),
        "WaitBatch": s(2),
        "InputDistStart": s(1, "data_dist", comm_group=WORLD),
        "Forward": s(2, comm_group=WORLD),
        "InputDistWait": s(1, "data_dist", comm_group=WORLD),
        "Dequeue": s(2),
    }
    fire = ["H2D", "WaitBatch", "InputDistStart", "Forward", "InputDistWait", "Dequeue"]
    intra = [
        ("InputDistWait", "InputDistStart"),
        ("WaitBatch", "InputDistWait"),
        ("Forward", "WaitBatch"),
        ("Dequeue", "Forward"),
    ]
    if clear_data_dist_inputs:
        schedule["ClearDataDistInputs"] = s(2, "data_dist")
        fire.insert(fire.index("WaitBatch") + 1, "ClearDataDistInputs")
        intra.append(("ClearDataDistInputs", "WaitBatch"))
    return _plan(
        "EvalPipelineSparseDist",
        schedule,
        fire,
        intra=intra,
        inter=[],
        source="H2D",
        depth=3,
    )


def staged_plan(stage_names: list[str], stage_streams: list[str] | None = None) -> PipelinePlan:
    """StagedTrainPipeline: N user stages; stage k works on the batch k steps behind stage 0, and
    an Emit task hands the batch that left the last stage to the caller (who runs fwd/bwd/opt).

    UPSTREAM: seed 001 gives depth N; the batch being returned is one more position, so the
    depth is N + 1. Within a call upstream first pops the batch it returns (``_advance``, the
    Emit task), then runs stage 0 (the newest batch), stage 1, ... stage N-1.
    """
    if not stage_names:
        raise ValueError("StagedTrainPipeline needs at least one stage")
    if len(set(stage_names)) != len(stage_names) or "Emit" in stage_names:
        raise ValueError(f"stage names must be distinct and not 'Emit', got {stage_names}")
    streams = stage_streams or ["default"] * len(stage_names)
    s = TaskSchedule
    schedule = {name: s(k, streams[k]) for k, name in enumerate(stage_names)}
    schedule["Emit"] = s(len(stage_names))
    tasks = [PipelineTask(stage_names[0], writes=(f"out_{0}",))]
    tasks += [
        PipelineTask(name, reads=(f"out_{k - 1}",), writes=(f"out_{k}",)) for k, name in enumerate(stage_names) if k
    ]
    tasks.append(PipelineTask("Emit", reads=(f"out_{len(stage_names) - 1}",), writes=("output",)))
    return PipelinePlan(
        schedule=schedule,
        pipeline_depth=len(stage_names) + 1,
        fire_order=["Emit", *stage_names],
        tasks=tasks,
        source=stage_names[0],
        output="output",
        name="StagedTrainPipeline",
    )


def comp_autograd_plan(*, execute_all_batches: bool = True, clear_data_dist_inputs: bool = False) -> PipelinePlan:
    """TrainPipelineSparseDistCompAutograd: SparseDist's schedule, with Forward and Backward
    under compiled autograd.

    UPSTREAM: no ``enqueue_batch_after_forward`` option (H2D always before Forward).
    """
    return sparse_dist_plan(
        execute_all_batches=execute_all_batches,
        clear_data_dist_inputs=clear_data_dist_inputs,
        name="TrainPipelineSparseDistCompAutograd",
    )


def default_plans() -> dict[str, PipelinePlan]:
    """The default plan of each of the 11 upstream pipelines (semi-sync: its semi-sync phase)."""
    return {
        "TrainPipelineBase": train_pipeline_base_plan(),
        "TrainPipelinePT2": pt2_plan(),
        "TrainPipelineSparseDist": sparse_dist_plan(),
        "TrainPipelineSparseDistLite": sparse_dist_lite_plan(),
        "TrainPipelineFusedSparseDist": fused_sparse_dist_plan(),
        "TrainPipelineSemiSync": semi_sync_plan(),
        "PrefetchTrainPipelineSparseDist": prefetch_sparse_dist_plan(),
        "EvalPipelineSparseDist": eval_sparse_dist_plan(),
        "EvalPipelineFusedSparseDist": eval_fused_sparse_dist_plan(),
        "StagedTrainPipeline": staged_plan(["data_copy", "gpu_postproc"], ["memcpy", "postproc"]),
        "TrainPipelineSparseDistCompAutograd": comp_autograd_plan(),
    }
