"""Who may do what: the pure decisions behind the API's accounts (no I/O, table-tested).

A request is first *classified* (:func:`classify`: its method and path name an
:class:`Action`, and the job it acts on, if any), then *decided* (:func:`may`: the principal's
role and, for a per-job action, whether the job is its own). The guard
(:mod:`silentswarm.leader.auth`) does both for every request, so a route nobody classified is
safe by default: a GET is a read, anything else needs ``admin``.

======================  =====  =====================  ======
action                  admin  submitter              viewer
======================  =====  =====================  ======
read (every GET)        yes    yes                    yes
submit a job            yes    yes (its pools only)   no
control a job           yes    its own jobs only      no
a job's stage files     yes    its own jobs only      no
upload a dataset        yes    yes (a new name)       no
read tickets, whoami    yes    yes                    yes
everything else         yes    no                     no
======================  =====  =====================  ======

"Control a job" is every non-GET route under ``/api/v1/jobs/{id}`` (cancel, checkpoint and
any per-job action added later); "a job's stage files" are the GET routes a stage downloads
its shards, its ``init_from`` export and its datasets from (a stage's own token opens them;
an account's token on another account's job is refused before that token is looked at).
"Everything else" is accounts, the fleet (release, update, purges), join sessions and
deleting datasets. A submitter reads every job (the list, records, metrics), like a viewer;
no route serves an export's manifest or weights to an account.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum
from pathlib import PurePath

import msgspec

from silentswarm.datasets import is_dataset
from silentswarm.plan import DEFAULT_CORPUS, JsonlSource
from silentswarm.pools import DEFAULT_POOL
from silentswarm.types.accounts import OPERATOR_ACCOUNT, Role

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class Action(StrEnum):
    READ = "read"
    SUBMIT = "submit"
    CONTROL_JOB = "control a job"
    JOB_FILES = "read a job's stage files"
    UPLOAD_DATASET = "upload a dataset"
    SELF = "get a read ticket or say who it is"
    ADMIN = "administer"  # accounts, the fleet, join sessions, deleting datasets


class Principal(msgspec.Struct, frozen=True, kw_only=True):
    """Who a request comes from: the operator (the bootstrap token) or an account."""

    name: str
    role: Role
    pools: tuple[str, ...] | None = None  # None: any pool

    @property
    def is_operator(self) -> bool:
        return self.name == OPERATOR_ACCOUNT


OPERATOR = Principal(name=OPERATOR_ACCOUNT, role=Role.ADMIN)
# Who reads without a token where reads are public (SWARM_API_PUBLIC_READS): a viewer.
ANONYMOUS = Principal(name="anonymous", role=Role.VIEWER)


class Request(msgspec.Struct, frozen=True):
    """A classified request: what it does, and the job it does it to (if any)."""

    action: Action
    job_id: str | None = None


class Refusal(msgspec.Struct, frozen=True):
    """Why not, for the 403: the role that would be needed and the job's owner (if any)."""

    message: str
    needed_role: Role
    owner: str | None = None


_JOB = r"/api/v1/jobs/(?P<job>[^/]+)"
_JOB_FILES = re.compile(_JOB + r"/(shards/\d+/[^/]+|init/[^/]+|datasets/[0-9a-f]{64})$")
_JOB_ROUTE = re.compile(_JOB + r"(/.*)?$")
_DATASET = re.compile(r"/api/v1/datasets/[^/]+$")
_SELF_ROUTES = {("POST", "/api/v1/auth/read-ticket"), ("GET", "/api/v1/auth/whoami")}
_ADMIN_READS = re.compile(r"/api/v1/accounts(/.*)?$")


def classify(method: str, path: str) -> Request:
    """What a request does, from its method and path alone."""
    method, path = method.upper(), path.rstrip("/") or "/"
    if (method, path) in _SELF_ROUTES:
        return Request(Action.SELF)
    if method in READ_METHODS:
        if files := _JOB_FILES.match(path):
            return Request(Action.JOB_FILES, files["job"])
        if _ADMIN_READS.match(path):
            return Request(Action.ADMIN)
        return Request(Action.READ)
    if method == "POST" and path == "/api/v1/jobs":
        return Request(Action.SUBMIT)
    if job := _JOB_ROUTE.match(path):
        return Request(Action.CONTROL_JOB, job["job"])
    if method == "PUT" and _DATASET.match(path):
        return Request(Action.UPLOAD_DATASET)
    return Request(Action.ADMIN)


def may(principal: Principal, request: Request, job_owner: str | None = None) -> Refusal | None:
    """None when ``principal`` may do ``request``; else why not. ``job_owner``: the owner of
    the job the request names (None: no such job, which the route then answers with 404)."""
    role, action = principal.role, request.action
    if role is Role.ADMIN or action in (Action.SELF, Action.READ):
        return None
    who = f"account {principal.name!r} ({role})"
    if role is Role.SUBMITTER:
        if action in (Action.SUBMIT, Action.UPLOAD_DATASET):
            return None
        if action in (Action.CONTROL_JOB, Action.JOB_FILES):
            if job_owner is None or job_owner == principal.name:
                return None
            return Refusal(
                f"job {request.job_id} belongs to account {job_owner!r}; {who} may "
                f"{action} only for its own jobs (this needs the admin role)",
                needed_role=Role.ADMIN,
                owner=job_owner,
            )
        return Refusal(f"{who} may not {action}: this needs the admin role", Role.ADMIN)
    needed = Role.SUBMITTER if action in _SUBMITTER_ACTIONS else Role.ADMIN
    return Refusal(
        f"{who} may only read: to {action} needs the {needed} role",
        needed_role=needed,
        owner=job_owner if request.job_id else None,
    )


_SUBMITTER_ACTIONS = frozenset(
    {Action.SUBMIT, Action.UPLOAD_DATASET, Action.CONTROL_JOB, Action.JOB_FILES}
)


def init_from_refusal(principal: Principal, job_id: str, owner: str) -> Refusal | None:
    """Whether a job of ``principal`` may start from the export of job ``job_id`` (owned by
    ``owner``): starting from it reads its weights, which only its owner and admins may."""
    if principal.role is Role.ADMIN or owner == principal.name:
        return None
    return Refusal(
        f"init_from: job {job_id} belongs to account {owner!r}; account {principal.name!r} "
        f"({principal.role}) may start only from its own jobs' exports (or an admin's job may)",
        needed_role=Role.ADMIN,
        owner=owner,
    )


def export_dir_refusal(principal: Principal, relative: PurePath) -> str | None:
    """Why ``principal`` may not export into ``relative`` (a configured export directory,
    relative to the export root), or None when it may. An account other than an admin exports
    only under ``<export root>/<account>/``, so that its jobs can never write into the export
    of another account's job (a job's own default, ``<root>/<job id>/``, is never asked)."""
    if principal.role is Role.ADMIN or relative.parts[:1] == (principal.name,):
        return None
    return (
        f"artifact_paths.model_export_dir: account {principal.name!r} exports only under "
        f'{principal.name}/ in the export root (e.g. "{principal.name}/my-run"), or '
        "leaves it unset for the job's own directory"
    )


def fellow_path_refusal(
    principal: Principal, data: Sequence[str | JsonlSource], init_from: str | None
) -> tuple[str, str] | None:
    """``(field, why)`` when ``principal`` may not have fellows read what a job names, or None.

    A ``data`` path or glob, a JSONL source's ``jsonl`` and ``init_from`` "preset:DIR" are
    read by the fellow on its own disk: whoever names them reads that fellow's files (its
    credentials, ``/proc``) through the tokens stage 0 sends down the pipeline. Only an admin
    names them; an account names uploaded datasets ("dataset:NAME") and "stdlib", and starts
    from "job:" or "export:" sources, which the leader serves and checks."""
    if principal.role is Role.ADMIN:
        return None
    who = f"account {principal.name!r} ({principal.role})"
    for i, entry in enumerate(data):
        field, text = (
            (f"data[{i}].jsonl", entry.jsonl)
            if isinstance(entry, JsonlSource)
            else (f"data[{i}]", entry)
        )
        if not (is_dataset(text) or text == DEFAULT_CORPUS):
            return field, (
                f'{field}: {who} may name only uploaded datasets ("dataset:NAME", swarm data '
                f'upload) and "stdlib": a path is read from the fellows\' own disks, which '
                "needs the admin role"
            )
    if init_from is not None and init_from.startswith("preset:"):
        return "init_from", (
            f'init_from: {who} may start from "job:ID" or "export:DIR"; a "preset:DIR" is '
            "read from the fellows' own disks, which needs the admin role"
        )
    return None


def pool_refusal(principal: Principal, pool: str) -> str | None:
    """Why ``principal`` may not submit a job that runs in ``pool`` (a job naming none runs
    in ``default``), or None when it may. An account limited to pools may use only those."""
    allowed = principal.pools
    if principal.role is Role.ADMIN or allowed is None or pool in allowed:
        return None
    listed = ", ".join(sorted(allowed)) or "none"
    why = f"account {principal.name!r} may not submit to pool {pool!r} (its pools: {listed})"
    if pool == DEFAULT_POOL:
        why += '; a job that names no "pool" runs in the default pool: name one'
    return why
