"""The DLRM example's ``--input-dist-cache-mb``: a train-and-evaluate run on 2 gloo ranks that
evaluates its held-out set 4 times finds the same AUC and NE after every evaluation, and trains
the same weights, as the run without the cache; the held-out batches' input dist runs in the
first evaluation only (the cache's counts, rank 0's, in the summary and its line). Bad
arguments are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.test_dlrm_eval import _ranks
from tests.dist.test_torchx_dlrm import assert_refused

BATCHES = 6
RUN = ["--steps", "16", "--eval-every", "4", "--eval-batches", str(BATCHES)]


@pytest.mark.multiprocess
def test_four_evaluations_distribute_the_held_out_set_once_and_find_the_same_auc_and_ne(tmp_path: Path) -> None:
    plain, _ = _ranks(RUN, tmp_path, "plain")
    cached, output = _ranks([*RUN, "--input-dist-cache-mb", "16"], tmp_path, "cached")
    assert len(plain["evaluations"]) == 4
    for a, b in zip(plain["evaluations"], cached["evaluations"], strict=True):
        assert (a["step"], a["auc"], a["ne"], a["batches"]) == (b["step"], b["auc"], b["ne"], b["batches"])
    assert cached["weights_sha256"] == plain["weights_sha256"]
    assert plain["input_dist_cache"] is None
    stats = cached["input_dist_cache"]
    assert (stats["hits"], stats["misses"], stats["entries"], stats["not_kept"]) == (3 * BATCHES, BATCHES, BATCHES, 0)
    assert 0 < stats["bytes"] <= 16 * 2**20 and stats["saved_s"] > 0
    assert f"input dist cache: {3 * BATCHES} of {4 * BATCHES} held-out batches reused their input dist" in output


BAD = {
    "without evaluation": (["--input-dist-cache-mb", "8"], "--input-dist-cache-mb: no evaluation without --eval-every"),
    "hybrid": (
        ["--eval-every", "4", "--eval-mode", "hybrid", "--input-dist-cache-mb", "8"],
        "--input-dist-cache-mb: the cache is our EvalPipelineSparseDist's (--eval-mode pipeline, --impl ours), "
        "not --eval-mode hybrid --impl ours",
    ),
    "upstream": (
        ["--eval-every", "4", "--impl", "upstream", "--input-dist-cache-mb", "8"],
        "not --eval-mode pipeline --impl upstream",
    ),
    "negative": (["--eval-every", "4", "--input-dist-cache-mb", "-1"], "--input-dist-cache-mb must be a finite"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_cache_the_run_cannot_use_is_refused_in_one_line(case: str) -> None:
    assert_refused(*BAD[case])


def test_the_component_passes_the_cap() -> None:
    from examples.dlrm.component import dlrm

    assert "--eval-every 4 --input-dist-cache-mb 32" in dlrm(eval_every=4, input_dist_cache_mb=32).roles[0].args[-1]
    assert "--input-dist-cache-mb" not in dlrm(eval_every=4).roles[0].args[-1]
