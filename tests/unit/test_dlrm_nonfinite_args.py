"""The DLRM example's non-finite options, in one process: the argument checks and the edited data.

* ``--on-nonfinite``, ``--poison-batch``, ``--poison-rank``, ``--drop-batch`` and ``--grad-accum`` that do not hang
  together are refused by ``train.py --check`` (what ``make run`` runs before launching) with one
  line; those that do pass.
* ``EditedBatches`` (``--drop-batch``, ``--poison-batch``): the batches a rank draws, the same by
  index and in order, synthetic or read from Criteo TSV files; the loader and the map source hand
  out the same ones.

The runs on 2 ranks: ``tests/dist/test_dlrm_nonfinite.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torchrec.datasets.utils import Batch

from examples.dlrm.data import CriteoTsv, EditedBatches, SyntheticCriteo, write_sample_tsv
from examples.dlrm.loader import MapBatches, SyntheticBatches, TsvBatches, make_loader
from tests.dist.test_torchx_dlrm import _check, assert_refused
from torchrec_swp.data import MapSource

REFUSED = {
    # name: (train.py arguments, the error line's message)
    "poison rank alone": (["--poison-rank", "1"], "--poison-rank: poisons rank R's batch of --poison-batch K"),
    "poison past the steps": (
        ["--steps", "10", "--poison-batch", "10"],
        "--poison-batch 10: out of range: each rank draws --steps 10 batches, 0 to 9",
    ),
    "negative drop": (["--steps", "10", "--drop-batch", "-1"], "--drop-batch -1: out of range"),
    "drop past the steps": (["--steps", "10", "--drop-batch", "12"], "--drop-batch 12: out of range"),
    "poison rank past the ranks": (
        ["--poison-batch", "2", "--poison-rank", "2", "--world-size", "2"],
        "--poison-rank 2: the job has 2 ranks, 0 to 1",
    ),
    "upstream": (
        ["--impl", "upstream", "--on-nonfinite", "skip", "--poison-batch", "2", "--poison-rank", "0"],
        "--on-nonfinite, --poison-batch, --poison-rank: for our pipelines only (--impl ours)",
    ),
    "an eval pipeline": (
        ["--pipeline", "EvalPipelineSparseDist", "--on-nonfinite", "skip"],
        "--on-nonfinite skip: EvalPipelineSparseDist evaluates only: no step to roll back",
    ),
    "poisoning an eval pipeline": (
        ["--pipeline", "EvalPipelineSparseDist", "--poison-batch", "2"],
        "--poison-batch: EvalPipelineSparseDist evaluates only: no training step to poison",
    ),
    "staged": (
        ["--pipeline", "StagedTrainPipeline", "--on-nonfinite", "raise"],
        "--on-nonfinite raise: StagedTrainPipeline's caller trains on the batch it hands out",
    ),
    "a plan with an effect it cannot undo": (
        ["--pipeline", "TrainPipelineBase", "--on-nonfinite", "skip"],
        "--on-nonfinite skip: our TrainPipelineBase cannot roll its steps back: plan TrainPipelineBase: task WaitBatch "
        "declares counters",
    ),
    "a thread map that splits the step": (
        ["--on-nonfinite", "skip", "--thread-map", "Backward=bwd"],
        "cannot roll its steps back: plan TrainPipelineSparseDist: its tasks with effects are on several threads",
    ),
    "autotune": (["--autotune", "--on-nonfinite", "skip"], "--on-nonfinite skip: not with --autotune"),
    "global data": (
        ["--data-source", "global", "--epoch-batches", "8", "--poison-batch", "1"],
        "--poison-batch: not with --data-source global",
    ),
    "the option by --option": (["--option", "on_nonfinite='skip'"], "--option on_nonfinite: give --on-nonfinite MODE"),
    "an unknown mode": (["--on-nonfinite", "ignore"], "argument --on-nonfinite: invalid choice: 'ignore'"),
    # --grad-accum, with which --on-nonfinite closes a window as if the rolled-back batch was never seen
    "no window": (["--grad-accum", "0"], "--grad-accum must be >= 1 (1: no accumulation)"),
    "accumulating an eval pipeline": (
        ["--pipeline", "EvalPipelineSparseDist", "--grad-accum", "2"],
        "--grad-accum 2: EvalPipelineSparseDist evaluates only: no optimizer step to accumulate for",
    ),
    "accumulating for the staged pipeline's caller": (
        ["--pipeline", "StagedTrainPipeline", "--grad-accum", "2"],
        "--grad-accum 2: StagedTrainPipeline hands its batches to the caller, who steps the optimizer",
    ),
    "accumulating while the training pipeline evaluates": (
        ["--grad-accum", "2", "--eval-every", "5", "--eval-mode", "hybrid"],
        "--grad-accum 2: not with --eval-mode hybrid (the training pipeline evaluates too)",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_nonfinite_arguments_that_do_not_hang_together_are_refused_with_one_line(case: str) -> None:
    assert_refused(*REFUSED[case])


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "30", "--poison-batch", "12", "--on-nonfinite", "skip"],
        ["--steps", "29", "--drop-batch", "12"],
        ["--steps", "30", "--poison-batch", "12", "--poison-rank", "1", "--on-nonfinite", "raise", "--world-size", "2"],
        ["--steps", "30", "--poison-batch", "12"],  # off: the NaN goes into the weights, as upstream's would
        ["--impl", "upstream", "--steps", "29", "--drop-batch", "0"],
        ["--on-nonfinite", "skip", "--data-source", "map", "--loads", "2", "--thread-map", "io"],
        ["--on-nonfinite", "skip", "--pipeline", "TrainPipelineFusedSparseDist", "--optimizer", "adagrad"],
        ["--on-nonfinite", "skip", "--pipeline", "TrainEvalHybridPipelineBase", "--eval-every", "5"],
        ["--on-nonfinite", "skip", "--checkpoint-dir", "{tmp}", "--checkpoint-every", "5"],
        ["--on-nonfinite", "skip", "--grad-accum", "3", "--checkpoint-dir", "{tmp}", "--checkpoint-every", "5"],
        ["--impl", "upstream", "--grad-accum", "4", "--eval-every", "5"],
    ],
)
def test_nonfinite_arguments_that_hang_together_pass(argv: list[str], tmp_path: Path) -> None:
    code, err = _check([a.format(tmp=tmp_path / "checkpoints") for a in argv])
    assert code == 0, err


def _equal(a: Batch, b: Batch) -> bool:
    """The same batch: dense features (NaN where NaN), labels, ids and their counts."""

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.shape == y.shape and bool(((x == y) | (x.isnan() & y.isnan())).all())

    return (
        same(a.dense_features, b.dense_features)
        and same(a.labels, b.labels)
        and same(a.sparse_features.values(), b.sparse_features.values())
        and same(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def test_edited_batches_are_the_draws_without_the_dropped_one_with_the_poisoned_one_nan(tmp_path: Path) -> None:
    tsv = tmp_path / "day_0.tsv"
    write_sample_tsv(tsv, lines=2 * 4 * 9)
    sources = {
        "synthetic": SyntheticCriteo(batch_size=4, num_batches=9, num_embeddings=50, num_sparse=3, rank=1),
        "tsv": CriteoTsv([tsv], batch_size=4, num_embeddings=50, num_sparse=3, rank=1, world_size=2),
    }
    for source in sources.values():
        plain = list(source)
        dropped = EditedBatches(source, drop=3)
        assert len(dropped) == 8
        for k, batch in enumerate(dropped):
            assert _equal(batch, plain[k if k < 3 else k + 1]) and _equal(dropped.batch(k), batch)
        both = EditedBatches(source, drop=3, poison=5)  # the 5th batch drawn: the source's 6th
        drawn = list(both)
        assert [k for k, b in enumerate(drawn) if b.dense_features.isnan().any()] == [5]
        assert drawn[5].dense_features.isnan().all() and torch.equal(drawn[5].labels, plain[6].labels)
        assert torch.equal(drawn[5].sparse_features.values(), plain[6].sparse_features.values())
        assert both.batch(5).dense_features.isnan().all() and not math.isnan(float(both.batch(4).dense_features[0, 0]))
        with pytest.raises(IndexError):
            both.batch(8)


def test_the_loader_and_the_map_source_hand_out_the_edited_batches_alike(tmp_path: Path) -> None:
    source = SyntheticCriteo(batch_size=4, num_batches=7, num_embeddings=50, num_sparse=3)
    edited = EditedBatches(source, drop=0, poison=2)
    through_loader = list(make_loader(SyntheticBatches(edited), num_workers=2))
    mapped = MapSource(MapBatches(edited))
    through_map = list(mapped)
    assert len(through_loader) == len(through_map) == 6
    for a, b, want in zip(through_loader, through_map, edited, strict=True):
        assert _equal(a, want) and _equal(b, want)
    tsv = tmp_path / "day_0.tsv"
    write_sample_tsv(tsv, lines=4 * 5)
    read = CriteoTsv([tsv], batch_size=4, num_embeddings=50, num_sparse=3)
    assert len(list(make_loader(TsvBatches(EditedBatches(read, drop=4))))) == 4
