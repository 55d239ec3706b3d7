"""FellowLogBuffer: the latest log records of every fellow, for quick snapshots. Pure state.

Filled from the log stream (so it is refilled after a leader restart) and bounded per
fellow; the stream itself keeps more, and the SSE endpoint reads it for resumable tails.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque

from silentswarm.protocol import LogBatch
from silentswarm.types.fleet import LogEntry

PER_FELLOW = 2000
# And in bytes (a record's message is up to 8 KiB): per fellow, and over all of them, the
# fellows written to least recently leaving first (names come and go; a released fellow's
# records are not kept for ever).
PER_FELLOW_BYTES = 1 << 20
TOTAL_BYTES = 64 << 20
ENTRY_OVERHEAD = 200  # about what a LogEntry costs beside its strings


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


def entry_bytes(entry: LogEntry) -> int:
    """What a kept record weighs in memory, about (a string of emoji is four bytes a
    character there)."""
    return ENTRY_OVERHEAD + sys.getsizeof(entry.message) + sys.getsizeof(entry.logger)


class _Kept:
    """One fellow's latest records and what they weigh."""

    def __init__(self) -> None:
        self.entries: deque[LogEntry] = deque()
        self.bytes = 0


class FellowLogBuffer:
    def __init__(
        self,
        per_fellow: int = PER_FELLOW,
        *,
        per_fellow_bytes: int = PER_FELLOW_BYTES,
        total_bytes: int = TOTAL_BYTES,
    ) -> None:
        self.per_fellow = per_fellow
        self.per_fellow_bytes = per_fellow_bytes
        self.total_bytes = total_bytes
        self._logs: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0
        self.last_seq = 0

    def add(self, seq: int, batch: LogBatch) -> None:
        if seq <= self.last_seq:  # replayed after a reconnect: already here
            return
        self.last_seq = seq
        kept = self._logs.pop(batch.fellow_id, None) or _Kept()
        self._logs[batch.fellow_id] = kept  # the most recently written last
        for entry in entries(seq, batch):
            kept.entries.append(entry)
            size = entry_bytes(entry)
            kept.bytes += size
            self._bytes += size
        while kept.entries and (
            len(kept.entries) > self.per_fellow or kept.bytes > self.per_fellow_bytes
        ):
            self._drop_oldest(kept)
        while self._bytes > self.total_bytes and len(self._logs) > 1:
            _, gone = self._logs.popitem(last=False)
            self._bytes -= gone.bytes

    def _drop_oldest(self, kept: _Kept) -> None:
        size = entry_bytes(kept.entries.popleft())
        kept.bytes -= size
        self._bytes -= size

    @property
    def bytes(self) -> int:
        """What the kept records weigh, about."""
        return self._bytes

    def snapshot(self, fellow_id: str, limit: int) -> list[LogEntry]:
        kept = self._logs.get(fellow_id)
        if kept is None or not kept.entries or limit <= 0:
            return []
        return list(kept.entries)[-limit:]
