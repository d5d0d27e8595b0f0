"""Errors raised for plans that cannot run. Every message names the culprit."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan (or a change to a plan) that cannot run.

    ``culprit`` names the task, dependency or field the error is about, so that tools
    and tests can point at it without parsing the message. ``line``: for an error about a
    plan's text, the number of the line it is about (the message begins ``line N:``), else None.
    """

    def __init__(self, message: str, *, culprit: str = "", line: int | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.line = line
