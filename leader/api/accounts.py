"""Accounts (admin only: the guard refuses other roles): create, list, change, rotate a
token, revoke."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from litestar import Controller, Request, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from silentswarm.errors import FieldError
from silentswarm.jobspec import decode_strict
from silentswarm.leader.services.accounts import AccountsService
from silentswarm.types.account_api import AccountCreated, AccountView, CreateAccount, UpdateAccount

_MISSING = re.compile(r"missing required field `(?P<name>[^`]+)`")


@contextlib.contextmanager
def naming_the_field() -> Iterator[None]:
    """A body's FieldError (400) naming the field: a missing one too, not ``$``."""
    try:
        yield
    except FieldError as exc:
        if exc.field != "$":
            raise
        missing = _MISSING.search(exc.message)
        if missing:
            name = missing["name"]
            raise FieldError(f"{name}: required", field=name) from None
        raise FieldError(exc.message.removeprefix("job spec: "), field="$") from None


class AccountsController(Controller):
    path = "/api/v1/accounts"
    tags = ["accounts"]

    @post(
        "/",
        status_code=HTTP_201_CREATED,
        summary=(
            "Create an account (admin): body {name, role, pools?, pool_limits?}; 201 with its "
            "token, shown this once (only its SHA-256 is kept)"
        ),
    )
    async def create(
        self, request: Request, accounts: NamedDependency[AccountsService]
    ) -> AccountCreated:
        with naming_the_field():
            body = decode_strict(await request.body(), CreateAccount)
        return await accounts.create(body)

    @get("/", summary="Every account, revoked ones too (admin); never a token or its hash")
    async def list_accounts(self, accounts: NamedDependency[AccountsService]) -> list[AccountView]:
        return await accounts.list()

    @get("/{name:str}", summary="One account (admin)")
    async def get_account(
        self, name: FromPath[str], accounts: NamedDependency[AccountsService]
    ) -> AccountView:
        return await accounts.get(name)

    @patch(
        "/{name:str}",
        summary="Change an account's pools and pool limits (admin): the fields given replace",
    )
    async def update(
        self, name: FromPath[str], request: Request, accounts: NamedDependency[AccountsService]
    ) -> AccountView:
        with naming_the_field():
            body = decode_strict(await request.body(), UpdateAccount)
        return await accounts.update(name, body)

    @post(
        "/{name:str}/rotate",
        status_code=HTTP_200_OK,
        summary=(
            "Give an account a new token (admin), shown this once: the old one stops working "
            "at once; role, pools, limits and jobs stay. 409 for a revoked account"
        ),
    )
    async def rotate(
        self, name: FromPath[str], accounts: NamedDependency[AccountsService]
    ) -> AccountCreated:
        return await accounts.rotate(name)

    @post(
        "/{name:str}/revoke",
        status_code=HTTP_200_OK,
        summary="Revoke an account (admin): its token stops working at once; the record stays",
    )
    async def revoke(
        self, name: FromPath[str], accounts: NamedDependency[AccountsService]
    ) -> AccountView:
        return await accounts.revoke(name)
