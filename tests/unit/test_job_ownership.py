"""A job belongs to its submitter's account: pools and init_from are checked at submit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from silentswarm.jobspec import JobSpec
from silentswarm.leader import initsource
from silentswarm.leader.errors import AccountForbiddenError, PoolForbiddenError
from silentswarm.leader.permissions import OPERATOR, Principal
from silentswarm.types.accounts import Role
from silentswarm.types.jobs import InitSource
from tests.unit.test_leader_services import _jobs_service

ALICE = Principal(name="alice", role=Role.SUBMITTER)
BOB = Principal(name="bob", role=Role.SUBMITTER, pools=("gpu",))


def test_a_job_is_its_submitters(tmp_path: Path) -> None:
    service, _ = _jobs_service(tmp_path)
    assert asyncio.run(service.submit(JobSpec(name="a"), ALICE)).owner == "alice"
    assert asyncio.run(service.submit(JobSpec(name="o"))).owner == "operator"
    assert [j.owner for j in service.jobs.list()] == ["alice", "operator"]


def test_a_pool_outside_the_accounts_is_refused_naming_pool(tmp_path: Path) -> None:
    service, _ = _jobs_service(tmp_path)
    assert asyncio.run(service.submit(JobSpec(name="b", pool="gpu"), BOB)).owner == "bob"
    with pytest.raises(PoolForbiddenError) as err:
        asyncio.run(service.submit(JobSpec(name="b", pool="cpu"), BOB))
    assert err.value.to_dict()["field"] == "pool" and err.value.http_status == 403
    assert len(service.jobs.list()) == 1


def test_init_from_another_accounts_job_is_refused(tmp_path, monkeypatch) -> None:
    service, _ = _jobs_service(tmp_path)
    source = asyncio.run(
        service.submit(JobSpec(name="bobs"), Principal(name="bob", role=Role.SUBMITTER))
    )

    def resolved(spec, jobs, root):
        return InitSource(
            directory=str(tmp_path), step=1, manifest_sha256="0", job_id=source.job_id
        )

    monkeypatch.setattr(initsource, "resolve", resolved)
    spec = JobSpec(name="warm", init_from=f"job:{source.job_id}")
    with pytest.raises(AccountForbiddenError) as err:
        asyncio.run(service.submit(spec, ALICE))
    body = err.value.to_dict()
    assert body["owner"] == "bob" and body["account"] == "alice" and body["needed_role"] == "admin"
    assert body["message"].startswith("init_from:")
    assert asyncio.run(service.submit(spec, OPERATOR)).owner == "operator"
    assert (
        asyncio.run(service.submit(spec, Principal(name="bob", role=Role.SUBMITTER))).owner == "bob"
    )


@pytest.mark.parametrize(
    ("manifest_owner", "refused"),
    [("bob", True), ("alice", False), (None, False)],  # None: an export from before accounts
)
def test_init_from_a_deleted_jobs_export_keeps_its_owner(
    tmp_path, monkeypatch, manifest_owner, refused
) -> None:
    """Once the source job's record is deleted (retention), its export stays on disk; the
    owner its manifest names still decides who may start from it."""
    service, _ = _jobs_service(tmp_path)

    def resolved(spec, jobs, root):
        return InitSource(
            directory=str(tmp_path),
            step=1,
            manifest_sha256="0",
            job_id="bobs-deleted-0a1b2c",
            owner=manifest_owner,
        )

    monkeypatch.setattr(initsource, "resolve", resolved)
    spec = JobSpec(name="warm", init_from="export:bobs-deleted-0a1b2c/model_export")
    if refused:
        with pytest.raises(AccountForbiddenError) as err:
            asyncio.run(service.submit(spec, ALICE))
        assert err.value.to_dict()["owner"] == "bob"
    else:
        assert asyncio.run(service.submit(spec, ALICE)).owner == "alice"
    assert asyncio.run(service.submit(spec, OPERATOR)).owner == "operator"
