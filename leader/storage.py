"""The health of the leader's JetStream store: is there room for its history and its state?

:class:`StorageMonitor` looks at the store every CHECK_S seconds (the history streams'
limits and usage, the account's usage, and, every CAPACITY_EVERY_S, the capacity the server
grants: :func:`silentswarm.leader.streams.store_capacity`), takes in what failed elsewhere (the
streams could not be created; the state store could not write), and :func:`storage_reasons` turns
all that into the reasons ``/health`` gives for being degraded. Each change is logged once,
and a failure that repeats is logged at most once per LOG_EVERY_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from silentswarm.leader import streams
from silentswarm.leader.streams import StoreCapacity, StreamSpec
from silentswarm.throttle import Throttle
from silentswarm.types.api import StorageView, StreamUsage

log = logging.getLogger(__name__)

CHECK_S = 2.0
CAPACITY_EVERY_S = 300.0
LOG_EVERY_S = 60.0
# Used at or above this fraction of the capacity, the store counts as full: the streams
# reserve 70% of it, so only the leader's state (or another tenant) gets it there.
FULL_FRACTION = 0.9
# The monitor's probe goes this far (a store larger than this is never full by our hand).
CAPACITY_PROBE_UPPER = 1 << 40


def _mib(n: int) -> str:
    return f"{n / streams.MIB:.1f} MiB"


def storage_reasons(
    *,
    usage: Sequence[StreamUsage],
    used_bytes: int | None,
    capacity: StoreCapacity | None,
    create_error: str | None,
    write_error: str | None,
    check_error: str | None,
) -> list[str]:
    """Why the store is not healthy (nothing when it is). Pure.

    A stream that does not exist yet is no reason while nothing failed: the leader is
    starting."""
    reasons = []
    missing = [u.name for u in usage if u.max_bytes == 0]
    if missing and create_error:
        reasons.append(
            f"the history streams ({', '.join(missing)}) could not be created: {create_error}"
        )
    for u in usage:
        if 0 < u.max_bytes < u.min_bytes:
            reasons.append(
                f"the JetStream store is too small: the stream {u.name} gets {_mib(u.max_bytes)}"
                f" (at least {_mib(u.min_bytes)} is useful); give nats-server a larger store"
            )
    if used_bytes is not None and capacity is not None and not capacity.at_least:
        total = capacity.total_bytes
        if total > 0 and used_bytes >= FULL_FRACTION * total:
            reasons.append(
                f"the JetStream store is full: {_mib(used_bytes)} used of {_mib(total)} "
                f"({100 * used_bytes / total:.0f}%)"
            )
    if write_error:
        reasons.append(f"the leader cannot save its state in JetStream: {write_error}")
    if check_error:
        reasons.append(f"JetStream refuses the leader: {check_error}")
    return reasons


class StorageMonitor:
    """The store's health, for ``/health``, ``/api/v1/info`` and the metrics."""

    def __init__(self, *, prefix: str = "swarm", specs: Sequence[StreamSpec] = ()) -> None:
        self.prefix = prefix
        self.specs = list(specs)
        self.create_error: str | None = None
        self.check_error: str | None = None
        self.write_error: str | None = None
        self.reasons: list[str] = []
        self.throttle = Throttle(LOG_EVERY_S)
        self._usage: list[StreamUsage] = []
        self._used: int | None = None
        self._capacity: StoreCapacity | None = None
        self._capacity_at = -CAPACITY_EVERY_S
        self._checks = 0
        self._checked_at: float | None = None

    def view(self) -> StorageView:
        capacity = self._capacity
        return StorageView(
            checks=self._checks,
            checked_at=self._checked_at,
            capacity_bytes=None if capacity is None else capacity.total_bytes,
            capacity_at_least=capacity is not None and capacity.at_least,
            used_bytes=self._used,
            streams=list(self._usage),
            reasons=list(self.reasons),
        )

    # --- what failed elsewhere -----------------------------------------------------------

    def streams_failed(self, exc: BaseException, retry_s: float) -> None:
        """The history streams could not be created (they are retried in ``retry_s``)."""
        self.create_error = streams.describe(exc)
        held = self.throttle.allow("streams")
        if held is not None:
            more = f"; {held} more such failure(s) since the last report" if held else ""
            log.error(
                "cannot open the history streams (%s); retrying in %.0f s%s",
                self.create_error,
                retry_s,
                more,
            )

    # --- looking ---------------------------------------------------------------------------

    async def run(
        self,
        nc: Callable[[], Client | None],
        write_error: Callable[[], str | None],
        ready: asyncio.Event,
    ) -> None:
        """Check every CHECK_S: ``nc`` gives the connection (None while disconnected),
        ``write_error`` the state store's last storage error, ``ready`` says the streams
        exist."""
        while True:
            try:
                await self.check(nc(), write_error(), ready.is_set())
            except Exception:  # one bad look must not end the looking
                log.exception("checking the JetStream store failed")
            await asyncio.sleep(CHECK_S)

    async def check(self, nc: Client | None, write_error: str | None, ready: bool) -> None:
        if ready:
            self.create_error = None
        self.write_error = write_error
        if nc is not None and nc.is_connected:
            await self._look(nc, probe=ready)
        self._set(
            storage_reasons(
                usage=self._usage,
                used_bytes=self._used,
                capacity=self._capacity,
                create_error=self.create_error,
                write_error=self.write_error,
                check_error=self.check_error,
            )
        )

    async def _look(self, nc: Client, *, probe: bool) -> None:
        js = nc.jetstream()
        try:
            account = await js.account_info()
            usage = [await _usage(js, spec) for spec in self.specs]
            now = time.monotonic()
            # Only once the streams exist: the probe must not compete with their fitting.
            if probe and now - self._capacity_at >= CAPACITY_EVERY_S:
                self._capacity = await streams.store_capacity(
                    js, probe=f"{self.prefix}_store_probe", upper=CAPACITY_PROBE_UPPER
                )
                self._capacity_at = now
        except Exception as exc:
            if streams.is_storage_error(exc):
                self.check_error = streams.describe(exc)
            else:  # a slow or restarting server: nothing to say about the store
                log.debug("could not look at the JetStream store: %s", exc)
            return
        self.check_error = None
        self._used, self._usage = account.storage, usage
        self._checks += 1
        self._checked_at = time.time()

    def _set(self, reasons: list[str]) -> None:
        if reasons == self.reasons:
            return
        if reasons:
            held = self.throttle.allow("degraded")
            if held is not None:
                log.error("JetStream storage degraded: %s", "; ".join(reasons))
        elif self.reasons:
            log.info("JetStream storage healthy again")
        self.reasons = reasons


async def _usage(js, spec: StreamSpec) -> StreamUsage:
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        return StreamUsage(spec.name, 0, 0, 0, spec.min_bytes)
    config = info.config
    return StreamUsage(
        name=spec.name,
        max_bytes=config.max_bytes if config.max_bytes else -1,
        bytes=info.state.bytes,
        max_msgs_per_subject=config.max_msgs_per_subject,
        min_bytes=spec.min_bytes,
    )
