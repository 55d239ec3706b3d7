"""Every error leaves the API as JSON ``{"code", "message"}`` (plus ``details`` for 400s).

A :class:`~swarm.errors.SwarmError` answers with its own code and ``http_status``; Litestar's
own HTTP errors get the code of their status (:data:`HTTP_CODES`), and anything else is a
500 ``INTERNAL`` whose details stay in the leader's log.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from silentswarm.errors import ErrorCode, SwarmError

log = logging.getLogger(__name__)

HTTP_CODES = {
    400: ErrorCode.BAD_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    500: ErrorCode.INTERNAL,
}


def error_response(
    status: int, code: ErrorCode, message: str, **extra: Any
) -> Response[dict[str, Any]]:
    return Response({"code": str(code), "message": message, **extra}, status_code=status)


def swarm_error_handler(_: Request, exc: SwarmError) -> Response[dict[str, Any]]:
    return Response(exc.to_dict(), status_code=exc.http_status)


def http_error_handler(_: Request, exc: HTTPException) -> Response[dict[str, Any]]:
    if isinstance(exc, ValidationException):
        return error_response(
            exc.status_code, ErrorCode.VALIDATION_ERROR, exc.detail, details=exc.extra or []
        )
    code = HTTP_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
    return error_response(exc.status_code, code, exc.detail)


def internal_error_handler(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(
        HTTP_500_INTERNAL_SERVER_ERROR, ErrorCode.INTERNAL, "internal server error"
    )


EXCEPTION_HANDLERS = {
    SwarmError: swarm_error_handler,
    HTTPException: http_error_handler,
    HTTP_500_INTERNAL_SERVER_ERROR: internal_error_handler,
}
