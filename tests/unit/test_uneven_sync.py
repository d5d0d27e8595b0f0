"""``sync_dataloader_exhaustion`` in one process: the engine's draws with a stand-in for the
collective (a peer whose data holds a given number of batches), and the option's bad input.

The stand-in answers ``agree(have)`` as the MIN all-reduce would with one peer holding
``peer`` batches per epoch; it records which thread asked. The real collective on 2 gloo
ranks is tested in tests/dist/test_uneven_data.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchrec_swp
from tests.unit.test_engine_options import Summing, build
from torchrec_swp.data import MapSource
from torchrec_swp.engine import exhaustion, source
from torchrec_swp.engine.exhaustion import ExhaustionSync
from torchrec_swp.integrations.torchrec import pipelines
from torchrec_swp.integrations.torchrec.pipelines.engine_options import EngineOptions

CPU = torch.device("cpu")


class Done:
    """A finished collective's work."""

    def wait(self) -> bool:
        return True


class PeerSync(ExhaustionSync):
    """One peer with ``peer`` batches per epoch; no process group: each all-reduce is answered
    when it is issued, as the real one would be once the peer issued its own."""

    def __init__(self, peer: int) -> None:
        super().__init__(group=None)  # type: ignore[arg-type]
        self.peer = peer
        self.position = 0
        self.threads: list[str] = []

    def _issue(self, have: bool) -> tuple[Any, torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        every = have and self.position < self.peer
        self.position = self.position + 1 if every else 0  # the end starts the peer's next epoch
        return Done(), torch.tensor([1 if every else 0], dtype=torch.int32)


def batches(n: int, seed: int) -> list[torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [torch.randn(5, 4) for _ in range(n)]


def epochs(lengths: list[int], data: Callable[[list[torch.Tensor]], Any] = iter, **options: Any) -> tuple[Any, ...]:
    """Train TrainPipelineBase over one epoch per length (a new iterator each): outputs and
    StopIteration call per epoch, the final weights, the pipeline."""
    model = Summing()
    pipeline = torchrec_swp.TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.05), CPU, **options)
    runs = []
    for e, n in enumerate(lengths):
        it = data(batches(n, seed=e))
        outputs = []
        for call in range(n + 3):
            try:
                outputs.append(pipeline.progress(it)[1].detach().clone())
            except StopIteration:
                runs.append((outputs, call))
                break
    pipeline.close()
    return runs, {k: v.clone() for k, v in model.state_dict().items()}, pipeline


OPTIONS = [{}, {"thread_map": "io"}, {"loads": 2}, {"thread_map": "io", "lookahead": 2}, {"loads": 3, "lookahead": 1}]


@pytest.mark.parametrize("data", [iter, MapSource], ids=["iterator", "MapSource"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("mine, peer", [(13, 10), (10, 13)], ids=["longer", "shorter"])
def test_every_rank_stops_at_the_shorter_data_and_trains_as_with_it(
    monkeypatch: pytest.MonkeyPatch, data: Any, options: dict[str, Any], mine: int, peer: int
) -> None:
    sync = PeerSync(peer)
    monkeypatch.setattr(ExhaustionSync, "create", classmethod(lambda cls, owner, timeout_s, required=True: sync))
    reference, ref_weights, _ = epochs([10, 10], sync_dataloader_exhaustion=False)
    runs, weights, pipeline = epochs([mine, mine], data, sync_dataloader_exhaustion=True, **options)
    for (outputs, stop), (ref_outputs, ref_stop) in zip(runs, reference, strict=True):
        assert stop == ref_stop == 10
        assert len(outputs) == 10 and all(torch.equal(a, b) for a, b in zip(outputs, ref_outputs))
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    # one collective per draw, batch 10 included; an item drawn for it by the longer rank is not trained
    assert len(sync.threads) == 2 * 11
    assert pipeline.batch_ledger.dropped_past_end == (2 if mine > peer else 0)
    assert pipeline.batch_ledger.trained == 20 and pipeline.batch_ledger.dropped == []
    # issued by the thread that draws: the calling thread only where the plan draws there
    drew_on_caller = {threading.current_thread().name} == set(sync.threads)
    assert drew_on_caller == (options == {}), (options, set(sync.threads))


def test_a_task_that_found_its_batch_in_flight_before_another_thread_retracts_it_does_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The io thread's next draw settles batch 10's "no" and retracts it while the main thread's
    first task of batch 10 has found it in flight: that task must still see the retraction (a
    slow retraction widens the window; before the gate kept the retracted batch it ran batch 10
    in nearly every epoch)."""
    retract = source.Source.retract

    def slow(self: source.Source, b: int, book: Any) -> None:
        time.sleep(0.003)
        retract(self, b, book)

    monkeypatch.setattr(source.Source, "retract", slow)
    sync = PeerSync(10)
    monkeypatch.setattr(ExhaustionSync, "create", classmethod(lambda cls, owner, timeout_s, required=True: sync))
    reference, ref_weights, _ = epochs([10] * 6, sync_dataloader_exhaustion=False)
    runs, weights, pipeline = epochs([13] * 6, MapSource, sync_dataloader_exhaustion=True, thread_map="io", lookahead=2)
    assert [stop for _, stop in runs] == [10] * 6
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert pipeline.batch_ledger.trained == 60


@pytest.mark.parametrize("option", [False, None], ids=["off", "default-without-a-process-group"])
def test_without_the_sync_nothing_agrees_and_the_data_ends_where_it_ends(option: bool | None) -> None:
    assert not torch.distributed.is_initialized()
    runs, _, pipeline = epochs([13], sync_dataloader_exhaustion=option)
    assert runs[0][1] == 13 and pipeline.engine.exhaustion is None


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("name", pipelines.__all__)
def test_without_a_process_group_every_pipeline_says_so_in_one_line(name: str) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError) as info:
        build(name, sync_dataloader_exhaustion=True).close()
    assert str(info.value) == (
        f"{name}(sync_dataloader_exhaustion=True) needs torch.distributed's default process group: call "
        "torch.distributed.init_process_group() before building the pipeline"
    )


def test_the_option_is_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match=r"^X: sync_dataloader_exhaustion must be a bool or None .*, got 'yes'$"):
        EngineOptions.take({"sync_dataloader_exhaustion": "yes"}, "X")


def test_synced_iterator_stops_with_the_shorter_peer() -> None:
    sync = PeerSync(2)
    it = exhaustion.SyncedIterator(iter([1, 2, 3, 4]), sync)
    assert list(it) == [1, 2] and it.dropped == 1


# ------------------------------------------------------------------ the deferred agreement
class Pending:
    """A collective's work that completes only when waited for (and says so)."""

    def __init__(self, log: list[str], what: str) -> None:
        self.log, self.what = log, what

    def wait(self) -> bool:
        self.log.append(f"wait {self.what}")
        return True


class LatePeerSync(PeerSync):
    """``PeerSync`` whose answers are known only once waited for."""

    def __init__(self, peer: int) -> None:
        super().__init__(peer)
        self.log: list[str] = []

    def _issue(self, have: bool) -> tuple[Any, torch.Tensor]:
        _, flag = super()._issue(have)
        self.log.append(f"issue {int(have)}")
        return Pending(self.log, str(int(have))), flag


def test_a_deferred_agreement_retracts_the_batch_a_peer_lacks_and_nothing_after_it() -> None:
    sync = LatePeerSync(peer=2)
    items = iter(range(100))
    retracted: list[int] = []
    pull = lambda: next(items)  # noqa: E731
    assert sync.begin(0, pull, lambda: retracted.append(0)) == 0
    assert sync.gated_from == 0 and sync.log == ["issue 1"]  # begun, not waited for
    assert sync.begin(1, pull, lambda: retracted.append(1)) == 1  # the open one settled first
    assert sync.log == ["issue 1", "wait 1", "issue 1"] and sync.gated_from == 1
    assert sync.begin(2, pull, lambda: retracted.append(2)) == 2  # the peer has no batch 2
    assert sync.settle() is False and retracted == [2]
    assert sync.gated_from == 2  # still gated: a task that saw batch 2 in flight asks again
    # a draw that began before the retraction was seen: nothing pulled, nothing issued
    issued = len(sync.log)
    with pytest.raises(StopIteration):
        sync.begin(3, pull, lambda: retracted.append(3))
    assert next(items) == 3 and len(sync.log) == issued and retracted == [2]
    # the next epoch (batches from 0 again) draws, and its agreements begin again
    assert sync.begin(0, pull, lambda: retracted.append(0)) == 4
    assert sync.settle() is True and retracted == [2]


def test_a_carried_flag_rides_on_the_draws_all_reduce_and_is_known_once_settled() -> None:
    class CarryingPeer(ExhaustionSync):
        """A peer with ``peer`` batches that holds every carried flag; records what was issued."""

        def __init__(self, peer: int) -> None:
            super().__init__(group=None)  # type: ignore[arg-type]
            self.peer, self.position, self.issued = peer, 0, []

        def _issue(self, *flags: bool) -> tuple[Any, torch.Tensor]:
            self.issued.append(flags)
            every = flags[0] and self.position < self.peer
            self.position = self.position + 1 if every else 0
            return Done(), torch.tensor([int(every), int(flags[1])], dtype=torch.int32)

    sync = CarryingPeer(peer=2)
    carried: list[exhaustion.Carried] = []

    def carry(item: Any) -> exhaustion.Carried:
        carried.append(exhaustion.Carried(mine=item % 2 == 0))
        return carried[-1]

    sync.carry = carry
    items = iter(range(10))
    pull = lambda: next(items)  # noqa: E731
    assert sync.begin(0, pull, lambda: None) == 0 and carried[0].every is None  # begun, not settled
    assert sync.begin(1, pull, lambda: None) == 1 and carried[0].every is True
    assert sync.settle() is True and carried[1].every is False  # one int32 more, no collective more
    assert sync.issued == [(True, True), (True, False)]
    assert sync.begin(2, pull, lambda: None) == 2 and sync.settle() is False  # the peer has no batch 2
    assert carried[2].every is None  # retracted: nothing agreed
    with pytest.raises(StopIteration):  # the end of this rank's data carries nothing of its own
        sync.begin(0, lambda: next(iter(())), None)
    assert sync.issued[-1] == (False, False)


def test_a_rank_whose_data_ends_agrees_no_and_its_next_epoch_settles_that_first() -> None:
    sync = LatePeerSync(peer=5)
    with pytest.raises(StopIteration):
        sync.begin(0, lambda: next(iter(())), None)
    assert sync.log == ["issue 0"] and sync.gated_from == exhaustion.NEVER  # nothing of ours to gate
    assert sync.begin(0, lambda: "x", None) == "x"  # the open "no" waited for, not a retraction
    assert sync.log == ["issue 0", "wait 0", "issue 1"]
    sync.finish()
    assert sync.log[-1] == "wait 1" and sync.settle() is True


def test_a_blocking_draw_settles_an_open_agreement_first() -> None:
    sync = LatePeerSync(peer=1)
    assert sync.begin(0, lambda: "a", None) == "a"
    with pytest.raises(StopIteration):
        sync.draw(lambda: "b")  # batch 0 was agreed, the peer has no batch 1
    assert sync.log == ["issue 1", "wait 1", "issue 1", "wait 1"]


def test_finishing_after_the_group_was_shut_down_raises_nothing() -> None:
    class Broken:
        def wait(self) -> bool:
            raise RuntimeError("the process group was destroyed")

    sync = LatePeerSync(peer=5)
    sync.begin(0, lambda: "x", None)
    sync._open.work = Broken()  # type: ignore[union-attr]
    sync.finish()
    assert sync.settle() is True and sync.gated_from == exhaustion.NEVER
