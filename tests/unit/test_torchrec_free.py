"""tests/conftest.py's ``torchrec_free`` mark: `make test` skips these tests on TorchRec 1.8, so a
test that can reach TorchRec must never get it."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, torchrec_free

UNIT = ROOT / "tests" / "unit"


@pytest.mark.parametrize("name", ["test_plan.py", "test_sim_engine.py", "test_engine.py", "test_pp_actions.py"])
def test_tests_of_the_pure_rooms_and_the_engine_are_free(name: str) -> None:
    assert torchrec_free(UNIT / name)


@pytest.mark.parametrize(
    "name, why",
    [
        ("test_public_names.py", "imports the pipelines from torchrec_swp's first-use names"),
        ("test_compat.py", "reads TorchRec's installed version (package metadata)"),
        ("test_upstream_streams.py", "imports upstream's pipelines"),
        ("test_dlrm_data.py", "imports torchrec.datasets through the example"),
        ("test_streamcheck_report.py", "runs programs in subprocesses"),
    ],
)
def test_tests_that_can_reach_torchrec_are_not(name: str, why: str) -> None:
    assert not torchrec_free(UNIT / name), why


@pytest.mark.parametrize(
    "body, free",
    [
        ("import torchrec_swp\n\n\ndef test_x():\n    torchrec_swp.TrainPipelineBase\n", False),
        ("from torchrec_swp import TrainPipelineBase\n", False),
        ("import torchrec_swp.sim\n\n\ndef test_x():\n    torchrec_swp.sim.simulate\n", True),
    ],
    ids=["attribute of a first-use package", "name from a first-use package", "submodule of it"],
)
def test_a_name_from_a_first_use_package_counts_as_reaching_torchrec(
    body: str, free: bool, request: pytest.FixtureRequest
) -> None:
    # the probe must lie in the checkout to be resolved; one module name per case (results are cached)
    probe = UNIT / f"_probe_torchrec_free_{abs(hash(request.node.name))}.py"
    try:
        probe.write_text(body)
        assert torchrec_free(probe) is free
    finally:
        probe.unlink(missing_ok=True)
