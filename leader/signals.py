"""SignalHub: signals to fellows over NATS request/reply, acknowledged, retried, recorded.

Every signal gets an id that stays the same across retries, so a fellow that got the first
try but whose answer was lost recognises the retry and answers it as a duplicate instead
of acting twice. A try that gets no answer (no responders, timeout) is retried with
backoff until the deadline (stamina); the outcome, acknowledged or not, is returned as a record.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from nats.aio.client import Client
from nats.errors import Error as NatsError

from silentswarm import subjects as topics
from silentswarm.errors import ErrorCode, ProtocolError
from silentswarm.leader.jobs import clean_report
from silentswarm.protocol import SignalAck, make_signal
from silentswarm.retrying import Backoff
from silentswarm.types.jobs import SignalRecord
from silentswarm.types.signals import SignalArgs

log = logging.getLogger(__name__)

TRY_TIMEOUT_S = 2.0
# A try that gets no answer (no responders, a timeout) or an unreadable one is tried again,
# after 0.1 s doubling up to 1 s (no jitter: one leader, a handful of fellows), until the
# deadline; any other error is a bug and is raised.
RETRY_ON = (NatsError, TimeoutError, ProtocolError)
ACK_MESSAGE_SHOWN = 1024  # of a fellow's words on a refusal, what its job's record keeps
CODE_CHARS = 64
RETRIES = Backoff(wait_initial=0.1, wait_max=1.0)  # the deadline ends them (asyncio.timeout)


def new_signal_id() -> str:
    return uuid.uuid4().hex[:16]


class SignalHub:
    def __init__(self, nc: Client, *, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix

    async def send(
        self,
        fellow_id: str,
        args: SignalArgs,
        *,
        job_id: str | None = None,
        attempt: int | None = None,
        deadline_s: float = 8.0,
    ) -> SignalRecord:
        """Send the signal that carries ``args`` (its kind follows from their type)."""
        sig = make_signal(args, signal_id=new_signal_id(), job_id=job_id, attempt=attempt)
        kind = sig.kind
        subject = topics.SIGNAL.subject(self.prefix, fellow=fellow_id)
        payload = topics.encode(sig)
        sent_at = time.time()
        tries, last_error = 0, "no answer (TimeoutError)"
        try:
            # The deadline bounds the whole: a try or a backoff still running then is cut.
            async with asyncio.timeout(deadline_s):
                async for try_ in RETRIES.context(on=RETRY_ON):
                    with try_:
                        tries = try_.num
                        try:
                            msg = await self.nc.request(subject, payload, timeout=TRY_TIMEOUT_S)
                            ack = topics.SIGNAL.decode_reply(msg.data)
                        except RETRY_ON as exc:
                            last_error = why_unanswered(exc)
                            raise
        except RETRY_ON:
            log.warning("%s -> %s: %s after %d tries", kind.value, fellow_id, last_error, tries)
            return SignalRecord(
                signal_id=sig.signal_id,
                kind=kind.value,
                fellow_id=fellow_id,
                sent_at=sent_at,
                attempts=tries,
                ok=False,
                code=ErrorCode.NO_ANSWER,
                message=f"{last_error} after {tries} tries",
            )
        record = answered(
            ack,
            signal_id=sig.signal_id,
            fellow_id=fellow_id,
            kind=kind.value,
            sent_at=sent_at,
            attempts=tries,
        )
        log.info(
            "%s %s -> %s: %s%s",
            kind.value,
            sig.signal_id,
            fellow_id,
            "ok" if record.ok else f"refused ({record.code}: {record.message})",
            f" after {tries} tries" if tries > 1 else "",
        )
        return record


def answered(
    ack: SignalAck,
    *,
    signal_id: str,
    fellow_id: str,
    kind: str,
    sent_at: float,
    attempts: int,
) -> SignalRecord:
    """The record of ``fellow_id``'s answer to signal ``signal_id`` (of ``kind``, first sent
    at ``sent_at``, in ``attempts`` tries): the ids are the leader's,
    never the answer's (a stranger's answer naming another fellow must not count against
    that one), and an answer naming another signal or fellow is a refusal by this one. The
    fellow's code and words are cleaned to show."""
    ok, code = ack.ok, None if ack.code is None else clean_report(ack.code, CODE_CHARS)
    message = clean_report(ack.message, ACK_MESSAGE_SHOWN)
    if (ack.signal_id, ack.fellow_id) != (signal_id, fellow_id):
        ok, code = False, ErrorCode.PROTOCOL_ERROR
        message = clean_report(
            f"answered signal {ack.signal_id!r} as {ack.fellow_id!r}", ACK_MESSAGE_SHOWN
        )
    return SignalRecord(
        signal_id=signal_id,
        fellow_id=fellow_id,
        ok=ok,
        code=code,
        message=message,
        duplicate=ack.duplicate,
        kind=kind,
        sent_at=sent_at,
        attempts=attempts,
    )


def why_unanswered(exc: BaseException) -> str:
    """A failed try in words: no answer (no responders, a timeout) or an unreadable one."""
    if isinstance(exc, ProtocolError):
        return f"unreadable answer: {exc}"
    return f"no answer ({type(exc).__name__})"
