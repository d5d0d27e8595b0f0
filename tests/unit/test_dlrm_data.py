"""The DLRM example's data (``examples/dlrm/data.py``) against TorchRec's ``torchrec.datasets``.

* Synthetic batches: the ids' counts of batch k are those of TorchRec's RandomRecDataset seeded with
  the batch's seed, the ids its uniform ids made heavy-tailed, the dense features its normal ones
  made log counts, and the labels follow the hidden model (not RandomRecDataset's coin flips); the
  same batch for the same (seed, rank, k), whether asked for by index, in any order, or iterating.
* Criteo TSV: on a well-formed file, the reader reads the values TorchRec's own reader of the format
  (``criteo_kaggle``, a CriteoIterDataPipe) reads, line by line; on lines that reader takes silently
  (short, unreadable numbers, a quote), ours names the file and line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES, criteo_kaggle
from torchrec.datasets.random import RandomRecDataset

from examples.dlrm.data import NUM_DENSE, CriteoTsv, SyntheticCriteo, sparse_names, write_sample_tsv


def test_synthetic_batches_are_random_rec_datasets_ones_made_criteo_like_with_learnable_labels() -> None:
    data = SyntheticCriteo(batch_size=64, num_batches=3, num_embeddings=1000, num_sparse=5, ids_per_feature=3, rank=1)
    for k, batch in enumerate(data):
        (drawn,) = RandomRecDataset(
            keys=sparse_names(5),
            batch_size=64,
            hash_size=1000,
            ids_per_feature=3,
            min_ids_per_feature=1,
            num_dense=NUM_DENSE,
            manual_seed=data._seed(k),
            num_batches=1,
            num_generated_batches=-1,
        )
        # its normal dense features as Criteo-like log counts: log(1 + floor(20 * Exp(1))), monotone in them
        want = torch.log1p((-20 * torch.special.log_ndtr(-drawn.dense_features)).floor())
        assert torch.equal(batch.dense_features, want) and bool((want >= 0).all())
        assert torch.equal(batch.sparse_features.lengths(), drawn.sparse_features.lengths())
        assert batch.sparse_features.keys() == drawn.sparse_features.keys() == DEFAULT_CAT_NAMES[:5]
        uniform = drawn.sparse_features.values()
        heavy = batch.sparse_features.values()
        assert heavy.shape == uniform.shape and bool((heavy <= uniform).all()) and bool((heavy >= 0).all())
        assert (heavy == 0).float().mean() > 0.1 > (uniform == 0).float().mean()  # a frequent id: Criteo's shape
        assert not torch.equal(batch.labels, drawn.labels)
    again = SyntheticCriteo(batch_size=64, num_batches=3, num_embeddings=1000, num_sparse=5, ids_per_feature=3, rank=1)
    for k in (2, 0, 1):  # by index, in any order: the batches of iterating
        assert torch.equal(again.batch(k).sparse_features.values(), list(data)[k].sparse_features.values())
        assert torch.equal(again.batch(k).labels, data.batch(k).labels)
    other_rank = SyntheticCriteo(batch_size=64, num_batches=1, num_embeddings=1000, num_sparse=5, ids_per_feature=3)
    assert not torch.equal(other_rank.batch(0).dense_features, data.batch(0).dense_features)


def test_synthetic_labels_follow_the_hidden_model() -> None:
    """The labels carry the signal the loss learns: the hidden model's logit ranks them far better than
    chance (the AUC of the logit over 20 batches), as RandomRecDataset's coin flips could not."""
    data = SyntheticCriteo(batch_size=256, num_batches=20, num_embeddings=100, num_sparse=2)
    logits, labels = [], []
    for batch in data:
        n = batch.labels.numel()
        first_ids = batch.sparse_features.values()[:n]  # one id per example: feature 0's come first
        dense = batch.dense_features
        logits.append((dense - dense.mean(0)) @ data._dense_weight + (first_ids % 2).float() - 0.5)
        labels.append(batch.labels)
    logit, label = torch.cat(logits), torch.cat(labels).bool()
    pos, neg = logit[label], logit[~label]
    auc = (pos[:, None] > neg[None, :]).float().mean().item()
    assert auc > 0.7, auc


def test_criteo_tsv_reads_what_torchrecs_criteo_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    write_sample_tsv(path, lines=24, seed=3)
    rows = list(criteo_kaggle(str(path)))  # TorchRec's reader: a dict per line, missing numbers as 0
    ours = list(CriteoTsv([path], batch_size=8, num_embeddings=1 << 20))
    assert len(rows) == 24 and len(ours) == 3
    for k, batch in enumerate(ours):
        for i in range(8):
            row = rows[8 * k + i]
            assert batch.labels[i].item() == row["label"]
            want = [math.log1p(max(row[name], 0)) for name in DEFAULT_INT_NAMES]
            assert torch.allclose(batch.dense_features[i], torch.tensor(want))
        for name in DEFAULT_CAT_NAMES:
            ids = batch.sparse_features[name]
            cats = [rows[8 * k + i][name] for i in range(8)]
            assert ids.lengths().tolist() == [1 if c else 0 for c in cats]
            assert ids.values().tolist() == [int(c, 16) % (1 << 20) for c in cats if c]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("1\t2\t3", r"bad.tsv:2: 3 tab-separated fields"),  # TorchRec's: cat_23..cat_25 and no label
        ("0\tx" + "\t1" * 12 + "\tab" * 26, r"bad.tsv:2: not a Criteo TSV line"),  # TorchRec's: int_0 = 0
        ('0\t"5' + "\t1" * 12 + "\tab" * 26, r"bad.tsv:2: not a Criteo TSV line"),  # TorchRec's: the quote eats on
    ],
)
def test_criteo_tsv_names_the_lines_torchrecs_reader_takes_silently(tmp_path: Path, line: str, error: str) -> None:
    path = tmp_path / "bad.tsv"
    write_sample_tsv(path, lines=1)
    path.write_text(path.read_text() + line + "\n")
    list(criteo_kaggle(str(path)))  # no error there
    with pytest.raises(ValueError, match=error):
        list(CriteoTsv([path], batch_size=2, num_embeddings=100))
