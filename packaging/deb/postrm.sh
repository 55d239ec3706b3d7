#!/bin/sh
# remove: the files Python wrote at run time (__pycache__); purge: the state too. The
# system user stays (files elsewhere may still belong to it).
set -e
case "$1" in
  remove|purge)
    rm -rf /opt/silentswarm
    ;;
esac
if [ "$1" = "purge" ]; then
  rm -rf /var/lib/silentswarm /etc/silentswarm
fi
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
exit 0
