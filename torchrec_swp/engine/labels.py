"""Profiler labels at a quarter of ``torch.profiler.record_function``'s cost.

``record_function("## forward 3 ##")`` as upstream's pipelines write it goes through
``torch.ops.profiler._record_function_enter_new``: a Python dispatch of a registered op on every
enter and exit, about 6 us per label on this machine whether a profiler is on or not, several
times per ``progress()``. ``record_function`` here opens the same ``RecordFunction`` (user scope,
the same name, no inputs) through the C++ call the op itself makes
(``torch._C._autograd._record_function_with_args_enter`` / ``_exit``), so a profiler, an NVTX or
ITT range, or any other RecordFunction callback sees exactly what torch's context manager gives it
(``tests/unit/test_labels.py`` compares the traces), at about 1.5 us per label.

For labels only: no arguments, not for TorchScript (torch's own ``record_function`` stays the one
to use there). A torch without the two calls gets torch's context manager itself.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["record_function"]

_AUTOGRAD = torch._C._autograd
_enter: Any = getattr(_AUTOGRAD, "_record_function_with_args_enter", None)  # (None: torch's own is used)
_exit: Any = getattr(_AUTOGRAD, "_record_function_with_args_exit", None)


class _Label:
    """``with record_function(name):`` the profiler range ``name`` around the block."""

    __slots__ = ("_handle", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._handle: Any = None

    def __enter__(self) -> _Label:
        self._handle = _enter(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        handle, self._handle = self._handle, None
        _exit(handle)


#: ``with record_function(name):`` (``_Label``, or torch's own where torch lacks the C++ calls).
record_function: Any = _Label if _enter is not None and _exit is not None else torch.autograd.profiler.record_function
