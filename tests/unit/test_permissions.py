"""Who may do what (leader/permissions.py) and the account book (leader/accounts.py): pure."""

from __future__ import annotations

from pathlib import PurePath

import msgspec
import pytest

from silentswarm.errors import ConflictError, FieldError, NotFoundError
from silentswarm.leader.accounts import AccountBook, token_digest
from silentswarm.leader.auth import ReadTickets
from silentswarm.leader.errors import (
    AccountExistsError,
    ForbiddenError,
    NotReadyError,
    RevokedTokenError,
)
from silentswarm.leader.permissions import (
    OPERATOR,
    Action,
    Principal,
    Request,
    classify,
    export_dir_refusal,
    fellow_path_refusal,
    init_from_refusal,
    may,
    pool_refusal,
)
from silentswarm.plan import JsonlSource
from silentswarm.types.account_api import CreateAccount, UpdateAccount
from silentswarm.types.accounts import PoolLimit, Role
from tests.fakes import Clock

J = "/api/v1/jobs/j-1"


@pytest.mark.parametrize(
    ("method", "path", "action", "job"),
    [
        ("GET", "/api/v1/jobs", Action.READ, None),
        ("GET", "/api/v1/jobs/", Action.READ, None),
        ("GET", J, Action.READ, None),
        ("GET", f"{J}/metrics/stream", Action.READ, None),
        ("HEAD", "/api/v1/workers", Action.READ, None),
        ("GET", "/api/v1/bootstrap/join-sessions", Action.READ, None),
        ("GET", f"{J}/shards/10/stage0.weights.h5", Action.JOB_FILES, "j-1"),
        ("GET", f"{J}/init/run_manifest.json", Action.JOB_FILES, "j-1"),
        ("GET", f"{J}/datasets/{'a' * 64}", Action.JOB_FILES, "j-1"),
        ("GET", "/api/v1/accounts", Action.ADMIN, None),
        ("GET", "/api/v1/accounts/alice", Action.ADMIN, None),
        ("POST", "/api/v1/auth/read-ticket", Action.SELF, None),
        ("GET", "/api/v1/auth/whoami", Action.SELF, None),
        ("POST", "/api/v1/jobs", Action.SUBMIT, None),
        ("POST", "/api/v1/jobs/", Action.SUBMIT, None),
        ("DELETE", J, Action.CONTROL_JOB, "j-1"),
        ("POST", f"{J}/checkpoint", Action.CONTROL_JOB, "j-1"),
        ("post", f"{J}/resume", Action.CONTROL_JOB, "j-1"),  # any per-job action added later
        ("PATCH", J, Action.CONTROL_JOB, "j-1"),
        ("PUT", "/api/v1/datasets/corpus", Action.UPLOAD_DATASET, None),
        ("DELETE", "/api/v1/datasets/corpus", Action.ADMIN, None),
        ("POST", "/api/v1/accounts", Action.ADMIN, None),
        ("POST", "/api/v1/accounts/alice/revoke", Action.ADMIN, None),
        ("POST", "/api/v1/accounts/alice/rotate", Action.ADMIN, None),
        ("POST", "/api/v1/workers/f1/release", Action.ADMIN, None),
        ("POST", "/api/v1/workers/update", Action.ADMIN, None),
        ("POST", "/api/v1/purges/retry", Action.ADMIN, None),
        ("POST", "/api/v1/bootstrap/join-sessions", Action.ADMIN, None),
        ("POST", "/api/v1/something-new", Action.ADMIN, None),  # safe by default
    ],
)
def test_classify(method, path, action, job):
    assert classify(method, path) == Request(action, job)


ADMIN = Principal(name="root", role=Role.ADMIN)
ALICE = Principal(name="alice", role=Role.SUBMITTER)
VIEWER = Principal(name="eve", role=Role.VIEWER)
EVERY_ACTION = list(Action)


@pytest.mark.parametrize("principal", [OPERATOR, ADMIN])
@pytest.mark.parametrize("action", EVERY_ACTION)
def test_an_admin_may_do_everything(principal, action):
    assert may(principal, Request(action, "j-1"), "bob") is None


@pytest.mark.parametrize(
    ("action", "owner", "allowed"),
    [
        (Action.READ, "bob", True),
        (Action.SELF, None, True),
        (Action.SUBMIT, None, True),
        (Action.UPLOAD_DATASET, None, True),
        (Action.CONTROL_JOB, "alice", True),
        (Action.CONTROL_JOB, "bob", False),
        (Action.CONTROL_JOB, "operator", False),
        (Action.CONTROL_JOB, None, True),  # no such job: the route's 404
        (Action.JOB_FILES, "alice", True),
        (Action.JOB_FILES, "bob", False),
        (Action.ADMIN, None, False),
    ],
)
def test_a_submitter_controls_its_own_jobs_only(action, owner, allowed):
    refusal = may(ALICE, Request(action, "j-1"), owner)
    assert (refusal is None) is allowed
    if refusal is not None:
        assert refusal.needed_role is Role.ADMIN
        assert "alice" in refusal.message
        if owner:
            assert refusal.owner == owner and f"account {owner!r}" in refusal.message


@pytest.mark.parametrize(
    ("action", "needed"),
    [
        (Action.READ, None),
        (Action.SELF, None),
        (Action.SUBMIT, Role.SUBMITTER),
        (Action.UPLOAD_DATASET, Role.SUBMITTER),
        (Action.CONTROL_JOB, Role.SUBMITTER),
        (Action.JOB_FILES, Role.SUBMITTER),
        (Action.ADMIN, Role.ADMIN),
    ],
)
def test_a_viewer_only_reads(action, needed):
    refusal = may(VIEWER, Request(action, "j-1"), "eve")
    if needed is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.needed_role is needed
        assert "may only read" in refusal.message


@pytest.mark.parametrize(
    ("principal", "pool", "refused"),
    [
        (Principal(name="a", role=Role.SUBMITTER), "default", False),
        (Principal(name="a", role=Role.SUBMITTER), "gpu", False),
        (Principal(name="a", role=Role.SUBMITTER, pools=("gpu",)), "gpu", False),
        (Principal(name="a", role=Role.SUBMITTER, pools=("gpu",)), "cpu", True),
        (Principal(name="a", role=Role.SUBMITTER, pools=("gpu",)), "default", True),
        (Principal(name="a", role=Role.SUBMITTER, pools=("gpu", "default")), "default", False),
        (Principal(name="a", role=Role.SUBMITTER, pools=()), "gpu", True),
        (Principal(name="a", role=Role.ADMIN, pools=("gpu",)), "cpu", False),
    ],
)
def test_pools(principal, pool, refused):
    why = pool_refusal(principal, pool)
    assert (why is not None) is refused
    if why:
        assert repr(pool) in why
        assert ("name one" in why) is (pool == "default")


@pytest.mark.parametrize(
    ("principal", "owner", "refused"),
    [(ALICE, "alice", False), (ALICE, "bob", True), (ADMIN, "bob", False), (OPERATOR, "x", False)],
)
def test_init_from_another_accounts_export(principal, owner, refused):
    refusal = init_from_refusal(principal, "j-9", owner)
    assert (refusal is not None) is refused
    if refusal:
        assert refusal.message.startswith("init_from:") and refusal.owner == owner


# --- the account book ----------------------------------------------------------------------------


def _book(*, loaded: bool = True) -> AccountBook:
    tokens = iter(f"swa_token{i}" for i in range(100))
    book = AccountBook(wall=Clock(1000.0), new_token=lambda: next(tokens))
    if loaded:
        book.restore([])
    return book


def test_a_token_resolves_to_its_account_until_revoked():
    book = _book()
    account, token = book.create(CreateAccount(name="alice", role=Role.SUBMITTER, pools=["b", "a"]))
    assert (
        account.token_sha256 == token_digest(token)
        and token not in msgspec.json.encode(account).decode()
    )
    assert account.pools == ["a", "b"]
    assert book.resolve(token) == Principal(name="alice", role=Role.SUBMITTER, pools=("a", "b"))
    assert book.resolve("swa_other") is None
    book.revoke("alice")
    with pytest.raises(RevokedTokenError) as err:
        book.resolve(token)
    assert err.value.http_status == 401 and "alice" in err.value.message
    assert book.principal("alice") is None
    assert book.revoke("alice").revoked_at == 1000.0  # again: the same record


def test_names_are_unique_and_operator_is_reserved():
    book = _book()
    _, first = book.create(CreateAccount(name="alice", role=Role.VIEWER))
    with pytest.raises(AccountExistsError) as err:
        book.create(CreateAccount(name="alice", role=Role.ADMIN))
    assert err.value.http_status == 409 and err.value.to_dict()["field"] == "name"
    with pytest.raises(FieldError) as reserved:
        book.create(CreateAccount(name="operator", role=Role.VIEWER))
    assert reserved.value.field == "name"
    # A revoked name may be created again: a new token; the old one stays dead.
    book.revoke("alice")
    account, second = book.create(CreateAccount(name="alice", role=Role.SUBMITTER))
    assert second != first and account.revoked_at is None
    assert book.resolve(second).role is Role.SUBMITTER
    assert book.resolve(first) is None


def test_a_rotated_token_replaces_the_old_one_and_keeps_the_account():
    book = _book()
    limits = {"gpu": PoolLimit(max_jobs=2)}
    request = CreateAccount(name="alice", role=Role.SUBMITTER, pools=["gpu"], pool_limits=limits)
    created, old = book.create(request)
    rotated, new = book.rotate("alice")
    assert new != old and rotated.token_sha256 == token_digest(new)
    assert book.resolve(old) is None, "the old token stops at once"
    assert book.resolve(new) == Principal(name="alice", role=Role.SUBMITTER, pools=("gpu",))
    assert (rotated.created_at, rotated.pool_limits) == (created.created_at, limits)
    assert book.get("alice") is rotated
    with pytest.raises(NotFoundError):
        book.rotate("nobody")
    book.revoke("alice")
    with pytest.raises(ConflictError) as refused:
        book.rotate("alice")
    assert refused.value.http_status == 409 and "create it again" in refused.value.message
    with pytest.raises(RevokedTokenError):
        book.resolve(new)


def test_pool_limits_must_name_the_accounts_pools():
    book = _book()
    with pytest.raises(FieldError) as err:
        book.create(
            CreateAccount(
                name="a", role=Role.SUBMITTER, pools=["gpu"], pool_limits={"cpu": PoolLimit()}
            )
        )
    assert err.value.field == "pool_limits"
    book.create(CreateAccount(name="a", role=Role.SUBMITTER, pools=["gpu"]))
    changed = book.update("a", UpdateAccount(pool_limits={"gpu": PoolLimit(max_jobs=2)}))
    assert changed.pools == ["gpu"] and changed.pool_limits["gpu"].max_jobs == 2
    assert book.update("a", UpdateAccount()).pools == ["gpu"]
    with pytest.raises(FieldError) as both:
        book.update("a", UpdateAccount(pools=["x"], any_pool=True))
    assert both.value.field == "any_pool"
    with pytest.raises(FieldError):  # its limits name gpu
        book.update("a", UpdateAccount(pools=["cpu"]))
    assert book.update("a", UpdateAccount(any_pool=True)).pools is None
    with pytest.raises(NotFoundError):
        book.update("nobody", UpdateAccount())


def test_an_unknown_token_waits_for_the_accounts_to_load():
    book = _book(loaded=False)
    with pytest.raises(NotReadyError):
        book.resolve("swa_anything")


def test_a_read_ticket_carries_its_account():
    tickets = ReadTickets("the-token")
    ticket, _ = tickets.issue("alice")
    assert tickets.check(ticket) == "alice"
    stamp, _, rest = ticket.partition(".")
    mac = rest.rpartition(".")[2]
    with pytest.raises(ForbiddenError):  # another account cannot be written in
        tickets.check(f"{stamp}.root.{mac}")
    assert tickets.check(tickets.issue()[0]) == "operator"


@pytest.mark.parametrize(
    ("principal", "relative", "refused"),
    [
        (Principal(name="alice", role=Role.SUBMITTER), "alice/run", False),
        (Principal(name="alice", role=Role.SUBMITTER), "alice", False),
        (Principal(name="alice", role=Role.SUBMITTER), "bob/run", True),
        (Principal(name="alice", role=Role.SUBMITTER), "bob-1a2b3c/model_export", True),
        (Principal(name="alice", role=Role.SUBMITTER), "alice-1a2b3c/model_export", True),
        (Principal(name="root", role=Role.ADMIN), "bob/run", False),
    ],
)
def test_a_submitter_exports_only_under_its_own_directory(principal, relative, refused):
    why = export_dir_refusal(principal, PurePath(relative))
    assert (why is not None) is refused
    if why:
        assert "artifact_paths.model_export_dir" in why and f"{principal.name}/" in why


ALICE = Principal(name="alice", role=Role.SUBMITTER)


@pytest.mark.parametrize(
    ("principal", "data", "init_from", "field"),
    [
        (ALICE, ["stdlib"], None, None),
        (ALICE, ["dataset:notes", JsonlSource(jsonl="dataset:qa@" + "0" * 64)], "job:x", None),
        (ALICE, ["stdlib"], "export:alice/run", None),
        (ALICE, ["dataset:notes", "/proc/self/environ"], None, "data[1]"),
        (ALICE, ["~/**"], None, "data[0]"),
        (ALICE, ["stdlib/../../etc/passwd"], None, "data[0]"),
        (ALICE, ["stdlib", JsonlSource(jsonl="/var/lib/silentswarm/*")], None, "data[1].jsonl"),
        (ALICE, ["stdlib"], "preset:/home/fellow/llama", "init_from"),
        (Principal(name="vera", role=Role.VIEWER), ["corpus/*.txt"], None, "data[0]"),
        (OPERATOR, ["/srv/corpus/**", JsonlSource(jsonl="qa.jsonl")], "preset:/models/x", None),
        (Principal(name="root", role=Role.ADMIN), ["~/corpus"], "preset:/m", None),
    ],
)
def test_only_an_admin_names_files_on_the_fellows_disks(principal, data, init_from, field):
    refused = fellow_path_refusal(principal, data, init_from)
    assert (refused and refused[0]) == field
    if refused:
        assert refused[1].startswith(f"{field}: account {principal.name!r}")
        assert "admin role" in refused[1]
