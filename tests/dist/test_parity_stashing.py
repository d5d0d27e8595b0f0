"""Our memory-stashing pipelines against upstream's, on 2 gloo ranks: TrainPipelineSparseDistOptStash,
TrainPipelineSparseDistEmbStash and TrainPipelinePrefetchEMS (TorchRec's experimental pipelines).

Same sharded model (fresh, same seed; the dense part trained by Adam, whose state is what
OptStash stashes) and same data for every run, two epochs (the second through a new iterator):
outputs, losses, final weights, batch counts and the call that raises StopIteration must be
equal bit for bit in each, with the default plan and thread maps that move tasks (OptStash's
stash thread back to the calling thread, H2D to an io thread with lookahead, one thread per
stream).

Upstream needs the test-only CPU patch (``upstream_cpu_patch``): its constructors create
``torch.cuda.Stream(device=device)`` and MemoryStashingManager's threaded stash and restore
record CUDA events on CUDA's current stream. Under it upstream's OptStash still has no
host-to-device stream on the CPU (TrainPipelineSparseDist makes none there): the test gives the
manager a CPU one (in ``_run``). MemoryStashingManager is process-wide: it
is reset after every run. On the CPU the manager stashes nothing (CUDA tensors only), on either
side: what is compared is the schedule around it. In checked mode (``SWP_STREAM_CHECK=1``)
every run is checked, upstream's too, its manager's thread hand-offs told to the checker
(``_future_edges``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import RunResult, assert_runs_equal, build_model, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks
from torchrec_swp.streamcheck import process_checker, stream_check_requested

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess]

STEPS = 10
CPU = torch.device("cpu")
#: the table-wise EmbeddingBagCollection (OptStash's output-dist site) and the over-arch (EmbStash's)
EBC, OVER = "sparse.ebc", "over"

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


def _counting_opt_stash(*args: Any, **kwargs: Any) -> Any:
    """Our OptStash, counting the calls of its restore hook (at the output dist of ``site_fqn``,
    in every backward) in ``pipeline.restore_hooks``: on the CPU it has nothing to restore, so
    the count is what shows that the hook is in place."""
    from torchrec_swp import TrainPipelineSparseDistOptStash

    class Counting(TrainPipelineSparseDistOptStash):
        restore_hooks = 0

        def _swp_restore_in_backward(self, pipeline: Any) -> None:
            self.restore_hooks += 1
            super()._swp_restore_in_backward(pipeline)

    return Counting(*args, **kwargs)


def _cases() -> dict[str, tuple[Factory, dict[str, Factory]]]:
    from torchrec.distributed.train_pipeline import experimental_pipelines as upstream

    import torchrec_swp as ours

    return {
        "TrainPipelineSparseDistOptStash": (
            lambda m, o: upstream.TrainPipelineSparseDistOptStash(m, o, CPU, site_fqn=EBC),
            {
                "default": lambda m, o: _counting_opt_stash(m, o, CPU, site_fqn=EBC),
                "main": lambda m, o: ours.TrainPipelineSparseDistOptStash(m, o, CPU, site_fqn=EBC, thread_map="main"),
                "by_stream": lambda m, o: ours.TrainPipelineSparseDistOptStash(
                    m, o, CPU, site_fqn=EBC, thread_map="by_stream"
                ),
                "io_lookahead": lambda m, o: ours.TrainPipelineSparseDistOptStash(
                    m, o, CPU, site_fqn=EBC, thread_map={"H2D": "io"}, lookahead=2
                ),
            },
        ),
        "TrainPipelineSparseDistEmbStash": (
            lambda m, o: upstream.TrainPipelineSparseDistEmbStash(m, o, CPU, site_fqn=OVER, delay_stash=True),
            {
                "default": lambda m, o: ours.TrainPipelineSparseDistEmbStash(
                    m, o, CPU, site_fqn=OVER, delay_stash=True
                ),
                "by_stream": lambda m, o: ours.TrainPipelineSparseDistEmbStash(
                    m, o, CPU, site_fqn=OVER, delay_stash=True, thread_map="by_stream"
                ),
            },
        ),
        "TrainPipelinePrefetchEMS": (
            lambda m, o: upstream.TrainPipelinePrefetchEMS(m, o, CPU, site_fqn=OVER),
            {
                "default": lambda m, o: ours.TrainPipelinePrefetchEMS(m, o, CPU, site_fqn=OVER),
                "by_stream": lambda m, o: ours.TrainPipelinePrefetchEMS(
                    m, o, CPU, site_fqn=OVER, thread_map="by_stream"
                ),
                "io_lookahead": lambda m, o: ours.TrainPipelinePrefetchEMS(
                    m, o, CPU, site_fqn=OVER, thread_map={"H2D": "io"}, lookahead=2
                ),
            },
        ),
    }


@contextlib.contextmanager
def _future_edges() -> Iterator[None]:
    """In checked mode, the CPU-side edges of MemoryStashingManager's thread hand-offs told to
    the stream checker: a job starts after its ``submit`` and ``result()`` returns after it.
    Upstream's OptStash records an event before submitting the stash or restore, which the
    manager's thread makes its stream wait for, and waits for the result before its own stream
    waits for the events recorded there; the checker sees threads only through such edges."""
    from torchrec.distributed.memory_stashing import MemoryStashingManager

    if not stream_check_requested():
        yield
        return
    checker = process_checker()
    submit = MemoryStashingManager.thread_submit.__func__  # type: ignore[attr-defined]
    serial = itertools.count()

    class _Joined(Future):  # type: ignore[type-arg]
        def __init__(self, inner: Future, key: tuple[str, int]) -> None:  # type: ignore[type-arg]
            super().__init__()
            self._inner, self._key = inner, key

        def result(self, timeout: float | None = None) -> Any:
            value = self._inner.result(timeout)
            checker.cpu_acquire(("done", *self._key))
            return value

    def thread_submit(cls: type, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:  # type: ignore[type-arg]
        key = ("stash job", next(serial))
        checker.cpu_release(("start", *key))

        def job() -> Any:
            checker.cpu_acquire(("start", *key))
            try:
                return fn(*args, **kwargs)
            finally:
                checker.cpu_release(("done", *key))

        return _Joined(submit(cls, job), key)

    MemoryStashingManager.thread_submit = classmethod(thread_submit)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        MemoryStashingManager.thread_submit = classmethod(submit)  # type: ignore[method-assign,assignment]


def _epochs(pipeline: Any, rank: int, world_size: int, seed: int) -> list[RunResult]:
    """Two epochs on one pipeline (the second on new batches, through a new iterator)."""
    return [
        train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed + epoch), STEPS + 3)
        for epoch in range(2)
    ]


def _run(
    rank: int, world_size: int, seed: int, factory: Factory, patched: bool
) -> tuple[list[RunResult], int | None]:
    """The runs of two epochs, and how often the pipeline's restore hook ran where it counts them
    (else None)."""
    from torchrec.distributed.memory_stashing import MemoryStashingManager
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model, _ = build_model(rank, world_size, seed)
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    optimizer = torch.optim.Adam(dense, lr=0.01)
    try:
        if not patched:
            pipeline = factory(model, optimizer)
            try:
                return _epochs(pipeline, rank, world_size, seed), getattr(pipeline, "restore_hooks", None)
            finally:
                pipeline.close()
        with upstream_cpu_patch(), _future_edges():
            pipeline = factory(model, optimizer)
            # upstream's OptStash restores on the pipeline's memcpy stream, which the CPU has not
            MemoryStashingManager.set_streams(torch.cpu.Stream(), MemoryStashingManager.d2h_stream())
            return _epochs(pipeline, rank, world_size, seed), None
    finally:
        MemoryStashingManager.reset()


def _all(rank: int, world_size: int, seed: int, name: str) -> dict[str, Any]:
    upstream_factory, our_factories = _cases()[name]
    return {
        "upstream": _run(rank, world_size, seed, upstream_factory, patched=True),
        "ours": {label: _run(rank, world_size, seed, f, patched=False) for label, f in our_factories.items()},
    }


@pytest.mark.parametrize(
    "name", ["TrainPipelineSparseDistOptStash", "TrainPipelineSparseDistEmbStash", "TrainPipelinePrefetchEMS"]
)
def test_stashing_pipeline_equals_upstream_bit_for_bit(name: str) -> None:
    for rank, runs in enumerate(run_on_ranks(_all, 41, name, timeout_s=600)):
        references: list[RunResult] = runs["upstream"][0]
        for reference in references:
            assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
        for label, (results, restore_hooks) in runs["ours"].items():
            for epoch, (reference, result) in enumerate(zip(references, results, strict=True)):
                assert_runs_equal(reference, result, what=f"rank {rank} {name} [{label}] epoch {epoch}")
            assert restore_hooks in (None, 2 * STEPS), f"rank {rank} {name} [{label}]: {restore_hooks} restore hooks"
        if name == "TrainPipelineSparseDistOptStash":
            assert runs["ours"]["default"][1] == 2 * STEPS
