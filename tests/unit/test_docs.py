"""The README's examples stay true: its stage plans decode and pass validation."""

import re
from pathlib import Path

from silentswarm.plan import decode_plan

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_stage_plans_are_valid_and_agree():
    blocks = re.findall(r"```json\n(.*?)```", README.read_text(), flags=re.S)
    plans = [decode_plan(b.encode(), source="README") for b in blocks if '"n_stages"' in b]
    assert [p.stage for p in plans] == [0, 1]
    first, second = plans
    assert first.next.data_address == second.data_address
    assert first.layer_end == second.layer_start and second.layer_end == second.model.n_layers
    assert first.model == second.model and first.train == second.train


def test_readme_documents_every_job_spec_field_and_setting():
    import msgspec

    from silentswarm.jobspec import JobSpec
    from silentswarm.settings import Settings, env_name

    text = README.read_text()
    for field in msgspec.structs.fields(JobSpec):
        assert f"`{field.name}" in text, f"job spec field {field.name} is not in the README"
    for field in msgspec.structs.fields(Settings):
        assert f"`{env_name(field.name)}`" in text, f"{env_name(field.name)} is not in the README"
