#!/bin/sh
# silentswarm-fellow postinst: the byte code of its tree (TensorFlow's import costs seconds
# more at every stage start without it), and the units' state the way dh_installsystemd's
# --no-enable --no-start --restart-after-upgrade snippets keep it: nothing is enabled or
# started at install; an upgrade restarts the units that were running.
set -e

FELLOW=/opt/silentswarm/fellow
UNITS="swarm-fellow.service swarm-serve.service"

case "$1" in
  configure|abort-upgrade|abort-deconfigure|abort-remove)
    # dpkg does not own the byte code: prerm removes it.
    /opt/silentswarm/bin/python -m compileall -q -j 0 "$FELLOW/site-packages" >/dev/null 2>&1 \
      || true
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
