"""A failed rank that stays connected until its peer has ended, so that the peer is ended by its
own timeout, not by the closed connection, however long that takes on a loaded machine (a sleep
would guess it). The two ranks are processes: the peer's end is a file."""

from __future__ import annotations

import time
from pathlib import Path


def peer_ended(marker: str) -> None:
    """The calling rank (the healthy one) has ended its run: a lingering peer may go."""
    Path(marker).touch()


def linger_until_peer_ended(marker: str, limit_s: float = 60.0) -> None:
    """Stay (connected) until ``peer_ended(marker)``; AssertionError after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not Path(marker).exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the peer did not end within {limit_s:.0f}s")
        time.sleep(0.01)  # a poll of the file: it decides when to go, not the time slept
