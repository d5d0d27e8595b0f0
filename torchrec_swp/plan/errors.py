"""Errors raised for plans that cannot run. Every message names the culprit."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan (or a change to a plan) that cannot run.

    ``culprit`` names the task, dependency or field the error is about, so that tools
    and tests can point at it without parsing the message.
    """

    def __init__(self, message: str, *, culprit: str = "") -> None:
        super().__init__(message)
        self.culprit = culprit
