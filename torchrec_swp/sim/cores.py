"""How the threads that want a core share a machine: cores, and each process's GIL.

At any moment some threads of a machine are in a CPU part (they want a core). Each progresses
at a *rate* (seconds of work per second). Two limits:

* **cores**: the rates of every runnable thread of the machine, plus ``background`` always
  runnable threads of other programs, add up to at most ``cores`` (``None``: no limit), and no
  thread runs faster than 1;
* **the GIL** (``gil`` of a rank, ``None``: not modelled): a fraction ``gil`` of a CPU part's
  work holds its process's interpreter lock, so the rates of one process's runnable threads add
  up to at most ``1 / gil`` (``gil`` 1: the process's threads never compute at once; 0.5: at most
  two cores' worth). Time off the CPU (sleeping, waiting in a collective or for another thread)
  holds neither.

Shares are max-min fair (water-filling): every thread gets the same rate until a limit binds;
the threads a binding GIL holds keep that rate and the others share what is left. This is the
processor-sharing model the calibration deflates measured times with (``sim.calibrate``).
"""

from __future__ import annotations

from collections.abc import Mapping


def fair_rates(
    runnable: Mapping[int, int],
    cores: int | None,
    background: float = 0.0,
    gil: Mapping[int, float | None] | None = None,
) -> dict[int, float]:
    """The rate of each runnable thread of each process: ``runnable[p]`` threads of process ``p``
    want a core; returns ``{p: rate}`` for every ``p`` with at least one (rules above)."""
    left = {p: n for p, n in runnable.items() if n > 0}
    rates: dict[int, float] = {}
    used = 0.0  # capacity taken by processes whose GIL binds
    while left:
        level = 1.0
        if cores is not None:
            level = min(level, max(0.0, cores - used) / (sum(left.values()) + background))
        bound = None
        for p, n in left.items():
            g = (gil or {}).get(p)
            if g is not None and g > 0 and (1.0 / g) / n < level:
                level, bound = (1.0 / g) / n, p
        if bound is None:
            rates.update(dict.fromkeys(left, level))
            break
        rates[bound] = level
        used += level * left.pop(bound)
    return rates
