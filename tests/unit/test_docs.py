"""The README and the reference in docs/ stay true to the code: the stage plans and job specs
they show decode and validate, every job-spec field, setting, CLI command and REST route is
documented, every relative link leads somewhere, and the README stays a first screen."""

import re
from pathlib import Path

import msgspec
import pytest

from silentswarm.plan import decode_plan

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
README_MAX_LINES = 200


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_the_stage_plans_the_cli_reference_shows_are_valid_and_agree():
    text = (REFERENCE / "cli.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    plans = [decode_plan(b.encode(), source="cli.md") for b in blocks if '"n_stages"' in b]
    assert [p.stage for p in plans] == [0, 1]
    first, second = plans
    assert first.next.data_address == second.data_address
    assert first.layer_end == second.layer_start and second.layer_end == second.model.n_layers
    assert first.model == second.model and first.train == second.train


def test_the_readmes_job_spec_is_a_valid_job():
    from silentswarm.jobspec import decode_job_spec

    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README shows no job spec"
    for block in blocks:
        spec = decode_job_spec(block.encode())
        assert spec.problems() == [], block


def test_the_reference_documents_every_job_spec_field_and_setting():
    from silentswarm.jobspec import JobSpec
    from silentswarm.settings import Settings, env_name

    jobs = (REFERENCE / "jobs.md").read_text()
    for field in msgspec.structs.fields(JobSpec):
        assert f"`{field.name}" in jobs, f"job spec field {field.name} is not in jobs.md"
    settings = (REFERENCE / "settings.md").read_text()
    for field in msgspec.structs.fields(Settings):
        name = env_name(field.name)
        assert f"`{name}`" in settings, f"{name} is not in settings.md"


def cli_commands() -> list[str]:
    """Every leaf command of ``swarm``, as typed: ``swarm data upload``."""
    from cyclopts import App

    from silentswarm.cli.app import app

    out = []

    def walk(node: App, prefix: str) -> None:
        for name in node:
            if name.startswith("-"):
                continue
            child = node[name]
            leaves = [n for n in child if not n.startswith("-")]
            if leaves:
                walk(child, f"{prefix} {name}")
            else:
                out.append(f"{prefix} {name}")

    walk(app, "swarm")
    return out


def test_the_cli_reference_documents_every_command():
    text = (REFERENCE / "cli.md").read_text()
    commands = cli_commands()
    assert "swarm submit" in commands and "swarm data upload" in commands
    missing = [c for c in commands if f"`{c}" not in text]
    assert not missing, f"not in docs/reference/cli.md: {missing}"


def leader_routes() -> list[tuple[str, str]]:
    """(method, path with ``{}`` for each parameter) of every route the leader's code serves."""
    from silentswarm.leader.app import create_app
    from silentswarm.settings import Settings

    app = create_app(Settings(), nats="nats://127.0.0.1:1")
    out = []
    for route in app.routes:
        for handler in getattr(route, "route_handlers", []):
            if handler.fn.__module__.startswith("silentswarm.leader."):
                for method in handler.http_methods:
                    out.append((method, re.sub(r"\{[^}]*\}", "{}", route.path)))
    return out


def test_the_api_reference_documents_every_route():
    docs = [REFERENCE / "api.md", DOCS / "operations" / "bootstrap.md"]
    text = re.sub(r"\{[^}]*\}", "{}", "\n".join(p.read_text() for p in docs))
    missing = []
    for method, path in leader_routes():
        shown = re.escape(path) + r"(?![\w/{])"
        if method == "GET":
            found = re.search(rf"`(GET )?{shown}", text) or re.search(rf", {shown}`", text)
        else:
            found = re.search(rf"{method} {shown}", text)
        if not found:
            missing.append(f"{method} {path}")
    assert not missing, f"not in docs/reference/api.md (or bootstrap.md): {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        exists = linked.exists()
        if not exists or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_the_readme_is_a_first_screen_with_the_two_command_quickstart():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    quickstart = text.split("## Quickstart", 1)[1]
    [commands] = re.findall(r"```sh\n(.*?)```", quickstart, flags=re.S)[:1]
    lines = commands.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "bash .ci/run"
    assert "swarm submit exp/configs/quickstart.json --watch" in lines[0]
