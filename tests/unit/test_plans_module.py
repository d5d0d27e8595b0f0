"""``torchrec_swp.plans``: the documented import path of the plan edits (pure: no torch), the
catalog's own functions and transforms re-exported, and ``with_lookahead`` on PipelinePlan and PhasedPlan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.catalog import transforms
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PlanError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "statement",
    [
        "import torchrec_swp.plans as plans",
        "from torchrec_swp import plans",
        "import torchrec_swp; plans = torchrec_swp.plans",
    ],
)
def test_plans_imports_as_documented_without_torch(statement: str) -> None:
    code = (
        f"import sys\n{statement}\n"
        "assert plans.with_parallel_loads and plans.with_lookahead and plans.with_input_dist_group"
        " and plans.default_plans\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchrec', 'fbgemm_gpu')]\n"
        "assert not bad, bad\n"
        "print(plans.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "torchrec_swp" / "plans.py")


def test_the_edits_are_the_catalogs_own() -> None:
    from torchrec_swp import plans

    assert plans.default_plans is catalog.default_plans
    for name in (
        "with_parallel_loads",
        "with_input_dist_group",
        "with_lookahead",
        "splits_draw",
        "DRAW_TASKS",
        "FETCH",
        "INPUT_DIST_TASKS",
    ):
        assert getattr(plans, name) is getattr(transforms, name), name
    assert set(plans.__all__) == {name for name in dir(plans) if not name.startswith("_")} - {"annotations"}


def test_with_lookahead_edits_a_plan_and_every_phase() -> None:
    from torchrec_swp import plans

    plan = plans.with_lookahead(catalog.sparse_dist_plan(), 2)
    assert isinstance(plan, PipelinePlan)
    assert plan == catalog.sparse_dist_plan().replace(lookahead=2)
    assert plan.format_schedule(1).splitlines()[0].startswith("depth 3 + lookahead 2 = 5 batches in flight")
    phased = plans.with_lookahead(catalog.semi_sync_phases(start_batch=5), 1)
    assert isinstance(phased, PhasedPlan)
    assert [p.lookahead for p in phased.plans] == [1, 1] and [s for s, _ in phased.phases] == [0, 5]
    # after the loads, the lookahead is the last word
    loaded = plans.with_lookahead(plans.with_parallel_loads(catalog.sparse_dist_plan(), 2), 0)
    assert (loaded.loads, loaded.lookahead) == (2, 0)


@pytest.mark.parametrize("bad", [-1, True, 1.0, None])
def test_with_lookahead_refuses_what_is_not_an_int_of_at_least_0(bad: object) -> None:
    from torchrec_swp import plans

    with pytest.raises(PlanError, match=f"lookahead must be an int >= 0, got {bad!r}"):
        plans.with_lookahead(catalog.sparse_dist_plan(), bad)  # type: ignore[arg-type]
