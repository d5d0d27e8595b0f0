"""``make gpu-check`` on a machine without CUDA, and the parts of it that need no GPU: argument
handling, the stack requirements, the overlap computation from trace events, the JUnit reading,
the report's JSON and markdown, the block-interleaved timing and the pass/fail rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks.gpu import env, overlap, report, streams

ROOT = Path(__file__).resolve().parents[2]
PART_NAMES = list(env.PARTS.values())


def _assert_skip_line(stdout: str, stderr: str, returncode: int) -> None:
    lines = stdout.splitlines()
    assert returncode == 0, (stdout, stderr)
    assert len(lines) == 1, f"expected exactly one line, got {lines!r}"
    assert lines[0].startswith("gpu-check: no CUDA device found ("), lines[0]
    assert all(name in lines[0] for name in PART_NAMES), lines[0]
    assert stderr == ""


@pytest.fixture
def no_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA path cannot be exercised here")


def test_entry_point_without_cuda_prints_one_line_and_exits_0(no_cuda: None) -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_PYTHON": sys.executable},
    )
    _assert_skip_line(done.stdout, done.stderr, done.returncode)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_without_cuda_prints_one_line_and_exits_0(no_cuda: None) -> None:
    done = subprocess.run(
        ["make", "--no-print-directory", "gpu-check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "GPU_CHECK_PYTHON": sys.executable},
    )
    _assert_skip_line(done.stdout, done.stderr, done.returncode)


def test_a_driver_without_a_cuda_torch_is_no_cuda_device(no_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "nvidia_driver", lambda: True)
    found, why = env.cuda_python({"GPU_CHECK_PYTHON": sys.executable})
    assert found is None
    assert f"torch {torch.__version__} sees no CUDA device" in why
    line = env.skip_line(why, "ab")
    assert line.endswith("skipped (a) CUDA stream tests, (b) parity with upstream on one GPU")


def test_parts_and_options() -> None:
    from benchmarks.gpu_check import parse_args

    assert env.parse_parts("b,a") == "ab"
    assert env.parse_parts("dcba") == "abcd"
    for bad in ("", "x", "ae"):
        with pytest.raises(Exception, match="letters among abcd"):
            env.parse_parts(bad)
    args = parse_args([], {"GPU_CHECK_OUT": "/tmp/o", "GPU_CHECK_BUDGET_S": "100", "GPU_CHECK_INSTALL": "0"})
    assert (args.parts, args.out, args.budget_s, args.no_install) == ("abcd", Path("/tmp/o"), 100.0, True)
    args = parse_args(["--parts", "c", "--budget-s", "5"], {})
    assert (args.parts, args.out, args.budget_s, args.no_install) == ("c", Path("out/gpu_check"), 5.0, False)
    with pytest.raises(SystemExit):
        parse_args(["--budget-s", "0"], {})


def test_candidates_are_the_named_interpreter_alone_when_given() -> None:
    assert env.candidates({"GPU_CHECK_PYTHON": "/x/python"}) == ["/x/python"]
    found = env.candidates({"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin"})
    assert len(found) == len({str(Path(p).resolve()) for p in found}), "an interpreter is asked twice"


def test_stack_requirements_swap_fbgemm_and_keep_the_found_torch(tmp_path: Path) -> None:
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "stack-1.9.txt").write_text(
        "# pins\ntorch==2.13.0\nfbgemm-gpu-cpu==1.8.0  # cpu\ntensordict==0.15.3\nnumpy==2.4.6\nortools==9.15.6755\n"
    )
    (tmp_path / "requirements" / "torchrec-1.9.txt").write_text("# no deps\ntorchrec==1.9.2\n")
    same, nodeps = env.stack_requirements("2.13.0+cu130", tmp_path)
    assert same == ["fbgemm-gpu==1.8.0", "tensordict==0.15.3"] and nodeps == ["torchrec==1.9.2"]
    other, _ = env.stack_requirements("2.11.0+cu130", tmp_path)
    assert other == ["torch==2.13.0", "fbgemm-gpu==1.8.0", "tensordict==0.15.3"]


def test_stack_requirements_of_this_repository_name_the_cuda_fbgemm() -> None:
    with_deps, without_deps = env.stack_requirements(None)
    assert any(r.startswith("fbgemm-gpu==") for r in with_deps)
    assert not any(r.startswith(("fbgemm-gpu-cpu", "numpy", "ortools")) for r in with_deps)
    assert [r.split("==")[0] for r in without_deps] == ["torchrec"]


# ---------------------------------------------------------------------------------- overlap
def _label(task: str, batch: int, tid: int, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": f"## {task} {batch} ##", "tid": tid, "ts": ts, "dur": dur}


def _launch(tid: int, ts: float, correlation: int, cat: str = "cuda_runtime") -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "tid": tid,
        "ts": ts,
        "dur": 1,
        "args": {"correlation": correlation},
    }


def _device(stream: int, ts: float, dur: float, correlation: int, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": "k", "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}  # fmt: skip


def synthetic_trace() -> list[dict[str, Any]]:
    """Two steps. Main thread 1: Forward/Backward on stream 7, InputDistStart whose kernels run on
    stream 20 (data_dist) and 30 (NCCL). Thread 2: H2D copies on stream 13, launched inside a
    TorchRec label nested in ours. One unlabelled kernel on stream 7 (compute, unattributed)."""
    events = [{"ph": "M", "name": "process_name", "pid": 0}]
    for step, t0 in enumerate((0.0, 1000.0)):
        c = 100 * step
        events += [
            _label("Forward", step, 1, t0, 100), _launch(1, t0 + 10, c + 1),
            _device(7, t0 + 100, 300, c + 1),  # compute: t0+100 .. t0+400
            _label("Backward", step, 1, t0 + 150, 50), _launch(1, t0 + 160, c + 2),
            _device(7, t0 + 400, 200, c + 2),  # compute: t0+400 .. t0+600
            _label("InputDistStart", step + 1, 1, t0 + 210, 40),
            _launch(1, t0 + 220, c + 3), _device(20, t0 + 350, 100, c + 3),  # input dist, all overlapped
            _launch(1, t0 + 230, c + 4, "cuda_driver"), _device(30, t0 + 550, 100, c + 4),  # NCCL: half
            _label("H2D", step + 2, 2, t0 + 5, 20), _label("copy_batch_to_gpu", step, 2, t0 + 5.5, 5),
            _launch(2, t0 + 6, c + 5),  # inside TorchRec's own label, inside ours
            _device(13, t0 + 50, 100, c + 5, "gpu_memcpy"),  # copy t0+50..t0+150: 50 overlapped
            _launch(1, t0 + 300, c + 6), _device(7, t0 + 700, 100, c + 6),  # no label: compute, unattributed
        ]  # fmt: skip
    return events


def test_device_spans_are_attributed_through_labels_and_correlations() -> None:
    spans = overlap.device_spans(synthetic_trace())
    assert len(spans) == 12
    by_corr = {(s.task, s.batch, s.stream) for s in spans if s.start < 1000}
    assert by_corr == {
        ("Forward", 0, 7), ("Backward", 0, 7), ("InputDistStart", 1, 20), ("InputDistStart", 1, 30),
        ("H2D", 2, 13), (None, None, 7),
    }  # fmt: skip
    assert overlap.compute_stream(spans) == 7


def test_overlap_summary_per_step() -> None:
    got = overlap.overlap_summary(synthetic_trace(), steps=2)
    assert got["streams"] == {"compute": [7], "h2d": [13], "input_dist": [20, 30]}
    assert got["busy_us_per_step"] == {"compute": 600.0, "h2d": 100.0, "input_dist": 200.0}
    assert got["overlap_us_per_step"] == {"h2d": 50.0, "input_dist": 150.0}
    assert got["overlap_share"] == {"h2d": 0.5, "input_dist": 0.75}
    assert got["on_compute_stream_us_per_step"] == {"h2d": 0.0, "input_dist": 0.0}
    assert got["attributed_share"] == pytest.approx(800 / 900)
    with pytest.raises(ValueError):
        overlap.overlap_summary([], steps=0)


def test_overlap_of_work_left_on_the_compute_stream_is_reported_apart() -> None:
    events = [
        _label("Forward", 0, 1, 0, 10), _launch(1, 1, 1), _device(7, 10, 100, 1),
        _label("H2D", 2, 1, 20, 10), _launch(1, 21, 2), _device(7, 110, 40, 2, "gpu_memcpy"),
    ]  # fmt: skip
    got = overlap.overlap_summary(events, steps=1)
    assert got["busy_us_per_step"]["h2d"] == 0.0 and got["overlap_share"]["h2d"] is None
    assert got["on_compute_stream_us_per_step"]["h2d"] == 40.0
    assert got["busy_us_per_step"]["compute"] == 140.0


def test_interval_helpers() -> None:
    assert overlap.merge([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]
    assert overlap.intersection([(0, 3), (5, 6)], [(2, 5.5)]) == 1.5
    assert overlap.length([(0, 3), (5, 6)]) == 4
    assert overlap.compute_stream([]) is None


# ---------------------------------------------------------------------------------- junit
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_stream_pool_cuda" name="test_a" time="0.5"/>
<testcase classname="tests.gpu.test_stream_pool_cuda" name="test_b" time="1.0">
  <failure message="AssertionError: without the wait the consumer read&#10;more">trace</failure></testcase>
<testcase classname="tests.gpu.test_engine_streams_cuda" name="test_c[main]" time="0.0">
  <skipped type="pytest.skip" message="needs a CUDA device">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_and_the_rule_that_a_skip_fails_part_a() -> None:
    tests = streams.parse_junit(JUNIT)
    assert [(t["name"], t["outcome"]) for t in tests] == [
        ("test_stream_pool_cuda::test_a", "passed"),
        ("test_stream_pool_cuda::test_b", "failed"),
        ("test_engine_streams_cuda::test_c[main]", "skipped"),
    ]
    assert tests[1]["message"] == "AssertionError: without the wait the consumer read"
    assert streams.status_of(tests[:1]) == "passed"
    assert streams.status_of(tests[::2]) == "failed"
    assert streams.status_of([]) == "failed"


def test_part_a_on_this_machine_reads_pytest_s_report(no_cuda: None, tmp_path: Path) -> None:
    got = streams.run(tmp_path, timeout_s=300)
    assert got["tests"] and all(t["outcome"] == "skipped" for t in got["tests"]), got
    assert got["status"] == "failed"  # a skipped CUDA test proves nothing
    assert (tmp_path / streams.JUNIT_NAME).exists() and (tmp_path / streams.LOG_NAME).exists()


# --------------------------------------------------------------------------------- report
def sample_report() -> dict[str, Any]:
    o = overlap.overlap_summary(synthetic_trace(), steps=2)
    stats = {"median_ms": 4.0, "p90_ms": 4.5, "qps": 2048000.0}
    return {
        "meta": {"date": "2026-11-23T10:00:00", "device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "13.0",
                 "python": "3.12.3"},
        "stack": {"ok": True, "versions": {"torch": "2.13.0", "fbgemm_gpu": "1.8.0", "torchrec": "1.9.2"}},
        "parts": {
            "a": {"status": "passed", "seconds": 12.0, "tests": [
                {"name": "test_stream_pool_cuda::test_x", "outcome": "passed", "seconds": 0.4, "message": ""}]},
            "b": {"status": "failed", "seconds": 95.0, "steps": 20, "cases": [
                {"pipeline": "TrainPipelineSparseDist", "options": "", "variant": "by_stream", "status": "equal",
                 "batches": 20, "seconds": 2.0, "upstream_seconds": 2.1},
                {"pipeline": "TrainPipelineSemiSync", "options": "start_batch=10", "variant": "default",
                 "status": "differs", "batches": 20, "difference": "loss of step 3: max abs diff 1e-07",
                 "seconds": 2.0, "upstream_seconds": 2.0, "upstream_repeatable": True}]},
            "c": {"status": "passed", "seconds": 60.0, "size": "batch 8192", "warmup": 20, "steps": 200,
                  "block_steps": 5, "errors": {}, "results": [
                      {"pipeline": "TrainPipelineSparseDist", "upstream": stats, "ours": stats, "ratio": 1.0,
                       "ratio_95": (0.98, 1.02), "same_losses": True, "max_loss_diff": 0.0}]},
            "d": {"status": "passed", "seconds": 30.0, "steps": 2, "size": "batch 8192", "configs": [
                {"label": "H2D on io", "thread_map": {"H2D": "io"}, "trace": "trace_H2D_on_io.json.gz",
                 "step_ms": 4.2, "overlap": o}]},
        },
    }  # fmt: skip


def test_report_json_markdown_and_verdict(tmp_path: Path) -> None:
    doc = sample_report()
    json_path, md_path = report.write(doc, tmp_path)
    assert json.loads(json_path.read_text())["parts"]["b"]["cases"][1]["status"] == "differs"
    md = md_path.read_text()
    for expected in (
        "| (a) CUDA stream tests | passed | 12 s | 1/1 tests passed |",
        "| (b) parity with upstream on one GPU | failed | 95 s | 1/2 runs bit-identical to upstream |",
        "| TrainPipelineSemiSync (start_batch=10) | default | 20 | differs: loss of step 3: max abs diff 1e-07 |",
        "| TrainPipelineSparseDist | 4.00 / 4.50 | 4.00 / 4.50 | 2,048,000 | 2,048,000 "
        "| **1.000** (0.980-1.020) | yes |",
        "| H2D on io | 4.20 | 600 us | 100 us | 50 us (50%) | 200 us | 150 us (75%) | `trace_H2D_on_io.json.gz` |",
    ):
        assert expected in md, f"missing {expected!r} in\n{md}"
    assert report.exit_code(doc) == 1
    assert report.verdict(doc) == "gpu-check FAILED: (a) passed, (b) failed, (c) passed, (d) passed"
    assert report.part_line("c", doc["parts"]["c"]) == (
        "gpu-check (c) step time vs upstream on one GPU: passed, ours/upstream SparseDist 1.000, 60 s"
    )
    assert report.part_line("d", doc["parts"]["d"]).startswith(
        "gpu-check (d) overlap trace on one GPU: passed, H2D on io: H2D overlap 50 us/step, input dist 150 us/step"
    )


def test_report_of_a_machine_without_the_torchrec_stack() -> None:
    reason = "TorchRec's CUDA stack is not usable: ModuleNotFoundError: No module named 'fbgemm_gpu'"
    install_error = "pip install ... failed: ERROR: No matching distribution found for fbgemm-gpu==1.8.0"
    doc = {
        "meta": {"device": "NVIDIA H100"},
        "stack": {"ok": False, "versions": {}, "error": "ModuleNotFoundError: No module named 'fbgemm_gpu'",
                  "install_error": install_error},
        "parts": {"a": sample_report()["parts"]["a"], **{p: report.skipped(reason) for p in "bcd"}},
    }  # fmt: skip
    md = report.markdown(doc)
    assert "TorchRec's CUDA stack is not usable here: ModuleNotFoundError" in md
    assert "Installing it failed: pip install ... failed: ERROR: No matching distribution" in md
    assert f"| (b) parity with upstream on one GPU | skipped | 0 s | {reason} |" in md
    assert "## (b)" not in md and "## (a)" in md
    assert report.exit_code(doc) == 0
    assert (
        report.part_line("b", doc["parts"]["b"]) == f"gpu-check (b) parity with upstream on one GPU: skipped ({reason})"
    )


def test_runner_skips_the_torchrec_parts_without_the_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.gpu import run

    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"ok": False, "versions": {}, "error": "no fbgemm_gpu"}))
    code = run.main(
        ["--parts", "bcd", "--out", str(tmp_path), "--stack", str(stack), "--deadline", str(time.time() + 600)]
    )
    assert code == 0
    doc = json.loads((tmp_path / report.JSON_NAME).read_text())
    assert {p: v["status"] for p, v in doc["parts"].items()} == {"b": "skipped", "c": "skipped", "d": "skipped"}
    assert "no fbgemm_gpu" in doc["parts"]["c"]["reason"]
    assert capsys.readouterr().out.splitlines()[-1] == "gpu-check passed: (b) skipped, (c) skipped, (d) skipped"
    # and a part that would start too close to the deadline is skipped, saying so
    stack.write_text(json.dumps({"ok": True, "versions": {}}))
    assert (
        run.main(["--parts", "d", "--out", str(tmp_path), "--stack", str(stack), "--deadline", str(time.time() + 5)])
        == 0
    )
    assert "time budget" in json.loads((tmp_path / report.JSON_NAME).read_text())["parts"]["d"]["reason"]


# ------------------------------------------------------------------------ parts b, c and d
def test_parity_covers_every_pipeline_we_export_and_judges_runs() -> None:
    import torchrec_swp
    from benchmarks.gpu import parity

    # a case for every pipeline (TrainPipelinePEC's runs only where TorchRec has it, from 1.9),
    # or a reason why not
    cases = {c.pipeline for c in parity.cases()}
    assert cases | set(parity.NOT_ON_GPU) == set(torchrec_swp._PIPELINES) and not cases & set(parity.NOT_ON_GPU)
    assert all(c.mode in ("train", "eval_fwd", "staged") and "default" in c.variants for c in parity.cases())
    assert {c.pipeline for c in parity._OWN_CASES} <= cases  # no case of a pipeline that is not a drop-in
    row = {"status": "equal"}
    assert parity.status_of([row, {"status": "inconclusive"}]) == "passed"
    assert parity.status_of([row, {"status": "differs"}]) == "failed"
    assert parity.status_of([row, {"status": "error"}]) == "failed"
    assert parity.status_of([]) == "failed"


def test_block_interleaving_times_blocks_to_a_sync_and_compares() -> None:
    from benchmarks.common import Contender
    from benchmarks.gpu import bench

    calls: list[str] = []

    class FakeRunner:
        def __init__(self, label: str, loss: float) -> None:
            self.label, self.loss = label, loss

        def step(self, batches: Any) -> tuple[torch.Tensor, ...]:
            calls.append(self.label)
            return (torch.tensor(self.loss),)

    up, ours = Contender("upstream", FakeRunner("u", 0.5), iter(())), Contender("ours", FakeRunner("o", 0.5), iter(()))
    syncs: list[int] = []
    bench.interleave_blocks([up, ours], blocks=4, block_steps=3, sync=lambda: syncs.append(len(calls)))
    assert calls == ["u"] * 3 + ["o"] * 3 + ["o"] * 3 + ["u"] * 3 + ["u"] * 3 + ["o"] * 3 + ["o"] * 3 + ["u"] * 3
    assert syncs[:4] == [0, 3, 3, 6], "each block starts and ends with a sync"
    assert len(up.times) == len(ours.times) == 4 and len(up.losses) == 12
    up.times, ours.times = [1.0, 0.002, 0.002, 0.002], [1.0, 0.001, 0.001, 0.001]
    got = bench.compare("TrainPipelineSparseDist", up, ours, warmup_blocks=1, examples_per_step=1000)
    assert got["ratio"] == pytest.approx(0.5) and got["ratio_95"] == pytest.approx((0.5, 0.5))
    assert got["upstream"]["median_ms"] == pytest.approx(2.0) and got["ours"]["qps"] == pytest.approx(1e6)
    assert got["same_losses"] and got["max_loss_diff"] == 0.0


def test_trace_part_passes_only_when_something_overlapped() -> None:
    from benchmarks.gpu import trace

    none = {"overlap": {"overlap_us_per_step": {"h2d": 0.0, "input_dist": 0.0}}}
    some = {"overlap": {"overlap_us_per_step": {"h2d": 0.0, "input_dist": 3.0}}}
    assert trace.status_of([none, some]) == "passed"
    assert trace.status_of([none]) == "failed"
    assert SimpleNamespace(**trace.CONFIGS)  # labels are plain names
    assert trace.CONFIGS["H2D on io"] == {"H2D": "io"} and trace.CONFIGS["default"] is None
