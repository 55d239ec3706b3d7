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
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
exit 0
