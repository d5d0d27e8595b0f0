"""The schedules of TorchRec's training pipelines (1.8 and 1.9, PEC included), as plans: pure data.

Each pipeline's plan is one table in the plan text form (``torchrec_swp.plan.text_words``): rows in
fire order (the CPU submission order within an internal iteration) with stage, stream, thread,
comm group, guard (``when``), reads and writes, then the explicit dependencies. A function per
pipeline takes the constructor options that change the schedule and applies the option edits,
each written once below (``_stopping``, ``_h2d_after_forward``, ``_h2d_on``, ``_clearing_data_dist_inputs``).
The transforms any of these plans may take afterwards (``with_parallel_loads``, ``with_lookahead``,
``with_input_dist_group``) are in ``torchrec_swp.catalog.transforms``.

Task names are those of the design tables kept in ``tests/golden/design_tables/``. Where such a table
and upstream's real ``progress()`` disagree, the plan follows upstream and says so in a comment
marked ``UPSTREAM:``.

Comm groups: every task that issues a collective on the model's process group is in comm group
``world`` (the design tables mark only InputDistStart; upstream's InputDistWait launches the tensor
all-to-all, Forward the embedding output dist, Backward its gradient all-to-all and DDP's
all-reduce). On one thread this changes nothing; once a thread_map spreads them over threads,
the turnstile keeps every rank issuing them in fire order.

The first input dist of an epoch is upstream's ``_init_pipelined_modules`` (it rewrites the model
the first time, then sets the module context and starts the input dist), every later one
``start_sparse_data_dist``: two tasks, InitPipelinedModules (``when=first``) and InputDistStart
(``when=not_first``). Forward, Backward and OptimizerStep are anchors (the training step
itself): the auto-scheduler keeps them on the default stream at the highest stage.

Effects (``PipelineTask.effects``, ``torchrec_swp.plan.effects``): what each task changes outside
its batch's slot, which the engine captures and restores to undo a step that went non-finite.
They are declared by task name, once, in ``EFFECTS`` (the tables leave the ``effects`` column out:
rows of nine cells, which the text form reads as declaring none, and ``_table`` declares each
task's from ``EFFECTS``), so that a task has the same effects in every pipeline whose function
for it is the same; where a pipeline's function does more, its plan function adds what it does
(``_declaring``: TrainPipelineBase's WaitBatch, PT2's Forward, the stashing pipelines' Forward and
Backward). Moving data declares nothing: H2D (and Enqueue) advance upstream's ``_batch_count`` and
context index, but those number the batches drawn, not the steps trained (a step undone does not
undraw its batch), and they run batches ahead of the step. ZeroGrad declares none: it clears the
gradients the previous step consumed, which a rolled-back step leaves cleared. Eval pipelines forward
only and declare nothing.
"""

from __future__ import annotations

import dataclasses
import sys

from torchrec_swp import drop_ins
from torchrec_swp.catalog.transforms import FETCH, with_parallel_loads
from torchrec_swp.plan import MAIN_THREAD, Dep, PhasedPlan, PipelinePlan, PipelineTask, TaskSchedule, When
from torchrec_swp.plan.threads import IO_THREAD

WORLD = "world"

FUSED_BACKWARD = ("fused_rows", "dense_grads")
DENSE_STEP = ("dense_params", "dense_optim")

#: What each task changes outside its batch's slot (module docstring), by task name; a task not
#: named here changes nothing but its slot (``_table`` declares these; ``_declaring`` adds more).
EFFECTS: dict[str, tuple[str, ...]] = {
    # ZeroGrad (the optimizer's zero_grad()) declares none: it clears the gradients the previous
    # step's optimizer consumed, a rolled-back step leaves them cleared as the next step would, and
    # restoring them would carry one accumulation window's gradients into the next. The dense
    # gradients are captured before Backward, after the clear.
    # the backward: the dense gradients accumulate, and the fused TBE (optimizer in backward) updates
    # the rows the batch's ids touch and their optimizer state. SparseDist's also runs the 2D
    # (DMPCollection) sync of every replica's embeddings and fused optimizer state every N batches:
    # all rows, not only the batch's. SemiSync's sparse modules are detached (their backward is
    # EmbBackward), but a module the model rewrite could not pipeline still updates its rows here.
    "Backward": FUSED_BACKWARD,
    "OptimizerStep": DENSE_STEP,
    # BwdOpt: the dense optimizer steps in a hook inside the backward
    "BackwardOptimizerStep": (*FUSED_BACKWARD, *DENSE_STEP),
    # SemiSync: the embeddings' backward, the fused TBE updating the rows (and the 2D sync, as Backward)
    "EmbBackward": ("fused_rows",),
    # SemiSync's stash_gradients: the gradients just computed kept for the next step, the stashed
    # ones of the previous batch put in .grad
    "GradSwap": ("dense_grads", "stashed_grads"),
    # the prefetch of a batch's rows into the embedding caches (UVM caching)
    "EmbPrefetch": ("emb_cache",),
    "PrefetchNext": ("emb_cache",),
    # PEC: the gradient all-to-all's awaitable applies the gradient to the TBE when waited (re-lookup
    # with the fused optimizer). NolGradApply(N) applies batch N-1's NOL gradient (deferred one
    # step: rows of N-1's NOL ids); DeferNolGradLast applies the last batch's at once. The *Start
    # tasks only start the all-to-alls; OlGradStart's batch's NOL gradient, made by its backward,
    # is stashed for the next step (undone by not handing it on).
    "OlGradStart": ("stashed_grads",),
    "OlGradApply": ("fused_rows",),
    "NolGradApply": ("fused_rows",),
    "DeferNolGradLast": ("fused_rows",),
    # OptStash: the optimizer state restored to the device (RestoreWait ends the restore that
    # Backward's hook started) and stashed off it after the step
    "RestoreWait": ("stashed_state",),
    "StashOptimizerState": ("stashed_state",),
    # PrefetchEMS: the stashed embedding weights brought back (same values: their rows are
    # Backward's) and the EMO caches re-allocated and refilled with the batch's rows
    "RestoreEmbeddings": ("stashed_state", "emb_cache"),
    # StagedTrainPipeline: upstream's step count (_num_steps, in its logs), the highest stage
    "Emit": ("counters",),
}


def _task(name: str, **fields: object) -> PipelineTask:
    """Task ``name`` declaring its effects (``EFFECTS``)."""
    # (the ignore below: names and values checked by the constructor (a guard given by name))
    return PipelineTask(name, effects=EFFECTS.get(name, ()), **fields)  # type: ignore[arg-type]


def _table(text: str) -> PipelinePlan:
    """The plan of a table, each task declaring its effects (``EFFECTS``)."""
    plan = PipelinePlan.from_text(text)
    declared = [dataclasses.replace(io, effects=EFFECTS.get(io.name, ())) for io in plan.tasks.values()]
    return plan.replace(tasks=declared)


def _declaring(plan: PipelinePlan, task: str, *effects: str) -> PipelinePlan:
    """``plan`` whose ``task`` also declares ``effects`` (where this pipeline's function for it does more)."""
    io = plan.tasks[task]
    more = dataclasses.replace(io, effects=(*io.effects, *(e for e in effects if e not in io.effects)))
    return plan.replace(tasks=[more if t.name == task else t for t in plan.tasks.values()])


# ----------------------------------------------------------------- option edits, written once
def _stopping(plan: PipelinePlan, execute_all_batches: bool) -> PipelinePlan:
    """``execute_all_batches=False``: stop at the first missing batch instead of draining."""
    return plan if execute_all_batches else plan.replace(on_exhausted="stop")


def _h2d_after_forward(plan: PipelinePlan, enqueue_batch_after_forward: bool) -> PipelinePlan:
    """``enqueue_batch_after_forward``: the copy of batch i+2 fires after Forward(i)."""
    return plan.moved("H2D", after="Forward") if enqueue_batch_after_forward else plan


def _h2d_on(plan: PipelinePlan, thread: str) -> PipelinePlan:
    """``h2d_thread``: the thread group the H2D copy runs on (the pipelines give ``async_inplace_copy``'s
    in-place copy a thread of its own, as upstream's background copy thread)."""
    return plan if thread == plan.task("H2D").thread_group else plan.with_schedule("H2D", thread_group=thread)


def _clearing_data_dist_inputs(plan: PipelinePlan, clear: bool, *, after: str | None = "WaitBatch") -> PipelinePlan:
    """``clear_data_dist_inputs``: free the input-dist inputs of the batch being trained early,
    right after ``after`` (first in the iteration when None), on the data_dist stream."""
    if not clear:
        return plan
    stage = plan.max_stage
    io = _task("ClearDataDistInputs", reads=("context",), doc="free input-dist inputs early")
    deps = [("ClearDataDistInputs", after)] if after is not None else []
    plan = plan.with_task(io, TaskSchedule(stage, "data_dist"), after=after, deps=deps)
    if "InputDistWait" not in plan.schedule or "Forward" not in plan.schedule:
        return plan
    # With this option upstream finishes the input dist (dist_init) on the compute stream, in
    # Forward, reading all-to-all outputs allocated on data_dist that it frees there with no
    # record_stream. The next batch's InputDistWait allocates on data_dist: it waits for Forward
    # (the CPU stream checker found the early free; docs/gpu_check.md).
    # the Forward of the same internal iteration (one earlier if it fires after InputDistWait)
    distance = plan.schedule["Forward"].stage - plan.schedule["InputDistWait"].stage
    if plan.fire_order.index("Forward") > plan.fire_order.index("InputDistWait"):
        distance += 1
    inter = [*plan.inter_iter_deps, Dep("InputDistWait", "Forward", distance)]
    return plan.replace(inter_iter_deps=inter)


def _without_optimizer_step(plan: PipelinePlan, *, after: str) -> PipelinePlan:
    """``plan`` without OptimizerStep (and its dependencies): ZeroGrad follows ``after``, and the
    next Forward follows ZeroGrad as before."""
    schedule = {t: s for t, s in plan.schedule.items() if t != "OptimizerStep"}
    kept = [d for d in plan.explicit_deps if "OptimizerStep" not in (d.consumer, d.producer)]
    return plan.replace(
        schedule=schedule,
        intra_iter_deps=[d for d in kept if d.distance == 0] + [("ZeroGrad", after)],
        inter_iter_deps=[d for d in kept if d.distance != 0],
    )


# ------------------------------------------------------------------------------- the tables
BASE = """
# UPSTREAM: the design table (tests/golden/design_tables) has one H2D task. Upstream's progress()
# pulls batch i+1 from the dataloader first (_next_batch, before zero_grad) and copies it to the
# device only after backward (_copy_batch_to_gpu): two stage-0 tasks, LoadBatch (the source) and
# H2D. A copy to the device the batch is already on is skipped there (compiled as an alias). No
# deque, so no Dequeue task.
plan TrainPipelineBase
depth 2
source LoadBatch
output output
exhausted drain
#    task           stage  stream   thread   comm   when  reads       writes         flags
task LoadBatch      0      default  default  -      -     -           host_batch     -
task ZeroGrad       1      default  default  -      -     -           -              -
task WaitBatch      1      default  default  -      -     batch       -              -
task Forward        1      default  default  world  -     batch       losses,output  anchor
task Backward       1      default  default  world  -     losses      -              anchor
task H2D            0      memcpy   default  -      -     host_batch  batch          noop_on=cpu
task OptimizerStep  1      default  default  -      -     -           -              anchor
dep WaitBatch <- ZeroGrad
dep Forward <- WaitBatch
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""

PT2 = """
# No pipelining: every task on the default stream for the same batch. The compile step is a
# phase of its own (pt2_phases), with a Compile task right before Forward.
# UPSTREAM: the model is compiled in the 4th progress() call (_iter == compile_on_iter with
# _iter counting from 0), not the 3rd as the design table says; upstream does it inside forward.
plan TrainPipelinePT2
depth 1
source LoadBatch
output output
exhausted drain
#    task            stage  stream   thread   comm   when  reads        writes         flags
task LoadBatch       0      default  default  -      -     -            host_batch     -
task H2D             0      default  default  -      -     host_batch   batch          noop_on=cpu
task InputTransform  0      default  default  -      -     batch        model_input    -
task ZeroGrad        0      default  default  -      -     -            -              -
task Forward         0      default  default  world  -     model_input  losses,output  anchor
task Backward        0      default  default  world  -     losses       -              anchor
task OptimizerStep   0      default  default  -      -     -            -              anchor
dep ZeroGrad <- InputTransform
dep Forward <- ZeroGrad
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""

SPARSE_DIST = """
# H2D(i+2) || InputDist(i+1) || forward/backward/optimizer(i).
# UPSTREAM: the design table omits the bookkeeping at the end of progress(); upstream pops the trained
# batch with dequeue_batch(), the Dequeue task.
plan TrainPipelineSparseDist
depth 3
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads           writes         flags
task ZeroGrad              2      default    default  -      -          -               -              -
task WaitBatch             2      default    default  -      -          batch,context   -              -
task InitPipelinedModules  1      data_dist  default  world  first      batch,context   -              -
task InputDistStart        1      data_dist  default  world  not_first  batch,context   -              -
task H2D                   0      memcpy     default  -      -          -               batch,context  -
task Forward               2      default    default  world  -          batch,context   losses,output  anchor
task InputDistWait         1      data_dist  default  world  -          context         -              -
task Backward              2      default    default  world  -          losses,context  -              anchor
task OptimizerStep         2      default    default  -      -          context         -              anchor
task Dequeue               2      default    default  -      -          context         -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep WaitBatch <- InputDistWait
dep Forward <- InputDistWait
dep WaitBatch <- ZeroGrad
dep Forward <- WaitBatch
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Dequeue <- OptimizerStep
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""

SPARSE_DIST_LITE = """
# Only H2D overlaps; the input dist runs on the default stream in the critical path (upstream
# sets _data_dist_stream = None) and is upstream's _init_pipelined_modules for every batch.
plan TrainPipelineSparseDistLite
depth 2
source H2D
output output
exhausted drain
#    task                  stage  stream   thread   comm   when  reads           writes         flags
task ZeroGrad              1      default  default  -      -     -               -              -
task WaitBatch             1      default  default  -      -     batch,context   -              -
task InitPipelinedModules  1      default  default  world  -     batch,context   -              -
task InputDistWait         1      default  default  world  -     context         -              -
task Forward               1      default  default  world  -     batch,context   losses,output  anchor
task Backward              1      default  default  world  -     losses,context  -              anchor
task H2D                   0      memcpy   default  -      -     -               batch,context  -
task OptimizerStep         1      default  default  -      -     context         -              anchor
task Dequeue               1      default  default  -      -     context         -              -
dep WaitBatch <- ZeroGrad
dep InitPipelinedModules <- WaitBatch
dep InputDistWait <- InitPipelinedModules
dep Forward <- InputDistWait
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Dequeue <- OptimizerStep
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""

FUSED_SPARSE_DIST = """
# EmbLookup(i) on its own stream first in progress(), overlapping the tail of the previous
# optimizer step; H2D(i+2) and InputDist(i+1) as in TrainPipelineSparseDist. The fused TBE
# updates embeddings in backward: the next lookup follows it (EmbLookup <- Backward @1).
# UPSTREAM: the design table names the lookup's stream emb_lookup whatever the option; with the default
# option upstream submits it to data_dist. Upstream's forward waits for data_dist, not the lookup.
plan TrainPipelineFusedSparseDist
depth 3
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads           writes         flags
task EmbLookup             2      data_dist  default  world  -          batch,context   -              -
task ZeroGrad              2      default    default  -      -          -               -              -
task WaitBatch             2      default    default  -      -          batch,context   -              -
task InitPipelinedModules  1      data_dist  default  world  first      batch,context   -              -
task InputDistStart        1      data_dist  default  world  not_first  batch,context   -              -
task H2D                   0      memcpy     default  -      -          -               batch,context  -
task Forward               2      default    default  world  -          batch,context   losses,output  anchor
task InputDistWait         1      data_dist  default  world  -          context         -              -
task Backward              2      default    default  world  -          losses,context  -              anchor
task OptimizerStep         2      default    default  -      -          context         -              anchor
task Dequeue               2      default    default  -      -          context         -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep EmbLookup <- InputDistWait
dep WaitBatch <- ZeroGrad
dep Forward <- EmbLookup
dep Forward <- WaitBatch
dep Dequeue <- Forward
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Dequeue <- OptimizerStep
dep EmbLookup <- Backward @1
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""

SEMI_SYNC = """
# H2D(i+3) -> InputDist(i+2) -> EmbLookup(i+1) -> forward/backward/optimizer(i), semi-sync phase:
# EmbLookup(i+1) is issued before Backward(i): its embeddings see updates up to batch i-1 (a dep
# on EmbBackward @2, and EmbBackward(i) after it), and its all-to-all overlaps batch i's backward.
# GradSwap (stash_gradients) is added by the plan function.
# UPSTREAM: the design table lists the tasks stage by stage. Upstream's real order starts with
# InputDistStart(i+2), pops batch i right after Forward(i) (Dequeue) and zeroes gradients last.
plan TrainPipelineSemiSync_semi_sync
depth 4
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads           writes         flags
task InitPipelinedModules  1      data_dist  default  world  first      batch,context   -              -
task InputDistStart        1      data_dist  default  world  not_first  batch,context   -              -
task Forward               3      default    default  world  -          batch,context   losses,output  anchor
task Dequeue               3      default    default  -      -          context         -              -
task H2D                   0      memcpy     default  -      -          -               batch,context  -
task EmbLookup             2      default    default  world  -          batch,context   -              -
task InputDistWait         1      data_dist  default  world  -          context         -              -
task Backward              3      default    default  world  -          losses,context  -              anchor
task EmbBackward           3      default    default  world  -          context         -              -
task OptimizerStep         3      default    default  -      -          context         -              anchor
task ZeroGrad              3      default    default  -      -          -               -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep EmbLookup <- InputDistWait
dep Forward <- EmbLookup
dep Dequeue <- Forward
dep Backward <- Forward
dep EmbBackward <- Backward
dep OptimizerStep <- EmbBackward
dep ZeroGrad <- OptimizerStep
dep Forward <- ZeroGrad @1
dep Forward <- OptimizerStep @1
dep EmbLookup <- EmbBackward @2
# EmbLookup(i+1) reads the tables EmbBackward(i) updates, both on the default stream: issued
# before it (upstream's order), on whatever threads they run
dep EmbBackward <- EmbLookup @-1
"""

SEMI_SYNC_SYNC_PHASE = """
# The sync phase of TrainPipelineSemiSync (batches before start_batch): EmbLookup(i+1) after the
# optimizer of batch i and a device-wide synchronize() when batch i+1 exists: its embeddings
# see batch i's update (a dep on EmbBackward @1).
plan TrainPipelineSemiSync_sync
depth 4
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads           writes         flags
task InitPipelinedModules  1      data_dist  default  world  first      batch,context   -              -
task InputDistStart        1      data_dist  default  world  not_first  batch,context   -              -
task Forward               3      default    default  world  -          batch,context   losses,output  anchor
task Dequeue               3      default    default  -      -          context         -              -
task H2D                   0      memcpy     default  -      -          -               batch,context  -
task InputDistWait         1      data_dist  default  world  -          context         -              -
task Backward              3      default    default  world  -          losses,context  -              anchor
task EmbBackward           3      default    default  world  -          context         -              -
task OptimizerStep         3      default    default  -      -          context         -              anchor
task ZeroGrad              3      default    default  -      -          -               -              -
task Synchronize           3      default    default  -      has_next   -               -              -
task EmbLookup             2      default    default  world  -          batch,context   -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep EmbLookup <- InputDistWait
dep Forward <- EmbLookup
dep Dequeue <- Forward
dep Backward <- Forward
dep EmbBackward <- Backward
dep OptimizerStep <- EmbBackward
dep ZeroGrad <- OptimizerStep
dep Synchronize <- ZeroGrad
dep Forward <- ZeroGrad @1
dep Forward <- OptimizerStep @1
dep EmbLookup <- EmbBackward @1
dep EmbLookup <- Synchronize @1
"""

PREFETCH_SPARSE_DIST = """
# H2D and InputDistStart(i+2), InputDistWait and the embedding cache prefetch (i+1) on a
# prefetch stream, forward/backward/optimizer (i). EmbPrefetch(i+1) refills the cache Forward(i)
# reads from (EmbPrefetch <- Forward @1).
# NOT UPSTREAM (TorchRec PR #4191, open): InputDistStart(i+2) follows EmbPrefetch(i+1)
# (InputDistStart <- EmbPrefetch @1, the last dep): the data_dist stream waits for the prefetch
# stream before the next input dist, as the PR's data_dist_stream.wait_stream(prefetch_stream)
# (see prefetch_sparse_dist_plan).
# UPSTREAM: the design table says this pipeline uses the deprecated _batch_i/_ip1/_ip2 window; since 1.8
# it uses the batches/contexts deques and pops with dequeue_batch() (the Dequeue task). With
# execute_all_batches=False upstream refills on every call and drops the last four batches; the
# plan stops at the first missing batch, like TrainPipelineSparseDist.
plan PrefetchTrainPipelineSparseDist
depth 3
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads           writes         flags
task ZeroGrad              2      default    default  -      -          -               -              -
task WaitBatch             2      default    default  -      -          batch,context   -              -
task H2D                   0      memcpy     default  -      -          -               batch,context  -
task InputDistWait         1      data_dist  default  world  -          context         -              -
task Forward               2      default    default  world  -          batch,context   losses,output  anchor
task EmbPrefetch           1      prefetch   default  -      -          context         -              -
task Backward              2      default    default  world  -          losses,context  -              anchor
task OptimizerStep         2      default    default  -      -          context         -              anchor
task InitPipelinedModules  0      data_dist  default  world  first      batch,context   -              -
task InputDistStart        0      data_dist  default  world  not_first  batch,context   -              -
task Dequeue               2      default    default  -      -          context         -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep EmbPrefetch <- InputDistWait
dep WaitBatch <- EmbPrefetch
dep WaitBatch <- ZeroGrad
dep Forward <- WaitBatch
dep Backward <- Forward
dep OptimizerStep <- Backward
dep Dequeue <- OptimizerStep
dep EmbPrefetch <- Forward @1
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
dep InputDistStart <- EmbPrefetch @1
"""

EVAL_SPARSE_DIST = """
# A background thread copies batch i+2 while the calling thread runs input dist (i+1) and
# forward (i): thread io, the one name of a thread that loads or copies the next batch.
# UPSTREAM: the design table draws two stages with input dist in the forward stage and says pipelined
# modules are re-initialised on every call. Upstream starts the input dist of batch i+1 in the
# call that forwards batch i, so there are three stages (depth 3), and initialises the pipelined
# modules only on the first call. It also starts batch 0's input dist twice; the plan, once.
plan EvalPipelineSparseDist
depth 3
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads          writes         flags
task H2D                   0      memcpy     io       -      -          -              batch,context  -
task WaitBatch             2      default    default  -      -          batch,context  -              -
task InitPipelinedModules  1      data_dist  default  world  first      batch,context  -              -
task InputDistStart        1      data_dist  default  world  not_first  batch,context  -              -
task Forward               2      default    default  world  -          batch,context  losses,output  anchor
task InputDistWait         1      data_dist  default  world  -          context        -              -
task Dequeue               2      default    default  -      -          context        -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep WaitBatch <- InputDistWait
dep Forward <- WaitBatch
dep Dequeue <- Forward
"""


PEC = """
# TrainPipelinePEC (TorchRec 1.9): compute-ahead pipeline for PEC embedding collections. Batch N
# trains while N+1's overlap with N is detected (OverlapDist, mask all-to-alls on data_dist) and
# its non-overlapping (NOL) embeddings are computed ahead on stale weights (NolCompute), and
# N+2 is copied and its input dist started. N's overlapping (OL) embeddings and the non-PEC
# modules' lookups run first in the step (fresh weights). Gradients: OL applied in the same step,
# NOL deferred one batch (DeferNolGrad hands N's to N+1, whose step starts and applies them).
# The last batch of an epoch has no successor: OverlapDistLast computes its backward partition
# alone, and DeferNolGradLast applies its NOL gradient at once. The embedding tables are shared
# state: N+1's NOL lookups follow the application of N-1's NOL gradient and precede N's OL
# gradient (upstream's order, kept by deps whatever the thread map).
# UPSTREAM: progress() numbers these #1-#14; fill_pipeline() is the first two internal iterations.
plan TrainPipelinePEC
depth 3
source H2D
output output
exhausted drain
#    task                  stage  stream     thread   comm   when       reads              writes         flags
task SetModuleContext      2      default    default  -      -          context            -              -
task H2D                   0      memcpy     default  -      -          -                  batch,context  -
task OlCompute             2      default    default  world  -          context            -              -
task EmbLookup             2      default    default  world  -          context            -              -
task OverlapDist           1      data_dist  default  world  -          context,context@1  -              -
task OverlapDistLast       2      data_dist  default  world  last       context            -              -
task InitPipelinedModules  0      data_dist  default  world  first      batch,context      -              -
task InputDistStart        0      data_dist  default  world  not_first  batch,context      -              -
task NolGradStart          2      default    default  world  -          context            nol_grad       -
task RecordBatch           2      default    default  -      -          batch              -              -
task ZeroGrad              2      default    default  -      -          -                  -              -
task Forward               2      default    default  world  -          batch              losses,output  anchor
task InputDistWait         0      data_dist  default  world  -          context            -              -
task NolGradApply          2      default    default  -      -          nol_grad           -              -
task NolCompute            1      default    default  world  -          context            -              -
task Backward              2      default    default  world  -          losses             -              anchor
task WaitOverlapDist       2      default    default  -      last       -                  -              -
task OlGradStart           2      default    default  world  -          context            ol_grad        -
task OptimizerStep         2      default    default  -      -          -                  -              anchor
task OlGradApply           2      default    default  -      -          ol_grad            -              -
task DeferNolGrad          1      default    default  -      not_first  context,context@1  -              -
task DeferNolGradLast      2      default    default  world  last       context            -              -
task Dequeue               2      default    default  -      -          context            -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep OverlapDist <- InputDistWait
dep EmbLookup <- InputDistWait
dep NolCompute <- OverlapDist
dep OlCompute <- OverlapDist
dep OverlapDistLast <- OverlapDist
dep DeferNolGrad <- OverlapDist
dep NolGradStart <- DeferNolGrad
dep Forward <- SetModuleContext
dep Forward <- ZeroGrad
dep Forward <- OlCompute
dep Forward <- EmbLookup
dep Forward <- NolCompute
# Forward(N) merges with N's backward partition (upstream's PECPipelinedForward reads it) and
# Backward(N) splits the gradient with its permutes: it comes after the task that made them on
# data_dist, on the host and on the device - OverlapDist(N+1), or OverlapDistLast(N) for the last
# batch (under a thread map that splits them, nothing else orders them)
dep Forward <- OverlapDistLast
dep Forward <- OverlapDist @-1
# N's OL and NOL lookups share the TBE (its bounds-check warning buffer): NOL first, as upstream
dep OlCompute <- NolCompute
dep RecordBatch <- SetModuleContext
dep NolGradApply <- Forward
dep WaitOverlapDist <- Backward
# the wait is on the event OverlapDistLast records: under a thread map that splits them, it must come after it
dep WaitOverlapDist <- OverlapDistLast
dep OlGradStart <- Backward
dep OlGradStart <- WaitOverlapDist
dep OlGradStart <- OverlapDistLast
dep OptimizerStep <- OlGradStart
dep OlGradApply <- OptimizerStep
dep DeferNolGradLast <- OlGradApply
dep DeferNolGradLast <- NolGradApply
dep Dequeue <- DeferNolGradLast
dep Dequeue <- OlGradApply
dep Dequeue <- NolGradApply
dep NolGradApply <- OlCompute
dep OverlapDist <- OverlapDist @1
dep DeferNolGrad <- OlGradApply @1
dep NolCompute <- NolGradApply @1
dep OlGradApply <- NolCompute @-1
dep OlGradStart <- OverlapDist @-1
dep EmbLookup <- Backward @1
dep OlCompute <- OlGradApply @1
dep Forward <- OptimizerStep @1
dep ZeroGrad <- OptimizerStep @1
"""


# ------------------------------------------- TorchRec's experimental_pipelines.py (1.8 and 1.9)
SPARSE_DIST_BWD_OPT = """
# TrainPipelineSparseDist without an optimizer step of its own: the step runs inside backward,
# in a hook on the gradient of site_fqn's output dist (upstream's register_backward_hook, set
# when the model is rewritten), so that it overlaps the rest of backward's all-to-alls. One
# task, BackwardOptimizerStep, is both; the next batch's ZeroGrad and Forward follow it.
plan TrainPipelineSparseDistBwdOpt
depth 3
source H2D
output output
exhausted drain
#    task                   stage  stream     thread   comm   when       reads           writes         flags
task ZeroGrad               2      default    default  -      -          -               -              -
task WaitBatch              2      default    default  -      -          batch,context   -              -
task InitPipelinedModules   1      data_dist  default  world  first      batch,context   -              -
task InputDistStart         1      data_dist  default  world  not_first  batch,context   -              -
task H2D                    0      memcpy     default  -      -          -               batch,context  -
task Forward                2      default    default  world  -          batch,context   losses,output  anchor
task InputDistWait          1      data_dist  default  world  -          context         -              -
task BackwardOptimizerStep  2      default    default  world  -          losses,context  -              anchor
task Dequeue                2      default    default  -      -          context         -              -
dep InputDistWait <- InitPipelinedModules
dep InputDistWait <- InputDistStart
dep WaitBatch <- InputDistWait
dep Forward <- InputDistWait
dep WaitBatch <- ZeroGrad
dep Forward <- WaitBatch
dep BackwardOptimizerStep <- Forward
dep Dequeue <- BackwardOptimizerStep
dep Forward <- BackwardOptimizerStep @1
dep ZeroGrad <- BackwardOptimizerStep @1
"""


EVAL_CPU_SPARSE = """
# EvalPipelineCPUSparse (TorchRec's experimental, pipeline_depth=2): evaluation with the sparse
# part on the CPU (data-parallel tables: no collectives) and the dense part on the device.
# LoadBatch(i+2) draws the batch, Enqueue(i+2) makes its context; SparseForward(i+2) runs its input dist,
# lookups and output dist on the CPU and copies the embeddings into pinned buffers (the first
# batch of an epoch: InitPipelinedModules, the model rewrite and bootstrap input dist first);
# CopyToDevice(i+1) copies the dense features and the embeddings to the device on memcpy, after
# DenseForward(i) (upstream's wait_stream); DenseForward(i) runs the model under no_grad with the
# copied embeddings. With multi_thread the sparse work runs on thread ``sparse`` and
# DenseForward(i) waits for SparseForward(i+1), as upstream waits for its future.
plan EvalPipelineCPUSparse
depth 3
source LoadBatch
output output
exhausted drain
#    task                  stage  stream   thread   comm   when       reads          writes        flags
task DenseForward          2      default  default  world  -          batch,context  output        anchor
task CopyToDevice          1      memcpy   default  -      -          host,context   batch         -
task Dequeue               2      default  default  -      -          context        -             -
task LoadBatch             0      default  default  -      -          -              host_batch    -
task Enqueue               0      default  default  -      -          host_batch     host,context  -
task InitPipelinedModules  0      default  default  -      first      host,context   -            -
task SparseForward         0      default  default  -      not_first  host,context   -            -
dep CopyToDevice <- InitPipelinedModules
dep CopyToDevice <- SparseForward
dep Dequeue <- DenseForward
dep CopyToDevice <- DenseForward @1
dep DenseForward <- SparseForward @-1
# the embeddings' host buffers are one per module: i+1's sparse work writes them after i's copy read them
dep SparseForward <- CopyToDevice @1
"""


# ------------------------------------------------------------------------ plans by options
def train_pipeline_base_plan() -> PipelinePlan:
    """TrainPipelineBase: H2D of batch i+1 overlaps the optimizer of batch i."""
    # its WaitBatch counts the progress() calls (upstream's _batch_count, in its logs), at the step's stage
    return _declaring(_table(BASE), "WaitBatch", "counters")


def pt2_plan(*, compile_step: bool = False) -> PipelinePlan:
    """TrainPipelinePT2's step (``PT2``); with ``compile_step`` the step that compiles the
    model: a Compile task right before Forward (upstream compiles at the start of forward)."""
    # Forward counts the forwards (upstream's _iter, which decides the compile of a plan without Compile)
    plan = _declaring(_table(PT2), "Forward", "counters")
    if not compile_step:
        return plan
    # compiling changes how the model runs, not what it holds: no effect to undo
    compile_task = _task("Compile", doc="compile the model (compile_configs), with the pre/post-compile hooks")
    plan = plan.with_task(
        compile_task, TaskSchedule(0), after="ZeroGrad", deps=[("Compile", "ZeroGrad"), ("Forward", "Compile")]
    )
    return plan.replace(name="TrainPipelinePT2_compile")


def pt2_phases(*, compile_on_iter: int = 3) -> PhasedPlan:
    """TrainPipelinePT2: the plain step, and the step of forward number ``compile_on_iter`` (from
    0, over the pipeline's life) that compiles the model first: a phase of its own, on the
    ``drawn`` clock (upstream's ``_iter`` counts forwards across epochs and reset()). A negative
    ``compile_on_iter`` never compiles, as upstream's."""
    plain = pt2_plan()
    if compile_on_iter < 0:
        return PhasedPlan([(0, plain)], name="TrainPipelinePT2", clock="drawn")
    phases = [(0, plain)] if compile_on_iter > 0 else []
    phases += [(compile_on_iter, pt2_plan(compile_step=True)), (compile_on_iter + 1, plain)]
    return PhasedPlan(phases, name="TrainPipelinePT2", clock="drawn")


def sparse_dist_plan(
    *,
    enqueue_batch_after_forward: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    h2d_thread: str = MAIN_THREAD,
    name: str = "TrainPipelineSparseDist",
) -> PipelinePlan:
    """TrainPipelineSparseDist (``SPARSE_DIST``) with the options that change its schedule."""
    plan = _sparse_dist_options(
        _table(SPARSE_DIST), enqueue_batch_after_forward, execute_all_batches, clear_data_dist_inputs, h2d_thread
    )
    return plan.replace(name=name)


def _sparse_dist_options(
    plan: PipelinePlan,
    enqueue_batch_after_forward: bool,
    execute_all_batches: bool,
    clear_data_dist_inputs: bool,
    h2d_thread: str,
) -> PipelinePlan:
    """TrainPipelineSparseDist's option edits on ``plan`` (SparseDist's table or a variant of it)."""
    plan = _h2d_after_forward(_h2d_on(plan, h2d_thread), enqueue_batch_after_forward)
    plan = _clearing_data_dist_inputs(plan, clear_data_dist_inputs)
    return _stopping(plan, execute_all_batches)


def sparse_dist_lite_plan(*, h2d_thread: str = MAIN_THREAD) -> PipelinePlan:
    """TrainPipelineSparseDistLite: two batches in flight; upstream forces the other options."""
    return _h2d_on(_table(SPARSE_DIST_LITE), h2d_thread)


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
    """TrainPipelineFusedSparseDist (``FUSED_SPARSE_DIST``) with its options.

    ``emb_lookup_stream``: ``"data_dist"`` (upstream's default: the lookup runs on the data_dist
    stream itself), ``"new"`` (a stream of its own, named ``emb_lookup``) or ``"current"`` (the
    default stream). ``embedding_lookup_after_data_dist``: the lookup fires right before Forward.
    ``train=False`` is EvalPipelineFusedSparseDist: no backward or optimizer, H2D before Forward.
    """
    stream = {"data_dist": "data_dist", "new": "emb_lookup", "current": "default"}[emb_lookup_stream]
    plan = _table(FUSED_SPARSE_DIST).with_schedule("EmbLookup", stream=stream)
    if not train:
        schedule = {t: s for t, s in plan.schedule.items() if t not in ("Backward", "OptimizerStep")}
        plan = plan.replace(
            schedule=schedule,
            intra_iter_deps=[
                d for d in plan.explicit_deps if d.distance == 0 and {d.consumer, d.producer} <= set(schedule)
            ],
            inter_iter_deps=[],
        )
    plan = _h2d_after_forward(plan, enqueue_batch_after_forward and train)
    if embedding_lookup_after_data_dist:
        plan = plan.moved("EmbLookup", before="Forward")
    plan = _clearing_data_dist_inputs(plan, clear_data_dist_inputs)
    return _stopping(plan, execute_all_batches).replace(name=name)


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
    stage, right after its InputDistWait (the design tables do not cover this mode).
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
    return plan.replace(
        schedule={**plan.schedule, "EmbLookup": plan.schedule["EmbLookup"].replace(stage=1)}, fire_order=fire
    )


def semi_sync_plan(
    *,
    phase: str = "semi_sync",
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    stash_gradients: bool = False,
) -> PipelinePlan:
    """One phase of TrainPipelineSemiSync: ``"sync"`` (``SEMI_SYNC_SYNC_PHASE``) or
    ``"semi_sync"`` (``SEMI_SYNC``). Same tasks and stages but for Synchronize (sync) and
    GradSwap (semi-sync with ``stash_gradients``: swap the stashed gradients in before the step).
    ``"semi_sync_start"``: the semi-sync step of batch ``start_batch`` with ``stash_gradients``,
    which swaps in the (empty) stash and skips the optimizer step (upstream's
    ``_mlp_optimizer_step``: not every optimizer steps on null gradients): no OptimizerStep, and
    ZeroGrad follows GradSwap.

    UPSTREAM: ``execute_all_batches=False`` stops at the first missing batch; upstream's SemiSync
    copy never raises, so only its in-place copy stops, and otherwise the pipeline passes True.
    ``clear_data_dist_inputs`` adds ClearDataDistInputs(i), upstream's first call in progress().
    """
    match phase:
        case "sync":
            plan = _table(SEMI_SYNC_SYNC_PHASE)
        case "semi_sync" | "semi_sync_start":
            plan = _table(SEMI_SYNC)
            if stash_gradients or phase == "semi_sync_start":
                swap = _task("GradSwap", doc="swap the stashed gradients in (stash_gradients)")
                plan = plan.with_task(
                    swap,
                    TaskSchedule(3),
                    after="EmbBackward",
                    deps=[("GradSwap", "EmbBackward"), ("OptimizerStep", "GradSwap")],
                )
            if phase == "semi_sync_start":
                plan = _without_optimizer_step(plan, after="GradSwap").replace(
                    name="TrainPipelineSemiSync_semi_sync_start"
                )
        case _:
            raise ValueError(f"phase must be 'sync', 'semi_sync' or 'semi_sync_start', got {phase!r}")
    plan = _clearing_data_dist_inputs(plan, clear_data_dist_inputs, after=None)
    return _stopping(plan, execute_all_batches)


def semi_sync_phases(
    *,
    start_batch: int,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    stash_gradients: bool = False,
) -> PhasedPlan:
    """TrainPipelineSemiSync: the sync phase for batches before ``start_batch``, then semi-sync
    (upstream decides per progress() call from the index of the batch it forwards). With
    ``stash_gradients`` batch ``start_batch`` itself has a phase of its own, ``semi_sync_start``,
    without the optimizer step (upstream's ``_mlp_optimizer_step`` skips it there)."""
    options = {"execute_all_batches": execute_all_batches, "clear_data_dist_inputs": clear_data_dist_inputs}
    semi = semi_sync_plan(phase="semi_sync", stash_gradients=stash_gradients, **options)
    phases = [] if start_batch <= 0 else [(0, semi_sync_plan(phase="sync", **options))]
    if stash_gradients and start_batch >= 0:
        phases.append((start_batch, semi_sync_plan(phase="semi_sync_start", **options)))
        phases.append((start_batch + 1, semi))
    else:
        phases.append((max(start_batch, 0), semi))
    return PhasedPlan(phases, name="TrainPipelineSemiSync")


def prefetch_sparse_dist_plan(*, execute_all_batches: bool = True, h2d_thread: str = MAIN_THREAD) -> PipelinePlan:
    """PrefetchTrainPipelineSparseDist (``PREFETCH_SPARSE_DIST``), with the prefetch fence of
    TorchRec's open PR #4191, which upstream's release does not have.

    The fence is one dependency, ``dep InputDistStart <- EmbPrefetch @1``: the input dist of
    batch i+2 (``start_sparse_data_dist``, data_dist stream) comes after the prefetch of batch
    i+1 (prefetch stream), in the same internal iteration, both in ``fill_pipeline`` (batch 1
    after batch 0's prefetch) and in ``progress()``, the PR's two call sites. It is already
    upstream's CPU order, so the calls and the numbers stay upstream's; the compiler turns the
    cross-stream dep into ``record EmbPrefetch`` after the prefetch and
    ``stream data_dist <- EmbPrefetch@1`` before InputDistStart (an event wait: the PR's
    ``data_dist_stream.wait_stream(prefetch_stream)``, a device-side order, no host stall), and
    into a CPU ``wait EmbPrefetch`` where a thread map puts the two on different threads. Batch
    0's input dist (InitPipelinedModules) has no prefetch before it and is not fenced, as in the PR.

    Why (the PR reports device-side asserts and NaNs on UVM-caching jobs): upstream leaves the
    data_dist stream unordered with the prefetch stream, which works on the same TBE cache and
    reads the input dist's outputs and module contexts, blocks data_dist allocated. With the wait,
    all later data_dist work, and so any reuse of those blocks by data_dist's allocator, comes
    after the prefetch. The PR's other half, ``record_stream(data_dist_stream)`` of those
    tensors, is no task edit here: they are allocated on data_dist (every one, in the checked CPU
    run), and CUDA's caching allocator ignores ``record_stream`` on a block's own allocation
    stream; the wait is what keeps them alive for the prefetch as far as data_dist is concerned.
    """
    return _stopping(_h2d_on(_table(PREFETCH_SPARSE_DIST), h2d_thread), execute_all_batches)


def eval_sparse_dist_plan(*, clear_data_dist_inputs: bool = False) -> PipelinePlan:
    """EvalPipelineSparseDist (``EVAL_SPARSE_DIST``)."""
    return _clearing_data_dist_inputs(_table(EVAL_SPARSE_DIST), clear_data_dist_inputs)


def staged_plan(
    stage_names: list[str], stage_streams: list[str] | None = None, fill_callbacks: list[bool] | None = None
) -> PipelinePlan:
    """StagedTrainPipeline: N user stages; stage k works on the batch k steps behind stage 0, and
    an Emit task hands the batch that left the last stage to the caller (who runs fwd/bwd/opt).
    A stage with a fill callback has a task ``NAME.fill`` right after it, ``when=fill``.

    UPSTREAM: the design table gives depth N; the batch being returned is one more position, so the
    depth is N + 1. Within a call upstream first pops the batch it returns (``_advance``, the
    Emit task), then runs stage 0 (the newest batch), stage 1, ... stage N-1.
    """
    if not stage_names:
        raise ValueError("StagedTrainPipeline needs at least one stage")
    if len(set(stage_names)) != len(stage_names) or "Emit" in stage_names:
        raise ValueError(f"stage names must be distinct and not 'Emit', got {stage_names}")
    n = len(stage_names)
    streams = stage_streams or ["default"] * n
    fills = fill_callbacks or [False] * n
    schedule = {"Emit": TaskSchedule(n)}
    tasks = [_task("Emit", reads=(f"out_{n - 1}",), writes=("output",))]
    deps = []
    for k, name in enumerate(stage_names):
        schedule[name] = TaskSchedule(k, streams[k])
        # a stage runs the user's code: what it changes is the user's to declare (a plan of their own)
        tasks.append(PipelineTask(name, reads=(f"out_{k - 1}",) if k else (), writes=(f"out_{k}",)))
        if fills[k]:
            # (the ignore below: names and values checked by the constructor (a guard given by name))
            schedule[f"{name}.fill"] = TaskSchedule(k, streams[k], when="fill")  # type: ignore[arg-type]
            tasks.append(PipelineTask(f"{name}.fill", doc=f"fill_callback of stage {k}"))
            deps.append((f"{name}.fill", name))
    return PipelinePlan(
        schedule=schedule,
        intra_iter_deps=deps,
        pipeline_depth=n + 1,
        tasks=tasks,
        source=stage_names[0],
        output="output",
        name="StagedTrainPipeline",
    )


def pec_plan(*, execute_all_batches: bool = True) -> PipelinePlan:
    """TrainPipelinePEC (``PEC``); with ``execute_all_batches=False`` it stops at the first
    missing batch, where upstream's in-place enqueue raises StopIteration mid-step."""
    return _stopping(_table(PEC), execute_all_batches)


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


#: The thread group TrainPipelineSparseDistT copies batches to the device on (upstream's ``_copy_executor``):
#: ``io``, the one name of a thread that loads or copies the next batch (as the ``"io"`` thread map's).
COPY_THREAD = IO_THREAD


def train_eval_hybrid_plan(*, clear_data_dist_inputs: bool = False, h2d_thread: str = MAIN_THREAD) -> PipelinePlan:
    """TrainEvalHybridPipelineBase: TrainPipelineSparseDist's stages (``SPARSE_DIST``), training or
    evaluating as the model's mode says at each ``progress()`` call. ZeroGrad, Backward and
    OptimizerStep run ``when=train``, so a batch stepped in eval mode (``model.eval()``) is only
    forwarded (Forward under ``no_grad``). The draw of batch i+2 is split off H2D and fires first
    in the step (Fetch: upstream's ``_prepare_pipeline_step`` pre-fetches it to the host); H2D
    copies it before Forward. At the end of any data, the eval data's included, the batches in
    flight drain, StopIteration follows, and the next ``progress()`` fills again.
    ``h2d_thread``: as ``sparse_dist_plan``'s (``async_inplace_copy``).

    UPSTREAM: ``enqueue_batch_after_forward`` is accepted and ignored (H2D always before Forward).
    """
    plan = with_parallel_loads(_table(SPARSE_DIST), 1, lookahead=0, thread=MAIN_THREAD).moved(FETCH, before="ZeroGrad")
    for task in ("ZeroGrad", "Backward", "OptimizerStep"):
        plan = plan.with_schedule(task, when=When.TRAIN)
    plan = _clearing_data_dist_inputs(_h2d_on(plan, h2d_thread), clear_data_dist_inputs)
    return plan.replace(name="TrainEvalHybridPipelineBase")


def sparse_dist_t_plan(*, execute_all_batches: bool = True, clear_data_dist_inputs: bool = False) -> PipelinePlan:
    """TrainPipelineSparseDistT: TrainPipelineSparseDist (``SPARSE_DIST``) with the copy of batch i+2
    to the device on a thread of its own (upstream's ``_copy_executor``, here ``COPY_THREAD``): the
    calling thread draws the batch (Fetch, split off H2D) and goes on to Forward(i) while thread
    ``io`` copies it (H2D); InputDistStart(i+2) in the next step waits for the copy, where
    upstream resolves the copy's Future.

    UPSTREAM: ``enqueue_batch_after_forward`` is always False (the constructor does not take it).
    """
    plan = sparse_dist_plan(
        execute_all_batches=execute_all_batches,
        clear_data_dist_inputs=clear_data_dist_inputs,
        name="TrainPipelineSparseDistT",
    )
    plan = with_parallel_loads(plan, 1, lookahead=0, thread=MAIN_THREAD)
    return plan.with_schedule("H2D", thread_group=COPY_THREAD)


def sparse_dist_bwd_opt_plan(
    *, enqueue_batch_after_forward: bool = False, execute_all_batches: bool = True, clear_data_dist_inputs: bool = False
) -> PipelinePlan:
    """TrainPipelineSparseDistBwdOpt (``SPARSE_DIST_BWD_OPT``) with SparseDist's options."""
    plan = _h2d_after_forward(_table(SPARSE_DIST_BWD_OPT), enqueue_batch_after_forward)
    return _stopping(_clearing_data_dist_inputs(plan, clear_data_dist_inputs), execute_all_batches)


# ------------------------------------------------ TorchRec's memory-stashing pipelines (experimental)
#: The stream of a stash's device-to-host copies (its host-to-device ones are on ``memcpy``).
D2H = "d2h"
#: The thread OptStash's stash runs on (upstream's MemoryStashingManager thread).
STASH_THREAD = "stash"


def opt_stash_plan(
    *,
    enqueue_batch_after_forward: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    h2d_thread: str = MAIN_THREAD,
) -> PipelinePlan:
    """TrainPipelineSparseDistOptStash: SparseDist's schedule (with its options), the optimizer
    state stashed off the device after each step and brought back during the next backward.

    StashOptimizerState(i) runs on thread ``stash`` (upstream's background stash thread) in the
    ``d2h`` stream, after OptimizerStep(i); Backward(i+1) waits for it (the restore and the stash
    resize the same storages). The restore starts inside Backward, in the backward hook at the
    output dist of ``site_fqn`` (upstream's injection site); RestoreWait waits for it, and makes
    the compute stream wait for its copies, before OptimizerStep.
    """
    plan = sparse_dist_plan(
        enqueue_batch_after_forward=enqueue_batch_after_forward,
        execute_all_batches=execute_all_batches,
        clear_data_dist_inputs=clear_data_dist_inputs,
        h2d_thread=h2d_thread,
        name="TrainPipelineSparseDistOptStash",
    )
    stage = plan.max_stage
    wait = _task("RestoreWait", doc="wait for the restore started in backward, before the step")
    deps = [("RestoreWait", "Backward"), ("OptimizerStep", "RestoreWait")]
    plan = plan.with_task(wait, TaskSchedule(stage), after="Backward", deps=deps)
    stash = _task("StashOptimizerState", doc="stash the optimizer state off the device after the step")
    plan = plan.with_task(
        stash,
        TaskSchedule(stage, D2H, thread_group=STASH_THREAD),
        after="OptimizerStep",
        deps=[("StashOptimizerState", "OptimizerStep")],
    )
    plan = plan.replace(inter_iter_deps=[*plan.inter_iter_deps, Dep("Backward", "StashOptimizerState", 1)])
    # the hook at site_fqn's output dist starts the restore of the optimizer state inside Backward
    return _declaring(plan, "Backward", "stashed_state")


def emb_stash_plan(
    *,
    enqueue_batch_after_forward: bool = False,
    execute_all_batches: bool = True,
    clear_data_dist_inputs: bool = False,
    h2d_thread: str = MAIN_THREAD,
) -> PipelinePlan:
    """TrainPipelineSparseDistEmbStash: SparseDist's schedule (upstream's ``progress()`` is
    SparseDist's). The embedding weights are stashed by TorchRec's sharded modules right after
    their lookup (inside Forward; MemoryStashingManager, enabled by the pipeline's streams; with
    ``delay_stash`` at ``stash_site_fqn``'s forward, or at ``site_fqn`` in backward) and restored
    inside Backward, by the hook at the injection site ``site_fqn``, before the gradient reaches them.
    """
    plan = sparse_dist_plan(
        enqueue_batch_after_forward=enqueue_batch_after_forward,
        execute_all_batches=execute_all_batches,
        clear_data_dist_inputs=clear_data_dist_inputs,
        h2d_thread=h2d_thread,
        name="TrainPipelineSparseDistEmbStash",
    )
    # the sharded modules stash their weights (and EMO caches) after the lookup, in Forward (with
    # delay_stash in Backward), and the hook at site_fqn restores them in Backward
    return _declaring(_declaring(plan, "Forward", "stashed_state"), "Backward", "stashed_state")


def prefetch_ems_plan(
    *, enqueue_batch_after_forward: bool = False, execute_all_batches: bool = True, h2d_thread: str = MAIN_THREAD
) -> PipelinePlan:
    """TrainPipelinePrefetchEMS: EmbStash's schedule (no ``clear_data_dist_inputs`` upstream), and
    before Backward, in eval mode too, RestoreEmbeddings brings back the stashed embedding
    weights and EMO caches on the compute stream, then PrefetchNext(i+1) prefetches the next
    batch's rows into the embedding caches (after its input dist) for the next Forward. The first
    batch of an epoch is never prefetched (upstream's fill has no step before it).

    UPSTREAM: one call, ``_restore_and_prefetch()``, reading the next batch as
    ``self.contexts[1]``; here two tasks, the prefetch reading its own batch's context.
    """
    plan = emb_stash_plan(
        enqueue_batch_after_forward=enqueue_batch_after_forward,
        execute_all_batches=execute_all_batches,
        h2d_thread=h2d_thread,
    ).replace(name="TrainPipelinePrefetchEMS")
    stage = plan.max_stage
    restore = _task("RestoreEmbeddings", doc="restore stashed embedding weights and EMO caches")
    plan = plan.with_task(
        restore,
        TaskSchedule(stage),
        after="InputDistWait",
        deps=[("RestoreEmbeddings", "Forward"), ("Backward", "RestoreEmbeddings")],
    )
    prefetch = _task("PrefetchNext", reads=("context",), doc="prefetch the next batch into the caches")
    plan = plan.with_task(
        prefetch,
        TaskSchedule(stage - 1, when=When.NOT_FIRST),
        after="RestoreEmbeddings",
        deps=[("PrefetchNext", "InputDistWait")],
    )
    # i+1's prefetch follows i's restore, and i's backward follows i+1's prefetch (upstream's order)
    inter = [Dep("PrefetchNext", "RestoreEmbeddings", 1), Dep("Backward", "PrefetchNext", -1)]
    return plan.replace(inter_iter_deps=[*plan.inter_iter_deps, *inter])


#: The thread EvalPipelineCPUSparse's sparse work runs on with ``multi_thread`` (upstream's executor).
SPARSE_THREAD = "sparse"


def eval_cpu_sparse_plan(
    *, pipeline_depth: int = 2, multi_thread: bool = False, execute_all_batches: bool = True
) -> PipelinePlan:
    """EvalPipelineCPUSparse (``EVAL_CPU_SPARSE``) with the options that change its schedule.

    ``pipeline_depth=1``: the copy to the device follows the sparse work of the same batch, one
    step ahead of its DenseForward (upstream copies inside ``_sparse_forward``), with no wait for
    the previous DenseForward. ``multi_thread``: the sparse work (and with depth 1 the copy) on
    thread ``sparse``; the first batch's stays on the calling thread, as upstream's fill.
    """
    if pipeline_depth not in (1, 2):
        raise ValueError(f"EvalPipelineCPUSparse: pipeline_depth must be 1 or 2, got {pipeline_depth}")
    plan = _table(EVAL_CPU_SPARSE)
    moved: tuple[str, ...] = ("SparseForward",)
    if pipeline_depth == 1:
        schedule = {t: s.replace(stage=max(s.stage - 1, 0)) for t, s in plan.schedule.items()}
        fire = [t for t in plan.fire_order if t != "CopyToDevice"] + ["CopyToDevice"]
        inter = [d for d in plan.inter_iter_deps if d.consumer != "CopyToDevice" and d.consumer != "DenseForward"]
        plan = plan.replace(schedule=schedule, fire_order=fire, pipeline_depth=2, inter_iter_deps=inter)
        moved = ("SparseForward", "CopyToDevice")
    if multi_thread:
        for task in moved:
            plan = plan.with_schedule(task, thread_group=SPARSE_THREAD)
    return _stopping(plan, execute_all_batches)


def default_plans() -> dict[str, PipelinePlan | PhasedPlan]:
    """The default plan of each drop-in (``torchrec_swp.drop_ins``): the 11 pipelines of TorchRec
    1.8, 1.9's TrainPipelinePEC and those of ``experimental_pipelines.py`` (SemiSync: its two
    phases, start_batch 900 as upstream's default)."""
    return {row.name: default_plan(row) for row in drop_ins.drop_ins()}


def default_plan(row: drop_ins.DropIn) -> PipelinePlan | PhasedPlan:
    """The plan ``row``'s catalog function (``row.plan``, in this module) makes with ``row.plan_arguments``."""
    make = getattr(sys.modules[__name__], row.plan, None)
    if make is None:
        raise ValueError(f"{row.name}: torchrec_swp.catalog.torchrec has no plan function {row.plan!r}")
    return make(**row.plan_arguments)


# ------------------------------------------------------------- thread names
#: Every thread group the catalog's plans put tasks on, and the one idea each names
#: (``tests/unit/test_thread_names.py`` holds the catalog to it: a new name needs a new idea).
THREADS = {
    MAIN_THREAD: "the calling thread: progress() runs its tasks itself",
    IO_THREAD: "loads or copies the next batch in the background (the io thread map, SparseDistT's copy, "
    "async_inplace_copy's in-place copy, EvalPipelineSparseDist's loader)",
    "load": "the lanes of parallel loads (load, load.1, ...: with_parallel_loads)",
    STASH_THREAD: "moves OptStash's optimizer state to the host and back",
    SPARSE_THREAD: "EvalPipelineCPUSparse's sparse work with multi_thread",
}
