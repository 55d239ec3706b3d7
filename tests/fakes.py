"""Fakes the unit tests share: one of each, here, instead of a copy per test file."""

from __future__ import annotations


class Clock:
    """A clock that moves only when a test moves it: pass it where the code takes a
    ``clock``/``wall`` callable, then set or advance :attr:`now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds``; the new time."""
        self.now += seconds
        return self.now
