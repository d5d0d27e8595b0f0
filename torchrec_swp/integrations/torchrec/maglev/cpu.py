"""Maglev on the CPU: an input driver over gloo, a small model and its data (tests, benchmarks).

TorchRec 1.9.2's ``StageWrapper.to(device)`` hands the device to its ``InputDistDriver``, which
refuses anything but CUDA ("InputDistDriver requires a CUDA device"): the cascade all-to-all
that feeds a stage its microbatches copies to the GPU and exchanges data over NCCL. So Maglev
as shipped cannot run a step on the CPU. ``on_cpu(stage)`` gives the stage ``CpuInputDriver``,
the same contract (``take``/``exchange``/``pending``/``set_device``) on gloo: every rank of a
cascade flattens its send set with upstream's own ``flatten_to_tensors``, exchanges the dim-0
sizes (one ``all_to_all_single``) and then the bytes (a second one), and rebuilds what it got
with ``unflatten_from_tensors`` from its own carrier as the template, as upstream does on CUDA.
Upstream's and our pipelines then see the same microbatches.

``ModelConfig``/``build_model``/``make_batches``: TorchRec's own ``MaglevTestModel`` of
``MaglevTestLayer`` s (an EmbeddingBagCollection, a dense projection and a residual per layer),
every layer materialized on the CPU and seeded by its index, so any cut of the layers into
stages starts from the same weights. ``sparse_forward``/``dense_forward`` split a stage's
forward at the embedding lookup (the ``E``/``F`` actions of the sparse-hoist schedule), the
same operations in the same order as ``MaglevTestLayer.forward``.

TorchRec private names relied on: ``StageWrapper._input_driver``, ``_LayerChain.layers`` and
``_LayerChain._postproc``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.maglev.input_dist import flatten_to_tensors, unflatten_from_tensors
from torchrec.distributed.maglev.stage import StageWrapper
from torchrec.distributed.test_utils.model_input import ModelInput
from torchrec.distributed.test_utils.test_model import MaglevTestLayer, MaglevTestModel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

CPU = torch.device("cpu")


class _Ready:
    """An exchange that already finished (``LazyAwaitable``'s ``wait()``)."""

    def __init__(self, value: list[Any]) -> None:
        self._value = value

    def wait(self) -> list[Any]:
        return self._value


class CpuInputDriver:
    """``InputDistDriver`` on the CPU: whole rounds of a cascade all-to-all over gloo, queued and
    handed out ``n`` at a time (see the module docstring). Every rank of the cascade must run
    the same number of rounds, as upstream's."""

    def __init__(self, pg: dist.ProcessGroup, self_index: int) -> None:
        self._pg = pg
        self._self_index = self_index
        self._queue: deque[Any] = deque()

    def set_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"CpuInputDriver runs on the CPU, got {device}")

    @property
    def pending(self) -> int:
        return len(self._queue)

    def exchange(self, send: list[Any]) -> _Ready:
        """One all-to-all round: ``send[j]`` goes to rank ``j`` of the cascade; returns one
        carrier from each rank, all shaped like ``send[self_index]``."""
        world = self._pg.size()
        if len(send) != world:
            raise ValueError(f"expected one carrier per rank: got {len(send)} for a cascade of {world}")
        flat_send = [[t.contiguous() for t in flatten_to_tensors(c)] for c in send]
        example = flat_send[self._self_index]
        if any(t.dim() == 0 for f in flat_send for t in f):
            raise ValueError("CpuInputDriver exchanges tensors with a batch dimension, got a 0-dim tensor")
        slots = len(example)
        sizes_out = torch.tensor([t.shape[0] for f in flat_send for t in f], dtype=torch.int64)
        sizes_in = torch.empty(slots * world, dtype=torch.int64)
        dist.all_to_all_single(sizes_in, sizes_out, [slots] * world, [len(f) for f in flat_send], group=self._pg)
        sizes = sizes_in.view(world, slots).tolist()

        def nbytes(t: torch.Tensor, rows: int) -> int:
            return rows * _row_numel(t) * t.element_size()

        data_out = torch.cat([t.reshape(-1).view(torch.uint8) for f in flat_send for t in f])
        in_split = [sum(nbytes(example[k], sizes[i][k]) for k in range(slots)) for i in range(world)]
        out_split = [sum(t.numel() * t.element_size() for t in f) for f in flat_send]
        data_in = torch.empty(sum(in_split), dtype=torch.uint8)
        dist.all_to_all_single(data_in, data_out, in_split, out_split, group=self._pg)
        received, offset = [], 0
        for i in range(world):
            tensors = []
            for k, t in enumerate(example):
                n = nbytes(t, sizes[i][k])
                tensors.append(data_in[offset : offset + n].clone().view(t.dtype).view(sizes[i][k], *t.shape[1:]))
                offset += n
            received.append(unflatten_from_tensors(tensors, send[self._self_index]))
        return _Ready(received)

    def take(self, next_send: Callable[[], list[Any]], n: int) -> list[Any]:
        while len(self._queue) < n:
            self._queue.extend(self.exchange(next_send()).wait())
        return [self._queue.popleft() for _ in range(n)]


def _row_numel(t: torch.Tensor) -> int:
    numel = 1
    for d in t.shape[1:]:
        numel *= d
    return numel


def on_cpu(stage: StageWrapper) -> StageWrapper:
    """Give ``stage`` the gloo input driver and place it on the CPU (``stage.to(cpu)``)."""
    stage._input_driver = CpuInputDriver(stage.cascade_pg, stage.stage_index)
    return stage.to(CPU)


# ------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelConfig:
    """A MaglevTestModel: ``sum(layers_per_stage)`` layers, each ``num_tables`` tables of
    ``num_embeddings`` x ``emb_dim``, activations ``(batch_size, layer_dim)``."""

    layers_per_stage: tuple[int, ...] = (2, 2)
    batch_size: int = 16
    layer_dim: int = 32
    num_tables: int = 2
    num_embeddings: int = 200
    emb_dim: int = 8
    num_float_features: int = 8
    pooling: int = 4

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)


def layer_tables(config: ModelConfig, layer: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"l{layer}_t{t}",
            feature_names=[f"l{layer}_f{t}"],
            embedding_dim=config.emb_dim,
            num_embeddings=config.num_embeddings,
        )
        for t in range(config.num_tables)
    ]


def build_model(config: ModelConfig, seed: int = 0) -> MaglevTestModel:
    """The whole model on the CPU; layer ``l``'s weights are drawn after ``manual_seed(seed + l)``."""
    layers = []
    for layer in range(config.num_layers):
        torch.manual_seed(seed + layer)
        layers.append(
            MaglevTestLayer(
                tables=layer_tables(config, layer),
                layer_dim=config.layer_dim,
                is_first=layer == 0,
                batch_size=config.batch_size,
                num_float_features=config.num_float_features,
                device=CPU,
            )
        )
    return MaglevTestModel(layers)


def make_batches(config: ModelConfig, count: int, seed: int) -> list[list[ModelInput]]:
    """``count`` raw batches (one ModelInput per layer of the whole model, what the model's
    passthrough ``preproc`` takes), the same for equal seeds."""
    with torch.random.fork_rng():
        state = random.getstate()
        try:
            batches = []
            for i in range(count):
                torch.manual_seed(seed * 100_003 + i)
                random.seed(seed * 100_003 + i)
                batches.append(
                    [
                        ModelInput.generate(
                            batch_size=config.batch_size,
                            tables=layer_tables(config, layer),
                            weighted_tables=[],
                            num_float_features=config.num_float_features,
                            pooling_avg=config.pooling,
                        )
                        for layer in range(config.num_layers)
                    ]
                )
            return batches
        finally:
            random.setstate(state)


# ------------------------------------------------------------- the split at the lookup
def unwrap(module: nn.Module) -> nn.Module:
    """The stage's ``_LayerChain`` under a DDP (``.module``) or DMP (``._dmp_wrapped_module``)."""
    while True:
        inner = getattr(module, "_dmp_wrapped_module", None) or getattr(module, "module", None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def sparse_forward(chain: nn.Module, stage_input: Sequence[Any]) -> tuple[torch.Tensor, ...]:
    """Every layer's embedding lookup (pooled), needing nothing from another stage."""
    chain = unwrap(chain)
    layers = _test_layers(chain)
    return tuple(layer.ebc(inp.idlist_features).values() for layer, inp in zip(layers, stage_input, strict=True))


def dense_forward(
    chain: nn.Module, stage_input: Sequence[Any], pooled: Sequence[torch.Tensor], in_activations: tuple[Any, ...]
) -> Any:
    """The rest of the stage's forward given its lookups: ``MaglevTestLayer.forward`` after the
    lookup, layer by layer, then the model's ``postproc`` on the last stage."""
    chain = unwrap(chain)
    activations = in_activations
    for layer, inp, p in zip(_test_layers(chain), stage_input, pooled, strict=True):
        x = layer.input_proj(p)
        if layer.dense is not None:
            x = x + layer.dense(inp.float_features)
        if not layer.is_first:
            x = layer.scaled_add(activations[0], x)
        activations = (torch.relu(layer.block(x)),)
    postproc = getattr(chain, "_postproc", None)
    if postproc is not None:
        return postproc(activations, stage_input[-1])
    return activations


def _test_layers(chain: nn.Module) -> list[MaglevTestLayer]:
    layers = list(getattr(chain, "layers", ()))
    if not layers or not all(isinstance(layer, MaglevTestLayer) for layer in layers):
        raise TypeError(
            "the sparse/dense split is written for a stage of MaglevTestLayer s (a _LayerChain); "
            f"got {type(chain).__name__}"
        )
    return layers
