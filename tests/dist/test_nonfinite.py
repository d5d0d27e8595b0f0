"""``on_nonfinite="skip"``: a non-finite step rolled back on every rank, as if its batch had never been seen.

For each pipeline, on 1 and 2 gloo ranks: the run whose batch ``K`` is poisoned (non-finite dense
features: a NaN loss) under ``on_nonfinite="skip"`` ends with the same weights (sharded tables
included), fused and dense optimizer state, and the same loss and output at every other step, bit
for bit, as the run (``on_nonfinite="off"``, which the parity suite holds equal to upstream) whose
data lacks batch ``K``. Likewise with a finite loss and an Inf gradient (a hook multiplies the
dense arch's output gradient by Inf for the marked batch), with batch ``K`` poisoned on rank 1
only (every rank skips that step; the reference drops that step's batch on every rank), and with
``"raise"`` (``NonFiniteStep`` from the step's ``progress()``, naming the batch, then the next).

The tables use row-wise Adagrad (a state per row, and a TBE step counter) and the dense optimizer is
Adagrad (a state per parameter, a step count), so that every kind of captured state matters; the
dense gradients are compared after every step (``dense_grads``: ``Backward`` changes them; after
the rolled-back step they are as its ZeroGrad left them, cleared). ``test_each_capture_is_needed``
removes one effect's capture at a time and shows the run then differs from the reference.

Every case of one world size runs in one pair of rank processes (``_all``), each test checks one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig

from harness.parity import build_model, local_state, make_batches, record_losses
from harness.ranks import run_on_ranks
from torchrec_swp.data import MapSource
from torchrec_swp.engine.transaction import NonFiniteStep
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [pytest.mark.multiprocess, pytest.mark.every_release]

N, K = 10, 4  # batches per rank, the poisoned one
WINDOW_START, WINDOW_END = 3, 5  # with windows of 3, the first and the last micro-batch of the second window
SENTINEL = 7777.0  # a dense feature that marks the batch whose gradient the hook makes Inf
CPU = torch.device("cpu")
EFFECTS = ("fused_rows", "dense_grads", "dense_params", "dense_optim")
NO_COMPILE = TorchCompileConfig(compile_on_iter=-1)


def _synchronous_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
    """DDP's averaging all-reduce, done before it returns (BwdOpt steps inside the backward, which
    would otherwise read gradients gloo's threads are still writing; tests/dist/test_parity_experimental.py)."""
    grads = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(grads)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(grads)
    return done


def _factories(world_size: int = 2) -> dict[str, Callable[..., Any]]:
    import torchrec_swp as swp

    out: dict[str, Callable[..., Any]] = {
        "SparseDist": lambda m, o, **kw: swp.TrainPipelineSparseDist(m, o, CPU, **kw),
        "SparseDist.io_thread": lambda m, o, **kw: swp.TrainPipelineSparseDist(m, o, CPU, thread_map="io", **kw),
        "FusedSparseDist": lambda m, o, **kw: swp.TrainPipelineFusedSparseDist(m, o, CPU, **kw),
        "Prefetch": lambda m, o, **kw: swp.PrefetchTrainPipelineSparseDist(m, o, CPU, **kw),
        "Base": lambda m, o, **kw: swp.TrainPipelineBase(m, o, CPU, **kw),
        # its _iter put back; not compiled here (a rolled-back compile step: tests/unit/test_pt2_compile_step.py)
        "PT2": lambda m, o, **kw: swp.TrainPipelinePT2(m, o, CPU, compile_configs=NO_COMPILE, **kw),
    }
    if installed().release >= (1, 9, 0) and world_size > 1:  # (on 1 rank upstream's hook finds no grad: see below)
        out["BwdOpt"] = lambda m, o, **kw: swp.TrainPipelineSparseDistBwdOpt(m, o, CPU, "sparse.ebc", **kw)
    return out


def _model(rank: int, world_size: int, name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, sgd = build_model(rank, world_size, 0, fused_optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    optimizer = torch.optim.Adagrad([p for g in sgd.param_groups for p in g["params"]], lr=0.1)
    if name == "BwdOpt":
        model._dmp_wrapped_module.register_comm_hook(None, _synchronous_allreduce)
    return model, optimizer


def _inf_gradient_hook(model: torch.nn.Module) -> None:
    """The dense arch's output gradient times Inf for a batch whose first dense feature is SENTINEL."""
    dense = model.module.dense

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if output.requires_grad and float(args[0][0, 0]) == SENTINEL:
            output.register_hook(lambda g: g * math.inf)

    dense.register_forward_hook(hook)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights, the tables' optimizer state rows and step counters, the dense optimizer's state."""
    from torchrec_swp.integrations.torchrec.nonfinite import fused_lookups

    state = local_state(model)
    for k, lookup in enumerate(fused_lookups(model)):
        tbe = lookup.emb_module
        for t, states in enumerate(tbe.split_optimizer_states()):
            for j, s in enumerate(states):
                state[f"fused {k} table {t} state {j}"] = s.detach().clone()
        state[f"fused {k} iter"] = tbe.iter.detach().clone()
    for j, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"dense {j} {key}"] = value.detach().clone()
    return state


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]]


def _run(
    rank: int,
    world_size: int,
    name: str,
    batches: list[Any],
    *,
    inf_hook: bool = False,
    device_selects: bool = False,
    **options: Any,
) -> dict[str, Any]:
    model, optimizer = _model(rank, world_size, name)
    if inf_hook:
        _inf_gradient_hook(model)
    pipeline = _factories()[name](model, optimizer, **options)
    if device_selects:  # the GPU's path on the CPU: every restore a torch.where on the verdict's tensor
        pipeline.engine.transaction.host = False
    outputs: list[Any] = []
    grads: list[list[torch.Tensor | None]] = []
    raised: list[str] = []
    it = MapSource(batches)  # (a loader with a state: the pipeline's state_dict() needs one)
    with record_losses(model) as losses:
        for _ in range(len(batches) + 2):
            try:
                out = pipeline.progress(it)
            except StopIteration:
                break
            except NonFiniteStep as e:  # under "raise": recorded, the run goes on
                raised.append(f"{type(e).__name__}: {e}")
                outputs.append(None)
                grads.append(_grads(optimizer))
                continue
            outputs.append(out.detach().clone() if isinstance(out, torch.Tensor) else out)
            grads.append(_grads(optimizer))
    skipped = [(v.batch, v.what) for v in pipeline.skipped_steps]
    saved = pipeline.state_dict()
    state = _state(model, optimizer)
    for counter in getattr(pipeline, "_swp_counters", ()):  # the pipeline's own (counters)
        state[f"pipeline {counter}"] = torch.tensor(getattr(pipeline, counter))
    pipeline.close()
    if options:  # the count of skipped steps comes back with the state
        again = _factories()[name](model, optimizer, **options)
        again.load_state_dict(saved)
        assert [(v.batch, v.what) for v in again.skipped_steps] == skipped
        again.close()
    return {
        "state": state,
        "losses": [float(x) for x in losses],
        "outputs": outputs,
        "grads": grads,
        "skipped": skipped,
        "raised": raised,
        "saved": saved["nonfinite"],
    }


def _batches(rank: int, world_size: int, *, poison: str | None, ranks: tuple[int, ...] = (0, 1)) -> list[Any]:
    batches = make_batches(rank, world_size, N, 0)
    if poison is None:
        del batches[K]
    elif rank in ranks:
        batches[K].float_features[0, 0] = math.nan if poison == "nan" else SENTINEL
    return batches


def _all(rank: int, world_size: int) -> dict[tuple[str, ...], Any]:
    from torchrec_swp.integrations.torchrec import nonfinite

    out: dict[tuple[str, ...], Any] = {}
    for name in _factories(world_size):
        reference = _run(rank, world_size, name, _batches(rank, world_size, poison=None))
        out[(name, "reference")] = reference
        out[(name, "nan")] = _run(rank, world_size, name, _batches(rank, world_size, poison="nan"), on_nonfinite="skip")
    # the rest on TrainPipelineSparseDist
    name = "SparseDist"
    out[(name, "inf gradient")] = _run(
        rank, world_size, name, _batches(rank, world_size, poison="inf"), inf_hook=True, on_nonfinite="skip"
    )
    out[(name, "device selects")] = _run(
        rank, world_size, name, _batches(rank, world_size, poison="nan"), device_selects=True, on_nonfinite="skip"
    )
    out[(name, "raise")] = _run(rank, world_size, name, _batches(rank, world_size, poison="nan"), on_nonfinite="raise")
    if world_size > 1:
        out[(name, "rank 1 only")] = _run(
            rank, world_size, name, _batches(rank, world_size, poison="nan", ranks=(1,)), on_nonfinite="skip"
        )
    out[("refusals",)] = _refusals(rank, world_size)
    out[("SemiSync", "nan")] = _stepwise(rank, world_size, "SemiSync")
    for k in (K, WINDOW_START, WINDOW_END):  # a window's middle, first and last micro-batch
        out[("accumulation", "nan", k)] = _stepwise(rank, world_size, "accumulation", k=k)
        out[("accumulation", "reference", k)] = _stepwise(rank, world_size, "accumulation", k=k, poison=False)
    out[("accumulation", "io_thread")] = _stepwise(rank, world_size, "accumulation", thread_map="io")
    from torchrec_swp.engine.batches import Batches

    original_clock = Batches.rolled_back
    Batches.rolled_back = lambda self, b: None  # type: ignore[method-assign]  # the window counts batch K
    try:
        out[("accumulation", "without the clock")] = _stepwise(rank, world_size, "accumulation")
    finally:
        Batches.rolled_back = original_clock  # type: ignore[method-assign]
    for effect in EFFECTS:  # each capture removed in turn: the restore then puts nothing back
        classes = {
            "fused_rows": nonfinite.FusedRows,
            "dense_grads": nonfinite.DenseGrads,
            "dense_params": nonfinite.DenseParams,
            "dense_optim": nonfinite.DenseOptim,
        }
        cls = classes[effect]
        original = cls.restore
        cls.restore = lambda self, saved, keep: None  # type: ignore[method-assign]
        try:
            out[(name, f"without {effect}")] = _run(
                rank, world_size, name, _batches(rank, world_size, poison="nan"), on_nonfinite="skip"
            )
        finally:
            cls.restore = original  # type: ignore[method-assign]
    original_counters = nonfinite.Counters.restore
    nonfinite.Counters.restore = lambda self, saved, keep: None  # type: ignore[method-assign]
    try:
        out[("Base", "without counters")] = _run(
            rank, world_size, "Base", _batches(rank, world_size, poison="nan"), on_nonfinite="skip"
        )
    finally:
        nonfinite.Counters.restore = original_counters  # type: ignore[method-assign]
    return out


def _stepwise(
    rank: int, world_size: int, kind: str, k: int = K, *, poison: bool = True, thread_map: str | None = None
) -> dict[str, Any]:
    """Batch k poisoned (``poison``; else the data without it and ``on_nonfinite="off"``), the state
    after each step: TrainPipelineSemiSync in its semi-synchronous phase from batch 1
    (``kind="SemiSync"``), or GradientAccumulationWrapper over TrainPipelineSparseDist, windows of 3
    (``"accumulation"``; K is a window's second micro-batch)."""
    import torchrec_swp

    model, optimizer = _model(rank, world_size, kind)
    option = {"on_nonfinite": "skip"} if poison else {}
    if thread_map is not None:
        option["thread_map"] = thread_map
    if kind == "SemiSync":
        pipeline = torchrec_swp.TrainPipelineSemiSync(model, optimizer, CPU, start_batch=1, **option)
        stepper = pipeline
    else:
        pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, **option)
        config = torchrec_swp.GradientAccumulationConfig(num_steps=3)
        stepper = torchrec_swp.GradientAccumulationWrapper(pipeline, optimizer, model, config)
    batches = make_batches(rank, world_size, N, 0)
    if poison:
        batches[k].float_features[0, 0] = math.nan
    else:
        del batches[k]
    states, it = [], iter(batches)
    with record_losses(model) as losses:
        while True:
            try:
                stepper.progress(it)
            except StopIteration:
                break
            grads = {f"grad {j}": g for j, g in enumerate(_grads(optimizer)) if g is not None}
            states.append({**_state(model, optimizer), **grads})
    skipped = [v.batch for v in pipeline.skipped_steps]
    pipeline.close()
    return {"states": states, "losses": [float(x) for x in losses], "skipped": skipped}


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    """What each pipeline that cannot undo a step says when asked to (one line each)."""
    import torchrec_swp
    from torchrec_swp.plan import PipelinePlan

    model, optimizer = _model(rank, world_size, "SparseDist")
    text = torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU).plan.to_text()
    for effects in ("dense_params,dense_optim", "fused_rows,dense_grads", "dense_grads"):
        text = text.replace(effects, "-")
    no_effects = PipelinePlan.from_text(text)
    cases: dict[str, Callable[[], Any]] = {
        "PT2": lambda: torchrec_swp.TrainPipelinePT2(model, optimizer, CPU, on_nonfinite="skip"),
        "no effects": lambda: torchrec_swp.TrainPipelineSparseDist(
            model, optimizer, CPU, plan=no_effects, on_nonfinite="skip"
        ),
        "autotune": lambda: torchrec_swp.TrainPipelineSparseDist(
            model, optimizer, CPU, autotune=True, on_nonfinite="skip"
        ),
        "bad mode": lambda: torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU, on_nonfinite="ignore"),
        # nothing of an eval step changes what outlives it: accepted, nothing to undo
        "eval": lambda: torchrec_swp.EvalPipelineSparseDist(model, optimizer, CPU, on_nonfinite="skip"),
    }
    said = {}
    for label, make in cases.items():
        try:
            make().close()
            said[label] = "accepted"
        except Exception as e:  # noqa: BLE001 - what each says is the result
            said[label] = f"{type(e).__name__}: {e}"
    return said


@cache
def _results(world_size: int) -> list[dict[tuple[str, ...], Any]]:
    return run_on_ranks(_all, world_size=world_size, timeout_s=600)


def _without_k(values: list[Any]) -> list[Any]:
    return values[:K] + values[K + 1 :]


def _differences(run: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What differs between a run with batch K rolled back and the run without it (empty: nothing)."""
    found = []
    for key, value in reference["state"].items():
        if not torch.equal(run["state"][key], value):
            found.append(f"state {key}")
    if _without_k(run["losses"]) != reference["losses"]:
        found.append(f"losses {run['losses']} vs {reference['losses']}")
    for j, (a, b) in enumerate(zip(_without_k(run["outputs"]), reference["outputs"], strict=True)):
        if not (a is None or torch.equal(a, b)):
            found.append(f"output {j}")
    # after the rolled-back step the gradients are as its ZeroGrad left them (cleared: None), not
    # the step before's, which that step's optimizer consumed (docs/nonfinite.md)
    cleared = [[None] * len(reference["grads"][0])]
    expected = reference["grads"][:K] + cleared + reference["grads"][K:]
    for j, (a, b) in enumerate(zip(run["grads"], expected, strict=True)):
        if any((x is None) != (y is None) or (x is not None and not torch.equal(x, y)) for x, y in zip(a, b)):
            found.append(f"grads after step {j}")
    return found


WORLDS = [pytest.param(1, id="1rank"), pytest.param(2, id="2ranks")]


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(
    "name", ["SparseDist", "SparseDist.io_thread", "FusedSparseDist", "Prefetch", "BwdOpt", "Base", "PT2"]
)
def test_a_nan_batch_is_rolled_back_as_if_never_seen(world_size: int, name: str) -> None:
    if name == "BwdOpt" and (installed().release < (1, 9, 0) or world_size == 1):
        pytest.skip("TrainPipelineSparseDistBwdOpt: new in TorchRec 1.9; on 1 rank upstream's own fails too")
    for rank, result in enumerate(_results(world_size)):
        run, reference = result[(name, "nan")], result[(name, "reference")]
        assert _differences(run, reference) == [], f"rank {rank} {name}"
        assert [b for b, _ in run["skipped"]] == [K]
        assert "the losses" in run["skipped"][0][1]
        assert run["saved"] == {"skipped": [(K, K, list(run["skipped"][0][1]))]}


@pytest.mark.parametrize("world_size", WORLDS)
def test_an_inf_gradient_with_a_finite_loss_is_rolled_back(world_size: int) -> None:
    for rank, result in enumerate(_results(world_size)):
        run, reference = result[("SparseDist", "inf gradient")], result[("SparseDist", "reference")]
        assert math.isfinite(run["losses"][K]), run["losses"]
        assert _differences(run, reference) == [], f"rank {rank}"
        assert run["skipped"][0][0] == K and "the losses" not in run["skipped"][0][1]


@pytest.mark.parametrize("world_size", WORLDS)
def test_raise_names_the_batch_after_rolling_back(world_size: int) -> None:
    for rank, result in enumerate(_results(world_size)):
        run, reference = result[("SparseDist", "raise")], result[("SparseDist", "reference")]
        assert len(run["raised"]) == 1 and run["raised"][0].startswith(f"NonFiniteStep: batch {K} of the epoch")
        assert _differences(run, reference) == [], f"rank {rank}"


def test_one_ranks_bad_batch_rolls_the_step_back_on_every_rank() -> None:
    results = _results(2)
    for rank, result in enumerate(results):
        run, reference = result[("SparseDist", "rank 1 only")], result[("SparseDist", "reference")]
        assert _differences(run, reference) == [], f"rank {rank}"
        assert [b for b, _ in run["skipped"]] == [K]
    assert results[1][("SparseDist", "rank 1 only")]["skipped"][0][1][0] == "the losses"


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("effect", EFFECTS)
def test_each_capture_is_needed(world_size: int, effect: str) -> None:
    """With one effect's restore removed, the run is no longer the run without batch K."""
    differences = [
        _differences(r[("SparseDist", f"without {effect}")], r[("SparseDist", "reference")])
        for r in _results(world_size)
    ]
    assert any(differences), f"removing {effect}'s restore changed nothing"


@pytest.mark.parametrize("world_size", WORLDS)
def test_the_counters_capture_is_needed(world_size: int) -> None:
    """TrainPipelineBase's step count (``counters``) with its restore removed: one step too many."""
    for r in _results(world_size):
        run, reference = r[("Base", "without counters")], r[("Base", "reference")]
        assert _differences(run, reference) == ["state pipeline _batch_count"]
        assert int(run["state"]["pipeline _batch_count"]) == int(reference["state"]["pipeline _batch_count"]) + 1


@pytest.mark.parametrize("world_size", WORLDS)
def test_semi_sync_rolls_back_its_step_and_goes_on_finite(world_size: int) -> None:
    """What docs/nonfinite.md says SemiSync guarantees: the rolled-back step leaves every weight
    and optimizer state (fused rows, counters, dense) as the step before left them, and training
    goes on finite. Not the run without the batch: its next batch was looked up before the
    rolled-back update (one update later than without the batch)."""
    for rank, result in enumerate(_results(world_size)):
        run = result[("SemiSync", "nan")]
        assert run["skipped"] == [K]
        before, after = run["states"][K - 1], run["states"][K]
        assert before.keys() == after.keys()
        assert [k for k in before if not torch.equal(before[k], after[k])] == [], f"rank {rank}"
        assert math.isnan(run["losses"][K]) and all(math.isfinite(x) for x in _without_k(run["losses"]))
        assert all(bool(torch.isfinite(v).all()) for v in run["states"][-1].values() if v.is_floating_point())


def _stepwise_differences(run: dict[str, Any], reference: dict[str, Any], k: int) -> list[str]:
    """What differs between the accumulation run with micro-batch k rolled back, its step's state
    left out, and the run without batch k: after every step, each weight, optimizer state and
    accumulated gradient; every loss."""
    states = run["states"][:k] + run["states"][k + 1 :]
    if len(states) != len(reference["states"]):
        return [f"{len(states)} steps vs {len(reference['states'])}"]
    found = [
        f"step {j}: {key}"
        for j, (a, b) in enumerate(zip(states, reference["states"], strict=True))
        for key in sorted(a.keys() | b.keys())
        if key not in a or key not in b or not torch.equal(a[key], b[key])
    ]
    if run["losses"][:k] + run["losses"][k + 1 :] != reference["losses"]:
        found.append("losses")
    return found


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(("k", "where"), [(K, "middle"), (WINDOW_START, "first"), (WINDOW_END, "last")])
def test_the_accumulation_window_closes_as_if_the_micro_batch_was_never_seen(
    world_size: int, k: int, where: str
) -> None:
    """GradientAccumulationWrapper (windows of 3) over TrainPipelineSparseDist, a window's
    ``where`` micro-batch rolled back: bit for bit the run whose data lacks it, after every step
    (weights, fused and dense optimizer state, the window's accumulated gradients) and in every
    loss: the clock ``"trained"`` does not count the rolled-back batch, so the window closes one
    batch later (the io thread map too, whose loader thread may pick its phase earlier)."""
    for rank, result in enumerate(_results(world_size)):
        run, reference = result[("accumulation", "nan", k)], result[("accumulation", "reference", k)]
        assert run["skipped"] == [k]
        assert _stepwise_differences(run, reference, k) == [], f"rank {rank}"
        if k == K:
            assert _stepwise_differences(result[("accumulation", "io_thread")], reference, k) == [], f"rank {rank}"


@pytest.mark.parametrize("world_size", WORLDS)
def test_the_rolled_back_clock_is_needed(world_size: int) -> None:
    """With the rolled-back batch counted on the clock ``"trained"`` (``Batches.rolled_back`` doing
    nothing), the window closes after 3 batches drawn, one of them rolled back: not the run without it."""
    for result in _results(world_size):
        run, reference = result[("accumulation", "without the clock")], result[("accumulation", "reference", K)]
        assert run["skipped"] == [K]
        assert _stepwise_differences(run, reference, K) != []


def test_what_cannot_be_undone_is_refused_in_one_line() -> None:
    said = _results(1)[0][("refusals",)]
    assert said["PT2"] == "accepted"  # its _iter put back, its compile on the clock "trained" (tests/unit)
    assert "declares no effects" in said["no effects"] and said["no effects"].startswith("PlanError")
    autotune = "ValueError: TrainPipelineSparseDist: on_nonfinite='skip' with autotune"
    assert said["autotune"].startswith(autotune)
    assert said["bad mode"] == (
        "ValueError: TrainPipelineSparseDist: on_nonfinite must be one of 'off', 'skip', 'raise', got 'ignore'"
    )
    assert said["eval"] == "accepted"
    assert all("\n" not in line for line in said.values())


@pytest.mark.parametrize("world_size", WORLDS)
def test_the_gpu_path_rolls_back_the_same(world_size: int) -> None:
    """The verdict kept on the device (``Transaction.host`` False, what a GPU run does): every
    restore a ``torch.where`` on the reduced flags, read on the host a step later; the same run."""
    for rank, result in enumerate(_results(world_size)):
        run, reference = result[("SparseDist", "device selects")], result[("SparseDist", "reference")]
        assert _differences(run, reference) == [], f"rank {rank}"
        assert [b for b, _ in run["skipped"]] == [K] and "the losses" in run["skipped"][0][1]
