#!/bin/sh
# silentswarm postinst: the system user, the venv's byte code, and the units' state the way
# dh_installsystemd's --no-enable --no-start --restart-after-upgrade snippets keep it: nothing
# is enabled or started at install; an upgrade restarts the units that were running.
set -e

PREFIX=/opt/silentswarm
UNITS="swarm-nats.service swarm-leader.service"

case "$1" in
  configure|abort-upgrade|abort-deconfigure|abort-remove)
    if ! getent passwd silentswarm >/dev/null; then
      useradd --system --user-group --home-dir /var/lib/silentswarm --no-create-home \
        --shell /usr/sbin/nologin --comment "SilentSwarm" silentswarm
    fi
    for group in video render; do
      if getent group "$group" >/dev/null; then usermod -a -G "$group" silentswarm; fi
    done
    # Byte code, which dpkg does not own (prerm removes it): without it every process that
    # starts compiles what it imports, and the services (not root) could not keep it.
    "$PREFIX/bin/python" -m compileall -q -j 0 "$PREFIX/lib" >/dev/null 2>&1 || true
    for unit in $UNITS; do
      if deb-systemd-helper debian-installed "$unit"; then
        deb-systemd-helper unmask "$unit" >/dev/null || true
        if deb-systemd-helper --quiet was-enabled "$unit"; then
          # The operator enabled it: keep its links current.
          deb-systemd-helper enable "$unit" >/dev/null || true
        fi
      fi
      deb-systemd-helper update-state "$unit" >/dev/null || true
    done
    if [ -d /run/systemd/system ]; then
      systemctl --system daemon-reload >/dev/null || true
      if [ -n "$2" ]; then
        # shellcheck disable=SC2086  # one argument per unit
        deb-systemd-invoke try-restart $UNITS >/dev/null || true
      fi
    fi
    ;;
esac
exit 0
