"""The Ops UI: static files the leader serves as they are (no build step, no CDN)."""

from __future__ import annotations

from pathlib import Path

from litestar import Controller, get
from litestar.response import File, Redirect
from litestar.static_files import create_static_files_router

UI_DIR = Path(__file__).resolve().parent.parent / "ui"


class OpsController(Controller):
    path = "/ops"
    tags = ["ops"]
    include_in_schema = False

    @get("/join-v2")
    async def page(self) -> File:
        return File(
            UI_DIR / "index.html", content_disposition_type="inline", media_type="text/html"
        )

    @get("/")
    async def home(self) -> Redirect:
        return Redirect("/ops/join-v2")


STATIC = create_static_files_router(
    path="/ops/static", directories=[UI_DIR], include_in_schema=False, name="ops-static"
)
