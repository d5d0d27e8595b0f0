"""The TorchDispatchMode that sees every aten op run inside a checked task, and what it reads
and writes.

Which storages an op reads and writes comes from its schema's alias information, as
``torch.cuda._sanitizer`` decides it:

* an argument annotated ``(a!)`` is written (in-place and ``out=`` ops);
* an argument annotated ``(a)`` (a view's input) and any input of a factory (``new_*``,
  ``*_like``) is metadata only: no access;
* any other tensor argument is read;
* a return annotated ``(a)`` is a view (no access), ``(a!)`` the written argument again; any
  other return is a fresh storage written on the current stream, except the returns of
  ``empty*`` / ``new_empty*``, which are allocated but not written.

Two departures from the sanitizer: a factory's output is written (``zeros_like`` launches a
fill kernel on CUDA); ``lift_fresh``'s input (``torch.tensor(...)`` inside a task) counts as
allocated on the current stream. Plans are computed once per op overload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# access codes: what an op does to the storage of one tensor argument or return
NONE, READ, WRITE = 0, 1, 2

_FACTORY = re.compile(r"(new_.*|.*_like)$")
_ALLOC_ONLY = re.compile(r"(empty.*|new_empty.*)$")
_FRESH_INPUT = ("lift_fresh",)
# ops that make the host wait for the current stream on CUDA (a device-to-host copy of a scalar),
# when a host read (autograd.HOST_READS: .item(), .tolist(), ...) asked for them
_HOST_SYNC = ("_local_scalar_dense",)


@dataclass(frozen=True, slots=True)
class OpPlan:
    """What one op overload does to its tensor arguments: ``(name, access, fresh)`` per
    positional argument, the same by keyword name, and per return."""

    name: str
    positional: tuple[tuple[str, int, bool], ...]
    keyword: dict[str, tuple[int, bool]]
    returns: tuple[tuple[int, bool], ...]
    host_sync: bool


_plans: dict[Any, OpPlan] = {}


def op_plan(func: Any) -> OpPlan:
    """The (cached) access plan of ``func``, an ``OpOverload``."""
    plan = _plans.get(func)
    if plan is None:
        plan = _plans[func] = _build(func)
    return plan


def _build(func: Any) -> OpPlan:
    schema = func._schema
    base = schema.name.split("::")[-1]
    factory = bool(_FACTORY.match(base))
    fresh_input = base in _FRESH_INPUT
    args: list[tuple[str, int, bool]] = []
    for a in schema.arguments:
        alias = a.alias_info
        if alias is not None and alias.is_write:
            access = WRITE
        elif alias is not None or factory:
            access = NONE
        else:
            access = READ
        args.append((a.name, access, fresh_input))
    alloc_only = bool(_ALLOC_ONLY.match(base))
    returns: list[tuple[int, bool]] = []
    for r in schema.returns:
        alias = r.alias_info
        if alias is not None:
            returns.append((WRITE if alias.is_write else NONE, False))
        else:
            returns.append((NONE if alloc_only else WRITE, True))
    return OpPlan(
        name=str(func),
        positional=tuple(args),
        keyword={name: (access, fresh) for name, access, fresh in args},
        returns=tuple(returns),
        host_sync=base in _HOST_SYNC,
    )


# One storage touched by one op: (storage, access, fresh, argument name, tensor shape)
Touch = tuple[torch.UntypedStorage, int, bool, str, tuple[int, ...]]


def _collect(value: Any, access: int, fresh: bool, name: str, out: list[Touch]) -> None:
    if isinstance(value, torch.Tensor):
        if (access == NONE and not fresh) or not value.is_cpu:
            return
        try:
            storage = value.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
            return
        out.append((storage, access, fresh, name, value.shape))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, access, fresh, name, out)


class OpObserver(Protocol):
    """What the access mode reports to (``StreamChecker`` is one)."""

    def on_op(self, plan: OpPlan, touches: list[Touch]) -> None:
        """One op ran on the calling thread's current stream, touching ``touches``."""
        ...


class AccessMode(TorchDispatchMode):
    """Reports each op's touches to the checker after the op ran. One instance per thread (a mode
    keeps per-entry state); the checker pushes it for the duration of each task."""

    def __init__(self, checker: OpObserver) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        plan = _plans.get(func) or op_plan(func)
        touches: list[Touch] = []
        positional = plan.positional
        for i, value in enumerate(args):
            if i < len(positional):
                name, access, fresh = positional[i]
                _collect(value, access, fresh, name, touches)
        if kwargs:
            keyword = plan.keyword
            for name, value in kwargs.items():
                spec = keyword.get(name)
                if spec is not None:
                    _collect(value, spec[0], spec[1], name, touches)
        out = func(*args, **kwargs)
        returns = plan.returns
        if len(returns) == 1:
            _collect(out, returns[0][0], returns[0][1], "output", touches)
        elif returns:
            for (access, fresh), value in zip(returns, out, strict=False):
                _collect(value, access, fresh, "output", touches)
        self.checker.on_op(plan, touches)
        return out
