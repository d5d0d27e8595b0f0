"""The compiler: fill/steady/drain masks and the syncs it places, as readable golden text."""

from __future__ import annotations

import textwrap

from torchrec_swp.catalog.torchrec import sparse_dist_plan
from torchrec_swp.compile import CompiledPlan, active_stages, compile_iteration, format_program
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule

S = TaskSchedule


def golden(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_mask_formula_fill_steady_drain() -> None:
    plan = sparse_dist_plan()
    # M = 5 batches, max stage 2: iterations 0..6
    masks = [active_stages(plan, p, 5) for p in range(7)]
    assert masks == [(0,), (0, 1), (0, 1, 2), (0, 1, 2), (0, 1, 2), (1, 2), (2,)]
    assert active_stages(plan, 9, None) == (0, 1, 2)  # M unknown: steady state
    assert [p for p, _ in CompiledPlan(plan).iterations(5)] == list(range(7))


def test_single_thread_plan_compiles_to_a_flat_list() -> None:
    prog = compile_iteration(sparse_dist_plan(), [0, 1, 2])
    assert prog.flat and prog.single_thread and prog.tickets == ()
    assert format_program(prog) == golden(
        """
        stages 0,1,2
        thread default:
          run ZeroGrad
          run WaitBatch
          run InitPipelinedModules if first
          run InputDistStart if not_first
          run! H2D
          run Forward
          run InputDistWait
          run Backward
          run OptimizerStep
          run Dequeue
        """
    )


def test_h2d_on_its_own_thread_is_waited_for_across_iterations() -> None:
    # H2D(i+2) feeds InputDistStart(i+2) one iteration later and WaitBatch(i+2) two later: with no
    # barrier between iterations, the calling thread waits for those instances of H2D.
    prog = compile_iteration(sparse_dist_plan().with_thread_map({"H2D": "io"}), [0, 1, 2])
    assert not prog.flat
    assert format_program(prog) == golden(
        """
        stages 0,1,2
        thread default:
          run ZeroGrad
          wait H2D@P-2
          run WaitBatch
          wait H2D@P-1
          run InitPipelinedModules if first
          run InputDistStart if not_first
          run Forward
          run InputDistWait
          run Backward
          run OptimizerStep
          run Dequeue
        thread io:
          run! H2D
          signal H2D
        """
    )


def test_collectives_on_two_threads_take_tickets_in_fire_order() -> None:
    plan = sparse_dist_plan().with_thread_map("by_stream")
    prog = compile_iteration(plan, [0, 1, 2])
    assert prog.tickets == (("world", 5),)
    assert format_program(prog) == golden(
        """
        stages 0,1,2
        tickets world=5
        thread default:
          run ZeroGrad
          wait InputDistWait@P-1
          wait H2D@P-2
          run WaitBatch
          run Forward #2@world
          run Backward #4@world
          run OptimizerStep
          run Dequeue
        thread data_dist:
          wait H2D@P-1
          run InitPipelinedModules #0@world if first
          run InputDistStart #1@world if not_first
          run InputDistWait #3@world
          signal InputDistWait
        thread memcpy:
          run! H2D
          signal H2D
        """
    )


def test_same_iteration_dep_across_threads_gets_wait_and_signal() -> None:
    plan = PipelinePlan(
        schedule={"Load": S(0, "memcpy"), "Prep": S(0), "Fwd": S(1)},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Prep", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",)),
        ],
        source="Load",
    ).with_thread_map({"Load": "io"})
    prog = compile_iteration(plan, [0, 1])
    assert format_program(prog) == golden(
        """
        stages 0,1
        thread default:
          wait Load
          run? Prep
          run Fwd
        thread io:
          run! Load
          signal Load
        """
    )
    # fill: only stage 0
    assert [str(i) for i in compile_iteration(plan, [0]).instructions("default")] == ["wait Load", "run? Prep"]


def test_stop_policy_makes_later_tasks_on_other_threads_wait_for_the_source() -> None:
    plan = sparse_dist_plan(execute_all_batches=False).with_thread_map({"H2D": "io"})
    main = [str(i) for i in compile_iteration(plan, [0, 1, 2]).instructions("default")]
    # Forward fires after H2D: with on_exhausted=stop it must not start before H2D found a batch
    assert main[:7] == [
        "run ZeroGrad", "wait H2D@P-2", "run WaitBatch", "wait H2D@P-1", "run InitPipelinedModules if first",
        "run InputDistStart if not_first", "wait H2D",
    ]
    assert main[7] == "run Forward"


def test_device_streams_get_record_and_wait_pairs() -> None:
    # WaitBatch(i) reads the batch H2D(i) wrote on memcpy and InputDistWait(i) on data_dist:
    # the default stream waits for both once; Forward(i), on the same stream after it, need not.
    prog = compile_iteration(sparse_dist_plan(), [0, 1, 2], device_streams=True)
    assert format_program(prog) == golden(
        """
        stages 0,1,2
        thread default:
          run ZeroGrad
          stream default <- InputDistWait@0
          stream default <- H2D@0
          run WaitBatch
          stream data_dist <- H2D@0
          run InitPipelinedModules if first
          run InputDistStart if not_first
          run! H2D
          record H2D
          run Forward
          run InputDistWait
          record InputDistWait
          run Backward
          run OptimizerStep
          run Dequeue
        """
    )


def test_a_guard_on_the_next_batch_waits_for_the_source_on_another_thread() -> None:
    # Synchronize(b) runs only when batch b+1 exists: at stage 1 that is known once H2D (stage 0,
    # same iteration) has looked for b+1, so on another thread it waits for H2D.
    plan = PipelinePlan(
        schedule={"H2D": S(0, "memcpy"), "Sync": S(1, when="has_next"), "Fwd": S(1)},
        tasks=[PipelineTask("H2D", writes=("x",)), PipelineTask("Fwd", reads=("x",))],
        source="H2D",
    ).with_thread_map({"H2D": "io"})
    assert [str(i) for i in compile_iteration(plan, [0, 1]).instructions("default")] == [
        "wait H2D",
        "run Sync if has_next",
        "wait H2D@P-1",  # Fwd(b) reads what H2D(b) wrote one iteration before
        "run Fwd",
    ]


def test_a_source_with_several_loads_runs_on_lanes_that_everyone_waits_for() -> None:
    # two loads in flight: batch b is loaded on lane b % 2, so even a consumer on the source's
    # thread group would not share its thread: every consumer waits, the source signals
    plan = PipelinePlan(
        schedule={"Load": S(0, thread_group="load"), "Prep": S(0, thread_group="io"), "Fwd": S(1)},
        tasks=[
            PipelineTask("Load", writes=("x",)),
            PipelineTask("Prep", reads=("x",), writes=("y",)),
            PipelineTask("Fwd", reads=("y",)),
        ],
        source="Load",
        loads=2,
        lookahead=1,
    )
    assert plan.source_lanes() == ("load", "load.1")
    assert format_program(compile_iteration(plan, [0, 1])) == golden(
        """
        stages 0,1
        thread default:
          wait Prep@P-1
          run Fwd
        thread load:
          run! Load x2
          signal Load
        thread io:
          wait Load
          run? Prep
          signal Prep
        """
    )
