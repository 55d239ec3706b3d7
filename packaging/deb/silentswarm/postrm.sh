#!/bin/sh
# silentswarm postrm: purge removes the state (/var/lib/silentswarm: the leader's database,
# the NATS authority, the operator token), the configuration (/etc/silentswarm) and what is
# left of the venv. The system user stays (files elsewhere may still belong to it).
set -e

UNITS="swarm-nats.service swarm-leader.service"

if [ "$1" = purge ]; then
  if command -v deb-systemd-helper >/dev/null; then
    # shellcheck disable=SC2086  # one argument per unit
    deb-systemd-helper purge $UNITS >/dev/null || true
    # shellcheck disable=SC2086
    deb-systemd-helper unmask $UNITS >/dev/null || true
  fi
  rm -rf /var/lib/silentswarm /etc/silentswarm /opt/silentswarm
fi
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
  systemctl --system daemon-reload >/dev/null || true
fi
exit 0
