"""swarm.redact: every secret shape goes, ordinary log lines stay as they are."""

from __future__ import annotations

import logging
import time

import pytest

from silentswarm.agent.logship import MESSAGE_CHARS, FellowLogShipper
from silentswarm.natsauth import Permissions, creds_text, new_seed, public_key, user_jwt
from silentswarm.redact import REDACTED, redact

SEED = new_seed("user")
ACCOUNT = new_seed("account")
JWT = user_jwt(ACCOUNT, public_key(SEED), "fellow-1", Permissions(["a.>"], ["b.>"]))
PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "-----END OPENSSH PRIVATE KEY-----"
)
HEX = "9f" * 32  # an HMAC-shaped value, e.g. a shard token

REDACTED_CASES = [
    # (log line, what it must become)
    (
        f"HTTP Request: GET http://l:1/api/v1/jobs/j/shards/40/stage-0.npz?token={HEX} 200",
        f"HTTP Request: GET http://l:1/api/v1/jobs/j/shards/40/stage-0.npz?token={REDACTED} 200",
    ),
    (f"/x?a=1&access_token={HEX}&b=2", f"/x?a=1&access_token={REDACTED}&b=2"),
    ("/ws?ticket=abc.def-ghi", f"/ws?ticket={REDACTED}"),
    ("secret=hunter2 step=3", f"secret={REDACTED} step=3"),
    ("SWARM_API_TOKEN=s3cr3t", f"SWARM_API_TOKEN={REDACTED}"),
    (
        "SWARM_ENROLL_TOKEN=abc SWARM_NATS_URL=nats://h:4222",
        f"SWARM_ENROLL_TOKEN={REDACTED} SWARM_NATS_URL=nats://h:4222",
    ),
    ("pip --password=pw --index x", f"pip --password={REDACTED} --index x"),
    (f"Authorization: Bearer {HEX}", f"Authorization: Bearer {REDACTED}"),
    (
        "headers={'authorization': 'bearer abc.def'}",
        f"headers={{'authorization': 'bearer {REDACTED}'}}",
    ),
    ("Authorization: Basic dXNlcjpwYXNz", f"Authorization: Basic {REDACTED}"),
    (f"X-Swarm-Shard-Token: {HEX}", f"X-Swarm-Shard-Token: {REDACTED}"),
    ("Cookie: session=abc", f"Cookie: {REDACTED}"),
    (f"claimed: {JWT}", f"claimed: {REDACTED}"),
    (f"cut off: {JWT[:40]}", f"cut off: {REDACTED}"),
    (f"seed {SEED} loaded", f"seed {REDACTED} loaded"),
    (f"account {ACCOUNT}", f"account {REDACTED}"),
    (f"key:\n{PEM}\nafter", f"key:\n{REDACTED}\nafter"),
    (f"cut: {PEM[:60]}", f"cut: {REDACTED}"),
    (
        '{"secret": "tok-123", "fellow_name": "f1", "token": "a\\"b"}',
        f'{{"secret": "{REDACTED}", "fellow_name": "f1", "token": "{REDACTED}"}}',
    ),
    ("{'nats_creds': 'x\\ny'}", f"{{'nats_creds': '{REDACTED}'}}"),
    ("pip: https://user:pa55@mirror/simple", f"pip: https://user:{REDACTED}@mirror/simple"),
]

KEPT = [
    "step 40 loss 2.31 tok/s 8546",
    "max_new_tokens=40 tokens=1234",  # plural: a count, not a credential
    "the shard token is invalid (SHARD_TOKEN_INVALID)",
    f"package sha256 {HEX} verified",
    "fellow fellow-1 registered at nats://127.0.0.1:4222",
    "KeyError: 'layer_start'",
    "",
]


# Named by what they become: the lines hold fresh random keys, and test ids must be the same in
# every collection (pytest-xdist's workers collect separately).
@pytest.mark.parametrize(
    ("line", "expected"), REDACTED_CASES, ids=[expected[:60] for _, expected in REDACTED_CASES]
)
def test_secret_shapes_are_redacted(line, expected):
    assert redact(line) == expected


def test_a_whole_creds_file_keeps_nothing_secret():
    text = redact(creds_text(JWT, SEED))
    assert JWT not in text and SEED not in text
    assert all(part not in text for part in JWT.split(".") if len(part) > 8)


@pytest.mark.parametrize("line", KEPT)
def test_ordinary_lines_are_kept_as_they_are(line):
    assert redact(line) == line


def test_redacting_is_cheap_on_ordinary_lines():
    line = "2026-12-01 10:00:00 INFO    agent.runner: job j1 stage 0 step 120 loss 2.1834 " * 2
    assert redact(line) is line  # the pre-check answered: no pattern ran
    start = time.perf_counter()
    for _ in range(20_000):
        redact(line)
    per_line = (time.perf_counter() - start) / 20_000
    assert per_line < 50e-6, f"{per_line * 1e6:.1f} us per line"


def test_the_log_shipper_buffers_only_redacted_records():
    shipper = FellowLogShipper("f")
    logger = logging.getLogger("test.redact.httpx")
    logger.addHandler(shipper)
    logger.setLevel(logging.INFO)
    try:
        logger.info('HTTP Request: GET %s?token=%s "HTTP/1.1 200 OK"', "http://l/x", HEX)
        logger.info("creds: %s", creds_text(JWT, SEED))
    finally:
        logger.removeHandler(shipper)
    shipper.add("INFO", "stage", f"Authorization: Bearer {HEX}")  # a runtime output line
    # A secret that straddles the cut is redacted before the cut, not half kept.
    shipper.add("INFO", "big", "x" * (MESSAGE_CHARS - 20) + f" {JWT}")
    messages = [r.message for r in shipper.take()]
    assert messages[0] == f'HTTP Request: GET http://l/x?token={REDACTED} "HTTP/1.1 200 OK"'
    assert all(HEX not in m and SEED not in m and JWT[:30] not in m for m in messages)
    assert messages[2] == f"Authorization: Bearer {REDACTED}"
    assert messages[3].endswith(f" {REDACTED}") and len(messages[3]) <= MESSAGE_CHARS


def test_http_client_loggers_log_no_request_urls_at_any_level():
    from silentswarm.entry import QUIET_HTTP_LOGGERS, quiet_http_clients

    loggers = [logging.getLogger(name) for name in QUIET_HTTP_LOGGERS]
    before = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.DEBUG)
        quiet_http_clients()  # what configure_logging does in swarm-agent and swarm-stage
        assert [logger.getEffectiveLevel() for logger in loggers] == [logging.WARNING] * 2
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)
