"""The input dist cache's parts in one process: the batch digest, the cap, the stamp, the
modules it refuses, its bad input. Its run on sharded models, 1 and 2 ranks, is
tests/dist/test_input_dist_cache.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_swp.integrations.torchrec import input_dist_cache as cache_module
from torchrec_swp.integrations.torchrec.input_dist_cache import InputDistCache, batch_key


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    label: torch.Tensor


def kjt(values: list[int], lengths: list[int], weights: list[float] | None = None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["f1", "f2"],
        values=torch.tensor(values),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        weights=None if weights is None else torch.tensor(weights),
    )


def batch(**changes: Any) -> Batch:
    b = Batch(torch.arange(6.0).reshape(2, 3), kjt([1, 2, 3, 4], [1, 1, 2, 0]), torch.tensor([0.0, 1.0]))
    return replace(b, **changes)


# ------------------------------------------------------------------ the digest
def test_equal_batches_have_one_key_and_any_change_gives_another() -> None:
    key = batch_key(batch())
    assert key is not None and batch_key(batch()) == key  # new objects, same content
    others = [
        batch(sparse=kjt([1, 2, 3, 5], [1, 1, 2, 0])),  # one id
        batch(sparse=kjt([1, 2, 3, 4], [2, 0, 2, 0])),  # same ids, other bags
        batch(sparse=kjt([1, 2, 3, 4], [1, 1, 2, 0], [1.0, 1.0, 1.0, 1.0])),  # weights
        batch(dense=torch.arange(6.0).reshape(3, 2)),  # a shape
        batch(label=torch.tensor([0, 1])),  # a dtype
        batch(dense=torch.arange(6.0).reshape(2, 3) + 1),  # a dense value
    ]
    keys = {batch_key(b) for b in others}
    assert len(keys) == len(others) and key not in keys


def test_a_batch_off_the_host_or_of_an_unknown_type_gets_no_key() -> None:
    assert batch_key(batch(dense=torch.empty(2, 3, device="meta"))) is None
    assert cache_module.why_no_key(batch(dense=torch.empty(2, 3, device="meta"))) == "a tensor on meta"

    class Slotted:
        __slots__ = ("ids",)

    assert batch_key([torch.ones(2), Slotted()]) is None
    assert batch_key({"ids": torch.ones(2), "n": 3}) is not None


def test_a_plain_class_of_the_users_is_read_by_its_attributes() -> None:
    class UserBatch:
        def __init__(self, ids: list[int], label: float) -> None:
            self.kjt = kjt(ids, [1, 1, 2, 0])
            self.label = torch.tensor([label])

    key = batch_key(UserBatch([1, 2, 3, 4], 0.5))
    assert key is not None and key == batch_key(UserBatch([1, 2, 3, 4], 0.5))
    assert key != batch_key(UserBatch([1, 2, 3, 5], 0.5)) and key != batch_key(UserBatch([1, 2, 3, 4], 1.5))


def test_a_batch_without_a_key_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    class Slotted:
        __slots__ = ("ids",)

    cache = InputDistCache(1 << 20, None, "Eval")
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        for _ in range(3):
            cache.mark(Context(), Slotted())
    assert len(caplog.records) == 1
    assert "a batch (" in caplog.text and "Slotted) gets no key, its input dist is not cached: " in caplog.text


# ------------------------------------------------------------------ the cache on stand-ins
class ShardedEmbeddingBagCollection:  # the name the cache accepts
    def __init__(self, name: str) -> None:
        self.forward = type("Forward", (), {"name": name})()
        self._embedding_shardings = [object()]


class ShardedManagedCollisionEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    pass


class Request(Awaitable):
    def __init__(self, data: Any) -> None:
        super().__init__()
        self.data = data

    def _wait_impl(self) -> Any:
        return self.data


class Context:
    def __init__(self) -> None:
        self.module_contexts: dict[str, Any] = {}
        self.input_dist_tensors_requests: dict[str, Any] = {}


def evaluate(cache: InputDistCache, modules: list[Any], batches: list[Any], postprocs: tuple = ()) -> list[Any]:
    """Each batch through start, wait and the forward's awaits; what the forward got per batch.
    The stand-in's input dist returns (module, the batch's first id, a counter of dists run)."""
    got = []
    for b in batches:
        context = Context()
        cache.mark(context, b)

        def start(context: Context = context) -> None:
            for m in modules:
                context.module_contexts[m.forward.name] = {"ctx": m.forward.name}

        def wait(context: Context = context, b: Any = b) -> None:
            for m in modules:
                evaluate.runs += 1  # type: ignore[attr-defined]
                data = torch.tensor([int(b.sparse.values()[0]), evaluate.runs])  # type: ignore[attr-defined]
                context.input_dist_tensors_requests[m.forward.name] = Request(data)

        cache.start(modules, postprocs, context, start)
        cache.wait(context, wait)
        requests = context.input_dist_tensors_requests
        got.append([(context.module_contexts.pop(n), requests.pop(n).wait()) for n in names(modules)])
    return got


evaluate.runs = 0  # type: ignore[attr-defined]


def names(modules: list[Any]) -> list[str]:
    return [m.forward.name for m in modules]


def held_out(n: int) -> list[Batch]:
    return [batch(sparse=kjt([10 + i, 2, 3, 4], [1, 1, 2, 0])) for i in range(n)]


def test_a_second_evaluation_gets_what_the_first_distributed() -> None:
    modules = [ShardedEmbeddingBagCollection("a"), ShardedEmbeddingBagCollection("b")]
    cache = InputDistCache(1 << 20, None, "Eval")
    first = evaluate(cache, modules, held_out(3))
    runs = evaluate.runs  # type: ignore[attr-defined]
    second = evaluate(cache, modules, held_out(3))
    assert evaluate.runs == runs  # type: ignore[attr-defined]  # nothing distributed again
    assert all(torch.equal(x[1], y[1]) and x[0] == y[0] for p, q in zip(first, second) for x, y in zip(p, q))
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["entries"]) == (3, 3, 3)
    assert stats["bytes"] == 3 * 2 * torch.tensor([0, 0]).untyped_storage().nbytes()


def test_the_cap_keeps_what_fits_and_the_rest_is_distributed_each_time() -> None:
    modules = [ShardedEmbeddingBagCollection("a")]
    one = torch.tensor([0, 0]).untyped_storage().nbytes()
    cache = InputDistCache(2 * one, None, "Eval")
    evaluate(cache, modules, held_out(3))
    runs = evaluate.runs  # type: ignore[attr-defined]
    evaluate(cache, modules, held_out(3))
    assert evaluate.runs == runs + 1  # type: ignore[attr-defined]  # the third did not fit
    stats = cache.stats()
    assert (stats["entries"], stats["bytes"], stats["not_kept"], stats["hits"]) == (2, 2 * one, 2, 2)


def test_a_new_sharding_makes_its_batches_distribute_again() -> None:
    modules = [ShardedEmbeddingBagCollection("a")]
    cache = InputDistCache(1 << 20, None, "Eval")
    evaluate(cache, modules, held_out(2))
    modules[0]._embedding_shardings = [object()]  # what update_shards does
    runs = evaluate.runs  # type: ignore[attr-defined]
    evaluate(cache, modules, held_out(2))
    assert evaluate.runs == runs + 2 and cache.stats()["hits"] == 0  # type: ignore[attr-defined]
    evaluate(cache, modules, held_out(2))
    assert cache.stats()["hits"] == 2


@pytest.mark.parametrize("what", ["managed collision", "postproc"])
def test_a_model_whose_input_dist_may_not_be_pure_is_not_cached_and_says_so_once(
    what: str, caplog: pytest.LogCaptureFixture
) -> None:
    modules: list[Any] = [ShardedEmbeddingBagCollection("a")]
    postprocs: tuple = ()
    if what == "managed collision":
        modules.append(ShardedManagedCollisionEmbeddingBagCollection("mc"))
    else:
        postprocs = (object(),)
    cache = InputDistCache(1 << 20, None, "EvalPipelineSparseDist")
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        for _ in range(3):
            runs = evaluate.runs  # type: ignore[attr-defined]
            evaluate(cache, modules, held_out(2), postprocs)
            assert evaluate.runs == runs + 2 * len(modules)  # type: ignore[attr-defined]
    stats = cache.stats()
    assert stats["hits"] == 0 and stats["entries"] == 0 and stats["disabled"]
    assert len(caplog.records) == 1 and "input_dist_cache_mb=): off for this model" in caplog.text


@pytest.mark.parametrize(
    "value, error",
    [("64", TypeError), (True, TypeError), (-1, ValueError), (float("nan"), ValueError), (float("inf"), ValueError)],
)
def test_a_cap_that_is_not_a_number_of_mib_is_refused_in_one_line(value: Any, error: type) -> None:
    with pytest.raises(error, match=r"^Eval: input_dist_cache_mb must be .*, got ") as info:
        InputDistCache.create(value, "Eval")
    assert "\n" not in str(info.value)
    assert InputDistCache.create(0, "Eval").max_bytes == 0


# ------------------------------------------------------------------ the agreement carried by the draw's
def drawn(cache: InputDistCache, batches: list[Any], peer_has: bool) -> list[Any]:
    """What the draw does for each batch: ``carry``, then the draw's agreement settled (a peer
    that has it or not); the batches as drawn."""
    for b in batches:
        carried = cache.carry(b)
        carried.every = carried.mine and peer_has
    return batches


def test_where_the_draw_carries_the_flag_no_collective_of_its_own_is_made() -> None:
    modules = [ShardedEmbeddingBagCollection("a")]
    cache = InputDistCache(1 << 20, None, "Eval")
    cache._agree = lambda have: pytest.fail("a collective of its own")  # type: ignore[method-assign]
    evaluate(cache, modules, drawn(cache, held_out(2), peer_has=True))  # nothing held yet: "no"
    runs = evaluate.runs  # type: ignore[attr-defined]
    evaluate(cache, modules, drawn(cache, held_out(2), peer_has=False))  # a peer lacks them
    assert evaluate.runs == runs + 2 and cache.stats()["hits"] == 0  # type: ignore[attr-defined]
    evaluate(cache, modules, drawn(cache, held_out(2), peer_has=True))
    assert evaluate.runs == runs + 2 and cache.stats()["hits"] == 2  # type: ignore[attr-defined]
    assert cache.carried == 6


def test_a_sharding_changed_after_every_rank_agreed_at_the_draw_is_an_error_not_a_hang() -> None:
    modules = [ShardedEmbeddingBagCollection("a")]
    cache = InputDistCache(1 << 20, None, "Eval")
    evaluate(cache, modules, held_out(1))
    batches = drawn(cache, held_out(1), peer_has=True)
    modules[0]._embedding_shardings = [object()]  # resharded between the draw and the input dist
    with pytest.raises(RuntimeError, match=r"reshard between evaluations, not during one"):
        evaluate(cache, modules, batches)
