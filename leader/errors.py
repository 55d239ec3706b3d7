"""Every error leaves the API as JSON ``{"code", "message"}`` (plus ``details`` for 400s)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from swarm.errors import SwarmError

log = logging.getLogger(__name__)

_HTTP_CODES = {400: "BAD_REQUEST", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 409: "CONFLICT"}


def error_response(status: int, code: str, message: str, **extra: Any) -> Response[dict[str, Any]]:
    return Response({"code": code, "message": message, **extra}, status_code=status)


def swarm_error_handler(_: Request, exc: SwarmError) -> Response[dict[str, Any]]:
    return Response(exc.to_dict(), status_code=exc.http_status)


def http_error_handler(_: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    if isinstance(exc, ValidationException):
        return error_response(
            exc.status_code, "VALIDATION_ERROR", exc.detail, details=exc.extra or []
        )
    code = _HTTP_CODES.get(exc.status_code, f"HTTP_{exc.status_code}")
    return error_response(exc.status_code, code, exc.detail)


def internal_error_handler(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(HTTP_500_INTERNAL_SERVER_ERROR, "INTERNAL", "internal server error")


EXCEPTION_HANDLERS = {
    SwarmError: swarm_error_handler,
    HTTPException: http_error_handler,
    HTTP_500_INTERNAL_SERVER_ERROR: internal_error_handler,
}
