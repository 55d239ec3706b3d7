"""Accounts: who may use the leader's API, as the leader stores and serves them.

An account has a name, a role and one API token (stored only as its SHA-256: the token is shown
once, when the account is created). ``admin`` may do everything; ``submitter`` submits jobs
and controls and reads the exports of its own jobs only; ``viewer`` reads. The bootstrap
operator token (``SWARM_API_TOKEN`` or ``<state>/api-token``) is the reserved admin account
:data:`OPERATOR_ACCOUNT`. An account may be limited to pools (``pools``: None means any)
and, per pool, to a number of concurrent jobs and of fellows those jobs hold.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from silentswarm.unknown_fields import NewerValues

# The bootstrap admin: jobs submitted with the operator token belong to it. Reserved.
OPERATOR_ACCOUNT = "operator"
ACCOUNT_NAME_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
AccountName = Annotated[str, msgspec.Meta(pattern=ACCOUNT_NAME_PATTERN)]
PoolName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class Role(NewerValues):
    ADMIN = "admin"
    SUBMITTER = "submitter"
    VIEWER = "viewer"


class PoolLimit(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """At most this many of the account's jobs running (placed) in a pool at once, and at
    most this many fellows held by them; None: no limit."""

    max_jobs: Annotated[int, msgspec.Meta(ge=0, le=100_000)] | None = None
    max_fellows: Annotated[int, msgspec.Meta(ge=0, le=100_000)] | None = None


class AccountView(msgspec.Struct, kw_only=True):
    """An account as the API serves it: never its token, never the token's hash."""

    name: str
    role: Role
    created_at: float
    revoked_at: float | None = None
    # None: any pool (and jobs that name none); otherwise only these.
    pools: list[str] | None = None
    pool_limits: dict[str, PoolLimit] = msgspec.field(default_factory=dict)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def of(cls, account: AccountView) -> AccountView:
        """The view of ``account`` (an :class:`Account`: its token's hash left out)."""
        return AccountView(**{f: getattr(account, f) for f in AccountView.__struct_fields__})


class Account(AccountView, kw_only=True):
    """What the leader stores of an account: its view and its token's SHA-256 (never the
    token itself)."""

    token_sha256: str
