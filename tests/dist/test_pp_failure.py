"""One rank's action fails mid-step: both ranks end with a named error, never a hang (2 gloo ranks).

* A compute action (``PipelineRank``, ``P2PWire``): rank 1's forward of microbatch 2 raises.
  Rank 1's ``progress`` raises it, named (action ``1F2``, thread ``default``); rank 0 then waits
  for a gradient that never comes, and its receive's wait ends its step with an error naming
  the action that waited (``0B1`` or ``0B2``) and its receive (stage 0, from rank 1).
* A send on the comm thread (the ``Maglev1F1B`` drop-in, ``StageWrapperWire``): rank 0's third
  activation send raises on the ``comm`` thread. Rank 0 raises it, named (``0SF2`` on
  ``comm``; the main thread waiting on the comm thread is woken, not left blocked); rank 1's
  ``1F2``, waiting in upstream's ``wait_for_act`` for that activation, ends with an error
  naming it (stage 1, microbatch 2, from rank 0).

Each runs twice: the failed rank exits at once (the peer's wait fails on the closed connection,
the receive named in a note), or it stays connected until the peer has ended: the peer's
receive is then ended by its bound, the engine's ``engine_timeout_s`` (``TransferTimeout``, not
sooner: the bound is what ended it). Upstream's ``wait_for_act`` waits with no timeout (gloo
does not bound ``work.wait()``; the hand-off group's timeout does not apply), so the drop-in
bounds the works it posts (``maglev.runtime.BoundedWork``); before that, rank 1 waited as long
as rank 0 stayed connected, which a sleep of the failed rank (it exited after 7.5 s) had hidden.

A third case, a forward failing on the drop-in under GPipe with the failed rank lingering: the
healthy rank waits in upstream's ``finish_send_act`` for a receive the failed rank never posts
(gloo completes a send only then); the drop-in bounds that wait the same way.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.ranks import run_on_ranks
from tests.dist.linger import linger_until_peer_ended, peer_ended
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not installed().has_maglev, reason="torchrec.distributed.maglev is new in TorchRec 1.9"),
]

TIMEOUT_S = 3.0
SEND_CASE_ENGINE_TIMEOUT_S = TIMEOUT_S * 3  # the failed rank's error must not wait for its engine's timeout


def _report(error: BaseException | None, elapsed: float) -> dict[str, Any]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "notes": list(getattr(error, "__notes__", [])),
        "task": getattr(error, "swp_task", None),
        "thread": getattr(error, "swp_thread", None),
        "elapsed": elapsed,
    }


def _fail_forward(pipeline: Any, microbatch: int) -> None:
    """This rank's forward of ``microbatch`` raises; the others run as bound."""
    forward = pipeline.runtime.bindings()["F"]

    def failing(s: int, m: int) -> None:
        if m == microbatch:
            raise ValueError("injected failure in a forward on rank 1")
        forward(s, m)

    pipeline.engine.rebind("F", failing)


def _progress_and_report(
    progress: Callable[[], Any], rank: int, healthy: int, linger: bool, marker: str
) -> dict[str, Any]:
    """Run ``progress()``, then the ``healthy`` rank says it ended and the other (the failed rank)
    stays connected until then when ``linger``: the healthy rank's waits must end by their bound."""
    error = None
    start = time.monotonic()
    try:
        progress()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        error = e
    elapsed = time.monotonic() - start
    if rank == healthy:
        peer_ended(marker)
    elif linger:
        linger_until_peer_ended(marker)
    return _report(error, elapsed)


def _compute_fails(rank: int, world_size: int, linger: bool, marker: str) -> dict[str, Any]:
    from torchrec_swp.integrations.torchrec.maglev import PipelineRank
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches
    from torchrec_swp.pp import build

    config = ModelConfig()
    ranks = PipelineRank(
        build_model(config), [2, 2], build("1F1B", 2, 4), thread_map="comm", engine_timeout_s=TIMEOUT_S
    )
    if rank == 1:
        _fail_forward(ranks, 2)
    return _progress_and_report(lambda: ranks.progress(make_batches(config, 4, seed=1)), rank, 0, linger, marker)


def _send_fails(rank: int, world_size: int, linger: bool, marker: str) -> dict[str, Any]:
    from torch.distributed import distributed_c10d
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec.maglev import Maglev1F1B
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches, on_cpu

    config = ModelConfig()
    stage = on_cpu(StageWrapper(build_model(config), list(config.layers_per_stage), stage_size=1))
    for pg in stage.handoff_pgs:
        distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S), pg)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    pipeline = Maglev1F1B(stage, optimizer, 4, thread_map="comm", engine_timeout_s=SEND_CASE_ENGINE_TIMEOUT_S)
    if rank == 0:
        send, sent = stage.start_send_act, [0]

        def failing_send(outputs: Any) -> None:
            sent[0] += 1
            if sent[0] == 3:
                raise ConnectionError("injected failure in an activation send on rank 0")
            send(outputs)

        stage.start_send_act = failing_send
    batches = iter(make_batches(config, 2, seed=rank))
    return _progress_and_report(lambda: pipeline.progress(batches), rank, 1, linger, marker)


@pytest.mark.parametrize("linger", [False, True], ids=["failed rank exits", "failed rank lingers"])
def test_a_failing_compute_action_ends_both_ranks_with_named_errors(linger: bool, tmp_path: Path) -> None:
    marker = str(tmp_path / "healthy-rank-ended")
    healthy, failed = run_on_ranks(_compute_fails, linger, marker, timeout_s=60, group_may_break=True)
    assert failed["type"] == "ValueError" and "injected failure" in failed["message"]
    assert (failed["task"], failed["thread"]) == ("1F2", "default")
    assert any("action 1F2, microbatch 2 on thread 'default'" in n for n in failed["notes"])
    assert healthy["type"] not in ("NoneType", "StopIteration"), healthy
    assert healthy["task"] is not None and healthy["task"].startswith("0"), healthy
    # 0B1 or 0B2: rank 1 sends gradient 1 on its comm thread, which its failing 1F2 may stop first
    gradient = "receive of the gradient for stage 0, microbatch {} from rank 1"
    _ended_by_its_receive(healthy, r"0B([12])", gradient, linger, TIMEOUT_S)
    assert healthy["elapsed"] < TIMEOUT_S * 4


def _ended_by_its_receive(report: dict[str, Any], action: str, receive: str, linger: bool, bound_s: float) -> None:
    """The healthy rank's error names the receive it waited on (``action`` the consumer's pattern,
    its microbatch a group; ``receive`` formatted with it). The failed rank lingering, the
    receive's bound ended it, not sooner; the failed rank exiting, the closed connection ended
    that receive (or a send meeting it first, on another thread)."""
    match = re.fullmatch(action, report["task"] or "")
    if linger:
        assert match, report
        assert report["type"] == "TransferTimeout", report
        assert report["message"].startswith(f"{receive.format(*match.groups())}: not done within {bound_s:g}s")
        assert report["elapsed"] >= bound_s, report
    else:
        assert report["type"] != "TransferTimeout", report
        if match:
            assert any(receive.format(*match.groups()) in n for n in report["notes"]), report


@pytest.mark.parametrize("linger", [False, True], ids=["failed rank exits", "failed rank lingers"])
def test_a_failing_send_on_the_comm_thread_is_named_and_nothing_hangs(linger: bool, tmp_path: Path) -> None:
    marker = str(tmp_path / "healthy-rank-ended")
    failed, healthy = run_on_ranks(_send_fails, linger, marker, timeout_s=TIMEOUT_S * 10, group_may_break=True)
    assert failed["type"] == "ConnectionError", failed
    assert (failed["task"], failed["thread"]) == ("0SF2", "comm")
    assert any("action 0SF2, microbatch 2 on thread 'comm'" in n for n in failed["notes"])
    assert failed["elapsed"] < TIMEOUT_S * 2
    assert healthy["type"] != "NoneType", healthy
    assert healthy["task"] is not None and healthy["task"].startswith("1"), healthy
    activation = "receive of the activation for stage 1, microbatch {} from rank 0"
    _ended_by_its_receive(healthy, r"1F(2)", activation, linger, SEND_CASE_ENGINE_TIMEOUT_S)
    assert healthy["elapsed"] < TIMEOUT_S * 4


def _drop_in_compute_fails(rank: int, world_size: int, marker: str) -> dict[str, Any]:
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec.maglev import Maglev1F1B
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches, on_cpu

    config = ModelConfig()
    stage = on_cpu(StageWrapper(build_model(config), list(config.layers_per_stage), stage_size=1))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.001)
    pipeline = Maglev1F1B(stage, optimizer, 4, schedule="GPipe", engine_timeout_s=TIMEOUT_S)  # one thread
    if rank == 1:
        _fail_forward(pipeline, 0)
    batches = iter(make_batches(config, 2, seed=rank))
    return _progress_and_report(lambda: pipeline.progress(batches), rank, 0, True, marker)


def test_a_drop_in_whose_peer_failed_and_lingers_ends_by_its_bounded_send(tmp_path: Path) -> None:
    """GPipe on the drop-in, on one thread: rank 1's first forward fails after it posted its first
    receive, never its second. Rank 0's third send (``0SF2``) first finishes its second, in
    upstream's ``finish_send_act``, which gloo completes only once rank 1 posted that receive: the
    bound ends it, named (unbounded, rank 0 waited as long as rank 1 stayed connected)."""
    marker = str(tmp_path / "healthy-rank-ended")
    healthy, failed = run_on_ranks(_drop_in_compute_fails, marker, timeout_s=TIMEOUT_S * 10, group_may_break=True)
    assert failed["type"] == "ValueError" and failed["task"] == "1F0", failed
    assert (healthy["type"], healthy["task"]) == ("TransferTimeout", "0SF2"), healthy
    send = "send of the activation of stage 0, microbatch 1 to rank 1"
    assert healthy["message"].startswith(f"{send}: not done within {TIMEOUT_S:g}s"), healthy
    assert TIMEOUT_S <= healthy["elapsed"] < TIMEOUT_S * 4, healthy

