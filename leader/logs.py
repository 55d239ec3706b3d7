"""FellowLogBuffer: the latest log records of every fellow, for quick snapshots. Pure state.

Filled from the log stream (so it is refilled after a leader restart) and bounded per
fellow; the stream itself keeps more, and the SSE endpoint reads it for resumable tails.
"""

from __future__ import annotations

from collections import deque

from silentswarm.protocol import LogBatch
from silentswarm.types.fleet import LogEntry

PER_FELLOW = 2000


def entries(seq: int, batch: LogBatch) -> list[LogEntry]:
    return [
        LogEntry(
            seq=seq,
            fellow_id=batch.fellow_id,
            ts=r.ts,
            level=r.level,
            logger=r.logger,
            message=r.message,
        )
        for r in batch.records
    ]


class FellowLogBuffer:
    def __init__(self, per_fellow: int = PER_FELLOW) -> None:
        self.per_fellow = per_fellow
        self._logs: dict[str, deque[LogEntry]] = {}
        self.last_seq = 0

    def add(self, seq: int, batch: LogBatch) -> None:
        if seq <= self.last_seq:  # replayed after a reconnect: already here
            return
        self.last_seq = seq
        buffer = self._logs.setdefault(batch.fellow_id, deque(maxlen=self.per_fellow))
        buffer.extend(entries(seq, batch))

    def snapshot(self, fellow_id: str, limit: int) -> list[LogEntry]:
        buffer = self._logs.get(fellow_id)
        if not buffer or limit <= 0:
            return []
        return list(buffer)[-limit:]
