"""Errors raised for plans that cannot run. Every message names the culprit."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan (or a change to a plan) that cannot run.

    ``culprit`` names the task, dependency or field the error is about, so that tools
    and tests can point at it without parsing the message. ``line``: for an error about a
    plan's text, the number of the line it is about (the message begins ``line N:``, or
    ``line N, column C:`` where one word of the line is at fault), else None; ``column``: that
    word's column (1-based), else None. ``lines``: every line of the text the error involves,
    ``line`` first (a conflict between two lines, e.g. a dependency and a task's stage, names
    both). ``token``: the word at fault, where the error knows it (a read, a name), so that the
    text form can point at its column. ``also``: culprits of the other things the error
    involves (their lines go into ``lines``).
    """

    def __init__(
        self,
        message: str,
        *,
        culprit: str = "",
        line: int | None = None,
        column: int | None = None,
        lines: tuple[int, ...] = (),
        token: str = "",
        also: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.line = line
        self.column = column
        self.lines = lines or ((line,) if line is not None else ())
        self.token = token
        self.also = also
