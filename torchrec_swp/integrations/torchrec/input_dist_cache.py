"""The shortcut for a held-out set evaluated again and again: its input dist, run once and reused
(``EvalPipelineSparseDist(input_dist_cache_mb=)``).

The input dist of a batch (the all-to-alls that send each id to the rank holding its table's
shard, and the module context that says how they were split) depends only on the batch's
features and on the sharding: not on any weight. Tasks that declare no effects are pure
(``torchrec_swp.plan.effects``), and ``InputDistStart``/``InputDistWait`` declare none. So an
evaluation of the same held-out batches can reuse what the first evaluation distributed:

* **key**: a digest of the batch as the loader gave it, on the host, before its copy to the
  device (every tensor's dtype, shape and bytes, a KeyedJaggedTensor's keys, values, lengths,
  weights and strides), taken by the task that copies it (on the loader thread: no device
  synchronisation). A batch with a tensor already off the host, or of a type the digest cannot
  read (a dataclass, a plain class's attributes and the usual containers can be read), gets no
  key and is never cached, with one warning saying why.
* **what is kept**: for each pipelined module, the distributed features (the awaited result of
  its input dist) and its module context, recorded when the forward awaits them, along with a
  stamp of the sharded modules (their identity and their shardings): a batch is reused only
  while the sharding is the one it was distributed under.
* **the agreement**: every rank must skip the same input dists, or the ranks that do not would
  wait for all-to-alls the others never issue. Each rank says "I have it" per batch and the batch
  is reused only where every rank has it. Where the ranks already agree on each draw
  (``sync_dataloader_exhaustion``, on by default on several ranks), the flag rides on that
  agreement (``ExhaustionSync.carry``: a second int32 in the same all-reduce, issued when the
  batch is drawn and settled before its input dist): no collective of its own. Otherwise (the
  sync turned off, or a source that draws claims, not batches), one blocking MIN all-reduce before
  each batch's input dist on a gloo group of the cache's own (ranks > 1), in batch order (one
  thread starts input dists, in batch order, on every rank). Which of the two a batch takes
  depends only on the pipeline's options and plan, the same on every rank.
* **the cap**: ``max_bytes`` bounds what is kept (the features' and contexts' tensors, counted
  by their storage); a batch that does not fit is not kept, and its later evaluations
  distribute it again (the agreement makes that so on every rank).

What is not cached: models whose pipelined modules are not plain sharded embedding collections
(a managed-collision module remaps ids with state it changes; a postproc feeding a module
computes its input from weights): the cache is then off, with one warning. ``stats()`` reports
what it kept, reused and saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from torchrec_swp.engine.exhaustion import Carried

logger = logging.getLogger(__name__)

#: The sharded modules whose input dist is a function of the batch's features and the sharding alone.
PURE_INPUT_DIST = frozenset(
    {
        "ShardedEmbeddingBagCollection",
        "ShardedEmbeddingCollection",
        "ShardedFusedEmbeddingBagCollection",
        "ShardedFusedEmbeddingCollection",
    }
)

_KEY = "_swp_input_dist_key"  # the batch's digest, on its pipeline context
_HIT = "_swp_input_dist_hit"  # the context's input dist came from the cache
_PENDING = "_swp_input_dist_pending"  # what the forward's awaits record for the cache
_CARRIED = "_swp_input_dist_carried"  # the ranks' answer carried by the draw's agreement
_DRAWN = 64  # items whose key was taken at their draw, held until their copy task reads it


class _Unreadable(Exception):
    """The digest cannot read a part of the batch (or it is off the host)."""


def batch_key(batch: Any) -> bytes | None:
    """A digest of ``batch`` on the host (see the module docstring), or None where it has a
    tensor off the host or a part the digest cannot read (``why_no_key`` says which)."""
    return _key(batch)[0]


def why_no_key(batch: Any) -> str | None:
    """Why ``batch`` gets no key (None: it gets one)."""
    return _key(batch)[1]


def _key(batch: Any) -> tuple[bytes | None, str | None]:
    digest = hashlib.blake2b(digest_size=20)
    try:
        _feed(digest, batch, depth=0)
    except _Unreadable as e:
        return None, str(e)
    return digest.digest(), None


def _feed(digest: Any, value: Any, depth: int) -> None:
    if depth > 16:
        raise _Unreadable("too deep")
    put = digest.update
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise _Unreadable(f"a tensor on {value.device}")
        t = value.detach().contiguous()
        put(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            put(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, KeyedJaggedTensor):
        put(b"KJT")
        _feed(digest, list(value.keys()), depth + 1)
        _feed(digest, value.values(), depth + 1)
        _feed(digest, value.lengths(), depth + 1)
        _feed(digest, value.weights_or_none(), depth + 1)
        _feed(digest, value.stride(), depth + 1)
        if value.variable_stride_per_key():
            _feed(digest, value.stride_per_key_per_rank(), depth + 1)
    elif isinstance(value, JaggedTensor):
        put(b"JT")
        for part in (value.values(), value.lengths(), value.weights_or_none()):
            _feed(digest, part, depth + 1)
    elif isinstance(value, KeyedTensor):
        put(b"KT")
        _feed(digest, (value.keys(), value.length_per_key(), value.key_dim(), value.values()), depth + 1)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        put(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (list, tuple)):
        put(f"{type(value).__name__}[{len(value)}]".encode())
        for item in value:
            _feed(digest, item, depth + 1)
    elif isinstance(value, dict):
        put(f"dict[{len(value)}]".encode())
        for k in sorted(value, key=repr):
            _feed(digest, k, depth + 1)
            _feed(digest, value[k], depth + 1)
    elif dataclasses.is_dataclass(value):
        put(type(value).__qualname__.encode())
        for field in dataclasses.fields(value):
            put(field.name.encode())
            _feed(digest, getattr(value, field.name), depth + 1)
    elif isinstance(getattr(value, "__dict__", None), dict) and not callable(value):
        put(f"{type(value).__module__}.{type(value).__qualname__}".encode())  # a batch class of the user's
        for name in sorted(vars(value)):
            put(name.encode())
            _feed(digest, vars(value)[name], depth + 1)
    else:
        raise _Unreadable(type(value).__qualname__)


def _nbytes(value: Any, seen: set[int]) -> int:
    """Bytes of the tensors' storages under ``value`` (each storage once)."""
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v, seen) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v, seen) for v in value.values())
    if isinstance(value, (KeyedJaggedTensor, JaggedTensor, KeyedTensor)) or dataclasses.is_dataclass(value):
        return sum(_nbytes(v, seen) for v in vars(value).values())
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return sum(_nbytes(v, seen) for v in vars(value).values() if isinstance(v, (torch.Tensor, list, tuple, dict)))
    return 0


class _Done(Awaitable):
    """A finished input dist: the cached features."""

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._data = data

    def _wait_impl(self) -> Any:
        return self._data


class _Recording(Awaitable):
    """A module's input dist request whose awaited result is recorded for the cache."""

    def __init__(self, request: Awaitable, pending: _Pending, name: str) -> None:
        super().__init__()
        self._request, self._pending, self._name = request, pending, name

    def _wait_impl(self) -> Any:
        start = time.perf_counter()
        data = self._request.wait()
        self._pending.record(self._name, data, time.perf_counter() - start)
        return data


@dataclasses.dataclass
class _Entry:
    stamp: tuple[Any, ...]
    parts: dict[str, tuple[Any, Any]]  # module name -> (module context, distributed features)
    nbytes: int
    seconds: float  # what distributing it took (host time: start, wait, the forward's awaits)


class _Pending:
    """A batch distributed on a miss: what its forward's awaits record, kept when complete."""

    def __init__(self, cache: InputDistCache, key: bytes, stamp: tuple[Any, ...], contexts: dict[str, Any]) -> None:
        self.cache, self.key, self.stamp = cache, key, stamp
        self.contexts = contexts
        self.data: dict[str, Any] = {}
        self.seconds = 0.0

    def record(self, name: str, data: Any, seconds: float) -> None:
        self.data[name] = data
        self.seconds += seconds
        if len(self.data) == len(self.contexts):
            self.cache._keep(self)


class InputDistCache:
    """The input dists of batches seen before, reused (module docstring). ``group``: the gloo
    group of the agreement (None: one rank); ``max_bytes``: the cap."""

    @classmethod
    def create(cls, megabytes: Any, owner: str) -> InputDistCache:
        """The cache of pipeline ``owner`` (``input_dist_cache_mb=megabytes``), with the
        agreement's gloo group where ranks > 1 (a collective: every rank builds its pipelines in
        the same order). TypeError or ValueError in one line for a cap that is not a number >= 0."""
        if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)):
            raise TypeError(f"{owner}: input_dist_cache_mb must be a number of MiB or None, got {megabytes!r}")
        if not megabytes >= 0 or megabytes == float("inf"):
            raise ValueError(f"{owner}: input_dist_cache_mb must be a finite number >= 0, got {megabytes!r}")
        group: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            made = dist.new_group(backend="gloo")
            assert isinstance(made, dist.ProcessGroup)  # (every rank is in it)
            group = made
        return cls(int(megabytes * 2**20), group, owner)

    def __init__(self, max_bytes: int, group: dist.ProcessGroup | None, owner: str) -> None:
        self.max_bytes = max_bytes
        self.group = group
        self._owner = owner
        self._entries: dict[bytes, _Entry] = {}
        self.nbytes = 0
        self.hits = 0  # batches whose input dist came from the cache
        self.misses = 0  # batches distributed (and offered to the cache)
        self.not_kept = 0  # distributed batches that did not fit under the cap
        self.saved_s = 0.0  # the distributing time of the reused batches, less what reusing took
        self.agree_s = 0.0  # time in the agreement's all-reduces
        self.disabled: str | None = None  # why the cache is off for this model, once found
        self.carried = 0  # batches whose agreement rode on the draw's (no collective of its own)
        self._told_no_key = False
        self._modules: list[Any] = []  # the pipelined modules of the last input dist started
        self._drawn: OrderedDict[int, tuple[Any, bytes | None, Carried]] = OrderedDict()
        self._drawn_lock = threading.Lock()

    # ------------------------------------------------------------ the pipeline's hooks
    def carry(self, item: Any) -> Carried:
        """``ExhaustionSync.carry``: item just drawn (on the thread that draws): its key taken,
        and whether this rank holds its input dist, as the agreement on the draw carries it."""
        try:  # (never raises: a draw that failed here on one rank would leave its peers waiting)
            key = self._key(item)
            entry = self._entries.get(key) if key is not None and self.disabled is None else None
            carried = Carried(entry is not None and entry.stamp == self._stamp(self._modules))
        except Exception:  # noqa: BLE001 - this batch is distributed, not reused
            logger.warning("%s(input_dist_cache_mb=): a drawn batch's key failed", self._owner, exc_info=True)
            key, carried = None, Carried(False)
        with self._drawn_lock:
            self._drawn[id(item)] = (item, key, carried)
            while len(self._drawn) > _DRAWN:
                self._drawn.popitem(last=False)
        return carried

    def mark(self, context: Any, host_batch: Any) -> None:
        """The copy task's part: ``host_batch``'s key on its pipeline context (taken at its draw
        where the draw's agreement carried the flag: with it), before the copy to the device."""
        with self._drawn_lock:
            drawn = self._drawn.get(id(host_batch))
        if drawn is not None and drawn[0] is host_batch:  # (a retried copy finds it again)
            setattr(context, _KEY, drawn[1])
            setattr(context, _CARRIED, drawn[2])
        else:
            setattr(context, _KEY, self._key(host_batch))

    def start(self, modules: Iterable[Any], postprocs: Iterable[Any], context: Any, run: Callable[[], None]) -> None:
        """Batch ``context``'s input dist: from the cache where every rank has it, else ``run()``
        (the pipeline's start), recorded for the cache."""
        modules = self._modules = list(modules)
        key = getattr(context, _KEY, None)
        self._check(modules, list(postprocs))
        stamp = self._stamp(modules)
        entry = self._entries.get(key) if key is not None and self.disabled is None else None
        if key is not None and entry is not None and entry.stamp != stamp:  # the sharding changed: it no longer holds
            self._drop(key)
            entry = None
        carried = getattr(context, _CARRIED, None)
        if carried is not None and carried.every is not None:  # agreed with the draw
            self.carried += 1
            reuse = carried.every
            if reuse and entry is None:
                raise RuntimeError(
                    f"{self._owner}(input_dist_cache_mb=): every rank agreed to reuse a batch's input dist when it was "
                    "drawn, and its sharding changed before its input dist: reshard between evaluations, not during one"
                )
        else:
            reuse = self.disabled is None and self._agree(entry is not None)
        if reuse:
            began = time.perf_counter()
            for name, (module_context, data) in entry.parts.items():  # type: ignore[union-attr]
                context.module_contexts[name] = module_context
                context.input_dist_tensors_requests[name] = _Done(data)
            setattr(context, _HIT, True)
            self.hits += 1
            self.saved_s += entry.seconds - (time.perf_counter() - began)  # type: ignore[union-attr]
            return
        began = time.perf_counter()
        run()
        if key is not None and self.disabled is None:
            names = [m.forward.name for m in modules]
            pending = _Pending(self, key, stamp, {n: context.module_contexts.get(n) for n in names})
            pending.seconds = time.perf_counter() - began
            setattr(context, _PENDING, pending)
        self.misses += 1

    def wait(self, context: Any, run: Callable[[], None]) -> None:
        """Batch ``context``'s input dist awaited: nothing where it came from the cache, else
        ``run()`` (the pipeline's wait), its requests recording what the forward awaits."""
        if getattr(context, _HIT, False):
            return
        began = time.perf_counter()
        run()
        pending = getattr(context, _PENDING, None)
        if pending is None:
            return
        pending.seconds += time.perf_counter() - began
        for name in pending.contexts:
            request = context.input_dist_tensors_requests.get(name)
            if request is None:  # not this model's shape after all: not cached
                delattr(context, _PENDING)
                return
            context.input_dist_tensors_requests[name] = _Recording(request, pending, name)

    def stats(self) -> dict[str, Any]:
        """What the cache kept, reused and saved, on this rank."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "not_kept": self.not_kept,
            "saved_s": self.saved_s,
            "agree_s": self.agree_s,
            "carried": self.carried,
            "disabled": self.disabled,
        }

    def clear(self) -> None:
        """Forget every batch kept."""
        self._entries.clear()
        self.nbytes = 0

    # ------------------------------------------------------------ inside
    def _key(self, batch: Any) -> bytes | None:
        key, why = _key(batch)
        if key is None and not self._told_no_key:
            self._told_no_key = True
            logger.warning(
                "%s(input_dist_cache_mb=): a batch (%s) gets no key, its input dist is not cached: %s",
                self._owner, type(batch).__qualname__, why,
            )  # fmt: skip
        return key

    def _check(self, modules: list[Any], postprocs: list[Any]) -> None:
        if self.disabled is not None:
            return
        impure = sorted({type(m).__name__ for m in modules} - PURE_INPUT_DIST)
        if impure:
            self.disabled = f"the input dist of {', '.join(impure)} may depend on more than the batch"
        elif postprocs:
            self.disabled = "a pipelined postproc computes a sharded module's input"
        if self.disabled is not None:
            self.clear()
            logger.warning("%s(input_dist_cache_mb=): off for this model: %s", self._owner, self.disabled)

    @staticmethod
    def _stamp(modules: list[Any]) -> tuple[Any, ...]:
        """The sharding the input dists follow: each module and its shardings (an EmbeddingBag
        collection's ``_embedding_shardings``, an Embedding collection's by sharding type), which
        ``update_shards`` replaces; not the input dists themselves, made at the first batch."""

        def shardings(m: Any) -> tuple[int, ...]:
            found = getattr(m, "_embedding_shardings", None)
            if found is None:
                found = list(getattr(m, "_sharding_type_to_sharding", {}).values())
            return tuple(id(s) for s in found)

        return tuple((id(m), shardings(m)) for m in modules)  # (read at a draw too: forwards may be detached)

    def _agree(self, have: bool) -> bool:
        if self.group is None:
            return have
        began = time.perf_counter()
        flag = torch.tensor([1 if have else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        self.agree_s += time.perf_counter() - began
        return bool(flag.item())

    def _keep(self, pending: _Pending) -> None:
        if pending.key in self._entries:
            return
        parts = {name: (pending.contexts[name], pending.data[name]) for name in pending.contexts}
        nbytes = _nbytes(list(parts.values()), set())
        if self.nbytes + nbytes > self.max_bytes:
            self.not_kept += 1
            return
        self._entries[pending.key] = _Entry(pending.stamp, parts, nbytes, pending.seconds)
        self.nbytes += nbytes

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
