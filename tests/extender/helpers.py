"""Small helpers shared by the extender tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

WAIT = 10.0  # deadline for conditions; never reached when things work


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Poll ``predicate`` every 10 ms until it holds or ``timeout`` passes (a deadline, not a timing)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        pause.wait(0.01)
    return True
