"""``swarm-agent``: one fellow. Registers, heartbeats, and exits cleanly on SIGTERM.

The runner (and through it numpy, which the ``fellow`` extra brings with TensorFlow) is
imported once TensorFlow is known to be installed: where it is not, ``--help`` works and a
start is one line naming what to install.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import cyclopts

from silentswarm.agent.enroll import enroll
from silentswarm.agent.leadertrust import trust_leader_ca
from silentswarm.agent.runtime.tfsetup import require_tensorflow
from silentswarm.entry import configure_logging, run_or_exit
from silentswarm.errors import ConfigError
from silentswarm.natsauth import read_creds_user_name
from silentswarm.natsconn import NatsAccess
from silentswarm.settings import Settings

log = logging.getLogger("agent")
app = cyclopts.App(name="swarm-agent", help="Run a SilentSwarm fellow agent.")


@app.default
def serve(
    *,
    nats_url: Annotated[
        str | None, cyclopts.Parameter(help="NATS server URL [SWARM_NATS_URL]")
    ] = None,
    name: Annotated[
        str | None, cyclopts.Parameter(help="Fellow id (default: host name) [SWARM_FELLOW_NAME]")
    ] = None,
    data_address: Annotated[
        str | None,
        cyclopts.Parameter(help="Address peers use for tensors [SWARM_DATA_ADDRESS]"),
    ] = None,
    sync_address: Annotated[
        str | None,
        cyclopts.Parameter(
            help="Address its replicas use to keep a stage in sync [SWARM_SYNC_ADDRESS]"
        ),
    ] = None,
    nats_creds: Annotated[
        Path | None,
        cyclopts.Parameter(help="This fellow's NATS credentials file [SWARM_NATS_CREDS]"),
    ] = None,
    pool: Annotated[
        str | None,
        cyclopts.Parameter(help="The pool it is in (default: default) [SWARM_FELLOW_POOL]"),
    ] = None,
    labels: Annotated[
        str | None,
        cyclopts.Parameter(help="Its labels, e.g. gpu=a100,zone=eu [SWARM_FELLOW_LABELS]"),
    ] = None,
    log_level: Annotated[str | None, cyclopts.Parameter(help="[SWARM_LOG_LEVEL]")] = None,
) -> None:
    require_tensorflow("a fellow")  # its stages train with it: say so before joining
    settings = Settings.from_env().replace(
        nats_url=nats_url,
        fellow_name=name,
        data_address=data_address,
        sync_address=sync_address,
        nats_creds=nats_creds,
        fellow_pool=pool,
        fellow_labels=labels,
        log_level=log_level,
    )
    if settings.nats_url is None:
        raise ConfigError("no NATS server: pass --nats-url or set SWARM_NATS_URL")
    _gpus_from_nomad()
    configure_logging(settings.log_level)  # httpx/httpcore at WARNING: no request URLs logged
    trust_leader_ca(settings)  # before any HTTPS or wss:// connection
    if settings.enroll_token:
        from silentswarm.agent.runner import default_fellow_id

        name = settings.fellow_name or default_fellow_id()
        settings = settings.replace(fellow_name=name, nats_creds=enroll(settings, name))
    fellow_id = fellow_id_for(settings)
    if asyncio.run(_run(settings, settings.nats_access(settings.nats_url), fellow_id)):
        _restart()


def fellow_id_for(settings: Settings) -> str:
    """The fellow's id: its NATS user's name when it has credentials (NATS lets that user
    publish only that fellow's subjects), else the name given, else the host name."""
    if settings.nats_creds is None:
        from silentswarm.agent.runner import default_fellow_id

        return settings.fellow_name or default_fellow_id()
    user = read_creds_user_name(settings.nats_creds)
    if settings.fellow_name and settings.fellow_name != user:
        raise ConfigError(
            f"SWARM_FELLOW_NAME={settings.fellow_name!r} but the NATS credentials "
            f"{settings.nats_creds} are for fellow {user!r}: drop the name or use its own "
            "credentials"
        )
    return user


async def _run(settings: Settings, nats: NatsAccess, fellow_id: str) -> bool:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from silentswarm.agent.runner import FellowAgent

    agent = FellowAgent(settings, nats=nats, fellow_id=fellow_id)
    logging.getLogger().addHandler(agent.shipper)
    log.info("fellow %s (instance %s) joining %s", fellow_id, agent.identity.instance_id, nats.url)
    await agent.run(stop)
    log.info("fellow %s stopped", fellow_id)
    return agent.restart_requested


def _gpus_from_nomad() -> None:
    """Nomad's nvidia device plugin names the GPUs it assigned in NVIDIA_VISIBLE_DEVICES;
    outside containers TensorFlow (and NVML filtering here) go by CUDA_VISIBLE_DEVICES."""
    assigned = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    if (
        assigned
        and assigned not in ("all", "none", "void")
        and "CUDA_VISIBLE_DEVICES" not in os.environ
    ):
        os.environ["CUDA_VISIBLE_DEVICES"] = assigned


def _restart() -> None:
    """UPDATE: the same process (same pid, same supervisor) runs the installed agent anew."""
    logging.shutdown()
    # -P: the working directory stays off sys.path, so the new process imports the installed
    # package (a checkout or an 'agent' folder where the agent was started cannot shadow it).
    os.execv(sys.executable, [sys.executable, "-P", "-m", "silentswarm.agent.main", *sys.argv[1:]])


def main() -> None:
    run_or_exit("swarm-agent", app)


if __name__ == "__main__":
    main()
