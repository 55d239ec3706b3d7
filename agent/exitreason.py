"""Why a stage runtime died of a signal, in words an operator can act on: pure.

A runtime the kernel's out-of-memory killer ends gets SIGKILL and writes nothing: its
stderr's last line is whatever TensorFlow logged before, and "exit -9" alone names no cause.
The kernel counts each such kill in the victim's memory cgroup (the agent's: a runtime stays
in its parent's group) and on the host (:func:`silentswarm.ram.oom_kills`); the supervisor
reads both when it starts a runtime and when the runtime is gone, and a count that rose in
between says what killed it.
"""

from __future__ import annotations

import signal

from silentswarm.errors import ErrorCode
from silentswarm.ram import OomKills

GIB = 1 << 30


def _rose(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before


def signal_reason(
    code: int, before: OomKills, after: OomKills, limit: int | None
) -> tuple[str, ErrorCode] | None:
    """What killed a runtime that exited with ``code`` (negative: the signal's number), given
    the out-of-memory kills counted at its start (``before``) and after its end (``after``),
    and the fellow's memory limit (None: its cgroup sets none below the host's memory); None
    for an exit that no signal caused."""
    if code >= 0:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code != signal.SIGKILL:
        return f"the stage runtime was killed by {name}", ErrorCode.STAGE_FAILED
    if _rose(before.group, after.group):
        held = f"its limit of {limit / GIB:.1f} GiB" if limit is not None else "its limit"
        return (
            "the kernel's out-of-memory killer ended the stage runtime: the fellow's memory "
            f"cgroup reached {held} (the stage and what else runs in the fellow's container "
            "needed more: raise its memory limit)",
            ErrorCode.STAGE_OUT_OF_MEMORY,
        )
    if _rose(before.host, after.host):
        return (
            "the kernel's out-of-memory killer ended the stage runtime: the host ran out of "
            "memory (/proc/vmstat oom_kill rose while it ran)",
            ErrorCode.STAGE_OUT_OF_MEMORY,
        )
    return (
        "the stage runtime was killed by SIGKILL from outside the agent (an operator, a "
        "service manager, a memory watchdog)",
        ErrorCode.STAGE_FAILED,
    )
