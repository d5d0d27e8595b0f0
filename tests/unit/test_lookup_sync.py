"""Fused's and SemiSync's lookup is ordered after the input dist's stream on every supported
TorchRec (``pipelines.lookup_sync``): TorchRec 1.8.0's ``_start_embedding_lookup`` lets the lookup
stream read what the data-dist stream wrote with no wait (the race TorchRec 1.9.2 fixed), which
the stream checker reports; ours does not, on whichever TorchRec runs the test."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import utils as upstream

from torchrec_swp.integrations.torchrec.pipelines.lookup_sync import _stream_synced, start_embedding_lookup
from torchrec_swp.streamcheck import UnsyncedAccess, checking


class _Forward:
    name = "ebc"


class _Module:
    """A sharded module's lookup: reads the KJT on the current stream."""

    forward = _Forward()

    def compute_and_output_dist(self, ctx: Any, kjt: torch.Tensor) -> torch.Tensor:
        return kjt * 2


class _Request:
    """The input dist's awaitable: its wait writes the KJT (the recat) on the current stream."""

    def wait(self) -> torch.Tensor:
        return torch.arange(4.0) * 3


class _ModuleContext:
    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


class _Context:
    def __init__(self) -> None:
        self.module_contexts = {"ebc": _ModuleContext()}
        self.input_dist_tensors_requests = {"ebc": _Request()}
        self.embedding_a2a_requests: dict[str, Any] = {}


def _lookup(helper: Any) -> tuple[list[Any], torch.Tensor, list[str]]:
    """Fused's EmbLookup: ``helper`` on the ``emb_lookup`` stream, the input dist's on ``data_dist``,
    the compute stream the target; the checker's findings, the output, the streams recorded."""
    with checking() as checker:
        data_dist, emb_lookup = checker.stream("data_dist"), checker.stream("emb_lookup")
        context = _Context()
        with checker.task("EmbLookup", 0), torch.cpu.stream(emb_lookup):
            helper(_Module(), context, source_stream=data_dist, target_stream=checker.default_stream,
                   stream_context=torch.cpu.stream)
        out = context.embedding_a2a_requests["ebc"]
        recorded = [s.name for s in context.module_contexts["ebc"].recorded]
        return list(checker.findings), out, recorded


def test_the_lookup_waits_for_the_data_dist_stream() -> None:
    findings, out, recorded = _lookup(start_embedding_lookup)
    assert findings == [] and torch.equal(out, torch.arange(4.0) * 6)
    assert sorted(recorded) == ["default", "emb_lookup"]  # every consumer stream, not data_dist


def test_torchrec_1_8s_helper_races_and_the_copy_is_upstream_1_9s() -> None:
    # 1.8.0's helper (1.9.2 keeps it as _start_embedding_lookup_legacy behind a killswitch)
    legacy = getattr(upstream, "_start_embedding_lookup_legacy", upstream._start_embedding_lookup)
    findings, out, recorded = _lookup(legacy)
    assert torch.equal(out, torch.arange(4.0) * 6) and recorded == ["default"]
    assert any(isinstance(f, UnsyncedAccess) and (f.earlier.stream, f.later.stream) == ("data_dist", "emb_lookup")
               for f in findings), findings
    synced = getattr(upstream, "_start_embedding_lookup_stream_synced", None)
    if synced is not None:  # TorchRec 1.9.2: ours is upstream's, and the copy behaves as upstream's fix
        assert start_embedding_lookup is upstream._start_embedding_lookup
        assert _lookup(synced)[0] == [] and _lookup(_stream_synced)[0] == []
    else:  # TorchRec 1.8.0
        assert start_embedding_lookup is _stream_synced
