"""Pending purges: released fellows that must still be told to remove their install and state.

A purge for a fellow that cannot be reached is kept here (and in JetStream) and delivered
when the fellow is heard again, or when an operator retries. Pure state, injected clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from silentswarm.types.fleet import PendingPurge


class PurgeBook:
    def __init__(
        self,
        *,
        wall: Callable[[], float] = time.time,
        on_delivered: Callable[[str], None] | None = None,
    ) -> None:
        """``on_delivered``: told the fellow id once its purge is delivered (the leader
        then revokes the fellow's NATS users, which the purge still needed)."""
        self._wall = wall
        self._on_delivered = on_delivered
        self._pending: dict[str, PendingPurge] = {}
        # Fellow ids whose record changed (or was removed) since the store last wrote them.
        self.dirty: set[str] = set()

    def restore(self, records: Iterable[PendingPurge]) -> None:
        for record in records:
            self._pending[record.fellow_id] = record

    def add(self, fellow_id: str) -> PendingPurge:
        record = self._pending.get(fellow_id)
        if record is None:
            record = self._pending[fellow_id] = PendingPurge(
                fellow_id=fellow_id, requested_at=self._wall()
            )
            self.dirty.add(fellow_id)
        return record

    def get(self, fellow_id: str) -> PendingPurge | None:
        return self._pending.get(fellow_id)

    def is_pending(self, fellow_id: str) -> bool:
        return fellow_id in self._pending

    def list(self) -> list[PendingPurge]:
        return sorted(self._pending.values(), key=lambda p: (p.requested_at, p.fellow_id))

    def failed(self, fellow_id: str, error: str) -> None:
        record = self._pending.get(fellow_id)
        if record is not None:
            record.attempts += 1
            record.last_attempt_at = self._wall()
            record.last_error = error
            self.dirty.add(fellow_id)

    def delivered(self, fellow_id: str) -> None:
        if self._pending.pop(fellow_id, None) is not None:
            self.dirty.add(fellow_id)
            if self._on_delivered is not None:
                self._on_delivered(fellow_id)
