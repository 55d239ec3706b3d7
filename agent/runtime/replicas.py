"""Replicas: the ring that keeps a stage's replicas in sync (a job's ``replicas`` > 1).

The replicas of one stage form a ring over the data plane: replica ``r`` connects to
``(r + 1) % k`` and accepts from ``(r - 1) % k`` (the plan's ring; see elastic membership
below for the others), over ZeroMQ or the NATS relay like a
pipeline boundary (the same link factory, handshake and fingerprint). A *round* is an
all-gather of every member's contribution around the ring: each member sends its own to its
successor and forwards what comes from its predecessor unless the successor sent it (k - 1
hops), so every member ends the round holding the same set. Each member then applies the same
pure rules (:func:`clip_contributions`, :func:`average`) to that set, in origin order, so the
averages agree bit for bit.

A contribution is one wire frame (:func:`~silentswarm.agent.pipe.wire.encode_frame`, phase
``"sync"``, ``step`` the round, ``micro`` the origin replica) of a flat float32 vector laid out
by :func:`pack` as rows of :data:`ROW` values, each variable padded to whole rows (so the
int8 codec's per-row scales never span two variables). Every member uses the *decoded* value
of every contribution, its own included, so a lossy codec changes no member's view.

What a member does with a received frame:

- another job or attempt: dropped and counted (as on a boundary);
- an older round: dropped (a late member's contribution the others already left out);
- a later round (up to :data:`MAX_ROUNDS_AHEAD` ahead, one per origin): kept for that
  round, and the current one ends: the predecessor has moved on, so nothing more of this
  round can come through it; further ahead (this member is far behind): dropped as stale;
- one that does not decode, a phase other than ``sync``, an origin that is no member, this
  member itself or already seen, another shape, unsigned in a ring that signs: dropped,
  logged and counted as clipped (``sync_clipped``). The links carry only the placed peers'
  frames, so such a frame is a bug or an attack, and it costs that contribution, not the
  member: were it fatal, a hostile predecessor could end its honest successor and have its
  replica dropped.

A member whose contribution has not arrived within ``sync_timeout_s`` is left out of the
round and counted (``sync_missed``); the round averages over those present. In a ring of
three or more a stalled member also stops what it would have forwarded, so the members
may then hold different sets for that round: the cost of a ring's low traffic, which a
later round does not repair; the next ring change does (see below).

**Elastic membership.** The ring has a membership: epoch 0 is the plan's (every replica
``0..n_replicas - 1``); a :class:`~silentswarm.plan.RingChange` (the leader's ``ring``
command) makes another, ``members`` in ring order (each sends to the next member, the last to
the first). Rounds expect the current members only. :meth:`ReplicaSync.switch` closes the old
links (no DONE: the old ring is gone) and opens the new ones from the change's peers, CURVE
keys and relay tokens, as :meth:`ReplicaSync.open` does from the plan; a ring of one member has
no links, and its rounds return its own contribution. :meth:`ReplicaSync.hand_over` then moves
the donor's state once around the new ring, lossless (codec ``none``), as one frame of phase
``state`` (``step`` the epoch, ``micro`` the donor): each member forwards it unless its
successor is the donor. A state is any list of arrays, each laid out by :func:`pack_state`
(its bytes as float32 words, so integers such as the optimizer's step count travel
exactly); :func:`state_digest` is what every member reports, and :func:`relative_distance`
what a member checks the donor's weights with (above :data:`MAX_DONOR_DISTANCE`: refused).

The math is pure numpy (:func:`pack`, :func:`unpack`, :func:`clip_contributions`,
:func:`average`, :func:`nesterov_step`, :func:`pack_state`, :func:`unpack_state`,
:func:`state_digest`, :func:`relative_distance`); no TensorFlow here. The ring order
(:func:`~silentswarm.rings.next_member`, :func:`~silentswarm.rings.prev_member`) is the
leader's too, in :mod:`silentswarm.rings`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from silentswarm import subjects
from silentswarm.agent.errors import (
    ForwardRefusedError,
    FrameError,
    LinkError,
    PeerTimeoutError,
    RelayGapError,
    SlowReceiverError,
    SuccessorStalledError,
)
from silentswarm.agent.pipe.base import Parts
from silentswarm.agent.pipe.link import (
    CurveKeys,
    Link,
    RelayLink,
    TransportKind,
    accept_upstream,
    connect_downstream,
)
from silentswarm.agent.pipe.relay import DROP_LOG_EVERY_S, MAX_FRAME_BYTES
from silentswarm.agent.pipe.wire import (
    Direction,
    Frame,
    FrameHeader,
    decode_frame,
    encode_frame,
    frame_header,
)
from silentswarm.agent.runtime.ring_signing import RingSigner
from silentswarm.compression import parse_wire_codec
from silentswarm.plan import CurveKeys as PlanCurveKeys
from silentswarm.plan import RingChange, StagePlan, SyncRing
from silentswarm.rings import next_member, prev_member
from silentswarm.throttle import Throttle

log = logging.getLogger(__name__)

ROW = 64  # values per row of a contribution (one int8 scale per row: 3% more bytes)
PHASE = "sync"
# How long a member waits at least for its ring peers' first HELLO: as for a boundary, a
# peer's stage 0 may still be preparing its data (see stage.FIRST_HELLO_S).
FIRST_HELLO_S = 900.0

# A member that had state of its own refuses a donor whose weights are farther than this from
# its own (relative L2 distance): the replicas are in sync right after an allreduce step (and
# right after DiLoCo's outer step), so a far-off state is a broken or hostile donor.
MAX_DONOR_DISTANCE = 0.05
# How many rounds ahead of its own a member keeps its predecessor's frames (one per origin):
# a predecessor that moved on while this member stalled is a few rounds ahead at most; a
# frame further ahead is dropped, so a hostile one cannot fill this member's memory.
MAX_ROUNDS_AHEAD = 8
# The same for the rest of a member's float state (AdamW's moments, DiLoCo's outer momentum):
# moments follow the latest gradients, so replicas that missed a round differ more there.
MAX_STATE_DISTANCE = 1.0
# The least time a sync frame's send gets, however little of its round is left.
MIN_SEND_S = 1.0
# How long a joining stage waits for the ring command that lists it as joining, and then for
# the running members to reach its step (its new ring's links and the donor's state); the
# running members wait peer_timeout_s for theirs.
JOIN_TIMEOUT_S = 600.0
# How long re-binding the sync address may keep failing with "address in use" after the old
# ring's socket was closed (ZeroMQ closes a listener in its I/O thread, a moment later).
BIND_RETRY_S = 10.0
STATE_PHASE = "state"
NO_CODEC = parse_wire_codec("none")  # the state travels lossless, whatever sync_compression

RelayOpener = Callable[[], RelayLink]


def ring_send_queue(k: int) -> int:
    """How many sync frames a p2p ring link queues for a successor that reads none: the
    frames of the :data:`MAX_ROUNDS_AHEAD` rounds it may be behind (``k - 1`` a round), and
    one more. ZeroMQ's default, 1,000 whole contributions, would let a successor that stays
    connected but never reads grow its honest predecessor's memory until it is killed."""
    return MAX_ROUNDS_AHEAD * max(1, k - 1) + 1


# --- pure math --------------------------------------------------------------------------------


def layout_rows(shapes: Sequence[tuple[int, ...]]) -> int:
    """Rows of :data:`ROW` values that :func:`pack` lays ``shapes`` out in."""
    return sum(-(-math.prod(shape) // ROW) for shape in shapes)


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` as one float32 matrix of :data:`ROW` columns, each array flattened and
    padded with zeros to whole rows."""
    shapes = [tuple(a.shape) for a in arrays]
    out = np.zeros((layout_rows(shapes), ROW), dtype=np.float32)
    flat = out.reshape(-1)
    row = 0
    for a in arrays:
        n = a.size
        flat[row * ROW : row * ROW + n] = np.asarray(a, dtype=np.float32).reshape(-1)
        row += -(-n // ROW)
    return out


def unpack(matrix: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """The inverse of :func:`pack`: arrays of ``shapes`` (copies)."""
    flat = np.asarray(matrix, dtype=np.float32).reshape(-1)
    out, row = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[row * ROW : row * ROW + n].reshape(shape).copy())
        row += -(-n // ROW)
    return out


@dataclass(frozen=True)
class Clipped:
    """What :func:`clip_contributions` kept (by origin) and how many it changed."""

    kept: dict[int, np.ndarray]
    clipped: int


def _norm(vector: np.ndarray) -> float:
    """The L2 norm of ``vector`` through BLAS in float32, with no float64 copy: every member
    computes it from the same bits, and a bound ``ratio`` times a median needs no more than
    float32's precision. A vector whose squares overflow float32 (values near 1e19) counts as
    not finite, as its NaN or infinite cousins do."""
    flat = vector.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return math.sqrt(float(np.dot(flat, flat))) if flat.size else 0.0


def clip_contributions(vectors: Mapping[int, np.ndarray], ratio: float) -> Clipped:
    """Scale down every contribution whose L2 norm is above ``ratio`` times the median of
    the *other* contributions' norms to that bound; leave out one that is not finite.

    Each bound comes from the norms as received (not as clipped), so the result does not
    depend on the order; a lone contribution has no others to compare with and is kept as it
    is. Both a scaled and a left-out contribution count as clipped.
    """
    norms = {o: _norm(v) for o, v in vectors.items()}
    finite = {o: n for o, n in norms.items() if math.isfinite(n)}
    kept: dict[int, np.ndarray] = {}
    clipped = len(norms) - len(finite)
    for origin in sorted(finite):
        vector, norm = vectors[origin], finite[origin]
        others = [n for o, n in finite.items() if o != origin]
        if others and norm > 0:
            bound = ratio * statistics.median(others)
            if norm > bound:
                vector = vector * np.float32(bound / norm)
                clipped += 1
        kept[origin] = vector
    return Clipped(kept=kept, clipped=clipped)


def average(vectors: Mapping[int, np.ndarray]) -> np.ndarray:
    """The mean of ``vectors``, summed in origin order (every member gets the same bits)."""
    if not vectors:
        raise ValueError("nothing to average")
    first, *rest = sorted(vectors)
    total = np.array(vectors[first], dtype=np.float32)
    for origin in rest:
        total += vectors[origin]
    total /= np.float32(len(vectors))
    return total


def nesterov_step(
    anchor: np.ndarray, momentum: np.ndarray, delta: np.ndarray, *, lr: float, mu: float
) -> tuple[np.ndarray, np.ndarray]:
    """DiLoCo's outer step: SGD with Nesterov momentum on the pseudo-gradient ``delta``
    (anchor minus weights, averaged), as ``torch.optim.SGD(nesterov=True)`` does it:
    ``b = mu * b + delta``; ``anchor -= lr * (delta + mu * b)``. Returns (anchor, b)."""
    momentum = np.float32(mu) * momentum + delta
    return anchor - np.float32(lr) * (delta + np.float32(mu) * momentum), momentum


def _words(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes as float32 words (the last padded with zero bytes): a float32 array
    as it is, any other dtype bit for bit."""
    a = np.ascontiguousarray(array)
    if a.dtype == np.float32:
        return a.reshape(-1)
    raw = a.tobytes()
    raw += b"\0" * (-len(raw) % 4)
    return np.frombuffer(raw, dtype=np.float32)


def _n_words(shape: Sequence[int], dtype: np.dtype) -> int:
    return -(-math.prod(shape) * np.dtype(dtype).itemsize // 4)


StateSpec = tuple[tuple[int, ...], np.dtype]  # one array of a state: its shape and dtype


def state_rows(specs: Sequence[StateSpec]) -> int:
    """Rows of :data:`ROW` values :func:`pack_state` lays a state of ``specs`` out in."""
    return layout_rows([(_n_words(shape, dtype),) for shape, dtype in specs])


def pack_state(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """A state (any dtypes) as :func:`pack` lays out float32 arrays: each array's bytes as
    float32 words, padded to whole rows. Lossless: :func:`unpack_state` gives the same bits."""
    return pack([_words(a) for a in arrays])


def unpack_state(matrix: np.ndarray, specs: Sequence[StateSpec]) -> list[np.ndarray]:
    """The inverse of :func:`pack_state`: arrays of ``specs`` (shape, dtype), bit for bit."""
    words = unpack(matrix, [(_n_words(shape, dtype),) for shape, dtype in specs])
    out = []
    for w, (shape, dtype) in zip(words, specs, strict=True):
        dtype = np.dtype(dtype)
        if dtype == np.float32:
            out.append(w.reshape(shape))
            continue
        n = math.prod(shape)
        out.append(np.frombuffer(w.tobytes(), dtype=dtype, count=n).reshape(shape).copy())
    return out


def state_digest(matrix: np.ndarray) -> str:
    """The sha256 (hex) of a packed state's bytes: what every member of a new ring reports."""
    return hashlib.sha256(np.ascontiguousarray(matrix, dtype=np.float32).tobytes()).hexdigest()


def relative_distance(theirs: Sequence[np.ndarray], ours: Sequence[np.ndarray]) -> float:
    """``|theirs - ours| / |ours|`` over all the arrays together (L2, float64); the absolute
    distance when ``ours`` is all zeros; inf for another layout or a non-finite value."""
    if len(theirs) != len(ours) or any(
        np.shape(a) != np.shape(b) for a, b in zip(theirs, ours, strict=True)
    ):
        return math.inf
    diff = own = 0.0
    for a, b in zip(theirs, ours, strict=True):
        a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        diff += float(np.sum(np.square(a64 - b64)))
        own += float(np.sum(np.square(b64)))
    distance = math.sqrt(diff) / (math.sqrt(own) if own > 0 else 1.0)
    return distance if math.isfinite(distance) else math.inf


# The absolute slack of donor_refusal's moment bound: gradients below ~1e-21 leave a float32
# second moment at exactly 0 (g * g * 0.001 underflows) while the first is not; a first moment
# this small moves a weight by at most alpha * TINY / epsilon (Keras's 1e-7): 1e-5 of a step.
TINY = 1e-12


def adam_moment_bound(beta_1: float, beta_2: float) -> float:
    """How far AdamW's first moment can ever be from its second's square root, elementwise
    (``|m| <= bound * sqrt(v)``, by Cauchy-Schwarz over the two running means of the same
    gradients), with a 10% margin for rounding; inf where ``beta_1 ** 2 >= beta_2`` (no
    bound). 8.0 at Keras's 0.9 and 0.999."""
    if beta_1**2 >= beta_2:
        return math.inf
    return 1.1 * (1 - beta_1) / math.sqrt((1 - beta_2) * (1 - beta_1**2 / beta_2))


def position_refusal(epoch: int, index: int) -> str | None:
    """Why a joiner refuses the data position ``(epoch, index)`` its donor handed over as the
    donor's doing (None: it may take it): nothing negative. An index beyond the joiner's own
    dataset is not refused here: the joiner reads its data from its own host, so that may be
    the joiner's dataset, not the donor's word (a RingChangeError, which costs the joiner
    alone). The epoch has no upper bound: every replica reads the whole batch's rows of a
    dataset whose size only the hosts know, and an epoch far ahead only reorders the data.
    Pure."""
    if epoch < 0 or index < 0:
        return f"data position ({epoch}, {index}) is negative"
    return None


def donor_refusal(
    theirs: Sequence[np.ndarray],
    own: Sequence[np.ndarray] | None,
    *,
    n_weights: int,
    moments: Sequence[tuple[int, int]] = (),
    anchors: Sequence[tuple[int, int]] = (),
    moment_bound: float = math.inf,
    counts: Sequence[int] = (),
    steps_done: int | None = None,
) -> str | None:
    """Why a member refuses a donor's ring state ``theirs`` (None: it takes it).

    ``own`` is the member's own state in the same layout, None for a joining stage (nothing
    to compare). The first ``n_weights`` arrays are the weights, ``moments`` the positions of
    AdamW's ``(first, second)`` moments, ``anchors`` ``(DiLoCo anchor, its weight)``
    positions. Every value must be finite, no second moment negative and no first moment
    beyond ``moment_bound`` times its second's square root (:func:`adam_moment_bound`):
    a forged second moment would otherwise turn every weight NaN or huge at the next step,
    however close the state is overall. A joiner's anchors lie within
    :data:`MAX_DONOR_DISTANCE` of the donor's weights (a change comes right after an outer
    step, where they are equal). A member checks each class against its own: the weights
    and the anchors within :data:`MAX_DONOR_DISTANCE`, the rest of the float state (the
    moments, the outer momentum) within :data:`MAX_STATE_DISTANCE`, the integer state (the
    optimizer's step count) equal. Whoever takes it, the optimizer's step count (at the
    positions ``counts``) lies between 0 and ``steps_done`` (the steps the job has trained
    when the state changes hands; None: unbounded): AdamW divides by
    ``1 - beta ** (count + 1)``, which a count of -1 makes 0, and a joiner has no count of
    its own to compare. Pure."""
    bad = sum(1 for a in theirs if a.dtype.kind == "f" and not np.isfinite(a).all())
    if bad:
        return f"{bad} of its arrays hold values that are not finite"
    high = math.inf if steps_done is None else steps_done
    if any(theirs[i].size and (theirs[i].min() < 0 or theirs[i].max() > high) for i in counts):
        return (
            f"its optimizer's step count is outside 0 to {high} (the steps done when the "
            "state changes hands)"
        )
    for first, second in moments:
        m, v = theirs[first], theirs[second]
        if (v < 0).any():
            return "its optimizer's second moments hold negative values"
        if math.isfinite(moment_bound) and (np.abs(m) > moment_bound * np.sqrt(v) + TINY).any():
            return (
                f"its optimizer's first moments exceed {moment_bound:.3g} times the square "
                "root of their second moments (no AdamW state does)"
            )
    anchor_at = [a for a, _ in anchors]
    if own is None:
        distance = relative_distance(
            [theirs[a] for a in anchor_at], [theirs[w] for _, w in anchors]
        )
        if anchors and distance > MAX_DONOR_DISTANCE:
            return (
                f"its DiLoCo anchors are {distance:.4g} away from its weights (at most "
                f"{MAX_DONOR_DISTANCE})"
            )
        return None
    for what, at, limit in (
        ("weights", range(n_weights), MAX_DONOR_DISTANCE),
        ("DiLoCo anchors", anchor_at, MAX_DONOR_DISTANCE),
    ):
        distance = relative_distance([theirs[i] for i in at], [own[i] for i in at])
        if distance > limit:
            return (
                f"its {what} are {distance:.4g} away from this replica's (relative L2 "
                f"distance; at most {limit} between replicas in sync)"
            )
    rest = [
        i for i in range(n_weights, len(own)) if i not in anchor_at and own[i].dtype.kind == "f"
    ]
    distance = relative_distance([theirs[i] for i in rest], [own[i] for i in rest])
    if rest and distance > MAX_STATE_DISTANCE:
        return (
            f"its optimizer state is {distance:.4g} away from this replica's (at most "
            f"{MAX_STATE_DISTANCE})"
        )
    if any(
        b.dtype.kind != "f" and not np.array_equal(a, b)
        for a, b in zip(theirs[n_weights:], own[n_weights:], strict=False)
    ):
        return "its optimizer's step count is not this replica's"
    return None


# --- the ring ---------------------------------------------------------------------------------


@dataclass
class RoundResult:
    """A round's outcome on one member: the average and who was in it."""

    average: np.ndarray
    present: list[int]
    clipped: int
    missed: int
    seconds: float


def relay_opener(
    plan: StagePlan,
    boundary: str,
    name: str,
    send: str,
    recv: str,
    token: str | None,
    *,
    max_frame_bytes: int | None = None,
) -> RelayOpener | None:
    """How to open the relay end of a link whose RELAY ``boundary`` token is ``boundary``,
    publishing on direction ``send`` and hearing ``recv``; None without NATS in the plan.
    ``max_frame_bytes``: the largest frame either end takes (the link's, from the plan, as
    for a p2p link; None: the relay's own limit)."""
    if plan.nats is None:
        return None
    nats = plan.nats

    def subject(direction: str) -> str:
        return subjects.RELAY.subject(
            plan.subject_prefix,
            job=plan.job_id,
            attempt=plan.attempt,
            boundary=boundary,
            direction=direction,
        )

    def make() -> RelayLink:
        # A leader's plan tags every relay message with the link's token.
        return RelayLink(
            name=name,
            nats=nats.connect_options(),
            send_subject=subject(send),
            recv_subject=subject(recv),
            token=None if token is None else bytes.fromhex(token),
            max_frame_bytes=max_frame_bytes or MAX_FRAME_BYTES,
        )

    return make


def _curve(keys: PlanCurveKeys | None) -> CurveKeys | None:
    if keys is None:
        return None
    return CurveKeys(public=keys.public, secret=keys.secret, peer_public=keys.peer_public)


class ReplicaSync:
    """One member of one ring (the replicas' holders of one segment of layers: ``ring``,
    by default the plan's only ring): :meth:`open`, then :meth:`all_reduce` once per round
    (the same rounds in the same order on every member), :meth:`finish`, :meth:`close`.
    :class:`ReplicaRings` holds a stage's rings.

    Elastic membership: :meth:`switch` to a :class:`~silentswarm.plan.RingChange` (every
    member before the same step), then :meth:`hand_over` the donor's state. A joining
    stage's member (``plan.joining``) is in no ring until its first switch."""

    def __init__(
        self,
        plan: StagePlan,
        fingerprint: bytes,
        ring: SyncRing | None = None,
        *,
        max_message_bytes: int | None = None,
    ) -> None:
        if not plan.replicated:
            raise ValueError("ReplicaSync needs a replicated plan")
        if ring is None and not plan.joining:
            if len(plan.sync_rings) != 1:
                raise ValueError("ReplicaSync needs its ring of the plan's rings")
            ring = plan.sync_rings[0]
            if ring.prev is None or ring.next is None:
                raise ValueError("ReplicaSync needs a replicated plan with its ring peers")
        self.plan = plan
        self.ring = ring
        self.signer = _signer(ring)
        self.max_message_bytes = max_message_bytes  # a p2p ring link's (ZmqLink)
        self.fingerprint = fingerprint
        self.k = plan.n_replicas  # the replica slots (each keeps its own rows of the batch)
        self.replica = plan.replica
        # The ring in force, sorted: the plan's (epoch 0: every replica), none yet for a
        # joining stage; a RingChange makes another.
        self.members: list[int] = [] if plan.joining else list(range(self.k))
        self.epoch = 0
        self.codec = parse_wire_codec(plan.train.sync_compression)
        self.up: Link | None = None  # from the predecessor
        self.down: Link | None = None  # to the successor
        self.clipped = 0
        self.missed = 0
        self.dropped = 0  # frames of another job or attempt
        # A predecessor can send refused frames as fast as its link goes: a line every 5 s.
        self._drop_logs = Throttle(DROP_LOG_EVERY_S)
        self.stale = 0  # frames of a round already over
        self.seconds = 0.0  # in rounds since the last take_seconds()
        # Frames of rounds still to come (at most MAX_ROUNDS_AHEAD), by round and origin.
        self._early: dict[int, dict[int, Parts]] = {}
        # Rounds are named by their step: DiLoCo's come every ``sync_every`` steps.
        self._round_spacing = plan.train.sync_every if plan.train.sync == "diloco" else 1
        self._first_round_grace = False  # see switch()
        # What the links of earlier rings moved and dropped (the counters stay cumulative).
        self._sent_before = 0
        self._received_before = 0
        self._relay_dropped_before: dict[str, int] = {}

    @property
    def where(self) -> str:
        """The ring's name in logs and link names: its stage and its segment of layers."""
        ring = self.ring
        layers = "" if ring is None else f" layers {ring.layer_start}-{ring.layer_end}"
        return f"{self.plan.stage}{layers}"

    # --- links ------------------------------------------------------------------------------

    def open(self) -> None:
        """Open both ring links of the plan's ring: accepting from the predecessor (in a
        thread) while connecting to the successor, else a ring of two would wait on itself."""
        plan, ring = self.plan, self.ring
        assert ring is not None and ring.prev is not None and ring.next is not None
        self._open(
            prev=(self.replica - 1) % self.k,
            ring=ring,
            timeout_s=max(plan.peer_timeout_s, FIRST_HELLO_S),
            label="",
        )

    def _open(self, *, prev: int, ring: SyncRing, timeout_s: float, label: str) -> None:
        """Open the links of ``ring`` to its ``next`` and from its ``prev`` (replica
        ``prev``). The relay subject of the link from member ``a`` to its successor is
        ``sync_link(segment, a)``, whatever the ring's members."""
        plan = self.plan
        assert ring.prev is not None and ring.next is not None
        sync_prev, sync_next = ring.prev, ring.next
        transport = TransportKind(plan.transport.value)
        where = f"sync {self.where}{label}"
        up_name = f"{where} ({sync_prev.fellow_id} -> {plan.fellow_id})"
        down_name = f"{where} ({plan.fellow_id} -> {sync_next.fellow_id})"
        accepted: dict[str, Link | BaseException] = {}
        deadline = time.monotonic() + timeout_s
        bind_deadline = time.monotonic() + min(BIND_RETRY_S, timeout_s)

        def accept() -> None:
            while True:
                try:
                    accepted["link"] = accept_upstream(
                        name=up_name,
                        transport=transport,
                        bind=plan.sync_bind(ring),
                        relay=relay_opener(
                            plan,
                            subjects.sync_link(ring.segment, prev),
                            up_name,
                            "bwd",
                            "fwd",
                            ring.relay_up_token,
                            max_frame_bytes=self.max_message_bytes,
                        ),
                        timeout_s=max(0.001, deadline - time.monotonic()),
                        p2p_grace_s=plan.p2p_probe_timeout_s,
                        fingerprint=self.fingerprint,
                        curve=_curve(ring.curve_up),
                        max_message_bytes=self.max_message_bytes,
                    )
                    return
                except LinkError as exc:
                    # The old ring's socket on the same address may not be gone yet.
                    if _bind_failed(exc) and time.monotonic() < bind_deadline:
                        time.sleep(0.05)
                        continue
                    accepted["link"] = exc
                    return
                except BaseException as exc:  # handed to the opening thread
                    accepted["link"] = exc
                    return

        thread = threading.Thread(target=accept, name=f"accept {up_name}", daemon=True)
        thread.start()
        # A failed connect raises at once; the accepting thread (a daemon) is left to its
        # own timeout, as the stage ends anyway.
        self.down = connect_downstream(
            name=down_name,
            transport=transport,
            address=sync_next.data_address,
            relay=relay_opener(
                plan,
                subjects.sync_link(ring.segment, self.replica),
                down_name,
                "fwd",
                "bwd",
                ring.relay_down_token,
                max_frame_bytes=self.max_message_bytes,
            ),
            timeout_s=timeout_s,
            fingerprint=self.fingerprint,
            curve=_curve(ring.curve_down),
            max_message_bytes=self.max_message_bytes,
            max_queued=ring_send_queue(self.k),
        )
        thread.join()
        got = accepted["link"]
        if isinstance(got, BaseException):
            raise got
        self.up = got

    def switch(self, change: RingChange, timeout_s: float, ring: SyncRing | None = None) -> None:
        """Leave the ring in force for ``change``'s ``ring`` (by default its only one):
        close the old links (no DONE: the old ring is over), drop what was kept for later
        rounds, and open the new ring's links (none for a ring of one) within
        ``timeout_s``. Every member of the new ring calls it before the same step;
        :meth:`hand_over` comes next."""
        if ring is None:
            if len(change.rings) != 1:
                raise ValueError(f"ring change epoch {change.epoch}: which of its rings?")
            ring = change.rings[0]
        plan = self.plan
        problems = change.problems(self.replica, (plan.layer_start, plan.layer_end))
        if problems:
            raise ValueError(f"ring change epoch {change.epoch}: {'; '.join(problems)}")
        self._retire_links()
        self._early.clear()
        self.ring = ring
        self.signer = _signer(ring)
        self.members = list(change.members)
        self.epoch = change.epoch
        # A joining member's first step traces and compiles its step (seconds): the first
        # round of a ring it joins waits for it as long as a peer is waited for.
        self._first_round_grace = bool(change.joining)
        if len(self.members) == 1:
            return
        self._open(
            prev=prev_member(self.members, self.replica),
            ring=ring,
            timeout_s=timeout_s,
            label=f" epoch {change.epoch}",
        )

    def hand_over(
        self, change: RingChange, own: np.ndarray | None, shape: tuple[int, ...], timeout_s: float
    ) -> np.ndarray:
        """The donor's state (a :func:`pack_state` matrix of ``shape``) once around the new
        ring: the donor sends ``own``; every other member receives it from its predecessor,
        forwards it unless its successor is the donor, and returns it. Lossless (codec
        ``none``). A frame that is not the donor's state of this epoch is a
        ForwardRefusedError (naming the predecessor: the leader drops its replica too); none
        within ``timeout_s`` a PeerTimeoutError."""
        alone = len(self.members) == 1
        if self.replica == change.donor:
            if own is None:
                raise ValueError("the donor hands over its own state")
            matrix = np.ascontiguousarray(own, dtype=np.float32)
            if not alone:
                assert self.down is not None
                _, parts = encode_frame(
                    matrix,
                    NO_CODEC,
                    job=self.plan.job_id,
                    attempt=self.plan.attempt,
                    step=change.epoch,
                    micro=change.donor,
                    direction=Direction.FWD,
                    phase=STATE_PHASE,
                )
                self._hand_on(self.signer.sign(parts), change, timeout_s)
            return matrix
        assert self.up is not None and self.down is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() >= deadline:  # frames came, but none of them the state
                raise PeerTimeoutError(
                    f"no state of donor {change.donor} for ring epoch {change.epoch} within "
                    f"{timeout_s:.0f}s"
                )
            try:
                parts = self.up.recv(max(0.001, deadline - time.monotonic()))
                frame = self._donor_state(parts, change, shape)
            except FrameError as exc:
                predecessor = prev_member(self.members, self.replica)
                raise ForwardRefusedError(
                    f"{exc} (forwarded by replica {predecessor}, ring epoch {change.epoch})"
                ) from None
            if frame is not None:
                break
        matrix = np.array(frame.array, dtype=np.float32)
        if next_member(self.members, self.replica) != change.donor:
            self._hand_on(parts, change, timeout_s)
        return matrix

    def _hand_on(self, parts: Parts, change: RingChange, timeout_s: float) -> None:
        """Send the state to the successor; a SuccessorStalledError naming it where it takes
        none of it for ``timeout_s`` (the leader drops both: a successor that withheld credit
        used to cost its honest sender alone its replica). Credit that comes too slowly for
        the frame's deadline is no accusation (a slow uplink looks the same from here): a
        PeerTimeoutError, which costs this member its replica."""
        assert self.down is not None
        try:
            self.down.send(parts, timeout_s=timeout_s)
        except SlowReceiverError:
            raise
        except PeerTimeoutError as exc:
            successor = next_member(self.members, self.replica)
            raise SuccessorStalledError(
                f"{exc} (handing the state on to replica {successor}, ring epoch {change.epoch})"
            ) from None

    def _donor_state(
        self, parts: Parts, change: RingChange, shape: tuple[int, ...]
    ) -> Frame | None:
        """``parts`` from the predecessor as the donor's state of ``change``: its frame, None
        for one of another job or attempt (dropped), a FrameError for anything else."""
        assert self.up is not None
        name = self.up.name
        signed = self.signer.split(parts)
        if signed is None:
            raise FrameError(f"{name}: the donor's state came without a signature")
        body, signature = signed
        header = self._header_ours(body)
        if header is None:
            return None
        got = (header.phase, header.step, header.micro)
        want = (STATE_PHASE, change.epoch, change.donor)
        if got != want:
            raise FrameError(f"{name}: expected the donor's state {want}, got {got!r}")
        if header.codec != NO_CODEC.name:
            raise FrameError(f"{name}: the donor's state came in codec {header.codec!r}, not none")
        if header.shape != tuple(shape):
            raise FrameError(
                f"{name}: the donor's state has shape {list(header.shape)}, "
                f"this stage's is {list(shape)}"
            )
        if signature is not None and not self.signer.signed_by(change.donor, body, signature):
            raise FrameError(f"{name}: a state replica {change.donor} (the donor) did not sign")
        return self._decoded(body, header)

    def _header_ours(self, parts: Parts) -> FrameHeader | None:
        """The header of a frame from the predecessor, or None (dropped and counted) for one
        of another job or attempt; FrameError, naming the link, for one that does not parse.
        Only the header: a payload (sized by the sender) is decoded once the header is what
        this member waits for, and signed by whom it says (:meth:`_decoded`)."""
        assert self.up is not None
        name = self.up.name
        try:
            header = frame_header(parts)
        except FrameError as exc:
            raise FrameError(f"{name}: {exc}") from None
        if header.job != self.plan.job_id or header.attempt != self.plan.attempt:
            self.dropped += 1
            if self._drop_logs.allow("other job") is not None:
                log.warning(
                    "%s: dropped a frame of %.80r attempt %d", name, header.job, header.attempt
                )
            return None
        return header

    def _decoded(self, parts: Parts, header: FrameHeader) -> Frame:
        """The frame whose ``header`` :meth:`_header_ours` admitted; FrameError, naming the
        link, for a payload that does not decode."""
        assert self.up is not None
        try:
            return decode_frame(parts, header=header)
        except FrameError as exc:
            raise FrameError(f"{self.up.name}: {exc}") from None

    def _retire_links(self) -> None:
        """Close the links in force, keeping what they moved and dropped in the counters."""
        for link in self.links():
            self._sent_before += link.bytes_sent
            self._received_before += link.bytes_received
            if isinstance(link, RelayLink):
                for reason, n in link.dropped_by_reason.items():
                    self._relay_dropped_before[reason] = (
                        self._relay_dropped_before.get(reason, 0) + n
                    )
            try:
                link.close()
            except Exception as exc:  # the old ring is gone either way
                log.warning("%s: closing: %s", link.name, exc)
        self.up = self.down = None

    def links(self) -> list[Link]:
        return [link for link in (self.up, self.down) if link is not None]

    @property
    def bytes_sent(self) -> int:
        return self._sent_before + sum(link.bytes_sent for link in self.links())

    @property
    def bytes_received(self) -> int:
        return self._received_before + sum(link.bytes_received for link in self.links())

    def relay_dropped(self) -> dict[str, int]:
        out: dict[str, int] = dict(self._relay_dropped_before)
        for link in self.links():
            if isinstance(link, RelayLink):
                for reason, n in link.dropped_by_reason.items():
                    out[reason] = out.get(reason, 0) + n
        return out

    def take_seconds(self) -> float:
        """Seconds spent in rounds since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def finish(self) -> bool:
        """End in order: tell the predecessor everything it sent has arrived, then wait for
        the successor to say so (the last round's frames delivered before anyone closes).
        A successor that does not confirm (a replica that stalled or died) is logged, not
        fatal: the run is over, and this member's results are its own. A ring of one has
        no one to tell."""
        timeout_s = self.plan.peer_timeout_s + self.plan.train.sync_timeout_s
        if self.up is not None:
            try:
                self.up.send_done()
            except LinkError as exc:
                log.warning("%s: could not say DONE: %s", self.up.name, exc)
        if self.down is not None and not self.down.wait_done(timeout_s):
            log.warning("%s: the successor did not confirm the end of the run", self.down.name)
            return False
        return True

    def close(self) -> None:
        """Close the links in force (once: a relay link cannot be closed twice)."""
        links, self.up, self.down = self.links(), None, None
        for link in links:
            link.close()

    # --- rounds -----------------------------------------------------------------------------

    def all_reduce(self, round_id: int, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The replicas' average of ``arrays`` (clipped, over those present), shaped like them."""
        shapes = [tuple(a.shape) for a in arrays]
        result = self.round(round_id, pack(arrays))
        return unpack(result.average, shapes)

    def round(self, round_id: int, matrix: np.ndarray) -> RoundResult:
        """One round: gather every member's ``matrix`` (rows x :data:`ROW`), clip, average."""
        if self.replica not in self.members:
            raise ValueError(f"replica {self.replica} is in no ring yet")
        started = time.perf_counter()
        got = self._gather(round_id, np.ascontiguousarray(matrix, dtype=np.float32))
        clip = clip_contributions(got, self.plan.train.sync_clip_ratio)
        missed = len(self.members) - len(got)
        self.clipped += clip.clipped
        self.missed += missed
        if clip.clipped or missed:
            log.warning(
                "sync round %d of stage %s: %d clipped, %d left out",
                round_id,
                self.where,
                clip.clipped,
                missed,
            )
        # Every contribution non-finite, our own too: nothing to apply.
        mean = average(clip.kept) if clip.kept else np.zeros_like(matrix, dtype=np.float32)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        return RoundResult(
            average=mean,
            present=sorted(got),
            clipped=clip.clipped,
            missed=missed,
            seconds=seconds,
        )

    def _encode(self, round_id: int, matrix: np.ndarray) -> Parts:
        _, parts = encode_frame(
            matrix,
            self.codec,
            job=self.plan.job_id,
            attempt=self.plan.attempt,
            step=round_id,
            micro=self.replica,
            direction=Direction.FWD,
            phase=PHASE,
        )
        return parts

    def _send(self, parts: Parts, deadline: float) -> bool:
        """Hand ``parts`` to the successor within what is left of the round (at least
        :data:`MIN_SEND_S`); False where it took none of it in that time. The successor's
        own wait ends with the round too, so a frame that takes longer comes too late."""
        assert self.down is not None
        left = max(min(MIN_SEND_S, self.plan.train.sync_timeout_s), deadline - time.monotonic())
        try:
            self.down.send(parts, timeout_s=left)
        except PeerTimeoutError as exc:  # the successor stalls: it will miss this round
            if self._drop_logs.allow("stalled") is not None:
                log.warning("%s", exc)
            return False
        return True

    def _gather(self, round_id: int, matrix: np.ndarray) -> dict[int, np.ndarray]:
        """Every member's contribution to ``round_id`` that arrives in time, by origin."""
        for old in [r for r in self._early if r < round_id]:
            self.stale += len(self._early.pop(old))
        own = self._encode(round_id, matrix)
        # What the others will decode, so a lossy codec changes no member's view.
        got = {self.replica: np.asarray(decode_frame(own).array, dtype=np.float32)}
        n = len(self.members)
        if n == 1:  # a ring of one: nothing to send, nobody to wait for
            return got
        wait_s = self.plan.train.sync_timeout_s
        if self._first_round_grace:
            self._first_round_grace = False
            wait_s = max(wait_s, self.plan.peer_timeout_s)
        # The own frame's send and the wait for the others' each take up to ``wait_s``, the
        # forwards only what is left of that wait; a successor that took nothing is sent
        # nothing more this round. A round lasts about two timeouts at most, never k.
        taking = self._send(self.signer.sign(own), time.monotonic() + wait_s)
        deadline = time.monotonic() + wait_s
        successor = next_member(self.members, self.replica)
        pending = list(self._early.pop(round_id, {}).values())
        while len(got) < n:
            parts = pending.pop(0) if pending else self._recv(deadline)
            if parts is None:
                break
            origin = self._check(parts, round_id, got, matrix.shape)
            if origin is None:
                continue
            if origin < 0:  # a later round's: the predecessor has moved on
                break
            if origin != successor and taking:
                taking = self._send(parts, deadline)
        return got

    def _recv(self, deadline: float) -> Parts | None:
        """The predecessor's next frame; None once ``deadline`` has passed. A relay frame
        that does not assemble is the predecessor's doing: dropped as a contribution
        (:meth:`_reject`), and the wait goes on. A relay gap the predecessor never filled
        costs this round what it would have sent, as its silence would: raising would end
        this member, the one replica the gap is not the fault of."""
        assert self.up is not None
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                return self.up.recv(remaining)
            except PeerTimeoutError:
                return None
            except RelayGapError as exc:
                if self._drop_logs.allow("gap") is not None:
                    log.warning("%s", exc)
                return None
            except FrameError as exc:
                self._reject(str(exc))
        return None

    def _check(
        self,
        parts: Parts,
        round_id: int,
        got: dict[int, np.ndarray],
        shape: tuple[int, ...],
    ) -> int | None:
        """Take a received frame into ``got``: its origin; None for a frame dropped (another
        job or attempt, an older round, or one no honest predecessor sends: counted as
        clipped and logged); -1 for a later round's (kept for it, up to
        :data:`MAX_ROUNDS_AHEAD` rounds ahead, one per origin).

        A malformed frame is the predecessor's doing, so it costs that contribution, never
        this member: raising here would end this stage and drop its replica, which is what a
        hostile predecessor would want."""
        signed = self.signer.split(parts)
        if signed is None:
            return self._reject("an unsigned frame in a ring whose members sign")
        body, signature = signed
        try:
            header = self._header_ours(body)
        except FrameError as exc:
            return self._reject(str(exc))
        if header is None:
            return None
        why = self._problem(header, body, signature, shape)
        if why is not None:
            return self._reject(why)
        origin = header.micro
        if header.step < round_id:
            self.stale += 1
            return None
        if header.step > round_id:
            if not self._is_round(header.step):
                return self._reject(f"a contribution to step {header.step}, not a sync round")
            if header.step > round_id + MAX_ROUNDS_AHEAD * self._round_spacing:  # far behind
                return self._reject(
                    f"a contribution to round {header.step} in round {round_id} (more than "
                    f"{MAX_ROUNDS_AHEAD} rounds ahead)",
                    stale=True,
                )
            early = self._early.setdefault(header.step, {})
            if origin in early:
                return self._reject(f"a second round {header.step} contribution of {origin}")
            early[origin] = parts
            return -1
        if origin in got:
            return self._reject(f"a second round {round_id} contribution of replica {origin}")
        try:
            frame = self._decoded(body, header)
        except FrameError as exc:
            return self._reject(str(exc))
        got[origin] = np.asarray(frame.array, dtype=np.float32)
        return origin

    def _is_round(self, step: int) -> bool:
        """Whether a round is named ``step``: every step under allreduce, every
        ``sync_every``-th and the last under DiLoCo, none at or past the run's end. Frames
        of any other step are kept for no round: each would hold a contribution's memory."""
        steps = self.plan.train.steps
        if not 0 <= step < steps:
            return False
        return (
            self._round_spacing == 1 or (step + 1) % self._round_spacing == 0 or step + 1 == steps
        )

    def _problem(
        self, header: FrameHeader, body: Parts, signature: bytes | None, shape: tuple[int, ...]
    ) -> str | None:
        """Why no honest predecessor sends this sync frame (None: it may), from its header
        alone: its phase, sender, codec and shape are the ring's, and the sender signed it."""
        origin = header.micro
        if header.phase != PHASE:
            return f"a {header.phase!r} frame on a sync link"
        if origin == self.replica or origin not in self.members:
            return f"round {header.step} contribution of replica {origin} (members {self.members})"
        if header.codec != self.codec.name:
            return f"a contribution in codec {header.codec!r}, the ring's is {self.codec.name!r}"
        if header.shape != shape:
            return f"a contribution of shape {list(header.shape)}, this stage's is {list(shape)}"
        if signature is not None and not self.signer.signed_by(origin, body, signature):
            return f"a round {header.step} contribution replica {origin} did not sign"
        return None

    def _reject(self, why: str, *, stale: bool = False) -> None:
        """Drop a sync frame no honest predecessor sends (it counts as a clipped
        contribution), or with ``stale`` one this member is too far behind to keep."""
        assert self.up is not None
        if stale:
            self.stale += 1
        else:
            self.clipped += 1
        held = self._drop_logs.allow("stale" if stale else "refused")
        if held is not None:
            more = f" ({held} more not logged)" if held else ""
            log.warning("%s: dropped a sync frame: %.300s%s", self.up.name, why, more)


def _signer(ring: SyncRing | None) -> RingSigner:
    """The ring's keys as a member holds them (a ring of two, or none yet, signs nothing)."""
    if ring is None:
        return RingSigner(None, {})
    return RingSigner(ring.sign_seed, ring.signers)


class ReplicaRings:
    """A replicated stage's rings: one :class:`ReplicaSync` per segment of layers it holds
    (the plan's ``sync_rings``, then each ring change's ``rings``), in segment order.

    Every call runs the rings one after the other in that order, on every member alike, so
    none waits in a cycle: a ring's round (or opening, or hand-over) needs only its own
    members to reach it, and each reaches it once its rings of earlier segments are done,
    which need only theirs. A contribution or a state is one array per ring (the stage cuts
    its packed matrix by segment: :func:`ring_rows`). The counters are the rings' sums, kept
    across ring changes."""

    def __init__(
        self, plan: StagePlan, fingerprint: bytes, *, max_message_bytes: int | None = None
    ) -> None:
        if not plan.replicated:
            raise ValueError("ReplicaRings needs a replicated plan")
        self.plan = plan
        self.fingerprint = fingerprint
        self.max_message_bytes = max_message_bytes
        self.syncs: list[ReplicaSync] = (
            []
            if plan.joining
            else [
                ReplicaSync(plan, fingerprint, r, max_message_bytes=max_message_bytes)
                for r in plan.sync_rings
            ]
        )
        self._retired: list[ReplicaSync] = []  # rings given up at a change (their counters)

    @property
    def rings(self) -> list[SyncRing]:
        """The rings in force (none for a joining stage before its first change)."""
        return [sync.ring for sync in self.syncs if sync.ring is not None]

    @property
    def members(self) -> list[int]:
        return self.syncs[0].members if self.syncs else []

    def open(self) -> None:
        for sync in self.syncs:
            sync.open()

    def round(self, round_id: int, parts: Sequence[np.ndarray]) -> list[RoundResult]:
        """One round in every ring: ``parts[i]`` is this member's contribution to ring i."""
        if len(parts) != len(self.syncs):
            raise ValueError(f"{len(parts)} contributions for {len(self.syncs)} rings")
        return [sync.round(round_id, part) for sync, part in zip(self.syncs, parts, strict=True)]

    def switch(self, change: RingChange, timeout_s: float) -> None:
        """Leave the rings in force for ``change``'s (one per ring of it: the segments may
        differ from the old rings' when the members' splits do)."""
        plan = self.plan
        problems = change.problems(plan.replica, (plan.layer_start, plan.layer_end))
        if problems:
            raise ValueError(f"ring change epoch {change.epoch}: {'; '.join(problems)}")
        for sync in self.syncs:
            sync._retire_links()
        self._retired += self.syncs
        self.syncs = [
            ReplicaSync(plan, self.fingerprint, ring, max_message_bytes=self.max_message_bytes)
            for ring in change.rings
        ]
        for sync, ring in zip(self.syncs, change.rings, strict=True):
            sync.switch(change, timeout_s, ring)

    def hand_over(
        self,
        change: RingChange,
        own: Sequence[np.ndarray] | None,
        shapes: Sequence[tuple[int, ...]],
        timeout_s: float,
    ) -> list[np.ndarray]:
        """The donor's state in every ring (:meth:`ReplicaSync.hand_over`): ``own[i]`` (the
        donor's) and ``shapes[i]`` are ring i's."""
        if len(shapes) != len(self.syncs) or (own is not None and len(own) != len(shapes)):
            raise ValueError(f"states for {len(shapes)} rings, this stage is in {len(self.syncs)}")
        return [
            sync.hand_over(change, None if own is None else own[i], shapes[i], timeout_s)
            for i, sync in enumerate(self.syncs)
        ]

    def finish(self) -> bool:
        return all([sync.finish() for sync in self.syncs])

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()

    def take_seconds(self) -> float:
        return sum(sync.take_seconds() for sync in self.syncs)

    def _total(self, counter: str) -> int:
        """A counter summed over every ring this stage has been in."""
        return sum(getattr(sync, counter) for sync in [*self._retired, *self.syncs])

    bytes_sent = property(lambda self: self._total("bytes_sent"))
    bytes_received = property(lambda self: self._total("bytes_received"))
    clipped = property(lambda self: self._total("clipped"))
    missed = property(lambda self: self._total("missed"))
    dropped = property(lambda self: self._total("dropped"))

    def relay_dropped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for sync in [*self._retired, *self.syncs]:
            for reason, n in sync.relay_dropped().items():
                out[reason] = out.get(reason, 0) + n
        return out


def ring_rows(
    shapes: Sequence[tuple[int, ...]], bounds: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The row range of :func:`pack`'s matrix of ``shapes`` that each ``bounds`` (a range
    of the arrays' indices, as a ring's variables are) covers: variables are padded to
    whole rows, so a ring's part of the packed matrix is contiguous."""
    out = []
    for first, end in bounds:
        start = layout_rows(shapes[:first])
        out.append((start, start + layout_rows(shapes[first:end])))
    return out


def _bind_failed(exc: LinkError) -> bool:
    """Whether ``exc`` is a ZeroMQ bind that failed (agent/pipe/zmq.py's message), which a
    moment later may succeed: the address of a socket just closed."""
    return type(exc) is LinkError and "cannot bind" in str(exc)


__all__ = [
    "BIND_RETRY_S",
    "JOIN_TIMEOUT_S",
    "MAX_DONOR_DISTANCE",
    "MAX_STATE_DISTANCE",
    "ROW",
    "Clipped",
    "ReplicaRings",
    "ReplicaSync",
    "RoundResult",
    "adam_moment_bound",
    "average",
    "clip_contributions",
    "donor_refusal",
    "layout_rows",
    "nesterov_step",
    "next_member",
    "pack",
    "pack_state",
    "prev_member",
    "relative_distance",
    "relay_opener",
    "ring_rows",
    "state_digest",
    "state_rows",
    "unpack",
    "unpack_state",
]
