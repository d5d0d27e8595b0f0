"""The input dist on a process group of its own (``input_dist_group=True``), on 2 gloo ranks.

Same sharded model (fresh, same seed) and data for every run; tables 0-1 table-wise and 2-4
row-wise, so the input dists are TwSparseFeaturesDist and RwSparseFeaturesDist.

* TrainPipelineSparseDist with the option (one thread, the input dist on a ``dist`` thread,
  ``by_stream``) equals upstream bit for bit (outputs, losses, final weights, batch count, the
  call that raises StopIteration), and so does ours without the option; also over two epochs.
* Its subclasses (Lite, Fused, SemiSync with both phases, Prefetch, Eval) with the option and
  ``by_stream`` equal themselves without it.
* The input dist collectives really move: a log of the torch.distributed calls (function,
  group, calling function) shows every splits and tensors all-to-all after the first batch on
  the new group, nothing else on it, and every other collective unchanged; after the run the
  input dists' ``KJTAllToAll`` (and upstream's fused-splits wrapper of each) hold the new group,
  and no other object of the model does.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchrec.distributed.train_pipeline.train_pipelines as upstream

import torchrec_swp
from harness.parity import RunResult, assert_runs_equal, build_model, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.input_dist_group import input_dist_all_to_alls, rebind_input_dists

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.parity]

STEPS = 20
EPOCH_STEPS = 7
CPU = torch.device("cpu")
DIST = {"InitPipelinedModules": "dist", "InputDistStart": "dist", "InputDistWait": "dist"}
#: The functions that issue the input dist's collectives (TorchRec 1.8 and 1.9): the splits
#: all-to-all and the tensors all-to-all.
INPUT_DIST_CALLERS = ("SplitsAllToAllAwaitable.__init__", "KJTAllToAllTensorsAwaitable.__init__")
LOGGED = (
    "all_to_all_single",
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
    "broadcast",
)

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]
Log = Counter[tuple[str, str, str]]  # (function, "input_dist" | "model" | "other", caller) -> calls


@contextlib.contextmanager
def _collective_log(groups: dict[str, Any]) -> Iterator[Log]:
    """Within the block, counts the calls of the ``LOGGED`` torch.distributed functions by
    function, group (its label in ``groups``, filled in later by the caller; ``"model"`` for the
    default group) and calling function."""
    log: Log = Counter()
    originals = {name: getattr(dist, name) for name in LOGGED}

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def logged(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_qualname
            if caller.startswith("ExhaustionSync."):  # the uneven-data sync's, on its own group: not counted
                return fn(*args, **kwargs)
            group = signature.bind(*args, **kwargs).arguments.get("group")
            if group is not None and group is groups.get("input_dist"):
                label = "input_dist"
            elif group is None or group is dist.group.WORLD:
                label = "model"
            else:
                label = "other"
            log[(name, label, caller)] += 1
            return fn(*args, **kwargs)

        return logged

    for name, fn in originals.items():
        setattr(dist, name, spy(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _holders(pipeline: Any) -> dict[str, Any]:
    """Where the pipeline's input dist group ended up: ``a2a`` the input dists' KJTAllToAll
    (fused: their fused-splits wrappers) that hold it, ``missing`` those that do not, ``others``
    the model's other objects whose ``_pg`` is it."""
    group = pipeline._swp_input_dist_group
    a2as = input_dist_all_to_alls(pipeline._pipelined_modules)
    ids = {id(a) for _, a in a2as}
    fused = [vars(a).get("forward") for _, a in a2as]
    return {
        "a2a": sum(a._pg is group for _, a in a2as),
        "fused": sum(f is not None and f._pg is group for f in fused),
        "missing": [w for w, a in a2as if a._pg is not group],
        "others": [n for n, m in pipeline._model.named_modules() if vars(m).get("_pg") is group and id(m) not in ids],
    }


def _train(factory: Factory, rank: int, world_size: int, seed: int, steps: int = STEPS) -> tuple[RunResult, Log, Any]:
    model, optimizer = build_model(rank, world_size, seed)
    groups: dict[str, Any] = {}
    with _collective_log(groups) as log:
        pipeline = factory(model, optimizer)
        groups["input_dist"] = getattr(pipeline, "_swp_input_dist_group", None)
        try:
            result = train_pipeline_run(pipeline, make_batches(rank, world_size, steps, seed), steps + 5)
            holders = _holders(pipeline) if groups["input_dist"] is not None else None
        finally:
            if hasattr(pipeline, "close"):
                pipeline.close()
    if holders is not None:  # close() moved every input dist back to the model's group (teardown)
        after = _holders(pipeline)
        assert after["a2a"] == after["fused"] == 0 and not after["others"], after
    return result, Counter(log), holders


def _sparse_dist(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    ours = torchrec_swp.TrainPipelineSparseDist
    runs = {
        "upstream": lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU),
        "no option, dist thread": lambda m, o: ours(m, o, CPU, thread_map=DIST),
        "option, one thread": lambda m, o: ours(m, o, CPU, input_dist_group=True),
        "option, dist thread": lambda m, o: ours(m, o, CPU, input_dist_group=True, thread_map=DIST),
        "option, by_stream": lambda m, o: ours(m, o, CPU, input_dist_group=True, thread_map="by_stream"),
    }
    out = {label: _train(f, rank, world_size, seed) for label, f in runs.items()}
    # two epochs, each with a new iterator: the second epoch's first input dist is on the new group
    epochs = {}
    for label, factory in (
        ("upstream", lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU)),
        ("option, dist thread", lambda m, o: ours(m, o, CPU, input_dist_group=True, thread_map=DIST)),
    ):
        model, optimizer = build_model(rank, world_size, seed)
        pipeline = factory(model, optimizer)
        epochs[label] = [
            train_pipeline_run(pipeline, make_batches(rank, world_size, EPOCH_STEPS, seed + e), 20) for e in range(2)
        ]
        if hasattr(pipeline, "close"):
            pipeline.close()
    # a group over other ranks than the input dists' is refused, naming the input dist
    sub = dist.new_group(ranks=[0])
    refused = ""
    if rank == 0:
        with pytest.raises(ValueError) as err:
            rebind_input_dists(pipeline._pipelined_modules, sub)
        refused = str(err.value)
    return {"runs": out, "epochs": epochs, "refused": refused}


def _subclasses(rank: int, world_size: int, seed: int) -> dict[str, dict[str, Any]]:
    from torchrec_swp import (
        EvalPipelineSparseDist,
        PrefetchTrainPipelineSparseDist,
        TrainPipelineFusedSparseDist,
        TrainPipelineSemiSync,
        TrainPipelineSparseDistLite,
    )

    classes: dict[str, tuple[type, dict[str, Any]]] = {
        "Lite": (TrainPipelineSparseDistLite, {}),
        "Fused": (TrainPipelineFusedSparseDist, {}),
        "SemiSync": (TrainPipelineSemiSync, {"start_batch": 5}),
        "Prefetch": (PrefetchTrainPipelineSparseDist, {}),
        "Eval": (EvalPipelineSparseDist, {}),
    }
    out = {}
    option = {"input_dist_group": True, "thread_map": "by_stream"}
    for name, (cls, kw) in classes.items():
        out[name] = {
            "no option": _train(lambda m, o, c=cls, k=kw: c(m, o, CPU, **k), rank, world_size, seed),
            "option, by_stream": _train(lambda m, o, c=cls, k=kw: c(m, o, CPU, **k, **option), rank, world_size, seed),
        }
    return out


def _input_dist_calls(log: Log, label: str) -> Counter[str]:
    return Counter({caller: n for (fn, g, caller), n in log.items() if g == label and caller in INPUT_DIST_CALLERS})


def _check_moved(reference: Log, moved: Log, holders: dict[str, Any], batches: int, what: str) -> None:
    """``moved`` (with the option) made the collectives of ``reference`` (without it), with every
    input dist all-to-all after the first batch on the input dist group and nothing else there."""
    merged: Counter[tuple[str, str]] = Counter()
    for (fn, _, caller), n in moved.items():
        merged[(fn, caller)] += n
    assert merged == Counter({(fn, caller): n for (fn, _, caller), n in reference.items()}), (
        f"{what}: other collectives"
    )
    on_group = {key: n for key, n in moved.items() if key[1] == "input_dist"}
    assert all(fn == "all_to_all_single" and caller in INPUT_DIST_CALLERS for fn, _, caller in on_group), (
        f"{what}: not an input dist collective on the input dist group: {on_group}"
    )
    assert not any(g == "other" for _, g, _ in moved), f"{what}: a collective on an unknown group: {moved}"
    first = _input_dist_calls(moved, "model")
    later = _input_dist_calls(moved, "input_dist")
    tensors_per_batch = _input_dist_calls(reference, "model")["KJTAllToAllTensorsAwaitable.__init__"] // batches
    # batch 0 on the model's group: one splits all-to-all per input dist (not fused yet) and its
    # tensors; every later batch on the input dist group: one fused splits all-to-all and its tensors
    assert first == Counter({INPUT_DIST_CALLERS[0]: holders["a2a"], INPUT_DIST_CALLERS[1]: tensors_per_batch}), (
        f"{what}: input dist calls on the model's group {dict(first)}"
    )
    assert later == Counter(
        {INPUT_DIST_CALLERS[0]: batches - 1, INPUT_DIST_CALLERS[1]: tensors_per_batch * (batches - 1)}
    ), f"{what}: input dist calls on the input dist group {dict(later)}"
    assert holders["a2a"] == holders["fused"] == 3 and not holders["missing"] and not holders["others"], (
        f"{what}: {holders}"
    )


def test_sparse_dist_with_an_input_dist_group_equals_upstream_bit_for_bit() -> None:
    for rank, out in enumerate(run_on_ranks(_sparse_dist, 4321, timeout_s=600)):
        runs = out["runs"]
        reference, reference_log, _ = runs["upstream"]
        assert reference.num_calls == STEPS
        for label, (result, log, holders) in runs.items():
            assert_runs_equal(reference, result, what=f"rank {rank} SparseDist [{label}]")
            if label.startswith("option"):
                _check_moved(reference_log, log, holders, STEPS, f"rank {rank} SparseDist [{label}]")
            else:
                assert log == reference_log, f"rank {rank} SparseDist [{label}]: collectives differ"
        for epoch, (a, b) in enumerate(zip(*out["epochs"].values())):
            assert a.num_calls == EPOCH_STEPS
            assert_runs_equal(a, b, what=f"rank {rank} epoch {epoch}")
        if rank == 0:
            assert "runs on ranks [0, 1], the input dist group spans ranks [0]" in out["refused"], out["refused"]


def test_subclasses_with_an_input_dist_group_equal_themselves_without() -> None:
    for rank, out in enumerate(run_on_ranks(_subclasses, 99, timeout_s=600)):
        for name, runs in out.items():
            reference, reference_log, _ = runs["no option"]
            result, log, holders = runs["option, by_stream"]
            assert reference.num_calls == STEPS, f"{name}: {reference.num_calls} calls"
            assert_runs_equal(reference, result, what=f"rank {rank} {name}")
            _check_moved(reference_log, log, holders, STEPS, f"rank {rank} {name}")
