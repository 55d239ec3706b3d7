#!/bin/sh
# Creates the system user; reloads systemd; starts nothing.
set -e
if [ "$1" = "configure" ]; then
  if ! getent passwd silentswarm >/dev/null; then
    useradd --system --user-group --home-dir /var/lib/silentswarm --no-create-home \
      --shell /usr/sbin/nologin --comment "SilentSwarm" silentswarm
  fi
  for group in video render; do
    if getent group "$group" >/dev/null; then usermod -a -G "$group" silentswarm; fi
  done
fi
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
  # An upgrade ($2 = the old version): restart what was running; start nothing new.
  if [ "$1" = "configure" ] && [ -n "$2" ]; then
    systemctl try-restart swarm-nats.service swarm-leader.service swarm-fellow.service \
      swarm-serve.service || true
  fi
fi
exit 0
