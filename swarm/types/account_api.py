"""The bodies of ``/api/v1/accounts`` and ``/api/v1/auth/whoami`` (leader and CLI alike).

An account as the API shows it never carries its token or the token's hash; the token
appears once, in :class:`AccountCreated`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from silentswarm.types.accounts import AccountName, AccountView, PoolLimit, PoolName, Role

PoolList = Annotated[list[PoolName], msgspec.Meta(max_length=256)]


class CreateAccount(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /api/v1/accounts``."""

    name: AccountName
    role: Role
    pools: PoolList | None = None
    pool_limits: dict[PoolName, PoolLimit] = msgspec.field(default_factory=dict)


class UpdateAccount(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``PATCH /api/v1/accounts/{name}``: the fields given replace the account's; ``any_pool``
    lifts its limit to pools (then ``pools`` must be left out)."""

    pools: PoolList | None = None
    any_pool: bool = False
    pool_limits: dict[PoolName, PoolLimit] | None = None


class AccountCreated(msgspec.Struct, kw_only=True):
    """The answer to a create: the account and its token, shown this once."""

    account: AccountView
    token: str


class WhoAmI(msgspec.Struct, kw_only=True):
    """``GET /api/v1/auth/whoami``: the account a token (or read ticket) stands for."""

    name: str
    role: Role
    pools: list[str] | None = None
    operator: bool = False  # the bootstrap operator token (SWARM_API_TOKEN, <state>/api-token)
