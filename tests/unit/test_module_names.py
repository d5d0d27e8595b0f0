"""One file name per meaning: no two modules of the package share a file name, except the names
every package uses for the same thing (``__init__``, ``__main__``, and ``errors.py``: each
package's own exception types)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchrec_swp"
SAME_MEANING = {"__init__.py", "__main__.py", "errors.py"}


def test_no_two_modules_share_a_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for f in PACKAGE.rglob("*.py"):
        where[f.name].append(str(f.parent.relative_to(PACKAGE)))
    shared = {name: sorted(dirs) for name, dirs in where.items() if len(dirs) > 1 and name not in SAME_MEANING}
    assert shared == {}

