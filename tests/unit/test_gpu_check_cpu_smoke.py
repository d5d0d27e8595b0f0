"""Parts (b), (c) and (d) of ``make gpu-check`` run on the CPU (gloo, one rank, few steps): the
same code as on a GPU except the device, the backend, pinning, syncs and the CUDA profiler
activity. Catches breakage of the parts (harness, pipelines, engine API, report) without a GPU;
says nothing about CUDA itself."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.gpu import report

pytestmark = pytest.mark.multiprocess


def test_parity_bench_and_trace_parts_run_on_the_cpu(tmp_path: Path) -> None:
    from benchmarks.gpu import bench, parity, trace
    from harness.dlrm_data import SIZES

    b = parity.run(tmp_path, 600, steps=4, pipelines=["TrainPipelineSparseDist"], device_type="cpu")
    assert b["status"] == "passed", b
    assert [r["variant"] for r in b["cases"]] == ["default", "io thread", "by_stream", "per_task"]
    assert all(r["status"] == "equal" and r["batches"] == r["upstream_batches"] == 4 for r in b["cases"]), b

    small = SIZES["small"]
    c = bench.run(
        tmp_path, 600, ["TrainPipelineSparseDist"], warmup=2, steps=4, block_steps=2, device_type="cpu", size=small
    )
    assert c["status"] == "passed" and not c["errors"], c
    [row] = c["results"]
    assert row["same_losses"] and row["ratio"] > 0 and row["upstream"]["median_ms"] > 0

    d = trace.run(tmp_path, 600, warmup=4, steps=2, device_type="cpu", size=small)
    assert [cfg["label"] for cfg in d["configs"]] == list(trace.CONFIGS)
    assert d["status"] == "failed"  # the CPU has no device work to overlap
    for cfg in d["configs"]:
        with gzip.open(tmp_path / cfg["trace"]) as f:
            events = json.load(f)["traceEvents"]
        labels = {e["name"].split()[1] for e in events if str(e.get("name", "")).startswith("## H2D ")}
        assert labels == {"H2D"}, f"{cfg['label']}: no H2D labels in the trace"
        assert cfg["overlap"]["device_events"] == 0

    doc = {"meta": {}, "stack": {"ok": True, "versions": {}}, "parts": {"b": b, "c": c, "d": d}}
    md = report.markdown(doc)
    assert "| TrainPipelineSparseDist | by_stream | 4 | equal |" in md
    assert "## (c) step time vs upstream on one GPU" in md and "`trace_default.json.gz`" in md
