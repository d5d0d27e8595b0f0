"""Text grids of a program, for goldens, errors and logs. One row per rank.

``format_grid``: column ``k`` is each rank's ``k``-th action (what the program *says*), with an
optional cell marked ``>0F3<`` (the culprit of an error)::

    step    0    1    2    3
    rank 0  0F0  0SF0 0F1  0SF1 ...
    rank 1  1RF0 1F0  1B0  1SB0 ...

``format_ticks``: column ``t`` is what each rank is doing during tick ``t`` of a simulated
timeline (what the program *does*): an action's text in its first tick, ``~`` in the ticks it
goes on, ``.`` when the rank is idle (the bubble)::

    tick    0    1    2    3    4    5    6
    rank 0  0F0  0F1  .    .    0B0  ~    0B1 ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torchrec_swp.pp.errors import PPError

if TYPE_CHECKING:
    from torchrec_swp.pp.actions import Program

IDLE = "."
GOES_ON = "~"


def format_grid(program: Program, mark: tuple[int, int] | None = None) -> str:
    """The program's actions, rank by rank and step by step; ``mark=(rank, step)`` frames that
    cell (a step one past the rank's last action marks where a missing action should be)."""
    rows = [[str(a) for a in actions] for actions in program.ranks]
    if mark is not None:
        r, k = mark
        if 0 <= r < len(rows) and 0 <= k <= len(rows[r]):
            if k == len(rows[r]):
                rows[r].append("")
            rows[r][k] = f">{rows[r][k]}<"
    return _table("step", rows, [str(k) for k in range(max((len(r) for r in rows), default=0))])


def format_ticks(spans: Sequence[Sequence[tuple[str, float, float]]], tick: float = 1.0) -> str:
    """Ranks' ``(label, start, end)`` spans on a grid of ``tick``-long columns. Spans of zero
    length are not drawn; every drawn span must start and end on a tick boundary."""
    if tick <= 0:
        raise PPError(f"tick must be > 0, got {tick}")
    end = max((e for rank in spans for _, _, e in rank), default=0.0)
    width = _ticks(end, tick, "makespan")
    rows = [[IDLE] * width for _ in spans]
    for r, rank in enumerate(spans):
        for label, s, e in rank:
            if e <= s:
                continue
            first, last = _ticks(s, tick, label), _ticks(e, tick, label)
            rows[r][first] = label
            for t in range(first + 1, last):
                rows[r][t] = GOES_ON
    return _table("tick", rows, [str(t) if t % 5 == 0 else "" for t in range(width)], uniform=True)


def _ticks(value: float, tick: float, what: str) -> int:
    n = round(value / tick)
    if abs(n * tick - value) > 1e-9 * max(1.0, abs(value)):
        raise PPError(f"{what} at {value:g} is not on a tick boundary (tick {tick:g}): pick a tick that divides it")
    return n


def _table(corner: str, rows: list[list[str]], header: list[str], uniform: bool = False) -> str:
    columns = max([len(header)] + [len(r) for r in rows])
    cells = [header + [""] * (columns - len(header))] + [r + [""] * (columns - len(r)) for r in rows]
    widths = [max(len(row[k]) for row in cells) for k in range(columns)]
    if uniform:
        widths = [max(widths, default=0)] * columns
    labels = [corner] + [f"rank {r}" for r in range(len(rows))]
    pad = max(len(x) for x in labels)
    lines = []
    for label, row in zip(labels, cells, strict=True):
        lines.append((f"{label:<{pad}}  " + " ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True))).rstrip())
    return "\n".join(lines) + "\n"
