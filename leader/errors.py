"""Every error the leader raises, each with its :class:`~swarm.errors.ErrorCode`.

The API's handlers (:mod:`silentswarm.leader.api.error_handlers`) turn them into ``{"code",
"message"}`` answers with their ``http_status``. Imports only :mod:`silentswarm.errors`.
"""

from __future__ import annotations

import errno
from pathlib import Path

from silentswarm.errors import ConflictError, ErrorCode, SwarmError

# --- authentication and onboarding ------------------------------------------------------------


class UnauthorizedError(SwarmError):
    code = ErrorCode.UNAUTHORIZED
    http_status = 401


class ForbiddenError(SwarmError):
    code = ErrorCode.FORBIDDEN
    http_status = 403


class RevokedTokenError(UnauthorizedError):
    code = ErrorCode.TOKEN_REVOKED


class AccountForbiddenError(ForbiddenError):
    """An account's role, or the job's owner, does not allow this request (403). The body
    names the account, the job's owner and the role the request needs."""

    code = ErrorCode.ACCOUNT_FORBIDDEN

    def __init__(
        self, message: str, *, account: str, needed_role: str, owner: str | None = None
    ) -> None:
        super().__init__(message)
        self.account, self.needed_role, self.owner = account, needed_role, owner

    def to_dict(self) -> dict[str, str]:
        extra = {"account": self.account, "needed_role": self.needed_role}
        return {**super().to_dict(), **extra, **({"owner": self.owner} if self.owner else {})}


class PoolForbiddenError(ForbiddenError):
    """A job names a pool its account may not use (403, naming the field ``pool``)."""

    code = ErrorCode.POOL_FORBIDDEN
    field = "pool"

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "field": self.field}


class SpecFieldForbiddenError(ForbiddenError):
    """A job spec's field names what its account may not (403, naming the field): an export
    directory outside the account's part of the export root, files on the fellows' own disks
    (a ``data`` path, ``init_from`` "preset:DIR")."""

    code = ErrorCode.ACCOUNT_FORBIDDEN

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "field": self.field}


class AccountExistsError(ConflictError):
    code = ErrorCode.ACCOUNT_EXISTS

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "field": "name"}


class JoinRefusedError(SwarmError):
    code = ErrorCode.JOIN_TOKEN_INVALID
    http_status = 401


class JoinGoneError(SwarmError):
    code = ErrorCode.JOIN_SESSION_GONE
    http_status = 410


class PackageUnavailableError(SwarmError):
    code = ErrorCode.PACKAGE_UNAVAILABLE
    http_status = 503


class EnrollRefusedError(SwarmError):
    code = ErrorCode.ENROLL_REFUSED
    http_status = 403


class FellowNameError(ConflictError):
    """A join or enrollment may not take this name (409, naming the field)."""

    field = "fellow_name"

    def __init__(self, message: str, *, code: ErrorCode) -> None:
        super().__init__(message, code=code)

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "field": self.field}


class RevocationPushError(SwarmError):
    """nats-server did not take the account JWT that revokes users (unreachable, refused)."""

    code = ErrorCode.NATS_AUTH_UNAVAILABLE
    http_status = 503


# --- readiness and storage --------------------------------------------------------------------


class NotReadyError(SwarmError):
    """The job loop has not loaded its durable state yet."""

    code = ErrorCode.LEADER_NOT_READY
    http_status = 503


class StreamsUnavailableError(SwarmError):
    """The history streams are not made yet."""

    code = ErrorCode.LEADER_NOT_READY
    http_status = 503


class StorageUnavailableError(SwarmError):
    code = ErrorCode.STORAGE_UNAVAILABLE
    http_status = 503


class StoreTooSmallError(SwarmError):
    """The JetStream store cannot hold a history stream at all."""

    code = ErrorCode.JETSTREAM_STORE_TOO_SMALL
    http_status = 503


class StoreReadError(SwarmError):
    """The server did not list a bucket's keys: the leader must not start on a partial state."""

    code = ErrorCode.STATE_UNREADABLE
    http_status = 503


# --- exports ----------------------------------------------------------------------------------


class ShardAccessError(SwarmError):
    code = ErrorCode.SHARD_TOKEN_INVALID
    http_status = 403


# --- datasets ---------------------------------------------------------------------------------


class DatasetTooLargeError(SwarmError):
    """An upload is larger than SWARM_MAX_DATASET_BYTES, or than the disk has room for."""

    code = ErrorCode.PAYLOAD_TOO_LARGE
    http_status = 413


class ExportPathError(OSError):
    """A write into an export directory would leave the export root or follow a symlink.

    An ``OSError`` (EPERM), not a :class:`SwarmError`: every writer of an export handles it
    as the disk failure it stands in for, and reports it in the job's ``export_error``.
    """

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(
            errno.EPERM,
            f"{path}: {why}; exports never follow symlinks or leave "
            "the export root (SWARM_EXPORT_ROOT)",
        )
