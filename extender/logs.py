"""Rate-limited warnings: a down Prometheus or API server must not write a line per request.

The first warning of a key is logged at once; repeats within ``interval_s`` are counted and the
count is appended to the next line that gets through, so nothing is silently lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most one line per key per ``interval_s``; suppressed repeats are counted."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval_s`` ago; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            skipped = self._suppressed.pop(key, 0)
        if skipped:
            msg += " (%d similar messages suppressed)"
            args = (*args, skipped)
        self._logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def reset(self, key: str) -> None:
        """Forget ``key`` (the condition cleared), so its next occurrence is logged at once."""
        with self._lock:
            self._last.pop(key, None)
            self._suppressed.pop(key, None)
