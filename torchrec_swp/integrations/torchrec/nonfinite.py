"""What a TorchRec model's step changes, captured and restored: the effects of ``on_nonfinite=``.

Each class here is the ``Effect`` (``torchrec_swp.engine.transaction``) of one name of
``torchrec_swp.plan.effects``, for a model sharded by TorchRec and its optimizer:

* ``FusedRows`` (``fused_rows``): the fused tables' rows (TorchRec's FUSED kernels: FBGEMM's TBE
  applies the optimizer inside the backward). A forward pre-hook on each fused lookup module
  records the ids it is given (this rank's shard rows, after the input dist) and its TBE's step
  counters; the capture copies those rows of each table and of each of its optimizer states
  (``split_optimizer_states()``: momenta, row counters), never whole tables.
* ``DenseGrads`` (``dense_grads``), ``DenseParams`` (``dense_params``), ``DenseOptim``
  (``dense_optim``): the parameters the dense optimizer steps (not the fused tables'), their
  ``.grad``, and the optimizer's state of them.
* ``EmbCache`` (``emb_cache``): a TBE's cache (a prefetch loads rows into it). Without one (the
  CPU, a table on the device) there is nothing to capture; a cached TBE is refused.

On the CPU the verdict is read on the host and a step that stays finite costs its captures and
checks only; on a GPU each restore selects on the verdict's tensor (``torch.where``), nothing
waits for it on the host. ``effects_for(model, optimizer)`` makes them for a pipeline.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from torchrec_swp.engine.transaction import Effect, Verdict, running_batch
from torchrec_swp.plan import PlanError

LOG = logging.getLogger(__name__)

#: At most this many lookups of one module are kept between two captures (forward calls in
#: training mode without a backward through the pipeline would otherwise pile up).
MAX_RECORDS = 64


def _keep(new: torch.Tensor, saved: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``new`` where ``keep`` else ``saved`` (a device-side select)."""
    return torch.where(keep.to(new.device), new, saved)


# ------------------------------------------------------------------------------ fused rows
def fused_lookups(model: nn.Module) -> list[nn.Module]:
    """TorchRec's fused lookup modules of ``model`` (those with a TBE whose optimizer runs in the
    backward): inside each sharded module's ``_lookups``, which ``named_modules`` does not reach."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        for lookup in getattr(module, "_lookups", None) or ():
            if not isinstance(lookup, nn.Module):
                continue
            for m in lookup.modules():
                tbe = getattr(m, "emb_module", None)
                fused = tbe is not None and hasattr(tbe, "split_optimizer_states") and _fused(tbe)
                if fused and hasattr(m, "_feature_table_map"):
                    found[id(m)] = m
    return list(found.values())


def _optimizer_states(tbe: Any) -> list[list[torch.Tensor]]:
    """A TBE's optimizer states by table (views): ``[table][state]``; none per table for a
    stateless optimizer (EXACT_SGD, whose ``split_optimizer_states()`` is ``[]``)."""
    states = tbe.split_optimizer_states()
    return states if states else [[] for _ in tbe.split_embedding_weights()]


def _fused(tbe: Any) -> bool:
    """Whether a TBE applies an optimizer in its backward (OptimType NONE leaves the rows alone)."""
    return getattr(getattr(tbe, "optimizer", None), "name", "") != "NONE"


def _check_tbe(tbe: Any, where: str) -> None:
    """PlanError where a TBE's rows cannot be captured as rows: a cache in front of them, or
    optimizer states that are not one row per table row."""
    cache = getattr(tbe, "lxu_cache_weights", None)
    if isinstance(cache, torch.Tensor) and cache.numel() > 0:
        raise PlanError(
            f"on_nonfinite: {where} keeps its rows in a cache (UVM caching), whose contents torchrec_swp does not "
            "capture yet; use on_nonfinite='off' for this model"
        )
    weights = tbe.split_embedding_weights()
    for t, states in enumerate(_optimizer_states(tbe)):
        for state in states:
            if state.dim() == 0 or state.shape[0] != weights[t].shape[0]:
                raise PlanError(
                    f"on_nonfinite: {where}'s optimizer {tbe.optimizer} keeps a state of shape {tuple(state.shape)} "
                    f"for a table of {weights[t].shape[0]} rows: not one row per row, it cannot be captured by rows"
                )


class _Layout:
    """Where a TBE's rows are: for its weights and each optimizer state, one tensor over the whole
    buffer, rows first (``full``), and the row of each table's first row in it (``first``, per
    feature: ``first[f]`` for feature ``f``'s table), so that a batch's rows of every table are one
    ``index_select``; None for a buffer whose tables' views do not tile it by rows (tables of
    different widths), captured table by table instead (``tables``)."""

    def __init__(self, tbe: Any, feature_table_map: list[int]) -> None:
        weights = tbe.split_embedding_weights()
        states = _optimizer_states(tbe)
        #: per buffer (weights, then each optimizer state): each table's view
        self.tables: list[list[torch.Tensor]] = [list(weights)] + [
            [states[t][k] for t in range(len(weights))] for k in range(len(states[0]) if states else 0)
        ]
        self.key = _buffers_key(tbe)
        self.full: list[torch.Tensor | None] = []
        self.first: list[torch.Tensor | None] = []
        ftm = torch.tensor(feature_table_map, dtype=torch.long)
        for views in self.tables:
            tiled = _tiled(views)
            self.full.append(None if tiled is None else tiled[0])
            self.first.append(None if tiled is None else tiled[1][ftm].to(views[0].device))
        #: (bags per key) -> per buffer, the first row of each bag's table (None: not tiled)
        self.bag_first: dict[tuple[int, ...], list[torch.Tensor | None]] = {}


_BUFFERS = ("weights_dev", "weights_host", "weights_uvm", "momentum1_dev", "momentum1_host", "momentum1_uvm")


def _buffers_key(tbe: Any) -> tuple[int, ...]:
    """Where a TBE's buffers are (a layout made for other buffers is made again)."""
    buffers = tbe._buffers  # (registered buffers; the module's __getattr__ is slower)
    return tuple(b.data_ptr() if isinstance(b := buffers.get(n), torch.Tensor) else 0 for n in _BUFFERS)


def _tiled(views: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One tensor over the buffer ``views`` (each table's rows) lie in, rows first, and each
    table's first row in it; None unless every view is contiguous, of one storage, dtype and row
    shape, starting at a whole row."""
    v0 = views[0]
    row = v0[0].numel() if v0.dim() > 1 else 1
    storage = v0.untyped_storage()
    for v in views:
        if (
            v.untyped_storage().data_ptr() != storage.data_ptr()
            or v.dtype != v0.dtype
            or v.shape[1:] != v0.shape[1:]
            or not v.is_contiguous()
            or v.storage_offset() % row
        ):
            return None
    rows = storage.nbytes() // v0.element_size() // row
    full = torch.as_strided(v0, (rows, *v0.shape[1:]), (row, *v0.stride()[1:]) if v0.dim() > 1 else (1,), 0)
    return full, torch.tensor([v.storage_offset() // row for v in views], dtype=torch.long)


class FusedRows:
    """``fused_rows`` (module docstring). ``lookups``: the fused lookup modules (``fused_lookups``).

    A lookup is recorded for the batch whose task runs it (``running_batch``): SemiSync looks
    up the next batch before this one's update, so a capture takes its own batch's lookups only.
    The rows of every table of one TBE are gathered at once (``_Layout``: one ``index_select`` per
    buffer, not one per table and buffer). A TBE's step counters (``iter``: Adam's and LAMB's
    step, advanced by each forward) are put back by the advance the batch's own lookups made."""

    empty = False

    def __init__(self, lookups: list[nn.Module], *, host: bool) -> None:
        self.host = host
        self.empty = not lookups  # (a model without fused tables)
        # module -> [(batch, ids, ids per bag, bags per key)]
        self._records: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, tuple[int, ...]]]] = {}
        # (module, batch) -> [[counter, the batch's lookups' advance of it, its value before the lookup running]]
        self._counters: dict[tuple[int, int], list[list[Any]]] = {}
        self._modules = {id(m): m for m in lookups}
        self._layouts: dict[int, _Layout] = {}
        self._open: dict[int, list[tuple[Any, ...]]] = {}  # the batch captured and not yet decided: its captures
        self._bag_features: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # the feature of each bag
        self._handles = []
        for k, m in enumerate(lookups):
            _check_tbe(m.emb_module, f"fused lookup {k} ({type(m).__name__})")
            self._handles.append(m.register_forward_pre_hook(self._record, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._advanced))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @staticmethod
    def _counters_of(module: nn.Module) -> list[torch.Tensor]:
        """The TBE's step counters, where its optimizer advances them (EXACT_SGD's forward returns first)."""
        tbe: Any = module.emb_module  # fbgemm's TBE
        if getattr(tbe.optimizer, "name", "") == "EXACT_SGD":
            return []
        return [c for c in (getattr(tbe, "iter", None), getattr(tbe, "iter_cpu", None)) if isinstance(c, torch.Tensor)]

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A lookup in training with grad, by a task of batch ``b``: its ids (this rank's rows)
        and how many per bag and bags per key, and, the batch's first, its TBE's step counters."""
        b = running_batch()
        if b is None or not (module.training and torch.is_grad_enabled()):
            return
        features = args[0] if args else kwargs.get("features")
        if features is None:
            return
        records = self._records.setdefault(id(module), [])
        if len(records) >= MAX_RECORDS:
            del records[0]
        record = (b, features.values(), features.lengths(), tuple(features.stride_per_key()))
        saved = self._open.get(b)
        if saved is not None:  # a lookup after its batch's capture (PEC applies a gradient by looking
            # its rows up again, then backward through them): those rows, before that backward
            layout = self._layout(id(module))
            pairs = [p for per_buffer in self._record_rows(id(module), layout, record) for p in per_buffer]
            saved.append(([(x, rows, x.index_select(0, rows)) for x, rows in pairs], None))
        else:
            records.append(record)
        entry = self._counters.get((id(module), b))
        if entry is None:  # per counter: it, the batch's advance so far, its value before this lookup
            entry = [[c, torch.zeros_like(c), None] for c in self._counters_of(module)]
            self._counters[(id(module), b)] = entry
        for item in entry:
            item[2] = item[0].detach().clone()  # (before this lookup)

    def _advanced(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After a recorded lookup: its advance of the counters added to its batch's (the lookups of
        other batches between two of this batch's are not: PEC looks up the next batch ahead)."""
        b = running_batch()
        entry = self._counters.get((id(module), b)) if b is not None else None
        for item in entry or ():
            if item[2] is not None:
                item[1] += item[0].detach() - item[2]
                item[2] = None

    def _layout(self, key: int) -> _Layout:
        module: Any = self._modules[key]  # a fused lookup: its TBE (emb_module) and _feature_table_map
        layout = self._layouts.get(key)
        if layout is None or layout.key != _buffers_key(module.emb_module):  # (a buffer replaced)
            layout = self._layouts[key] = _Layout(module.emb_module, module._feature_table_map)
        return layout

    def _rows(self, key: int, b: int, layout: _Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Batch ``b``'s rows on module ``key``: ``(buffer, rows)`` for each buffer (weights, each
        optimizer state; a buffer not tiled by rows: each table's view), with repeats (no unique,
        no host sync); the records of older batches dropped (their step ran without an effect)."""
        per_buffer: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layout.tables]
        kept = []
        for record in self._records.get(key, ()):
            if record[0] > b:
                kept.append(record)
            elif record[0] == b:
                for k, pairs in enumerate(self._record_rows(key, layout, record)):
                    per_buffer[k].extend(pairs)
        self._records[key] = kept
        out = []
        for pairs in per_buffer:
            if len(pairs) == 1 or (pairs and layout.full[0] is None):
                out.extend(pairs)
            elif pairs:  # several lookups of one buffer in the batch
                out.append((pairs[0][0], torch.cat([rows for _, rows in pairs])))
        return out

    def _record_rows(
        self, key: int, layout: _Layout, record: tuple[int, torch.Tensor, torch.Tensor, tuple[int, ...]]
    ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """One lookup's rows on module ``key``, per buffer: ``[(buffer, rows)]`` (one pair where the
        buffer is tiled by rows, else one per table)."""
        _, values, lengths, strides = record
        if not values.numel():
            return [[] for _ in layout.tables]
        ids, n = values.long(), values.numel()
        firsts = layout.bag_first.get(strides)
        if firsts is None:
            bags = torch.repeat_interleave(torch.arange(len(strides)), torch.tensor(strides)).to(values.device)
            firsts = layout.bag_first[strides] = [None if f is None else f[bags] for f in layout.first]
        out: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for k, full in enumerate(layout.full):
            if full is not None:
                # (cast: firsts[k] is None only where full is, both None where the buffer is not tiled)
                out.append(
                    [(full, ids + torch.repeat_interleave(cast(torch.Tensor, firsts[k]), lengths, output_size=n))]
                )
            else:  # table by table (tables of different widths; a boolean mask: a host sync on a GPU)
                table_of = torch.repeat_interleave(
                    torch.tensor(self._modules[key]._feature_table_map, device=ids.device)[
                        torch.repeat_interleave(torch.arange(len(strides)), torch.tensor(strides)).to(ids.device)
                    ],
                    lengths,
                    output_size=n,
                )
                out.append([(view, ids[table_of == t]) for t, view in enumerate(layout.tables[k])])
        return out

    def capture(self, b: int) -> list[tuple[Any, ...]]:
        saved: list[tuple[Any, ...]] = []
        self._open = {b: saved}  # (one batch's step open at a time: an older one never decided is gone)
        for key in self._modules:
            layout = self._layout(key)
            buffers = [(x, rows, x.index_select(0, rows)) for x, rows in self._rows(key, b, layout)]
            if len(self._counters) > len(self._modules):  # (a batch whose step never captured)
                for stale in [k for k in self._counters if k[0] == key and k[1] < b]:
                    del self._counters[stale]
            # the batch's advance so far, and that of its lookups until the verdict (PEC's gradient
            # applications look its rows up again after the capture): read when restored
            saved.append((buffers, (key, b)))
        return saved

    def changed(self, saved: list[tuple[Any, ...]]) -> tuple[list[torch.Tensor], str]:
        return [x.index_select(0, rows) for buffers, _ in saved for x, rows, _ in buffers], "the fused embedding rows"

    def restore(self, saved: list[tuple[Any, ...]], keep: torch.Tensor | bool) -> None:
        self._open = {}
        if keep is True:
            for _, counted in saved:
                self._counters.pop(counted, None)
            return
        # Through ``.data``, as the TBE's own update in the backward, which autograd does not see:
        # a lookup made before it (SemiSync's next batch) still backpropagates through these weights.
        # Latest first: a row captured again after a lookup of the batch had changed it gets its
        # first capture's value last.
        for buffers, counted in reversed(saved):
            for x, rows, old in buffers:
                x.data.index_copy_(0, rows, old if keep is False else _keep(x.index_select(0, rows), old, keep))
            for counter, advance, _ in self._counters.pop(counted, ()) if counted is not None else ():
                counter.data.copy_(counter - advance if keep is False else _keep(counter, counter - advance, keep))


class EmbCache:
    """``emb_cache``: nothing to capture where no TBE has a cache (checked when made: ``FusedRows``
    refuses a cached TBE); its tasks run as they are."""

    empty = True

    def capture(self, b: int) -> None:
        return None

    def changed(self, saved: None) -> tuple[list[torch.Tensor], str]:
        return [], "the embedding cache"

    def restore(self, saved: None, keep: torch.Tensor | bool) -> None:
        return None


class Counters:
    """``counters``: a pipeline's own counters (host ints: e.g. TrainPipelineBase's
    ``_batch_count``), put back where the step rolls back. On a device the verdict is a tensor:
    the restore waits for its host read at the next capture (one step later, as the transaction's
    own count of skipped steps), or at ``settle()`` (the transaction's ``settled()``). Holds the
    pipeline weakly (the pipeline holds its transaction)."""

    empty = False

    def __init__(self, owner: Any, names: tuple[str, ...]) -> None:
        self._owner = weakref.ref(owner)
        self.names = names
        self._late: tuple[dict[str, Any], torch.Tensor] | None = None

    def capture(self, b: int) -> dict[str, Any]:
        self.settle()
        owner = self._owner()
        return {} if owner is None else {n: getattr(owner, n) for n in self.names}

    def changed(self, saved: dict[str, Any]) -> tuple[list[torch.Tensor], str]:
        return [], "the pipeline's counters"

    def restore(self, saved: dict[str, Any], keep: torch.Tensor | bool) -> None:
        if isinstance(keep, torch.Tensor):
            self._late = (saved, keep)
        elif not keep:
            self._put(saved)

    def settle(self) -> None:
        """A device verdict read on the host, its restore done where it rolled back."""
        late, self._late = self._late, None
        if late is not None and not bool(late[1]):
            self._put(late[0])

    def _put(self, saved: dict[str, Any]) -> None:
        owner = self._owner()
        if owner is not None:
            for name, value in saved.items():
                setattr(owner, name, value)


# ------------------------------------------------------------------------------ dense part
def _is_dense(p: Any) -> bool:
    """A parameter the dense optimizer steps: a plain tensor, not a fused table (TorchRec marks
    those ``_in_backward_optimizers``), not a ShardedTensor."""
    sharded = type(p).__name__ == "ShardedTensor"
    return isinstance(p, torch.Tensor) and not sharded and not hasattr(p, "_in_backward_optimizers")


def leaf_optimizers(optimizer: Any) -> Iterator[Any]:
    """The torch optimizers inside TorchRec's wrappers (CombinedOptimizer's ``_optims``,
    KeyedOptimizerWrapper's and OptimizerWrapper's ``_optimizer``)."""
    inner = getattr(optimizer, "_optims", None)
    if inner is not None:
        for item in inner:
            yield from leaf_optimizers(item[1] if isinstance(item, tuple) else item)
        return
    wrapped = getattr(optimizer, "_optimizer", None)
    if wrapped is not None and wrapped is not optimizer:
        yield from leaf_optimizers(wrapped)
        return
    yield optimizer


def dense_parameters(optimizer: Any) -> list[tuple[Any, torch.Tensor]]:
    """``(leaf optimizer, parameter)`` for each dense parameter the optimizer steps, in order, once."""
    seen: set[int] = set()
    out = []
    for leaf in leaf_optimizers(optimizer):
        for group in getattr(leaf, "param_groups", ()):
            for p in group["params"]:
                if _is_dense(p) and id(p) not in seen:
                    seen.add(id(p))
                    out.append((leaf, p))
    return out


class _Buffers:
    """Copies of a list of tensors into buffers kept from step to step: one fused copy
    (``_foreach_copy_``) where the tensors have the last step's shapes, else new clones. What a
    capture returns is only good until the next capture (one step open at a time)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self._buffers
        with torch.no_grad():
            if len(buffers) == len(tensors) and all(
                b.shape == t.shape and b.dtype == t.dtype and b.device == t.device for b, t in zip(buffers, tensors)
            ):
                if tensors:
                    torch._foreach_copy_(buffers, tensors)
                return buffers
            self._buffers = [t.detach().clone() for t in tensors]
        return self._buffers


class DenseParams:
    """``dense_params``: a copy of every dense parameter."""

    empty = False

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self._buffers = _Buffers()

    def capture(self, b: int) -> list[torch.Tensor]:
        return self._buffers.copy(self.params)

    def changed(self, saved: list[torch.Tensor]) -> tuple[list[torch.Tensor], str]:
        return self.params, "the dense parameters"

    def restore(self, saved: list[torch.Tensor], keep: torch.Tensor | bool) -> None:
        if keep is True:
            return
        with torch.no_grad():
            if keep is False:
                torch._foreach_copy_(self.params, saved)
                return
            for p, old in zip(self.params, saved):
                p.copy_(_keep(p, old, keep))


class DenseGrads:
    """``dense_grads``: a copy of every dense parameter's ``.grad`` (None stays None)."""

    empty = False

    def __init__(self, named: list[tuple[str, torch.Tensor]], host: bool) -> None:
        self.named, self.host = named, host
        self._buffers = _Buffers()

    def capture(self, b: int) -> list[torch.Tensor | None]:
        grads = [p.grad for _, p in self.named]
        present = [g for g in grads if g is not None]
        if not present:
            return grads  # (all None: nothing to copy)
        copies = iter(self._buffers.copy(present))
        return [None if g is None else next(copies) for g in grads]

    def changed(self, saved: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], str]:
        return [p.grad for _, p in self.named if p.grad is not None], "the dense gradients"

    def describe(self, saved: list[torch.Tensor | None]) -> str:
        """Which gradient is not finite (the first, by parameter name)."""
        for name, p in self.named:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"the gradient of {name}"
        return "the dense gradients"

    def restore(self, saved: list[torch.Tensor | None], keep: torch.Tensor | bool) -> None:
        if keep is True:
            return
        if keep is not False and any(old is None for old in saved):
            keep = bool(keep)  # (a gradient to drop again: decided on the host)
            if keep:
                return
        for (_, p), old in zip(self.named, saved):
            if old is None:
                p.grad = None
            elif p.grad is None:
                p.grad = old.clone()  # (the buffer is the next capture's)
            else:
                p.grad.copy_(old if keep is False else _keep(p.grad, old, keep))


class DenseOptim:
    """``dense_optim``: each dense parameter's optimizer state, copied (absent stays absent: a
    state the step created is dropped again)."""

    empty = False

    def __init__(self, owned: list[tuple[Any, torch.Tensor]]) -> None:
        self.owned = owned
        self._buffers = _Buffers()

    def capture(self, b: int) -> list[dict[str, Any] | None]:
        states = [leaf.state.get(p) for leaf, p in self.owned]
        tensors = [v for state in states for v in (state or {}).values() if isinstance(v, torch.Tensor)]
        copies = iter(self._buffers.copy(tensors))
        return [
            None if not state else {k: next(copies) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for state in states
        ]

    def changed(self, saved: list[dict[str, Any] | None]) -> tuple[list[torch.Tensor], str]:
        tensors = [
            v
            for leaf, p in self.owned
            for v in (leaf.state.get(p) or {}).values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()
        ]
        return tensors, "the dense optimizer's state"

    def restore(self, saved: list[dict[str, Any] | None], keep: torch.Tensor | bool) -> None:
        if keep is True:
            return
        if keep is not False and not self._selectable(saved):
            keep = bool(keep)  # (a state to drop or a number to put back: decided on the host)
            if keep:
                return
        with torch.no_grad():
            for (leaf, p), old in zip(self.owned, saved):
                state = leaf.state.get(p)
                if old is None:
                    leaf.state.pop(p, None)
                    continue
                if state is None:  # (clones: the buffers are the next capture's)
                    leaf.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in old.items()}
                    continue
                for k, v in old.items():
                    now = state.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(now, torch.Tensor) and now.shape == v.shape:
                        now.copy_(v if keep is False else _keep(now, v, keep))
                    elif now is not v:  # a number, None, or a tensor replaced: as it was
                        state[k] = v.clone() if isinstance(v, torch.Tensor) else v
                for k in [k for k in state if k not in old]:
                    del state[k]

    def _selectable(self, saved: list[dict[str, Any] | None]) -> bool:
        """Whether the restore is selects only: every state there before, with the same tensors'
        shapes and the same other values (SGD's ``momentum_buffer=None``)."""
        for (leaf, p), old in zip(self.owned, saved):
            state = leaf.state.get(p)
            if old is None or state is None or set(state) != set(old):
                return False
            for k, v in old.items():
                now = state[k]
                if isinstance(v, torch.Tensor):
                    if not isinstance(now, torch.Tensor) or now.shape != v.shape:
                        return False
                elif now is not v and now != v:
                    return False
        return True


# ------------------------------------------------------------------------------ for a pipeline
def effects_for(model: nn.Module, optimizer: Any, *, host: bool) -> tuple[dict[str, Effect], FusedRows]:
    """The effects a TorchRec pipeline's plan may declare, for its ``model`` and ``optimizer``
    (``host``: verdicts read on the host, the CPU); and the fused rows' hooks, to remove on close."""
    owned = dense_parameters(optimizer)
    named = list(model.named_parameters())  # (kept alive: a sharded module yields new objects, whose ids recur)
    names = {id(p): n for n, p in named}
    fused = FusedRows(fused_lookups(model), host=host)
    effects: dict[str, Effect] = {
        "fused_rows": fused,
        "emb_cache": EmbCache(),
        "dense_params": DenseParams([p for _, p in owned]),
        "dense_grads": DenseGrads([(names.get(id(p), f"parameter {k}"), p) for k, (_, p) in enumerate(owned)], host),
        "dense_optim": DenseOptim(owned),
    }
    return effects, fused


def report_at_rank_0(rank: int, owner: str) -> Any:
    """What tells of a rolled-back step: one line at rank 0 (logger ``LOG``: this module's name)."""

    def report(verdict: Verdict) -> None:
        if rank == 0:
            LOG.warning("%s: %s", owner, verdict.line())

    return report
