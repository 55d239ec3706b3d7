"""Relay messages: layout, tags and parsing (agent/pipe/relaymsg.py), without NATS."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from silentswarm.agent.errors import FrameError
from silentswarm.agent.pipe.link import deserialize_parts, serialize_parts
from silentswarm.agent.pipe.relay import FrameAssembler, chunk_frame, frame_views
from silentswarm.agent.pipe.relaymsg import (
    MAX_HANDSHAKE_BODY,
    OVERHEAD,
    TAG_BYTES,
    Control,
    Credit,
    DataChunk,
    DropReason,
    Probe,
    RelayAuth,
    parse_message,
)
from silentswarm.errors import ConfigError
from silentswarm.jobspec import JobSpec, PlacedStage, Placement, stage_plans
from silentswarm.plan import ModelConfig, StagePlan, Transport, decode_plan

TOKEN = bytes(range(32))
SUBJECT = "swarm.relay.j-1.2.0.fwd"
AUTH = RelayAuth(TOKEN, SUBJECT)


def test_tagged_messages_round_trip():
    data = AUTH.data(7, 1, 3, 5000, b"chunk bytes")
    assert len(data) == OVERHEAD + len(b"chunk bytes")
    chunk = parse_message(data, AUTH)
    assert isinstance(chunk, DataChunk)
    assert (chunk.seq, chunk.index, chunk.count, chunk.frame_bytes, bytes(chunk.chunk)) == (
        7,
        1,
        3,
        5000,
        b"chunk bytes",
    )
    assert parse_message(AUTH.credit(3, 2**40, 2**41), AUTH) == Credit(3, 2**40, 2**41)
    resend = parse_message(AUTH.credit(4, 10, 12, resend=True), AUTH)
    assert resend == Credit(serial=4, granted=10, acked=12, resend=True)
    assert parse_message(AUTH.probe(5, 99), AUTH) == Probe(serial=5, next_seq=99)
    assert parse_message(AUTH.message(b"H", b"fingerprint"), AUTH) == Control(b"H", b"fingerprint")
    assert parse_message(AUTH.message(b"E"), AUTH) == Control(b"E", b"")
    assert parse_message(AUTH.message(b"F"), AUTH) == Control(b"F", b"")


def test_a_chunk_sealed_from_pieces_is_the_chunk_of_their_bytes():
    pieces = [memoryview(b"abc"), memoryview(bytearray(b"de")), b"f"]
    assert AUTH.data(1, 0, 1, 6, pieces) == AUTH.data(1, 0, 1, 6, b"abcdef")


def test_a_data_chunk_is_a_view_of_the_message():
    data = AUTH.data(0, 0, 1, 1000, b"x" * 1000)
    chunk = parse_message(data, AUTH)
    assert isinstance(chunk.chunk, memoryview) and chunk.chunk.obj is data


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", DropReason.UNKNOWN_KIND),
        (b"Zjunk", DropReason.UNKNOWN_KIND),
        (b"d" + bytes(40), DropReason.UNKNOWN_KIND),  # kinds are case-sensitive
        (b"D", DropReason.TRUNCATED),
        (b"D" + bytes(TAG_BYTES + 23), DropReason.TRUNCATED),  # one byte short of the header
        (b"C" + bytes(TAG_BYTES + 23), DropReason.TRUNCATED),
        (b"R" + bytes(TAG_BYTES + 23), DropReason.TRUNCATED),
        (b"P" + bytes(TAG_BYTES + 15), DropReason.TRUNCATED),
        (b"F" + bytes(TAG_BYTES - 1), DropReason.TRUNCATED),
        (b"H" + bytes(TAG_BYTES - 1), DropReason.TRUNCATED),
        (b"E" + bytes(3), DropReason.TRUNCATED),
        (b"C" + bytes(TAG_BYTES + 25), DropReason.MALFORMED),  # one byte over
        (b"R" + bytes(TAG_BYTES + (1 << 20)), DropReason.MALFORMED),
        (b"P" + bytes(TAG_BYTES + 17), DropReason.MALFORMED),
        (b"E" + bytes(TAG_BYTES + 1), DropReason.MALFORMED),  # DONE has no body
        (b"F" + bytes(TAG_BYTES + 1), DropReason.MALFORMED),
        (b"H" + bytes(TAG_BYTES + MAX_HANDSHAKE_BODY + 1), DropReason.MALFORMED),
        (b"A" + bytes(TAG_BYTES + (1 << 20)), DropReason.MALFORMED),
        (b"C" + AUTH.data(0, 0, 1, 2, b"xx")[1:], DropReason.MALFORMED),  # a chunk as a grant
    ],
)
def test_malformed_messages_say_why(data, reason, monkeypatch):
    """Sizes are checked before the tag: a stranger's megabyte costs no copy and no MAC."""
    checked: list[bytes] = []
    real_check = RelayAuth.check

    def check(self, tag, kind, covered):
        checked.append(kind)
        return real_check(self, tag, kind, covered)

    monkeypatch.setattr(RelayAuth, "check", check)
    assert parse_message(data, AUTH) is reason
    assert parse_message(data, RelayAuth(None, SUBJECT)) is reason
    assert checked == []


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize(
    "forged",
    [
        RelayAuth(None, SUBJECT).data(0, 0, 1, 2, b"xx"),  # untagged
        RelayAuth(bytes(32), SUBJECT).data(0, 0, 1, 2, b"xx"),  # another token
        RelayAuth(TOKEN, SUBJECT.replace("fwd", "bwd")).data(0, 0, 1, 2, b"xx"),  # other subject
        RelayAuth(TOKEN, SUBJECT.replace(".2.", ".1.")).credit(1, 5, 5),  # an older attempt's
        _flip(AUTH.data(0, 0, 1, 2, b"xx"), 1 + TAG_BYTES + 7),  # seq 0 -> 1
        _flip(AUTH.data(0, 0, 1, 2, b"xx"), 1 + TAG_BYTES + 15),  # count 1 -> 0
        _flip(AUTH.data(0, 0, 1, 2, b"xx"), 1 + TAG_BYTES + 22),  # frame bytes 2 -> 258
        AUTH.data(0, 0, 1, 2, b"xx")[:-1],  # the chunk cut short
        AUTH.data(0, 0, 1, 2, b"xx") + b"!",  # or extended
        _flip(AUTH.credit(1, 5, 5), len(AUTH.credit(1, 5, 5)) - 1),  # more acknowledged
        _flip(AUTH.credit(1, 5, 5), 1 + TAG_BYTES + 7),  # another serial
        b"R" + AUTH.credit(1, 5, 5)[1:],  # a grant turned into a resend request
        _flip(AUTH.probe(1, 5), len(AUTH.probe(1, 5)) - 1),  # a probe claiming more sent
        _flip(AUTH.message(b"A", b"ok"), 1),  # a damaged tag
        AUTH.message(b"A", b"ok")[:-1],  # a changed body
        b"F" + AUTH.message(b"E")[1:],  # "done" turned into "done seen"
    ],
)
def test_a_message_without_a_valid_tag_is_dropped(forged):
    assert parse_message(forged, AUTH) is DropReason.BAD_TAG


def test_the_tag_covers_the_chunk_header_not_its_bytes():
    """By design (see the module docstring): integrity of the bytes comes from TLS and the
    server's permissions; the tag binds subject, kind, seq, index, count and length."""
    data = AUTH.data(4, 0, 1, 4, b"abcd")
    altered = parse_message(data[:-4] + b"wxyz", AUTH)
    assert isinstance(altered, DataChunk) and bytes(altered.chunk) == b"wxyz"


@pytest.mark.parametrize(
    "message",
    [
        AUTH.message(b"C", bytes(30)),  # a credit of another length
        AUTH.message(b"R", bytes(25)),
        AUTH.message(b"P", bytes(17)),
        AUTH.credit(1, 6, 5),  # grants more than it acknowledges
        AUTH.credit(1, 6, 5, resend=True),
        AUTH.data(0, 3, 3, 10, b"x"),  # index not below count
        AUTH.data(0, 0, 1, 2, b"xyz"),  # a chunk larger than its frame
    ],
)
def test_authentic_messages_that_contradict_themselves_are_malformed(message):
    assert parse_message(message, AUTH) is DropReason.MALFORMED


def test_without_a_token_anything_well_formed_is_taken():
    untagged = RelayAuth(None, SUBJECT)
    assert not untagged.enabled and AUTH.enabled
    assert untagged.data(1, 0, 1, 1, b"x")[1 : 1 + TAG_BYTES] == bytes(TAG_BYTES)
    for message in (untagged.data(1, 0, 1, 1, b"x"), AUTH.data(1, 0, 1, 1, b"x")):
        assert isinstance(parse_message(message, untagged), DataChunk)
    assert parse_message(RelayAuth(bytes(32), SUBJECT).credit(1, 3, 3), untagged) == Credit(1, 3, 3)


@pytest.mark.parametrize("token", [b"short", bytes(15), bytes(65)])
def test_a_token_of_the_wrong_size_is_refused(token):
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        RelayAuth(token, SUBJECT)


def test_parsing_never_raises_on_random_input():
    rng = random.Random(5)
    kinds = b"DCRPHAEFZ"
    for _ in range(2000):
        size = rng.choice([0, 1, 5, 16, 17, 24, 25, 33, 34, 40, 41, 100])
        data = bytes([rng.choice(kinds)]) + rng.randbytes(size)
        assert isinstance(parse_message(data, AUTH), DropReason)
        parse_message(data, RelayAuth(None, SUBJECT))  # any result, never an exception


def test_parts_serialize_from_views_of_any_format():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    empty = np.zeros((0, 4), dtype=np.float32)
    parts = [b"head", memoryview(array), memoryview(array)[::2], bytearray(b"x"), empty]
    back = deserialize_parts(serialize_parts(parts))
    assert [bytes(p) for p in back] == [
        b"head",
        array.tobytes(),
        array[::2].tobytes(),
        b"x",
        b"",
    ]


# --- frames in chunks, and put together again ---------------------------------------------


def _chunks(parts, chunk_bytes: int, seq: int = 0) -> list[DataChunk]:
    """The frame's chunks as the receiver parses them (tagged and checked on the way)."""
    views = frame_views(parts)
    size = sum(v.nbytes for v in views)
    pieces = chunk_frame(views, chunk_bytes)
    out = []
    for index, piece in enumerate(pieces):
        message = AUTH.data(seq + index, index, len(pieces), size, piece)
        chunk = parse_message(message, AUTH)
        assert isinstance(chunk, DataChunk)
        out.append(chunk)
    return out


def test_a_frame_is_chunked_across_its_parts_without_copying_them():
    array = np.arange(3000, dtype=np.float32)  # 12000 bytes
    views = frame_views([b"header", array])
    pieces = chunk_frame(views, 4096)
    assert [sum(p.nbytes for p in piece) for piece in pieces] == [4096, 4096, 20 + 6 + 12000 - 8192]
    assert b"".join(b"".join(piece) for piece in pieces) == serialize_parts([b"header", array])
    # The array's bytes are slices of the array itself, not copies.
    assert all(p.obj is array for piece in pieces for p in piece if p.nbytes > 100)
    assert chunk_frame(frame_views([]), 4096) == [[frame_views([])[0]]]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096, 1 << 20])
def test_every_split_is_put_together_into_one_buffer(chunk_bytes):
    rng = np.random.default_rng(chunk_bytes)
    array = rng.standard_normal((3, 50)).astype(np.float32)
    parts = [b"head", array, b"", bytes(range(256))]
    assembler = FrameAssembler()
    chunks = _chunks(parts, chunk_bytes)
    done = [item for chunk in chunks for item in assembler.add(chunk)]
    assert len(done) == 1 and not assembler.assembling
    [back] = done
    assert [bytes(p) for p in back] == [b"head", array.tobytes(), b"", bytes(range(256))]
    assert np.array_equal(np.frombuffer(back[1], dtype=np.float32).reshape(3, 50), array)
    if len(chunks) == 1:  # one chunk: views of the message itself, no copy at all
        assert back[1].obj is chunks[0].chunk.obj
    else:  # all parts are views of one buffer
        assert len({id(p.obj) for p in back}) == 1


def test_a_frame_over_the_limit_is_never_allocated_and_its_chunks_are_skipped():
    assembler = FrameAssembler(max_frame_bytes=1000)
    huge = AUTH.data(0, 0, 3, 1 << 40, b"x" * 10)
    [error] = assembler.add(parse_message(huge, AUTH))
    assert isinstance(error, FrameError) and "over the limit of 1000" in str(error)
    rest = parse_message(AUTH.data(1, 1, 3, 1 << 40, b"x" * 10), AUTH)
    assert assembler.add(rest) == [] and not assembler.assembling
    [frame] = [item for c in _chunks([b"ok"], 4, seq=2) for item in assembler.add(c)]
    assert [bytes(p) for p in frame] == [b"ok"]


def _chunk(index: int, count: int, size: int, data: bytes) -> DataChunk:
    chunk = parse_message(AUTH.data(index, index, count, size, data), AUTH)
    assert isinstance(chunk, DataChunk)
    return chunk


@pytest.mark.parametrize(
    "chunks",
    [
        [_chunk(0, 2, 10, b"12345"), _chunk(1, 2, 11, b"67890")],  # the size changes
        [_chunk(0, 2, 10, b"12345"), _chunk(1, 3, 10, b"67890")],  # the count changes
        [_chunk(0, 3, 10, b"12345"), _chunk(2, 3, 10, b"67890")],  # an index skipped
        [_chunk(0, 2, 10, b"12345"), _chunk(1, 2, 10, b"6789")],  # the last one short
        [_chunk(0, 2, 10, b"123456"), _chunk(1, 2, 10, b"67890")],  # more than the size
        [_chunk(0, 1, 10, b"12345")],  # one chunk that is not the whole frame
        [_chunk(0, 20, 10, b"1")],  # more chunks than bytes
        [_chunk(0, 2, 10, b"12345"), _chunk(1, 2, 10, b"")],  # an empty chunk
        [_chunk(0, 2, 9, b"12345"), _chunk(1, 2, 9, b"6789")],  # bytes that are no frame
    ],
)
def test_chunks_that_do_not_add_up_fail_their_frame_and_the_next_one_is_taken(chunks):
    assembler = FrameAssembler()
    out = [item for chunk in chunks for item in assembler.add(chunk)]
    assert len(out) == 1 and isinstance(out[0], FrameError), out
    [frame] = [item for c in _chunks([b"next"], 3, seq=9) for item in assembler.add(c)]
    assert [bytes(p) for p in frame] == [b"next"]


def test_a_frame_cut_short_by_a_new_one_fails_and_the_new_one_is_taken():
    assembler = FrameAssembler()
    first = _chunks([b"a" * 100], 32)
    assert assembler.add(first[0]) == [] and assembler.assembling
    out = [item for c in _chunks([b"b" * 100], 32, seq=1) for item in assembler.add(c)]
    assert isinstance(out[0], FrameError) and "cut short" in str(out[0])
    assert [bytes(p) for p in out[1]] == [b"b" * 100]


# --- the tokens in the plans --------------------------------------------------------------


def _plans(transport: Transport, n: int = 3) -> list[StagePlan]:
    placement = Placement(
        stages=[
            PlacedStage(
                stage=i,
                fellow_id=f"f{i}",
                hostname=f"h{i}",
                layer_start=i,
                layer_end=i + 1,
                data_address=f"tcp://h{i}:1",
            )
            for i in range(n)
        ],
        transport=transport,
    )
    spec = JobSpec(model=ModelConfig(n_layers=n), stages=n)
    return stage_plans(job_id="j-1", attempt=2, spec=spec, placement=placement, subject_prefix="s")


@pytest.mark.parametrize("transport", [Transport.AUTO, Transport.TUNNEL])
def test_each_relay_boundary_gets_a_fresh_token_both_neighbours_share(transport):
    plans = _plans(transport)
    assert plans[0].relay_up_token is None and plans[-1].relay_down_token is None
    tokens = [p.relay_down_token for p in plans[:-1]]
    assert tokens == [p.relay_up_token for p in plans[1:]]
    assert len(set(tokens)) == 2 and all(len(bytes.fromhex(t)) == 32 for t in tokens)
    assert not set(tokens) & {p.relay_down_token for p in _plans(transport)[:-1]}
    # A plan travels as JSON (START, the stage's plan file) and keeps its tokens.
    again = msgspec.json.decode(msgspec.json.encode(plans[1]), type=StagePlan)
    assert (again.relay_up_token, again.relay_down_token) == tuple(tokens)


def test_p2p_plans_have_no_relay_token_and_a_bad_token_is_refused():
    assert all(p.relay_up_token is p.relay_down_token is None for p in _plans(Transport.P2P))
    raw = msgspec.to_builtins(_plans(Transport.TUNNEL)[0])
    with pytest.raises(ConfigError, match="relay_down_token"):
        decode_plan(msgspec.json.encode({**raw, "relay_down_token": "not hex"}))
