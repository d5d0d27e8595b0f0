"""One thread name per idea: every thread group a catalog plan uses (each drop-in's default plan,
with each switch of its catalog function flipped, and with parallel loads) is a key of
``catalog.THREADS``, which says what it is for; and every key is used."""

from __future__ import annotations

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.catalog.transforms import with_parallel_loads
from torchrec_swp.integrations.torchrec.pipelines.protocol import catalog_plans
from torchrec_swp.plan.threads import IO_THREAD


def _plans() -> list[object]:
    plans = catalog_plans()
    plans.append(with_parallel_loads(catalog.sparse_dist_plan(), 3))
    plans.append(catalog.sparse_dist_plan(h2d_thread=catalog.COPY_THREAD))
    return plans


def _threads(plan: object) -> set[str]:
    return {s.thread_group.split(".")[0] for p in getattr(plan, "plans", (plan,)) for s in p.schedule.values()}


def test_every_catalog_thread_has_one_stated_meaning_and_every_meaning_is_used() -> None:
    used = set().union(*(_threads(p) for p in _plans()))
    assert used == set(catalog.THREADS), (used - set(catalog.THREADS), set(catalog.THREADS) - used)


def test_the_background_copy_threads_are_the_io_thread() -> None:
    """SparseDistT's copy, async_inplace_copy's in-place copy and EvalPipelineSparseDist's loader
    are one idea: the thread of the ``"io"`` thread map."""
    from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import INPLACE_COPY_THREAD

    assert catalog.COPY_THREAD == INPLACE_COPY_THREAD == IO_THREAD
    assert catalog.sparse_dist_t_plan().task("H2D").thread_group == IO_THREAD
    assert catalog.eval_sparse_dist_plan().task("H2D").thread_group == IO_THREAD
