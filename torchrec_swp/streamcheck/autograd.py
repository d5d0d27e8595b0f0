"""Backward on the streams CUDA would run it on.

On CUDA each backward op runs on the stream its forward op ran on, and the autograd engine
syncs a node's stream with the streams that produced its input gradients; the ``backward()``
call as a whole is ordered like one op on the calling thread's current stream. Without this the
checker would see every backward op on the stream current at ``.backward()`` (a TBE's fused
update reading on ``default`` what its forward allocated on ``data_dist``, say) and report uses
that a CUDA run does not have.

``NodeStreams`` (a TorchFunctionMode, pushed with the access mode for each task) tags the
autograd node of every tensor made while a stream other than the default is current: the node
gets a pre-hook that makes that stream wait for the calling thread's current stream and enters
it, and a hook that leaves it and makes the current stream wait for it. Nodes made inside one
Python-level torch call (the inner ops of a custom op, say) are not seen; only the node of its
outputs is tagged, and the others run on the current stream. The mode also marks the calls that
read a device value on the host (``HOST_READS``: ``.item()``, ``.tolist()``, ...): only their
``_local_scalar_dense`` synchronises the host with the stream. Custom ``autograd.Function``s'
``apply`` is not a torch function: the installed checker's patch of it tags their nodes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from torchrec_swp.streamcheck.emulated import Stream

_TAG = "swp_stream"
_HOST_READ_NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
#: The calls that read a device value on the host (a blocking device-to-host copy on CUDA). Only
#: inside one of them is an ``aten._local_scalar_dense`` a host synchronisation: the CPU kernels
#: also call it internally (the CPU TBE backward does, 8 times a step), where CUDA's do not.
HOST_READS = frozenset(getattr(c, n) for c in (torch._C.TensorBase, torch.Tensor) for n in _HOST_READ_NAMES)


class BackwardOps(Protocol):
    """What ``NodeStreams`` asks of its checker (``StreamChecker`` is one); each acts for the
    calling thread."""

    @property
    def default_stream(self) -> Stream: ...

    def current_stream(self) -> Stream: ...

    def implicit_wait(self, stream: Stream, other: Any) -> None: ...

    def enter_stream(self, stream: Stream) -> None: ...

    def leave_stream(self, stream: Stream) -> None: ...

    def count_backward_node(self) -> None: ...


class NodeStreams(TorchFunctionMode):
    """Tags the autograd nodes made on a non-default stream with it (see the module docstring).
    One instance per thread, like the access mode: ``in_host_read`` is the thread's."""

    def __init__(self, checker: BackwardOps) -> None:
        super().__init__()
        self.checker = checker
        self._host_reads = 0  # nesting of HOST_READS calls on this thread

    @property
    def in_host_read(self) -> bool:
        """Whether the thread is inside a call that reads a device value on the host."""
        return self._host_reads > 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            self._host_reads += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self._host_reads -= 1
        out = func(*args, **(kwargs or {}))
        self.tag_outputs(out)
        return out

    def tag_outputs(self, out: Any) -> None:
        """Tag the nodes of ``out`` (a tensor, or a tuple/list of them) with the current stream,
        if that is not the default one. ``patches`` calls it for ``autograd.Function.apply``,
        which torch function modes do not see."""
        stream = self.checker.current_stream()
        if stream is self.checker.default_stream:
            return
        if isinstance(out, torch.Tensor):
            self._tag(out, stream)
        elif isinstance(out, (tuple, list)):
            for value in out:
                if isinstance(value, torch.Tensor):
                    self._tag(value, stream)

    def _tag(self, tensor: torch.Tensor, stream: Stream) -> None:
        node = tensor.grad_fn
        if node is None:
            return
        metadata: dict[Any, Any] = node.metadata  # type: ignore[assignment]  # a dict (torch's stub: a method)
        if _TAG in metadata:
            return
        metadata[_TAG] = stream
        checker = self.checker
        checker.count_backward_node()
        ambient: list[Stream] = []

        def enter(grad_outputs: Any) -> None:
            current = checker.current_stream()
            ambient.append(current)
            checker.implicit_wait(stream, current)
            checker.enter_stream(stream)

        def leave(grad_inputs: Any, grad_outputs: Any) -> None:
            checker.leave_stream(stream)
            checker.implicit_wait(ambient.pop() if ambient else checker.current_stream(), stream)

        node.register_prehook(enter)
        node.register_hook(leave)
