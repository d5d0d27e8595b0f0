"""Measure the tasks of a real run (pure Python; the engine is only observed).

* ``TaskProfiler``: an engine observer - ``engine.instrument(profiler)`` or
  ``profiler.attach(pipeline.engine)`` - that turns runs, waits and iterations into a Profile.
* ``Profile`` / ``TaskStats``: per task its median duration, exposed time and count, with the
  plan's text; ``save``/``load`` a JSON file, ``print_table()``.
* ``exposed_times``: the critical-path attribution of one iteration.

Fixtures and measurements around it live outside the library, in ``harness/``: ``harness.sleep``
(sleeping tasks on an Engine) and ``harness.profiler_overhead`` (the profiler's cost).
"""

from torchrec_swp.profiler.events import IterationRecord, RunEvent, WaitEvent
from torchrec_swp.profiler.exposure import exposed_times
from torchrec_swp.profiler.profile import Profile, ProfileError, StepStats, TaskStats, Where
from torchrec_swp.profiler.task_profiler import TaskProfiler

__all__ = [
    "IterationRecord",
    "Profile",
    "ProfileError",
    "RunEvent",
    "StepStats",
    "TaskProfiler",
    "TaskStats",
    "WaitEvent",
    "Where",
    "exposed_times",
]
