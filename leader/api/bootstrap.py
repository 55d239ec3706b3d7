"""Remote onboarding routes: the package, the installer script, join sessions."""

from __future__ import annotations

from pathlib import Path

import msgspec
from litestar import Controller, Request, get, post
from litestar.response import File, Response, ServerSentEvent, ServerSentEventMessage
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from leader.services import LeaderServices
from swarm.jobspec import decode_strict
from swarm.types.onboarding import (
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


class BootstrapController(Controller):
    path = "/api/v1/bootstrap"
    tags = ["bootstrap"]

    @get("/manifest", summary="What a joining host installs: version, package, NATS URLs")
    async def manifest(self, request: Request, services: LeaderServices) -> BootstrapManifest:
        await services.ensure_package()
        return services.bootstrap_manifest(str(request.base_url))

    @get("/source", summary="The wheel of exactly the running version")
    async def source(self, services: LeaderServices) -> File:
        package = await services.ensure_package()
        return File(package.path, filename=package.file, media_type="application/octet-stream")

    @get("/fellow.sh", summary="The POSIX sh installer a join command runs")
    async def script(self) -> Response[bytes]:
        return Response(SCRIPT.read_bytes(), media_type="text/x-shellscript")

    @post(
        "/join-sessions",
        status_code=HTTP_201_CREATED,
        summary="Create a join session (operator token): its single-use token and command",
    )
    async def create(self, request: Request, services: LeaderServices) -> JoinSessionCreated:
        body = decode_strict(await request.body(), CreateSession)
        return services.create_join_session(body.fellow_name, body.ttl_s, str(request.base_url))

    @get("/join-sessions", summary="Every join session")
    async def sessions(self, services: LeaderServices) -> list[JoinSession]:
        return services.join_sessions()

    @get("/join-sessions/{session_id:str}", summary="One join session and its status")
    async def session(self, session_id: str, services: LeaderServices) -> JoinSession:
        return services.join_session(session_id)

    @post(
        "/join-sessions/{session_id:str}/claim",
        status_code=HTTP_200_OK,
        summary="The installer exchanges the single-use token (401 wrong, 410 used or expired)",
    )
    async def claim(self, session_id: str, request: Request, services: LeaderServices) -> JoinClaim:
        body = decode_strict(await request.body(), Claim)
        await services.ensure_package()
        return services.claim_join_session(session_id, body.token, body.fellow_name or None)

    @post(
        "/enroll",
        status_code=HTTP_200_OK,
        summary="A fleet fellow's own NATS user (Authorization: Bearer <SWARM_ENROLL_TOKEN>)",
    )
    async def enroll(self, request: Request, services: LeaderServices) -> Enrollment:
        body = decode_strict(await request.body(), Enroll)
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return services.enroll(body.fellow_name, token)

    @post(
        "/join-sessions/{session_id:str}/logs",
        status_code=HTTP_200_OK,
        summary="The installer's log lines (Authorization: Bearer <session secret>)",
    )
    async def post_logs(
        self, session_id: str, request: Request, services: LeaderServices
    ) -> LogLinesTaken:
        body = decode_strict(await request.body(), LogLines)
        secret = request.headers.get("authorization", "").partition(" ")[2].strip()
        count = services.joins.append_log(session_id, secret, body.lines, failed=body.failed)
        return LogLinesTaken(lines=count)

    @get("/join-sessions/{session_id:str}/logs/stream", summary="SSE: the installer's log")
    async def stream(self, session_id: str, services: LeaderServices) -> ServerSentEvent:
        services.join_session(session_id)  # 404 before the 200

        async def events():
            seq = 0
            while True:
                for line in services.joins.lines_after(session_id, seq):
                    seq = line.seq
                    yield ServerSentEventMessage(
                        data=msgspec.json.encode(line).decode(), event="log", id=line.seq
                    )
                session = services.join_session(session_id)
                if session.status in ("registered", "failed") and not services.joins.lines_after(
                    session_id, seq
                ):
                    data = msgspec.json.encode(session).decode()
                    yield ServerSentEventMessage(data=data, event="end")
                    return
                if services.observe.stopping.is_set():
                    return
                await services.joins.wait_change(session_id, 1.0)

        return ServerSentEvent(events())
