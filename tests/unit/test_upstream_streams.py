"""``harness.upstream_streams``: upstream's pipelines and our Maglev drop-ins run under a fresh
stream checker, their CUDA branches on emulated streams.

Needs a default process group of one gloo rank in this process (``one_rank``, tests/conftest.py;
a test that wants another world size runs in its own process).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torchrec.distributed.train_pipeline.train_pipelines")

from torchrec_swp.streamcheck import StreamChecker, active_checker


@pytest.fixture
def checker(one_rank: None) -> Iterator[StreamChecker]:
    if active_checker() is not None:
        pytest.skip("another stream checker is installed (SWP_STREAM_CHECK run)")
    c = StreamChecker()
    with c:
        yield c


def test_upstream_sparse_dist_runs_its_cuda_branches_on_emulated_streams(checker: StreamChecker) -> None:
    from harness.upstream_streams import train_upstream_checked

    ops: dict[str, int] = {}
    assert train_upstream_checked("TrainPipelineSparseDist", checker, steps=4, ops_per_stream=ops) == 4
    # the copy on memcpy, the input dist on data_dist, the rest on the default stream
    assert {"default", "memcpy", "data_dist"} <= {s for s, n in ops.items() if n > 0}, ops
    assert checker.findings == []


def test_an_unknown_upstream_pipeline_is_refused(checker: StreamChecker) -> None:
    from harness.dlrm import PipelineUnavailable
    from harness.upstream_streams import train_upstream_checked

    with pytest.raises(PipelineUnavailable, match="unknown pipeline"):
        train_upstream_checked("TrainPipelineSideways", checker)


def test_a_maglev_drop_in_runs_checked(checker: StreamChecker) -> None:
    pytest.importorskip("torchrec.distributed.maglev", reason="Maglev is new in TorchRec 1.9")
    from harness.upstream_streams import train_maglev_checked

    ops: dict[str, int] = {}
    tasks = checker.stats.tasks
    assert train_maglev_checked("Maglev1F1B", checker, steps=2, thread_map="comm", ops_per_stream=ops) == 2
    # Maglev has no side streams: every action runs on its thread's current (default) stream
    assert set(ops) == {"default"} and ops["default"] > 0
    assert checker.stats.tasks - tasks >= 2 * 4 * 2  # every microbatch's F and B, each step
