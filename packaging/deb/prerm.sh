#!/bin/sh
# On removal: stop and disable the services. On upgrade: leave them running (postinst
# restarts the ones that run, on the new files).
set -e
if [ "$1" = "remove" ] && [ -d /run/systemd/system ]; then
  systemctl disable --now swarm-serve.service swarm-fellow.service swarm-leader.service \
    swarm-nats.service >/dev/null 2>&1 || true
fi
exit 0
