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
        inter=[("Forward", "OptimizerStep")],
        source="LoadBatch",
        depth=2,
        io={
            "H2D": PipelineTask("H2D", reads=("host_batch",), writes=("batch",)),
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
        inter=[("Forward", "OptimizerStep")],
        source="H2D",
        depth=3,
        on_exhausted="drain" if execute_all_batches else "stop",
    )
