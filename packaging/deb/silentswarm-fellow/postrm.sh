#!/bin/sh
# silentswarm-fellow postrm: purge removes the fellow's and the completion server's state
# (/var/lib/silentswarm/fellow, .../serve), a GPU site installed as docs/deploy/debian.md
# says (/var/lib/silentswarm/gpu), and what is left of its tree. Removal keeps them.
set -e

UNITS="swarm-fellow.service swarm-serve.service"

if [ "$1" = purge ]; then
  if command -v deb-systemd-helper >/dev/null; then
    # shellcheck disable=SC2086  # one argument per unit
    deb-systemd-helper purge $UNITS >/dev/null || true
    # shellcheck disable=SC2086
    deb-systemd-helper unmask $UNITS >/dev/null || true
  fi
  rm -rf /var/lib/silentswarm/fellow /var/lib/silentswarm/serve \
    /var/lib/silentswarm/gpu /opt/silentswarm/fellow
fi
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
  systemctl --system daemon-reload >/dev/null || true
fi
exit 0
