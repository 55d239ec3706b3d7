#!/bin/sh
# silentswarm-fellow prerm: on removal, stop and disable the units (an upgrade leaves them
# running: postinst restarts them on the new files); always, remove the byte code postinst
# compiled (dpkg owns only the sources).
set -e

FELLOW=/opt/silentswarm/fellow
UNITS="swarm-serve.service swarm-fellow.service"

if [ "$1" = remove ]; then
  if [ -z "${DPKG_ROOT:-}" ] && [ -d /run/systemd/system ]; then
    # shellcheck disable=SC2086  # one argument per unit
    deb-systemd-invoke stop $UNITS >/dev/null || true
  fi
  # shellcheck disable=SC2086
  deb-systemd-helper disable $UNITS >/dev/null || true
fi
if [ -d "$FELLOW" ]; then
  find "$FELLOW" -type d -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
fi
exit 0
