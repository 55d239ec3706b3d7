"""One Settings object for every SilentSwarm process.

Values come from ``SWARM_*`` environment variables, read once at start-up by
:func:`Settings.from_env` and passed down explicitly; nothing else reads the environment.
Command-line flags override them through :meth:`Settings.replace`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from silentswarm.endpoints import endpoint_problem
from silentswarm.errors import ConfigError
from silentswarm.hosts import is_loopback
from silentswarm.natsconn import NatsAccess
from silentswarm.plan import Transport
from silentswarm.pools import DEFAULT_POOL, PoolName, parse_labels
from silentswarm.protocol import MAX_COMPUTE_SPEED, MIN_COMPUTE_SPEED
from silentswarm.subjects import TOKEN_RE

ENV_PREFIX = "SWARM_"
_DAY_S = 86400.0
_YEAR_S = 365 * _DAY_S
# SWARM_PIPELINE_TRANSPORT's values, as a job spec's ``transport`` names them.
PIPELINE_TRANSPORTS = tuple(t.value for t in Transport)


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    leader_host: str = "127.0.0.1"
    leader_port: int = 8080
    # Where clients reach the leader; None derives it (see LeaderClient users in swarm.cli).
    leader_url: str | None = None
    nats_url: str | None = None
    nats_host: str = "127.0.0.1"
    nats_port: int = 4222
    # Also serve NATS over WebSocket on this port (nats-servers we start), for fellows that
    # can only make outbound HTTP(S) connections: put TLS in front and give them
    # SWARM_PUBLIC_NATS_URL=wss://... (they need the [websocket] extra, aiohttp).
    nats_websocket_port: int | None = None
    subject_prefix: str = "swarm"
    # Dev mode: NATS without authentication (the leader warns loudly). Otherwise every
    # process connects with its own NATS user: SWARM_NATS_CREDS names its .creds file.
    dev: bool = False
    nats_creds: Path | None = None
    # The NATS authority (keys that mint users; see swarm.natsauth): the leader's, by
    # default <state>/nats-auth. With it the leader gives each joining fellow its own user.
    nats_auth_dir: Path | None = None
    # Fleet enrollment (Nomad, systemd fleets): a leader with this token mints a NATS user
    # for any fellow that presents it; a fellow with it and no credentials file asks the
    # leader (SWARM_LEADER_URL) for its own at start and keeps it (0600).
    enroll_token: str | None = None
    # TLS to NATS (a tls:// or wss:// URL): the CA that signed the server's certificate, and
    # a client certificate and key when the server asks for one.
    nats_tls_ca: Path | None = None
    nats_tls_cert: Path | None = None
    nats_tls_key: Path | None = None
    state_dir: Path = Path(".swarm")
    heartbeat_interval_s: float = 1.0
    offline_after_s: float = 3.0
    fellow_name: str | None = None
    data_address: str | None = None
    # Where the stage binds when that is not the advertised data_address (behind NAT or a
    # port forward: bind tcp://0.0.0.0:5701, advertise the public address).
    data_bind: str | None = None
    # Where a fellow's stage binds, and its replicas connect, for a job with replicas (the
    # rings that keep the replicas' layers in sync): a port beside data_address, or a range
    # of them (tcp://host:7000-7003), one per ring a stage is in (a stage of a replica that
    # splits the layers unlike the others is in several: silentswarm.rings). Unset, or past
    # its ports: under transport auto its ring links use the NATS relay; p2p jobs with
    # replicas are not placed on it.
    sync_address: str | None = None
    # Where the stage binds its ring ports when that is not the advertised sync_address
    # (behind NAT or a port forward, as data_bind for the data port): port j binds for
    # port j of sync_address.
    sync_bind: str | None = None
    # Where fellow.sh installed this fellow (venv, state, config): PURGE removes all of it.
    fellow_prefix: Path | None = None
    # The pip arguments fellow.sh installed with (an offline mirror): UPDATE reinstalls so.
    fellow_pip_args: str = ""
    # Exit after reporting the end of a job, for supervisors that want a fresh process.
    fellow_exit_after_training: bool = False
    # What a fellow offers at most, so a shared machine can join (None: no cap).
    fellow_max_vram_gb: float | None = None
    fellow_max_memory_gb: float | None = None
    fellow_max_network_mbps: float | None = None
    # The fellow's compute speed as the operator states it (standard blocks per second,
    # protocol.ComputeSpeed); unset: measured by a short probe at agent start.
    fellow_compute_speed: float | None = None
    # The pool the fellow is in (unset: "default") and its labels ("gpu=a100,zone=eu"): a
    # job runs only on fellows of its pool that carry all its labels (silentswarm.pools).
    fellow_pool: PoolName | None = None
    fellow_labels: str = ""
    # What remote hosts use to reach the leader's HTTP and NATS (behind NAT or a proxy); unset:
    # the URL a request came in on, and the leader's own NATS URL (an https:// public URL
    # alone: wss://<its host>/nats, the path packaging/proxy/Caddyfile publishes NATS on).
    public_url: str | None = None
    public_nats_url: str | None = None
    # On a fellow: the CA that signed the leader's HTTPS certificate (a private CA), trusted
    # besides the public ones for every call to the leader and for wss:// NATS.
    leader_ca: Path | None = None
    # The wheel the leader serves to joining and updating fellows (unset: the wheel of the
    # running version, found or built once).
    bootstrap_wheel: Path | None = None
    # The operator token (unset: the leader generates one in <state>/api-token) and whether
    # reads (GET) are open without it: None (the default) opens them only while the leader
    # listens on loopback; off loopback every read needs the token or a read ticket.
    api_token: str | None = None
    api_public_reads: bool | None = None
    # Where job exports may go (unset: <state>/model_exports): a job's
    # artifact_paths.model_export_dir must resolve inside it; relative paths are taken
    # under it.
    export_root: Path | None = None
    # Where uploaded datasets are kept (unset: <state>/datasets), content-addressed, and the
    # largest one an upload may be.
    dataset_root: Path | None = None
    max_dataset_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 2**30
    # How long a finished job's labelled series stay in the leader's /api/v1/metrics; how
    # many finished jobs GET /api/v1/jobs lists before older ones are archived (hidden; still
    # served by id and with ?all=true), and after how long a finished job is archived anyway
    # and an archived one deleted (record and progress history; never its export on disk).
    # 0: never, for the last two (leader.retention).
    job_metrics_retention_s: Annotated[float, msgspec.Meta(ge=0, le=30 * _DAY_S)] = 3600.0
    jobs_keep_finished: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 200
    jobs_archive_after_s: Annotated[float, msgspec.Meta(ge=0, le=10 * _YEAR_S)] = 7 * _DAY_S
    jobs_delete_after_s: Annotated[float, msgspec.Meta(ge=0, le=10 * _YEAR_S)] = 90 * _DAY_S
    # The leader's placement defaults for jobs that leave these fields unset.
    placement_min_gpu_free_gb: float = 4.0
    pipeline_last_stage_placement: str = "largest_vram"
    # How often the leader may have idle fellows on different hosts measure their links
    # before any job crosses them (silentswarm.leader.linkprobes); 0: never. At most this many
    # probes side by side, on machines of their own.
    link_probe_every_s: Annotated[float, msgspec.Meta(ge=0, le=_DAY_S)] = 10.0
    link_probes_at_once: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # The transport of jobs whose spec names none: auto, tunnel (the NATS relay) or p2p.
    pipeline_transport: str = "auto"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        _check_port("leader_port", self.leader_port)
        _check_port("nats_port", self.nats_port)
        if self.nats_websocket_port is not None:
            _check_port("nats_websocket_port", self.nats_websocket_port)
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"{env_name('heartbeat_interval_s')} must be > 0")
        if self.offline_after_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"{env_name('offline_after_s')} ({self.offline_after_s}) must be greater than "
                f"{env_name('heartbeat_interval_s')} ({self.heartbeat_interval_s})"
            )
        if not TOKEN_RE.match(self.subject_prefix):
            raise ConfigError(
                f"{env_name('subject_prefix')}={self.subject_prefix!r}: use letters, digits, "
                "'-' or '_'"
            )
        if self.fellow_name is not None and not TOKEN_RE.match(self.fellow_name):
            raise ConfigError(
                f"{env_name('fellow_name')}={self.fellow_name!r}: a fellow name is 1-64 "
                "letters, digits, '-' or '_'"
            )
        for name in ("fellow_max_vram_gb", "fellow_max_memory_gb", "fellow_max_network_mbps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{env_name(name)}={value}: must be > 0 (unset: no cap)")
        _check_compute_speed(self.fellow_compute_speed)
        _check_sync_ports(self)
        parse_labels(self.fellow_labels, source=env_name("fellow_labels"))
        if self.placement_min_gpu_free_gb < 0:
            raise ConfigError(f"{env_name('placement_min_gpu_free_gb')} must be >= 0")
        if self.pipeline_last_stage_placement not in ("largest_vram", "preserve"):
            raise ConfigError(
                f"{env_name('pipeline_last_stage_placement')}="
                f"{self.pipeline_last_stage_placement!r}: use largest_vram or preserve"
            )
        _check_choice("pipeline_transport", self.pipeline_transport, PIPELINE_TRANSPORTS)
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ConfigError(
                f"{env_name('nats_tls_cert')} and {env_name('nats_tls_key')} go together"
            )
        _check_retention(self.jobs_archive_after_s, self.jobs_delete_after_s)
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(f"{env_name('log_level')}={self.log_level!r}: not a log level")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``SWARM_*`` variables; an invalid value names its variable."""
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            value = env.get(env_name(field.name))
            if value is not None and value != "":
                raw[field.name] = value
        return _convert(raw)

    def replace(self, **changes: Any) -> Settings:
        """A copy with the given fields changed (``None`` values are ignored)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if not changes:
            return self
        merged = msgspec.structs.asdict(self) | changes
        return _convert(merged)

    @property
    def default_leader_url(self) -> str:
        host = "127.0.0.1" if self.leader_host in ("0.0.0.0", "", "::") else self.leader_host
        return f"http://{host}:{self.leader_port}"

    @property
    def pool(self) -> str:
        """The pool this fellow is in."""
        return self.fellow_pool or DEFAULT_POOL

    @property
    def labels(self) -> dict[str, str]:
        """This fellow's labels, parsed (validated when the settings were made)."""
        return parse_labels(self.fellow_labels, source=env_name("fellow_labels"))

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "runtime-logs"

    @property
    def nats_store_dir(self) -> Path:
        return self.state_dir / "nats"

    @property
    def reads_public(self) -> bool:
        """Whether GET routes answer without the operator token: by default only on loopback
        and without a public URL (a leader on loopback behind an HTTPS proxy is public)."""
        if self.api_public_reads is not None:
            return self.api_public_reads
        return is_loopback(self.leader_host) and not self.public_url

    @property
    def model_export_root(self) -> Path:
        """The export root, absolute (symlinks in it resolved: it is the operator's)."""
        return (self.export_root or self.state_dir / "model_exports").resolve()

    @property
    def datasets_dir(self) -> Path:
        """Where the leader keeps uploaded datasets, absolute."""
        return (self.dataset_root or self.state_dir / "datasets").resolve()

    @property
    def authority_dir(self) -> Path:
        return self.nats_auth_dir or self.state_dir / "nats-auth"

    def nats_access(self, url: str, creds: Path | None = None) -> NatsAccess:
        """How this process reaches NATS at ``url``: its credentials (``creds`` overrides
        SWARM_NATS_CREDS) and the TLS files."""

        def text(path: Path | None) -> str | None:
            return None if path is None else str(path.resolve())

        return NatsAccess(
            url=url,
            creds=text(creds or self.nats_creds),
            tls_ca=text(self.nats_tls_ca),
            tls_cert=text(self.nats_tls_cert),
            tls_key=text(self.nats_tls_key),
        )

    @property
    def api_token_file(self) -> Path:
        """Where a leader keeps the operator token it generated (mode 0600)."""
        return self.state_dir / "api-token"

    def client_token(self) -> str | None:
        """The token a client sends: SWARM_API_TOKEN, else the one stored in the state dir."""
        if self.api_token:
            return self.api_token
        try:
            return self.api_token_file.read_text().strip() or None
        except OSError:
            return None

    def fellow_dir(self, fellow_id: str) -> Path:
        """A fellow's own state: stage plans, runtime logs, checkpoints. PURGE removes it."""
        return self.state_dir / "fellows" / fellow_id

    def as_env(self) -> dict[str, str]:
        """The settings as ``SWARM_*`` variables, for child processes."""
        out: dict[str, str] = {}
        for name, value in msgspec.structs.asdict(self).items():
            if isinstance(value, bool):
                out[env_name(name)] = "1" if value else "0"
            elif value is not None:
                out[env_name(name)] = str(value)
        return out


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _check_sync_ports(settings: Settings) -> None:
    """The advertised addresses are TCP endpoints (:mod:`silentswarm.endpoints`), and a sync
    address names one port or a range of them (one per ring a stage is in)."""
    from silentswarm.rings import sync_ports  # it imports the plan, which imports this

    for name, ports in (("data_address", False), ("sync_address", True)):
        value = getattr(settings, name)
        problem = None if not value else endpoint_problem(value, ports=ports)
        if problem:
            raise ConfigError(f"{env_name(name)}: {problem} (what peers connect to)")
    counts = {}
    for name in ("sync_address", "sync_bind"):
        try:
            counts[name] = len(sync_ports(getattr(settings, name)))
        except ConfigError as exc:
            raise ConfigError(f"{env_name(name)}: {exc.message}") from None
    if counts["sync_address"] and counts["sync_bind"] and len(set(counts.values())) > 1:
        raise ConfigError(
            f"{env_name('sync_bind')} names {counts['sync_bind']} port(s), "
            f"{env_name('sync_address')} {counts['sync_address']}: port j binds for port j"
        )


def _check_compute_speed(speed: float | None) -> None:
    if speed is not None and not MIN_COMPUTE_SPEED <= speed <= MAX_COMPUTE_SPEED:
        raise ConfigError(
            f"{env_name('fellow_compute_speed')}={speed}: must be >= {MIN_COMPUTE_SPEED:g} and "
            f"<= {MAX_COMPUTE_SPEED:g} (unset: measured)"
        )


def _check_port(field: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{env_name(field)}={port}: a port is 0-65535 (0 picks a free one)")


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{env_name(field)}={value!r}: use " + ", ".join(choices))


def _check_retention(archive_after_s: float, delete_after_s: float) -> None:
    """A job is archived before it is deleted: deleting sooner than archiving is a mistake."""
    if 0 < delete_after_s < archive_after_s:
        raise ConfigError(
            f"{env_name('jobs_delete_after_s')} ({delete_after_s:g}) must be at least "
            f"{env_name('jobs_archive_after_s')} ({archive_after_s:g}), or 0 (never delete)"
        )


def _convert(raw: dict[str, Any]) -> Settings:
    try:
        return msgspec.convert(raw, Settings, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise ConfigError(_name_field(str(exc))) from None


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is Path and isinstance(value, str | Path):
        return Path(value)
    raise NotImplementedError(kind)


def _name_field(msg: str) -> str:
    """Rewrite msgspec's ``... - at `$.leader_port``` into ``SWARM_LEADER_PORT: ...``."""
    match = re.search(r"`\$\.(\w+)`", msg)
    if match is None:
        return msg
    reason = msg.split(" - at ")[0]
    return f"{env_name(match.group(1))}: {reason}"
