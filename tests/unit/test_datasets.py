"""Uploaded datasets: references and pinning (pure), the leader's store, START's arguments, and
how stage 0's data loader finds a downloaded dataset."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from silentswarm import datasets
from silentswarm.agent.errors import DataError
from silentswarm.agent.runtime.data import TextDataset, dataset_path, resolve_paths
from silentswarm.errors import FieldError, NotFoundError
from silentswarm.jobspec import JobSpec, decode_job_spec
from silentswarm.leader.datasets import DatasetStore, start_args
from silentswarm.leader.errors import DatasetTooLargeError
from silentswarm.leader.services.datasets import pin_datasets
from silentswarm.plan import JsonlSource, ModelConfig, TrainConfig, chain_plans
from silentswarm.types.datasets import DatasetRecord

SHA = "ab" * 32
OTHER = "cd" * 32


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("dataset:notes", datasets.DatasetRef("notes")),
        (f"dataset:notes@{SHA}", datasets.DatasetRef("notes", SHA)),
        ("dataset:a.b_c-1", datasets.DatasetRef("a.b_c-1")),
    ],
)
def test_a_dataset_reference_parses(text, ref):
    assert datasets.parse(text) == ref and str(ref) == text


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("dataset:", "must be 1-128"),
        ("dataset:../etc", "must be 1-128"),
        ("dataset:.hidden", "starting with a letter"),
        ("dataset:a b", "must be 1-128"),
        ("dataset:" + "x" * 129, "must be 1-128"),
        ("dataset:notes@abc", "64 lowercase hex"),
        (f"dataset:notes@{SHA.upper()}", "64 lowercase hex"),
        ("notes", "does not start with"),
    ],
)
def test_a_bad_reference_says_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=says):
        datasets.parse(text)


def test_pinned_refs_finds_text_and_jsonl_entries_once_each():
    data = [
        "stdlib",
        f"dataset:a@{SHA}",
        JsonlSource(jsonl=f"dataset:b@{SHA}"),
        JsonlSource(jsonl=f"dataset:c@{OTHER}", field="body"),
        "dataset:unpinned",
    ]
    assert [(r.name, r.sha256) for r in datasets.pinned_refs(data)] == [("a", SHA), ("c", OTHER)]


def spec(*data) -> JobSpec:
    return decode_job_spec(msgspec.json.encode({"data": list(data)}))


def record(name: str, sha: str = SHA) -> DatasetRecord:
    return DatasetRecord(name=name, sha256=sha, size_bytes=3, uploaded_at=0.0)


def lookup(name: str) -> DatasetRecord:
    if name != "notes":
        raise NotFoundError(f"no dataset called {name!r}")
    return record(name)


def test_a_job_spec_names_a_malformed_dataset_entry():
    with pytest.raises(Exception, match=r"data\[1\]: dataset name"):
        spec("a.txt", "dataset:bad name")
    with pytest.raises(Exception, match=r"data\[0\]: .*64 lowercase hex"):
        spec({"jsonl": "dataset:n@123"})


def test_submit_pins_each_dataset_entry_and_names_an_unknown_one():
    pinned = pin_datasets(
        spec("x.txt", "dataset:notes", {"jsonl": "dataset:notes", "field": "body"}),
        lookup,
        lambda digest: False,
    )
    assert pinned.data == [
        "x.txt",
        f"dataset:notes@{SHA}",
        JsonlSource(jsonl=f"dataset:notes@{SHA}", field="body"),
    ]
    with pytest.raises(FieldError, match="no dataset called 'nope'") as caught:
        pin_datasets(spec("x.txt", "dataset:nope"), lookup, lambda digest: True)
    assert caught.value.field == "data[1]"
    untouched = spec("x.txt")
    assert pin_datasets(untouched, lookup, lambda digest: False) is untouched


def test_an_entry_already_pinned_stays_while_the_leader_has_that_content():
    old = spec(f"dataset:notes@{OTHER}")
    assert pin_datasets(old, lookup, lambda digest: digest == OTHER).data == old.data
    with pytest.raises(FieldError, match="no dataset content cdcd") as caught:
        pin_datasets(old, lookup, lambda digest: False)
    assert caught.value.field == "data[0]"


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def store(tmp_path: Path, max_bytes: int = 1 << 20) -> DatasetStore:
    opened = DatasetStore(tmp_path / "datasets", max_bytes=max_bytes)
    opened.open()
    return opened


def test_the_store_keeps_content_by_digest_and_names_by_name(tmp_path):
    datasets_ = store(tmp_path)
    first = asyncio.run(datasets_.put("notes", chunks(b"abc", b"def"), source="n.txt"))
    assert first.sha256 == hashlib.sha256(b"abcdef").hexdigest() and first.size_bytes == 6
    assert datasets_.blob(first.sha256).read_bytes() == b"abcdef"
    assert datasets_.get("notes") == first and datasets_.list() == [first]
    # Re-uploading points the name at new content; the old content goes once nothing needs it.
    second = asyncio.run(datasets_.put("notes", chunks(b"xyz")))
    assert datasets_.get("notes").sha256 == second.sha256
    assert datasets_.collect(in_use={first.sha256}) == []
    assert datasets_.collect(in_use=set()) == [first.sha256]
    assert datasets_.blob(first.sha256) is None and datasets_.blob(second.sha256) is not None
    # Two names, one content: deleting one name keeps it.
    asyncio.run(datasets_.put("copy", chunks(b"xyz")))
    datasets_.delete("notes", in_use=set())
    assert datasets_.blob(second.sha256) is not None
    datasets_.delete("copy", in_use=set())
    assert datasets_.blob(second.sha256) is None and datasets_.list() == []
    with pytest.raises(NotFoundError, match="no dataset called 'copy'"):
        datasets_.get("copy")
    with pytest.raises(NotFoundError):
        datasets_.get("../names/copy")
    assert datasets_.blob("../" + "a" * 61) is None


def test_a_new_name_is_taken_by_one_upload_only_even_when_two_stream_at_once(tmp_path):
    """A submitter's upload may only make a new name: the check at its start is not enough
    (a slow upload begun while the name was free would replace what another upload put
    there meanwhile), so the name is taken when the body is in, in one step."""
    datasets_ = store(tmp_path)
    gate = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"the attacker's "
        await gate.wait()
        yield b"text"

    async def race():
        late = asyncio.create_task(datasets_.put("notes", slow(), replace=False))
        await asyncio.sleep(0)  # it has begun: the name was free then
        first = await datasets_.put("notes", chunks(b"the owner's text"), replace=False)
        gate.set()
        with pytest.raises(FileExistsError):
            await late
        return first

    first = asyncio.run(race())
    assert datasets_.get("notes") == first
    assert datasets_.collect(in_use=set()) == [hashlib.sha256(b"the attacker's text").hexdigest()]
    leftovers = [p.name for p in (tmp_path / "datasets" / ".incoming").iterdir()]
    assert leftovers == []
    replaced = asyncio.run(datasets_.put("notes", chunks(b"an admin's")))  # replace: True
    assert datasets_.get("notes") == replaced


def test_an_upload_over_the_limit_is_stopped_and_leaves_nothing(tmp_path):
    datasets_ = store(tmp_path, max_bytes=5)
    with pytest.raises(DatasetTooLargeError, match="at most 5 bytes"):
        asyncio.run(datasets_.put("big", chunks(b"abc", b"def")))
    with pytest.raises(DatasetTooLargeError, match="at most 5 bytes"):
        asyncio.run(datasets_.put("big", chunks(b"a"), declared_bytes=6))
    with pytest.raises(FieldError, match="dataset name") as caught:
        asyncio.run(datasets_.put("a/b", chunks(b"a")))
    assert caught.value.field == "name"
    leftovers = [p for p in (tmp_path / "datasets").rglob("*") if p.is_file()]
    assert leftovers == [] and datasets_.list() == []


def test_only_stage_0_is_told_where_its_datasets_are(tmp_path):
    datasets_ = store(tmp_path)
    uploaded = asyncio.run(datasets_.put("notes", chunks(b"hello")))
    model = ModelConfig(vocab_size=256, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    train = TrainConfig(data=[f"dataset:notes@{uploaded.sha256}"], steps=2)
    plans = chain_plans(job_id="j1", model=model, train=train, addresses=[None, "tcp://h:1"])
    args = start_args(datasets_, plans[0], job_id="j1", token="t" * 64, public_url="http://l/")
    assert args is not None and args.token == "t" * 64
    [file] = args.files
    assert (file.name, file.sha256, file.size_bytes) == ("notes", uploaded.sha256, 5)
    assert file.url == f"http://l/api/v1/jobs/j1/datasets/{uploaded.sha256}"
    assert start_args(datasets_, plans[1], job_id="j1", token="t", public_url="http://l") is None


def test_stage_0_reads_a_downloaded_dataset_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_DATA_CACHE", str(tmp_path / "cache"))
    text = b"hello uploaded world\n" * 50
    digest = hashlib.sha256(text).hexdigest()
    with pytest.raises(DataError, match="not in this fellow's data cache"):
        resolve_paths([f"dataset:notes@{digest}"])
    with pytest.raises(DataError, match="submit the job to that leader"):
        resolve_paths(["dataset:notes"])
    path = dataset_path(digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    assert resolve_paths([f"dataset:notes@{digest}"]) == [path]
    dataset = TextDataset([f"dataset:notes@{digest}"], seq_len=8, seed=0, val_fraction=0.2)
    assert bytes(dataset.tokens[: len(text)]) == text


def test_uploads_side_by_side_share_the_room_instead_of_each_taking_all_of_it(
    tmp_path, monkeypatch
):
    """Each upload saw the disk's free space at its start: two at once could each fill it.
    The room is read again as the body comes in, so together they stop at what was free."""
    from collections import namedtuple

    from silentswarm.leader import datasets as store_module

    datasets_ = store(tmp_path, max_bytes=1 << 30)
    incoming = tmp_path / "datasets" / ".incoming"
    usage = namedtuple("usage", "total used free")

    def disk_usage(_path):  # a disk with 10 KiB free, less what the uploads wrote
        written = sum(p.stat().st_size for p in incoming.iterdir())
        return usage(1 << 30, 0, 10_240 - written)

    monkeypatch.setattr(store_module.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(store_module, "DISK_MARGIN_BYTES", 0)
    monkeypatch.setattr(store_module, "WRITE_BYTES", 1024)

    async def body(turns: list[asyncio.Event], mine: int) -> AsyncIterator[bytes]:
        for _ in range(8):  # 8 KiB each, a KiB at a time, taking turns while both run
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(turns[mine].wait(), 0.5)
            turns[mine].clear()
            yield b"x" * 1024
            turns[1 - mine].set()

    async def both() -> list[object]:
        turns = [asyncio.Event(), asyncio.Event()]
        turns[0].set()
        uploads = [datasets_.put(f"d{i}", body(turns, i)) for i in (0, 1)]
        return await asyncio.gather(*uploads, return_exceptions=True)

    results = asyncio.run(both())
    refused = [r for r in results if isinstance(r, DatasetTooLargeError)]
    assert refused and all("room for" in str(r) for r in refused), results
    assert sum(r.size_bytes for r in datasets_.list()) <= 10_240  # never more than was free
