"""Remote onboarding routes: the package, the installer script, join sessions."""

from __future__ import annotations

from pathlib import Path

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import File, Response, ServerSentEvent
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from silentswarm.jobspec import decode_strict
from silentswarm.leader.services.onboarding import OnboardingService
from silentswarm.types.onboarding import (
    BootstrapManifest,
    Claim,
    CreateSession,
    Enroll,
    Enrollment,
    JoinClaim,
    JoinSession,
    JoinSessionCreated,
    LogLines,
    LogLinesTaken,
)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fellow.sh"
Onboarding = NamedDependency[OnboardingService]


def _bearer(request: Request) -> str:
    return request.headers.get("authorization", "").partition(" ")[2].strip()


class BootstrapController(Controller):
    path = "/api/v1/bootstrap"
    tags = ["bootstrap"]

    @get("/manifest", summary="What a joining host installs: version, package, NATS URLs")
    async def manifest(self, request: Request, onboarding: Onboarding) -> BootstrapManifest:
        return await onboarding.manifest(str(request.base_url))

    @get("/source", summary="The wheel of exactly the running version")
    async def source(self, onboarding: Onboarding) -> File:
        package = await onboarding.source()
        return File(package.path, filename=package.file, media_type="application/octet-stream")

    @get("/fellow.sh", summary="The POSIX sh installer a join command runs")
    async def script(self) -> Response[bytes]:
        return Response(SCRIPT.read_bytes(), media_type="text/x-shellscript")

    @post(
        "/join-sessions",
        status_code=HTTP_201_CREATED,
        summary="Create a join session (operator token): its single-use token and command",
    )
    async def create(self, request: Request, onboarding: Onboarding) -> JoinSessionCreated:
        body = decode_strict(await request.body(), CreateSession)
        return await onboarding.create_session(body.fellow_name, body.ttl_s, str(request.base_url))

    @get("/join-sessions", summary="Every join session")
    async def sessions(self, onboarding: Onboarding) -> list[JoinSession]:
        return onboarding.sessions()

    @get("/join-sessions/{session_id:str}", summary="One join session and its status")
    async def session(self, session_id: FromPath[str], onboarding: Onboarding) -> JoinSession:
        return onboarding.session(session_id)

    @post(
        "/join-sessions/{session_id:str}/claim",
        status_code=HTTP_200_OK,
        summary="The installer exchanges the single-use token (401 wrong, 410 used or expired)",
    )
    async def claim(
        self, session_id: FromPath[str], request: Request, onboarding: Onboarding
    ) -> JoinClaim:
        body = decode_strict(await request.body(), Claim)
        return await onboarding.claim(session_id, body.token, body.fellow_name or None)

    @post(
        "/enroll",
        status_code=HTTP_200_OK,
        summary="A fleet fellow's own NATS user (Authorization: Bearer <SWARM_ENROLL_TOKEN>)",
    )
    async def enroll(self, request: Request, onboarding: Onboarding) -> Enrollment:
        body = decode_strict(await request.body(), Enroll)
        return onboarding.enroll(body.fellow_name, _bearer(request))

    @post(
        "/join-sessions/{session_id:str}/logs",
        status_code=HTTP_200_OK,
        summary="The installer's log lines (Authorization: Bearer <session secret>)",
    )
    async def post_logs(
        self, session_id: FromPath[str], request: Request, onboarding: Onboarding
    ) -> LogLinesTaken:
        body = decode_strict(await request.body(), LogLines)
        count = onboarding.append_log(session_id, _bearer(request), body.lines, failed=body.failed)
        return LogLinesTaken(lines=count)

    @get("/join-sessions/{session_id:str}/logs/stream", summary="SSE: the installer's log")
    async def stream(self, session_id: FromPath[str], onboarding: Onboarding) -> ServerSentEvent:
        return ServerSentEvent(onboarding.log_stream(session_id))
