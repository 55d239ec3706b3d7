"""The package joining hosts install, and the leader's public addresses (HTTP and NATS)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit

from silentswarm.leader.bootstrap import Package, find_or_build_wheel, newest_wheel, package_of
from silentswarm.leader.errors import PackageUnavailableError
from silentswarm.settings import Settings

log = logging.getLogger(__name__)

SOURCE_ROUTE = "/api/v1/bootstrap/source"
# Where packaging/proxy/Caddyfile publishes nats-server's WebSocket listener on the origin.
PUBLIC_NATS_PATH = "/nats"


def fellow_nats_url(settings: Settings, nats_url: str) -> str:
    """The NATS URL joining and enrolling fellows get (pure): SWARM_PUBLIC_NATS_URL; else,
    with an ``https://`` SWARM_PUBLIC_URL, NATS over WebSocket on that same origin
    (``wss://<host>/nats``: a host that may only make outbound HTTPS reaches it); else the
    leader's own ``nats_url``."""
    if settings.public_nats_url:
        return settings.public_nats_url
    if settings.public_url:
        public = urlsplit(settings.public_url)
        if public.scheme == "https" and public.netloc:
            return f"wss://{public.netloc}{public.path.rstrip('/')}{PUBLIC_NATS_PATH}"
    return nats_url


class BootstrapPackage:
    """The wheel this leader serves (onboarding installs it, UPDATE reinstalls it)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.package: Package | None = None
        self._build: asyncio.Future[Package | None] | None = None

    def found(self, package: Package) -> None:
        """The package the start-up search found (cached or shipped), unless one is set."""
        if self.package is None:
            self.package = package
            log.info("serving %s (sha256 %s)", package.file, package.sha256)

    async def ensure(self) -> Package:
        """Found at start, else built once, on first need (a source checkout has no wheel
        until then; building takes seconds of CPU that a leader which never onboards anyone
        should not spend). One build, however many ask, and it finishes even if the request
        that started it goes away.

        With SWARM_BOOTSTRAP_WHEEL a directory, its newest wheel is looked up every time."""
        wheels = self.settings.bootstrap_wheel
        if wheels is not None and wheels.is_dir():
            newest = newest_wheel(wheels)
            if self.package is None or Path(self.package.path) != newest:
                self.package = await asyncio.to_thread(package_of, newest)
                log.info("serving %s (sha256 %s)", self.package.file, self.package.sha256)
            return self.package
        if self.package is None:
            build = self._build
            if build is None or (build.done() and build.exception() is not None):
                cache = self.settings.state_dir / "bootstrap"
                build = self._build = asyncio.ensure_future(
                    asyncio.to_thread(
                        find_or_build_wheel, cache, wheel=self.settings.bootstrap_wheel
                    )
                )
            self.package = await asyncio.shield(build)
        if self.package is None:
            raise PackageUnavailableError("no package to serve (see the leader's log)")
        return self.package

    def ready(self) -> Package:
        """The package, or 503 while there is none yet."""
        if self.package is None:
            raise PackageUnavailableError("the package is not ready yet; try again")
        return self.package

    def public_url(self, request_base: str) -> str:
        """This leader's address as joining hosts reach it: SWARM_PUBLIC_URL, else the
        request's own base URL."""
        return (self.settings.public_url or request_base).rstrip("/")

    def source_url(self, request_base: str) -> str:
        return f"{self.public_url(request_base)}{SOURCE_ROUTE}"
