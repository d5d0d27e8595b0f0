"""What an installed checker patches in torch, so that library code inside a task is seen.

torch 2.13's CPU device module (``torch.cpu``, which ``torch.get_device_module("cpu")`` and
``torch.get_device_module(torch.device("cpu"))`` return) has no-op ``Stream``/``Event``
classes and one *process-global* current stream. While installed:

===============================  ==========================================================
``torch.cpu.current_stream()``   the calling thread's current emulated stream (default:
                                 the checker's ``default`` stream; per thread, as on CUDA)
``torch.cpu.stream(s)``,         enter ``s`` on the calling thread (None: no-op). The
``torch.cpu.StreamContext(s)``   original ``torch.cpu.stream`` looks ``StreamContext`` up at
                                 call time, so references taken before installing (TorchRec
                                 keeps ``get_device_module(device).stream`` as
                                 ``self._stream_context``) are covered too.
``torch.cuda.StreamContext(s)``  the same for this checker's streams and adopted objects, and
(so ``torch.cuda.stream(s)``)    for any stream while CUDA is unavailable (TorchRec's
                                 ``_stream_context`` is ``torch.cuda.stream`` on CPU devices,
                                 where the original is a no-op); else the original.
``torch.cpu.Stream(...)``        a new emulated stream; ``torch.cpu.Event(...)``: a new
                                 emulated event; ``torch.cpu.synchronize()``: device sync.
``Tensor.record_stream(s)``      for CPU tensors: ``checker.record_stream`` (every tensor of
                                 a KJT/JaggedTensor/KeyedTensor/context goes through it);
                                 other tensors: the original.
``Tensor.to(cpu, non_blocking=   inside a task, of host memory (a storage made outside every
True)``                          task): a copy made on the current stream, as an H2D copy is
                                 (``checker.host_to_device``); else the original
``autograd.Function.apply``      the original (a Python classmethod on torch 2.13, C's
                                 ``_FunctionBase.apply`` on 2.14) bound to the class applied,
                                 then the outputs' autograd node is tagged with the current
                                 stream (``autograd``: backward runs there)
===============================  ==========================================================

Stream objects that are not emulated (a user's ``torch.cpu.Stream()`` made before installing,
a ``torch.Stream(device="cpu")``) are adopted on first sight: each stands for one emulated
stream. Not covered: ``torch.Stream``/``torch.Event``'s own methods and ``with torch.Stream``
(an immutable C type; on the CPU its ``wait_stream``/``record_event`` raise anyway),
``torch.accelerator.*`` (no accelerator on a CPU-only machine), ``torch.cuda.current_stream``
/ ``torch.cuda.Event`` (they raise without CUDA; TorchRec calls them only for CUDA devices).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.cpu
import torch.cuda

from torchrec_swp.streamcheck.emulated import Event, Stream

_MISSING = object()


class PatchedOps(Protocol):
    """What the patched torch functions ask of the installed checker (``StreamChecker`` is one)."""

    def current_stream(self) -> Stream: ...

    def stream_context(self, stream: Any) -> Any: ...

    def knows(self, obj: Any) -> bool: ...

    def synchronize(self) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...

    def host_to_device(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def tag_backward(self, out: Any) -> None: ...


class TorchPatch:
    """Installs and removes the patches above for one checker (process-global)."""

    def __init__(self, checker: PatchedOps) -> None:
        self.checker = checker
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        checker = self.checker
        original_cuda_context = torch.cuda.StreamContext
        original_record_stream = torch.Tensor.record_stream
        cuda_available = torch.cuda.is_available()

        def current_stream(device: Any = None) -> Stream:
            return checker.current_stream()

        def stream(stream: Any) -> Any:
            return checker.stream_context(stream)

        # classes, not functions: torch (dynamo among others) checks isinstance(x, StreamContext)
        class CpuStreamContext:
            def __new__(cls, stream: Any) -> Any:
                return checker.stream_context(stream)

        # (the ignore below: subclasses the class torch has at run time)
        class CudaStreamContext(original_cuda_context):  # type: ignore[misc, valid-type]
            def __new__(cls, stream: Any) -> Any:
                if stream is not None and (checker.knows(stream) or not cuda_available):
                    return checker.stream_context(stream)
                return original_cuda_context(stream)

        def synchronize(device: Any = None) -> None:
            checker.synchronize()

        def record_stream(self: torch.Tensor, stream: Any) -> None:
            if self.is_cpu:
                checker.record_stream(self, stream)
            else:
                original_record_stream(self, stream)

        self._set(torch.cpu, "current_stream", current_stream)
        self._set(torch.cpu, "stream", stream)
        self._set(torch.cpu, "StreamContext", CpuStreamContext)
        self._set(torch.cpu, "Stream", Stream)
        self._set(torch.cpu, "Event", Event)
        self._set(torch.cpu, "synchronize", synchronize)
        self._set(torch.cuda, "StreamContext", CudaStreamContext)
        self._set(torch.Tensor, "record_stream", record_stream)
        original_to = torch.Tensor.to

        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = original_to(self, *args, **kwargs)
            if out is self and self.is_cpu and not torch.compiler.is_compiling():
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                if non_blocking and device is not None and torch.device(device).type == "cpu":
                    return checker.host_to_device(self)
            return out

        self._set(torch.Tensor, "to", to)
        # torch 2.13 defines ``apply`` in Python (a ``classmethod``); torch 2.14 sets it to the C
        # ``_FunctionBase.apply`` (a ``classmethod_descriptor``, which has no ``__func__``). Both
        # are descriptors: binding the saved one to ``cls`` calls it for the subclass applied.
        original_apply = torch.autograd.Function.__dict__["apply"]

        def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_apply.__get__(None, cls)(*args, **kwargs)
            if not torch.compiler.is_compiling():
                checker.tag_backward(out)
            return out

        self._set(torch.autograd.Function, "apply", classmethod(apply))

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    def uninstall(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
