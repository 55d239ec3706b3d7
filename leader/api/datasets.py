from __future__ import annotations

from litestar import Controller, Request, delete, get, put
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from litestar.response import File
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from silentswarm.errors import NotFoundError
from silentswarm.leader.auth import principal_of
from silentswarm.leader.errors import AccountForbiddenError
from silentswarm.leader.permissions import Principal
from silentswarm.leader.services.datasets import DatasetsService
from silentswarm.types.accounts import Role
from silentswarm.types.datasets import DatasetRecord


def refuse_replacing(principal: Principal, name: str, datasets: DatasetsService) -> None:
    """A submitter uploads new names only: pointing a name at new content would change what
    other accounts' jobs that name it read from then on."""
    if principal.role is Role.ADMIN:
        return
    try:
        datasets.get(name)
    except NotFoundError:
        return
    raise AccountForbiddenError(
        f"dataset {name!r} exists; account {principal.name!r} ({principal.role}) may upload "
        "new names only (replacing a dataset needs the admin role)",
        account=principal.name,
        needed_role=Role.ADMIN,
    )


class DatasetsController(Controller):
    path = "/api/v1"
    tags = ["datasets"]

    @put(
        "/datasets/{name:str}",
        status_code=HTTP_201_CREATED,
        summary=(
            "Upload a dataset (the raw bytes of one text or JSONL file, streamed) under a name; "
            "?source= records the file it came from. A job names it as data 'dataset:NAME'. "
            "A submitter may upload new names; replacing one is an admin's"
        ),
        request_max_body_size=None,  # the store enforces SWARM_MAX_DATASET_BYTES as it streams
    )
    async def upload(
        self,
        name: FromPath[str],
        request: Request,
        datasets: NamedDependency[DatasetsService],
        source: FromQuery[str] = "",
    ) -> DatasetRecord:
        principal = principal_of(request)
        refuse_replacing(principal, name, datasets)
        try:
            return await datasets.upload(
                name,
                request.stream(),
                source=source[:4096],
                declared_bytes=request.content_length,
                replace=principal.role is Role.ADMIN,
            )
        except FileExistsError:  # another upload took the new name while this one streamed
            refuse_replacing(principal, name, datasets)
            raise

    @get("/datasets", summary="Every uploaded dataset: name, sha256, size")
    async def list_datasets(
        self, datasets: NamedDependency[DatasetsService]
    ) -> list[DatasetRecord]:
        return datasets.list()

    @get("/datasets/{name:str}", summary="One uploaded dataset")
    async def get_dataset(
        self, name: FromPath[str], datasets: NamedDependency[DatasetsService]
    ) -> DatasetRecord:
        return datasets.get(name)

    @delete(
        "/datasets/{name:str}",
        status_code=HTTP_200_OK,
        summary="Forget a dataset's name (its content stays while a running job reads it)",
    )
    async def delete_dataset(
        self, name: FromPath[str], datasets: NamedDependency[DatasetsService]
    ) -> DatasetRecord:
        return datasets.delete(name)

    @get(
        "/jobs/{job_id:str}/datasets/{sha256:str}",
        summary=(
            "A dataset the job's stage 0 reads (the X-Swarm-Shard-Token header from its START; "
            "never ?token=)"
        ),
        media_type="application/octet-stream",
    )
    async def download(
        self,
        job_id: FromPath[str],
        sha256: FromPath[str],
        request: Request,
        datasets: NamedDependency[DatasetsService],
    ) -> File:
        header = request.headers.get(DatasetsService.TOKEN_HEADER)
        path = datasets.dataset_file(job_id, sha256, header, request.query_params)
        return File(path, filename=sha256, media_type="application/octet-stream")
