"""At most one log line per key every so often, counting what was held back: for what a
stranger can make happen as often as it likes (malformed frames, failing figures)."""

from __future__ import annotations

import time
from collections.abc import Callable


class Throttle:
    """At most one log line per key every ``every_s``; counts what it held back."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str) -> int | None:
        """None: stay quiet; else how many were held back since the last line."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)
