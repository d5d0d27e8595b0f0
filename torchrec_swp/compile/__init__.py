"""Compiler (pure Python): plan -> per-thread iteration programs with explicit syncs."""

from torchrec_swp.compile.lower import CompiledPlan, active_stages, compile_iteration
from torchrec_swp.compile.program import (
    Alias,
    Instr,
    IterationProgram,
    RecordEvent,
    Run,
    RunAction,
    Signal,
    WaitStream,
    WaitTask,
    format_program,
    parse_program,
)

__all__ = [
    "Alias",
    "CompiledPlan",
    "Instr",
    "IterationProgram",
    "RecordEvent",
    "Run",
    "RunAction",
    "Signal",
    "WaitStream",
    "WaitTask",
    "active_stages",
    "compile_iteration",
    "format_program",
    "parse_program",
]
