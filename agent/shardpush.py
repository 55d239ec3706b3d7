"""Shard pushes: a fellow uploads its stage's checkpoints to the leader over NATS.

Each file goes in pieces below NATS's max payload, by request/reply on the fellow's own
``shard.<job>.<fellow>`` subject, in order; the leader answers with the piece it wants next
(so a lost piece, or a leader that restarted and lost a half-received file, makes the fellow
resend from there) and verifies the sha256 at the end. The arrays go first and the JSON last:
a shard is complete on the leader exactly when its JSON is.

Pushes run in the agent's event loop, one at a time, while the stage runtime trains on: they
never stall training. Only the newest periodic push waits its turn; an older one that has not
started yet is dropped (it would be stale by the time it arrived).

Only the lead replica of a job with replicas pushes (replica 0, or the one a ring change made
lead when replica 0 was lost: the export is its pipeline's, and the leader refuses any other
replica's shards): :meth:`ShardPusher.submit` takes no other replica's checkpoint, and
removes one that was written only to be pushed.

A push that fails is given up (the next periodic one may succeed); for a kept one (the final
checkpoint, an operator's) the pusher remembers why, naming the file, so that the stage's
outcome can tell the leader why its export is missing (:meth:`ShardPusher.failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client
from nats.errors import Error as NatsError

from silentswarm import subjects as topics
from silentswarm.agent.errors import FetchError, PushError
from silentswarm.errors import ProtocolError
from silentswarm.protocol import ShardAck, ShardChunk
from silentswarm.retrying import Backoff
from silentswarm.types.manifests import RUN_MANIFEST
from silentswarm.types.signals import InitArgs, InitFile, ResumeArgs, ShardFile

log = logging.getLogger(__name__)
CHUNK_BYTES = 512 * 1024
REQUEST_TIMEOUT_S = 10.0
# A piece the leader does not answer (or answers unreadably) is offered again, at most
# PIECE_ATTEMPTS times, after 1 s doubling up to 5 s (no jitter); a refusal is final.
PIECE_ATTEMPTS = 6
PIECE_RETRY_ON = (NatsError, TimeoutError, ProtocolError)
PIECE_RETRIES = Backoff(wait_initial=1.0, wait_max=5.0, attempts=PIECE_ATTEMPTS)
FAILURES_KEPT = 32  # the failed kept pushes remembered (by job, attempt and step)


@dataclass(frozen=True)
class Shard:
    job_id: str
    attempt: int
    stage: int
    step: int
    directory: Path  # the checkpoint's step directory
    replica: int = 0  # the pipeline the stage is of (a job with replicas)
    # Whether its checkpoints are the job's: replica 0's, or (elastic membership) the
    # replica a ring change made the lead; only a lead pushes.
    lead: bool = True
    periodic: bool = False  # written only to be pushed: removed here once a newer one is
    # The connection to push on: the attempt's own NATS user; None: the pusher's own.
    client: Client | None = None

    def files(self) -> list[Path]:
        return [
            self.directory / f"stage-{self.stage}.npz",
            self.directory / f"stage-{self.stage}.json",
        ]


class ShardPusher:
    def __init__(self, nc: Client, prefix: str, fellow_id: str) -> None:
        self.nc = nc
        self.prefix = prefix
        self.fellow_id = fellow_id
        self._queue: list[Shard] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._periodic: dict[str, Path] = {}  # job -> the pushed periodic checkpoint kept
        self._kept: set[Path] = set()  # checkpoints someone asked for: never removed
        # (job, attempt, step) -> why the last push of that kept checkpoint failed.
        self._failures: OrderedDict[tuple[str, int, int], str] = OrderedDict()

    def failure(self, job_id: str, attempt: int, step: int) -> str | None:
        """Why the latest push of a kept checkpoint failed; None: it succeeded (or never ran)."""
        return self._failures.get((job_id, attempt, step))

    def submit(self, shard: Shard) -> bool:
        """Queue a push; a periodic one replaces older periodic ones still waiting. False,
        and nothing queued, for a replica that does not lead (its periodic checkpoint
        removed)."""
        if not shard.lead:
            log.info(
                "job %s stage %d step %d: replica %d pushes no shards (the lead replica does)",
                shard.job_id,
                shard.stage,
                shard.step,
                shard.replica,
            )
            if shard.periodic:
                shutil.rmtree(shard.directory, ignore_errors=True)
            return False
        if not shard.periodic:
            self._kept.add(shard.directory)
        else:
            self._queue = [s for s in self._queue if not (s.periodic and s.job_id == shard.job_id)]
        self._queue.append(shard)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="shard-push")
        return True

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued push is done (or given up); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while self._queue:
            shard = self._queue.pop(0)
            key = (shard.job_id, shard.attempt, shard.step)
            try:
                await self.push(shard)
            except Exception as exc:  # a push is best effort: the next one may succeed
                log.warning(
                    "push of job %s stage %d step %d failed: %s",
                    shard.job_id,
                    shard.stage,
                    shard.step,
                    exc,
                )
                if not shard.periodic:
                    self._failures[key] = str(exc) or type(exc).__name__
                    self._failures.move_to_end(key)
                    while len(self._failures) > FAILURES_KEPT:
                        self._failures.popitem(last=False)
            else:
                if shard.periodic:
                    self._forget_older(shard)
                else:
                    self._failures.pop(key, None)
        self._idle.set()

    def _forget_older(self, shard: Shard) -> None:
        """The leader has this periodic checkpoint: the one pushed before is not needed here."""
        older = self._periodic.get(shard.job_id)
        self._periodic[shard.job_id] = shard.directory
        if older is not None and older != shard.directory and older not in self._kept:
            shutil.rmtree(older, ignore_errors=True)

    async def push(self, shard: Shard) -> None:
        """Send the shard's files, arrays first; PushError naming the file on failure."""
        for path in shard.files():
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except OSError as exc:
                raise PushError(f"cannot read {path}: [Errno {exc.errno}] {exc.strerror}") from None
            try:
                await self._send_file(shard, path.name, data)
            except PushError as exc:
                raise PushError(f"cannot push {path}: {exc}") from None
        log.info(
            "pushed job %s stage %d step %d to the leader", shard.job_id, shard.stage, shard.step
        )

    async def _send_file(self, shard: Shard, name: str, data: bytes) -> None:
        nc = shard.client or self.nc
        digest = hashlib.sha256(data).hexdigest()
        chunk = max(1024, min(CHUNK_BYTES, nc.max_payload - 1024))
        total = max(1, -(-len(data) // chunk))
        subject = topics.SHARD.subject(self.prefix, job=shard.job_id, fellow=self.fellow_id)
        seq = 0
        while True:
            piece = ShardChunk(
                job_id=shard.job_id,
                fellow_id=self.fellow_id,
                attempt=shard.attempt,
                stage=shard.stage,
                step=shard.step,
                name=name,
                size=len(data),
                sha256=digest,
                seq=seq,
                total=total,
                data=data[seq * chunk : (seq + 1) * chunk],
            )
            try:
                ack = await offer(nc, subject, piece)
            except PIECE_RETRY_ON as exc:
                raise PushError(f"the leader did not take piece {seq}: {exc}") from None
            if ack.done:
                return
            if not ack.ok and ack.next_seq == seq:
                raise PushError(f"the leader refused it: {ack.message}")
            seq = ack.next_seq


async def offer(nc: Client, subject: str, piece: ShardChunk) -> ShardAck:
    """The leader's answer to one piece, asked again (PIECE_RETRIES) while it gives none or
    an unreadable one; the last error once the tries are spent."""
    async for attempt in PIECE_RETRIES.context(on=PIECE_RETRY_ON):
        with attempt:
            reply = await nc.request(subject, topics.encode(piece), timeout=REQUEST_TIMEOUT_S)
            ack = topics.SHARD.decode_reply(reply.data)
    return ack


# The header the leader takes a shard download's token from (leader/exports.py's TOKEN_HEADER).
SHARD_TOKEN_HEADER = "X-Swarm-Shard-Token"


def fetch_shard(resume: ResumeArgs, directory: Path) -> Path:
    """Download a resumed stage's shard files (START's ``resume``) into ``directory``, each
    checked against its sha256; the checkpoint's JSON path. Runs in a thread."""
    names = fetch_files(resume.files, resume.token, directory)
    json_names = [name for name in names if name.endswith(".json")]
    if not json_names:
        raise FetchError("START named no checkpoint JSON to resume from")
    return directory / json_names[-1]


def fetch_init(init: InitArgs, directory: Path) -> Path:
    """Download the export files a job starts from (START's ``init``) into ``directory``,
    each checked against its sha256; the directory. Runs in a thread."""
    if RUN_MANIFEST not in fetch_files(init.files, init.token, directory):
        raise FetchError(f"START named no {RUN_MANIFEST} of the export to start from")
    return directory


def fetch_files(files: Sequence[ShardFile | InitFile], token: str, directory: Path) -> list[str]:
    """Download ``files`` with the stage's download ``token`` into ``directory``, each checked
    against its sha256 (FetchError otherwise); their names."""
    import httpx

    directory.mkdir(parents=True, exist_ok=True)
    # In a header, never in the URL: URLs get logged (by httpx at INFO, proxies, the leader).
    headers = {SHARD_TOKEN_HEADER: token}
    names = []
    for entry in files:
        name = entry.name
        if "/" in name or not (name.startswith("stage-") or name == RUN_MANIFEST):
            raise FetchError(f"the leader named an odd file {name!r}")
        try:
            response = httpx.get(entry.url, headers=headers, timeout=300)
        except httpx.HTTPError as exc:
            raise FetchError(f"cannot download {name}: {exc}") from None
        if response.status_code != 200:
            raise FetchError(
                f"cannot download {name}: HTTP {response.status_code} {response.text[:200]}"
            )
        digest = hashlib.sha256(response.content).hexdigest()
        if digest != entry.sha256:
            raise FetchError(f"{name}: sha256 {digest} is not the leader's {entry.sha256}")
        (directory / name).write_bytes(response.content)
        names.append(name)
    return names
