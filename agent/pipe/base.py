"""What every link module shares: a message's parts (a link's errors are in agent.errors)."""

from __future__ import annotations

Parts = list[bytes | memoryview]
