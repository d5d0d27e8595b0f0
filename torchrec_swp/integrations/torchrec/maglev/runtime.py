"""What each action kind does on one rank: the bindings ``ProgramEngine`` calls.

``RankRuntime`` holds, for one rank and one optimizer step, the stages the rank owns
(``Chunk``: a module called as ``module(stage_input, in_activations)``, Maglev's stage
contract, and its activation specs) and what flows between actions: each microbatch's
incoming activation, outputs, hoisted lookups, received gradients. Its ``bindings()`` map
every kind to ``fn(stage, microbatch)``:

=====  =====================================================================================
``E``  the stage's embedding lookups (``sparse_forward``), held for its ``F``
``F``  await the activation (from the wire, or detached from the local previous stage), run
       the stage (its dense half after an ``E``) under ``forward_context(stage, mb)``
``B``  await the output gradient (wire, or the local next stage's input ``.grad``; the loss on
       the last stage), ``autograd.backward``: input and weight gradients
``I``  the same restricted to the stage's input (``inputs=``, graph retained)
``W``  the same restricted to the stage's parameters (frees the graph)
``SF`` ``SB``  send the output / the input gradient (``Wire``)
``RF`` ``RB``  post the receive; the consumer awaits it
``G``  the stage's data-parallel gradient sync (``grad_sync``; none by default)
``O``  the stage's optimizer step (once per optimizer, at its last stage's ``O``)
=====  =====================================================================================

A local stage boundary (two consecutive stages on this rank: the V schedules) passes the
activation detached (a new leaf) and its gradient back through the leaf's ``.grad``, as
torch.distributed.pipelining does; numerically the same as a send.

``Wire`` is how activations and gradients cross ranks: ``StageWrapperWire`` is Maglev's own
hand-off (a ``StageWrapper``'s receive queues and one send in flight per direction), used by
the drop-in pipelines so that every transfer is the call upstream makes; ``P2PWire`` posts
one ``irecv``/``isend`` per (stage, microbatch) on two direction-split groups for ranks that
hold several stages, and drains its sends at the end of the step.

Transfers are bounded on both wires: a receive waits for its peer at most ``timeout_s`` (the
pipeline's ``engine_timeout_s``), and so does a send (gloo completes a send only once the peer
posted the matching receive); past it the action waiting fails with ``TransferTimeout`` naming
the direction, the stage, the microbatch and the peer rank, and the engine's failure path ends
the step. So a peer that failed and stays connected ends this rank with a named error, not a
hang (a peer that exits closes the connection: that error comes at once, with the same
transfer named in a note). The bound is per transfer, not the engine's progress rule
(``engine.board``): this rank cannot see its peer work, so a peer's work between two of its
transfers (its computes, its own waits) must take less than ``engine_timeout_s``. Upstream's
``StageWrapper`` waits (``wait_for_act``/``wait_for_grad``, ``finish_send_*``, ``drain_sends``)
call ``work.wait()`` with no timeout, which gloo does not bound (the hand-off groups' timeout
does not apply to it): ``StageWrapperWire`` wraps the works of each transfer it starts in
``BoundedWork`` so that upstream's own waits are the bounded ones. ``P2PWire`` waits its sends
with the bound at the step's end.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from torchrec_swp.integrations.torchrec.maglev.cpu import dense_forward, sparse_forward

Activations = tuple[torch.Tensor, ...]


@dataclass
class Chunk:
    """One stage this rank runs: ``module(stage_input, in_activations)`` returns the outgoing
    activation tuple, or ``(loss, output)`` on the last stage; ``in_specs``/``out_specs`` are
    the stage's ``ActivationSpec`` s (shape, dtype, whether a gradient flows back)."""

    index: int
    module: Callable[..., Any]
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    parameters: list[nn.Parameter] = field(default_factory=list)
    #: the module whose layers ``sparse_forward``/``dense_forward`` split (``E`` actions)
    split_module: nn.Module | None = None


class Wire(Protocol):
    def post_recv_act(self, stage: int, mb: int) -> None: ...

    def await_act(self, stage: int, mb: int) -> Activations: ...

    def send_act(self, stage: int, mb: int, outputs: Activations) -> None: ...

    def post_recv_grad(self, stage: int, mb: int) -> None: ...

    def await_grad(self, stage: int, mb: int) -> list[torch.Tensor]: ...

    def send_grad(self, stage: int, mb: int, in_activations: Activations) -> None: ...

    def drain(self) -> None: ...


class TransferTimeout(TimeoutError):
    """A receive or send whose peer did not take part within the wire's timeout (the engine's
    ``engine_timeout_s``): gloo completes a send only once the peer posted its receive."""


def bounded_wait(work: Any, timeout_s: float, what: str) -> None:
    """Wait on one transfer's ``work`` at most ``timeout_s``: ``TransferTimeout`` naming ``what``
    (the direction, stage, microbatch and peer) once the bound passed; another failure of the
    wait (the peer closed the connection) keeps its type and gains a note naming ``what``."""
    start = time.monotonic()
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        waited = time.monotonic() - start
        if waited < timeout_s:
            e.add_note(f"torchrec_swp: while waiting {waited:.1f}s for {what}")
            raise
        raise TransferTimeout(
            f"{what}: not done within {timeout_s:g}s (engine_timeout_s): the peer failed, hangs, or its work "
            "between two transfers takes longer than the timeout"
        ) from e


class BoundedWork:
    """One transfer's work handle whose ``wait()`` is ``bounded_wait``: what ``StageWrapperWire``
    puts in place of upstream's work handles, so that upstream's ``work.wait()`` is bounded.
    Waits once (gloo's second wait on a finished receive would wait for another message)."""

    def __init__(self, work: Any, timeout_s: float, what: str) -> None:
        self.work, self.timeout_s, self.what = work, timeout_s, what
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            bounded_wait(self.work, self.timeout_s, self.what)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or bool(self.work.is_completed())


class StageWrapperWire:
    """Maglev's hand-off, call for call: ``start_recv_act``/``wait_for_act`` (a FIFO queue),
    ``finish_send_act`` then ``start_send_act`` (one send in flight), the same for gradients,
    ``drain_sends``. Needs one stage per rank and microbatches in order per direction.

    Each transfer is bounded by ``timeout_s`` (module docstring): the work handles of the
    receive upstream's ``start_recv_act``/``start_recv_grad`` just queued, and of the send its
    ``start_send_act``/``start_send_grad`` just put in flight, become ``BoundedWork`` s, and
    upstream's ``wait_for_*``/``finish_send_*``/``drain_sends`` wait on those."""

    def __init__(self, stage: Any, *, timeout_s: float) -> None:
        for name, kind in (("_recv_act", deque), ("_recv_grad", deque), ("_send_act", list), ("_send_grad", list)):
            if not isinstance(getattr(stage, name, None), kind):
                raise TypeError(
                    f"{type(stage).__name__} has no {kind.__name__} {name} of work handles as TorchRec 1.9's "
                    "StageWrapper does: its transfers cannot be bounded"
                )
        self.stage = stage
        self.timeout_s = timeout_s

    def _post(self, queue: deque[Any], start: Callable[[], None], what: str, offset: int, stage: int, mb: int) -> None:
        """Upstream's ``start``, then the receive it queued (none on the first/last stage) bounded."""
        before = len(queue)
        start()
        if len(queue) > before:
            works, peer = queue[-1][0], self.stage.neighbor_rank(offset)
            label = f"receive of the {what} for stage {stage}, microbatch {mb} from rank {peer}"
            works[:] = [BoundedWork(w, self.timeout_s, label) for w in works]

    def _send(self, in_flight: str, start: Callable[[], None], what: str, offset: int, stage: int, mb: int) -> None:
        """Upstream's ``start`` of a send, then the works it put in flight (its new list
        ``in_flight``; none on the last/first stage) bounded: the next ``finish_send_*`` or
        ``drain_sends`` waits on them."""
        start()
        sends = getattr(self.stage, in_flight)
        if sends:
            label = f"send of the {what} of stage {stage}, microbatch {mb} to rank {self.stage.neighbor_rank(offset)}"
            sends[:] = [(BoundedWork(w, self.timeout_s, label), buf) for w, buf in sends]

    def post_recv_act(self, stage: int, mb: int) -> None:
        self._post(self.stage._recv_act, self.stage.start_recv_act, "activation", -1, stage, mb)

    def await_act(self, stage: int, mb: int) -> Activations:
        return self.stage.wait_for_act()

    def send_act(self, stage: int, mb: int, outputs: Activations) -> None:
        self.stage.finish_send_act()
        self._send("_send_act", partial(self.stage.start_send_act, outputs), "activation", 1, stage, mb)

    def post_recv_grad(self, stage: int, mb: int) -> None:
        self._post(self.stage._recv_grad, self.stage.start_recv_grad, "gradient", 1, stage, mb)

    def await_grad(self, stage: int, mb: int) -> list[torch.Tensor]:
        return self.stage.wait_for_grad()

    def send_grad(self, stage: int, mb: int, in_activations: Activations) -> None:
        self.stage.finish_send_grad()
        start = partial(self.stage.start_send_grad, in_activations)
        self._send("_send_grad", start, "gradient", -1, stage, mb)

    def drain(self) -> None:
        self.stage.drain_sends()


class P2PWire:
    """One ``irecv``/``isend`` per tensor per (stage, microbatch): activations on ``act_pg``,
    gradients on ``grad_pg``; ``peer(stage)`` is the global rank running ``stage``. Receive
    buffers follow the specs, as Maglev's do; zeros go back for an input with no gradient."""

    def __init__(
        self,
        chunks: Mapping[int, Chunk],
        peer: Callable[[int], int],
        act_pg: dist.ProcessGroup,
        grad_pg: dist.ProcessGroup,
        *,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.chunks, self.peer, self.act_pg, self.grad_pg = chunks, peer, act_pg, grad_pg
        self.device = device
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self._recv: dict[tuple[str, int, int], tuple[list[Any], list[torch.Tensor]]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def post_recv_act(self, stage: int, mb: int) -> None:
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in self.chunks[stage].in_specs]
        works = [dist.irecv(b, src=self.peer(stage - 1), group=self.act_pg) for b in bufs]
        self._recv[("F", stage, mb)] = (works, bufs)

    def await_act(self, stage: int, mb: int) -> Activations:
        bufs = self._await("F", stage, mb)
        for spec, t in zip(self.chunks[stage].in_specs, bufs, strict=True):
            if spec.requires_grad:
                t.requires_grad_(True)  # only once it landed: a leaf that collects the gradient
        return tuple(bufs)

    def send_act(self, stage: int, mb: int, outputs: Activations) -> None:
        for t in outputs:
            buf = t.detach().contiguous()
            self._sends.append((dist.isend(buf, dst=self.peer(stage + 1), group=self.act_pg), buf))

    def post_recv_grad(self, stage: int, mb: int) -> None:
        specs = [s for s in self.chunks[stage].out_specs if s.requires_grad]
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        works = [dist.irecv(b, src=self.peer(stage + 1), group=self.grad_pg) for b in bufs]
        self._recv[("B", stage, mb)] = (works, bufs)

    def await_grad(self, stage: int, mb: int) -> list[torch.Tensor]:
        return self._await("B", stage, mb)

    def send_grad(self, stage: int, mb: int, in_activations: Activations) -> None:
        for t, spec in zip(in_activations, self.chunks[stage].in_specs, strict=True):
            if spec.requires_grad:
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._sends.append((dist.isend(grad, dst=self.peer(stage - 1), group=self.grad_pg), grad))

    def _await(self, direction: str, stage: int, mb: int) -> list[torch.Tensor]:
        try:
            works, bufs = self._recv.pop((direction, stage, mb))
        except KeyError:
            what = "activation" if direction == "F" else "gradient"
            raise RuntimeError(f"stage {stage}, microbatch {mb}: no {what} receive was posted") from None
        kind, peer = ("activation", self.peer(stage - 1)) if direction == "F" else ("gradient", self.peer(stage + 1))
        what = f"receive of the {kind} for stage {stage}, microbatch {mb} from rank {peer}"
        for w in works:
            bounded_wait(w, self.timeout_s, what)
        return bufs

    def drain(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait(self.timeout)
        if self._recv:
            left = sorted(f"{s}R{d}{m}" for d, s, m in self._recv)
            self._recv.clear()
            raise RuntimeError(f"receives posted but never consumed this step: {', '.join(left)}")


class RankRuntime:
    """The per-step state and the action bindings of one rank (module docstring)."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        num_stages: int,
        wire: Wire,
        optimizers: Mapping[int, torch.optim.Optimizer],
        *,
        forward_context: Callable[[int, int], contextlib.AbstractContextManager[None]] | None = None,
        grad_sync: Callable[[int], None] | None = None,
    ) -> None:
        self.chunks = {c.index: c for c in chunks}
        self.num_stages = num_stages
        self.wire = wire
        self.optimizers = dict(optimizers)
        # each optimizer steps at the O of the last stage it serves
        self._step_at = {
            id(opt): max(s for s, o in self.optimizers.items() if o is opt) for opt in self.optimizers.values()
        }
        self.forward_context = forward_context or (lambda s, m: contextlib.nullcontext())
        self.grad_sync = grad_sync
        self.inputs: dict[int, list[Any]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self._in: dict[tuple[int, int], Activations] = {}
        self._out: dict[tuple[int, int], Any] = {}
        self._pooled: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        #: when a dict: seconds each compute action spent waiting for the wire, by
        #: ``(direction "F"/"B", stage, microbatch)`` (what calibrating a simulator subtracts)
        self.awaited: dict[tuple[str, int, int], float] | None = None

    def start_step(self, inputs: Mapping[int, Sequence[Any]]) -> None:
        """``inputs[stage][mb]``: the stage's input (one per layer it owns) for microbatch ``mb``."""
        missing = sorted(set(self.chunks) - set(inputs))
        if missing:
            raise ValueError(f"no inputs for stages {missing}")
        self.inputs = {s: list(v) for s, v in inputs.items()}
        self.losses = {}

    def finish_step(self, *, drain: bool = True) -> None:
        """Drain the sends (not after a failure: a peer may be gone); drop what the step left."""
        try:
            if drain:
                self.wire.drain()
        finally:
            self._in.clear()
            self._out.clear()
            self._pooled.clear()
            self._grads.clear()

    def bindings(self) -> dict[str, Callable[..., None]]:  # fn(stage, microbatch: int, or None for G and O)
        return {
            "E": self._sparse,
            "F": self._forward,
            "B": self._backward,
            "I": self._backward_input,
            "W": self._backward_weight,
            "SF": lambda s, m: self.wire.send_act(s, m, self._out[(s, m)]),
            "RF": self.wire.post_recv_act,
            "SB": lambda s, m: self.wire.send_grad(s, m, self._in[(s, m)]),
            "RB": self.wire.post_recv_grad,
            "G": self._grad_sync,
            "O": self._step,
        }

    # ------------------------------------------------------------- compute
    def _sparse(self, s: int, m: int) -> None:
        chunk = self.chunks[s]
        if chunk.split_module is None:
            raise TypeError(f"stage {s} has no sparse/dense split: it cannot run {s}E{m}")
        self._pooled[(s, m)] = sparse_forward(chunk.split_module, self.inputs[s][m])

    def _forward(self, s: int, m: int) -> None:
        chunk = self.chunks[s]
        if s == 0:
            in_acts: Activations = ()
        elif s - 1 in self.chunks:  # local boundary: a new leaf, as if it had been received
            in_acts = tuple(
                t.detach().requires_grad_(spec.requires_grad)
                for t, spec in zip(self._out[(s - 1, m)], chunk.in_specs, strict=True)
            )
        elif self.awaited is None:
            in_acts = self.wire.await_act(s, m)
        else:
            start = time.perf_counter()
            in_acts = self.wire.await_act(s, m)
            self.awaited[("F", s, m)] = time.perf_counter() - start
        with self.forward_context(s, m):
            pooled = self._pooled.pop((s, m), None)
            if pooled is None:
                out = chunk.module(self.inputs[s][m], in_acts)
            else:
                out = dense_forward(chunk.split_module, self.inputs[s][m], pooled, in_acts)  # type: ignore[arg-type]
        self._in[(s, m)] = in_acts
        self._out[(s, m)] = out
        if s == self.num_stages - 1:
            self.losses[m] = out[0].detach()

    def _output_grads(self, s: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(tensors, gradients) to differentiate for stage ``s``'s microbatch ``m``, as
        ``StageWrapper.backward`` pairs them (the loss alone on the last stage)."""
        out = self._out[(s, m)]
        if s == self.num_stages - 1:
            return [out[0]], [None]  # type: ignore[list-item]
        grads: list[Any] | None = self._grads.pop((s, m), None)  # (Any: t.grad's Nones until the filter below)
        if grads is None:
            if s + 1 in self.chunks:  # local boundary: the next stage's input gradient
                grads = [
                    t.grad for t, spec in zip(self._in[(s + 1, m)], self.chunks[s + 1].in_specs) if spec.requires_grad
                ]
                grads = [g for g in grads if g is not None]
            elif self.awaited is None:
                grads = self.wire.await_grad(s, m)
            else:
                start = time.perf_counter()
                grads = self.wire.await_grad(s, m)
                self.awaited[("B", s, m)] = time.perf_counter() - start
        carrying = [t for t, spec in zip(out, self.chunks[s].out_specs, strict=True) if spec.requires_grad]
        pairs = [(o, g) for o, g in zip(carrying, grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, s: int, m: int) -> None:
        tensors, grads = self._output_grads(s, m)
        if s == self.num_stages - 1:
            tensors[0].backward()
        elif tensors:
            torch.autograd.backward(tensors, grads)
        self._release(s, m)

    def _backward_input(self, s: int, m: int) -> None:
        tensors, grads = self._output_grads(s, m)
        self._grads[(s, m)] = grads  # W differentiates the same outputs
        inputs = [t for t in self._in[(s, m)] if t.requires_grad]
        if inputs and tensors:
            torch.autograd.backward(
                tensors, None if s == self.num_stages - 1 else grads, inputs=inputs, retain_graph=True
            )

    def _backward_weight(self, s: int, m: int) -> None:
        out = self._out[(s, m)]
        grads = self._grads.pop((s, m))
        if s == self.num_stages - 1:
            tensors, grads_ = [out[0]], None
        else:
            carrying = [t for t, spec in zip(out, self.chunks[s].out_specs, strict=True) if spec.requires_grad]
            tensors = [o for o in carrying if o.requires_grad]
            grads_ = grads
        params = [p for p in self.chunks[s].parameters if p.requires_grad]
        if tensors and params:
            torch.autograd.backward(tensors, grads_, inputs=params)
        self._release(s, m)

    def _release(self, s: int, m: int) -> None:
        """The microbatch's graph is done on this stage (its input stays: the gradient send and a
        local previous stage read its ``.grad``)."""
        self._out.pop((s, m), None)

    # ------------------------------------------------------------- step end
    def _grad_sync(self, s: int, m: int | None) -> None:
        if self.grad_sync is not None:
            self.grad_sync(s)

    def _step(self, s: int, m: int | None) -> None:
        opt = self.optimizers.get(s)
        if opt is not None and self._step_at[id(opt)] == s:
            opt.step()


def all_reduce_grads(parameters: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average ``.grad`` over ``group`` as DDP does: divide by its size, then sum."""
    size = group.size()
    if size == 1:
        return
    for p in parameters:
        if p.grad is not None:
            p.grad.div_(size)
            dist.all_reduce(p.grad, group=group)
