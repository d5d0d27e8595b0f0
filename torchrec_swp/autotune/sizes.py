"""How many bytes a batch holds: the tensors it reaches, each storage counted once.

A batch is whatever the data yields and the tasks write into its slot: tensors, TorchRec's
KeyedJaggedTensor and Batch dataclasses, lists, tuples, dicts, objects with attributes. The walk
follows containers and attributes (``__dict__``, ``__slots__``, dataclass fields) to a depth of
8, counts every tensor's storage once (views of one storage share it) and ignores modules,
functions, classes and the rest.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

_MAX_DEPTH = 8
_SKIPPED = (torch.nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def batch_bytes(value: Any) -> int:
    """Bytes of the tensor storages ``value`` reaches (module docstring)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    _walk(value, 0, seen_objects, storages)
    return sum(storages.values())


def _walk(value: Any, depth: int, seen: set[int], storages: dict[int, int]) -> None:
    if depth > _MAX_DEPTH or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, torch.Tensor):
        if value.layout is torch.strided:
            storage = value.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
        return
    if id(value) in seen or isinstance(value, _SKIPPED):
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for v in value.values():
            _walk(v, depth + 1, seen, storages)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _walk(v, depth + 1, seen, storages)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _walk(getattr(value, f.name, None), depth + 1, seen, storages)
    else:
        for v in getattr(value, "__dict__", {}).values():
            _walk(v, depth + 1, seen, storages)
        for name in getattr(type(value), "__slots__", ()):
            _walk(getattr(value, name, None), depth + 1, seen, storages)
