#!/bin/sh
# SilentSwarm fellow installer, served by a leader at /api/v1/bootstrap/fellow.sh.
#
#   curl -fsSL <leader>/api/v1/bootstrap/fellow.sh | sh -s -- --join <leader> <session> <token>
#   curl -fsSL <leader>/api/v1/bootstrap/fellow.sh | SWARM_JOIN_TOKEN=<token> sh -s -- \
#     --join <leader> <session>      (the token stays out of every process's arguments)
#
# Checks Python >= 3.11, claims the join session (its token works once), downloads the
# leader's package and checks its sha256, installs it into a venv under the prefix, writes
# the fellow's configuration and starts the agent (a systemd user unit when systemd runs,
# else a background process with a pid file). Every step's output goes to the join
# session's log on the leader.
#
# Options: --prefix DIR (default ~/.silentswarm), --name NAME (the fellow id), --python PATH,
# --pip-args "ARGS" (e.g. "--index-url https://mirror/simple" for an offline site),
# --site-packages DIR (add DIR to the venv's path: a pre-installed dependency set),
# --ca FILE (or SWARM_LEADER_CA=FILE: the CA of a leader whose HTTPS certificate a private CA
# signed; kept as $PREFIX/leader-ca.pem and trusted by the agent too), --no-systemd, --no-start.
#
# Secrets: everything it writes is private (umask 077: files 0600, directories 0700, the
# prefix too); the claim's answer (join.json: NATS JWT and seed, the session secret) is removed
# as soon as it is read, and on every exit; the join token and the session secret never go on
# a command line (the helper reads them from stdin or a 0600 file), nor into fellow.env.
set -eu
umask 077

PREFIX=""  # default $HOME/.silentswarm (no default without HOME: never a shared /tmp)
PYTHON="python3"
NAME=""
PIP_ARGS=""
SITE_PACKAGES=""
USE_SYSTEMD=1
START=1
LEADER=""
SESSION=""
TOKEN=""
CA="${SWARM_LEADER_CA:-}"

usage() {
  echo "usage: fellow.sh --join LEADER_URL SESSION_ID TOKEN [--prefix DIR] [--name NAME]" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --join)
      [ $# -ge 3 ] || usage
      LEADER="$2"; SESSION="$3"; shift 3
      # The token as an argument (older join commands: visible in this shell's arguments),
      # else from SWARM_JOIN_TOKEN below.
      if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then TOKEN="$1"; shift; fi ;;
    --prefix) PREFIX="$2"; shift 2 ;;
    --name) NAME="$2"; shift 2 ;;
    --python) PYTHON="$2"; shift 2 ;;
    --pip-args) PIP_ARGS="$2"; shift 2 ;;
    --site-packages) SITE_PACKAGES="$2"; shift 2 ;;
    --ca) CA="$2"; shift 2 ;;
    --no-systemd) USE_SYSTEMD=0; shift ;;
    --no-start) START=0; shift ;;
    *) usage ;;
  esac
done
[ -n "$LEADER" ] || usage
[ -n "$TOKEN" ] || TOKEN="${SWARM_JOIN_TOKEN:-}"
unset SWARM_JOIN_TOKEN  # no child inherits it
[ -n "$TOKEN" ] || usage

if [ -z "$PREFIX" ]; then
  if [ -z "${HOME:-}" ]; then
    echo "fellow.sh: HOME is not set: name the install directory with --prefix DIR" >&2
    exit 2
  fi
  PREFIX="$HOME/.silentswarm"
fi
mkdir -p "$PREFIX"
# Another user's directory (made before us, as anyone can in /tmp), or a link of theirs or to
# theirs, would let that user swap the venv, the helper or the credentials under us. A link of
# our own to a directory of our own (a bigger disk) is fine.
ME="$(id -u)"
if [ -z "$(find "$PREFIX" -prune -user "$ME" 2>/dev/null)" ] \
  || [ -z "$(find -H "$PREFIX" -prune -user "$ME" 2>/dev/null)" ]; then
  echo "fellow.sh: $PREFIX is another user's directory or link: refusing to install into it" >&2
  exit 1
fi
chmod 700 "$PREFIX"
LOG="$PREFIX/join.log"
: >"$LOG"
chmod 600 "$LOG"
HELPER="$PREFIX/join-helper.py"
JOIN="$PREFIX/join.json"
SECRET_FILE="$PREFIX/join.secret"
SENT=0

# join.json and the session secret go whatever happens; a signal exits through here too.
cleanup() {
  rm -f "$JOIN" "$SECRET_FILE"
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

say() {
  echo "$*"
  echo "$*" >>"$LOG"
}

# Ship the log lines written since the last call (best effort: the install goes on).
ship() {
  if [ -s "$SECRET_FILE" ]; then
    SENT=$("$PYTHON" "$HELPER" post "$LEADER" "$SESSION" "$SECRET_FILE" "$LOG" "$SENT" "${1:-ok}" 2>/dev/null || echo "$SENT")
  fi
}

fail() {
  say "FAILED: $*"
  ship failed
  exit 1
}

command -v "$PYTHON" >/dev/null 2>&1 || { echo "FAILED: $PYTHON not found; install Python >= 3.11" >&2; exit 1; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "FAILED: $PYTHON is older than 3.11" >&2; exit 1; }

cat >"$HELPER" <<'PY'
import hashlib, json, os, ssl, sys, time, urllib.request

def private(path, data):
    # 0600 also when the file was there before with another mode.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)

# A private CA for the leader's HTTPS (fellow.sh --ca): trusted alone, only the leader is asked.
CA = os.environ.get("SWARM_LEADER_CA") or None
TLS = ssl.create_default_context(cafile=CA) if CA else None

def call(method, url, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=TLS) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

cmd = sys.argv[1]
if cmd == "claim":
    leader, session, name, out = sys.argv[2:6]
    token = sys.stdin.readline().strip()  # never an argument: arguments are public
    claim = {"token": token, "fellow_name": name or None}
    for _ in range(30):  # 503: the leader is still loading the fellows it knows (seconds)
        status, body = call("POST", f"{leader}/api/v1/bootstrap/join-sessions/{session}/claim", claim)
        if status != 503:
            break
        time.sleep(2)
    if status != 200:
        try:
            message = json.loads(body)["message"]
        except Exception:
            message = body.decode(errors="replace")[:300]
        print(f"the leader refused the join ({status}): {message}")
        sys.exit(1)
    private(out, body)
elif cmd == "get":
    print(json.load(open(sys.argv[2]))[sys.argv[3]] or "")
elif cmd == "private":  # a secret field into its own 0600 file (exit 1: the answer has none)
    value = json.load(open(sys.argv[2])).get(sys.argv[3])
    if not value:
        sys.exit(1)
    private(sys.argv[4], value.encode())
elif cmd == "fetch":
    url, sha256, out = sys.argv[2:5]
    with urllib.request.urlopen(url, timeout=300, context=TLS) as r:
        data = r.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        print(f"sha256 of the package is {digest}, the leader announced {sha256}: refusing it")
        sys.exit(1)
    open(out, "wb").write(data)
elif cmd == "post":
    leader, session, secret_file, log, sent, result = sys.argv[2:8]
    secret = open(secret_file).read().strip()
    lines = open(log, errors="replace").read().splitlines()[int(sent):]
    if lines or result == "failed":
        status, _ = call("POST", f"{leader}/api/v1/bootstrap/join-sessions/{session}/logs",
                         {"lines": lines, "failed": result == "failed"},
                         {"authorization": f"Bearer {secret}"})
        if status != 200:
            sys.exit(1)
    print(int(sent) + len(lines))
PY

CA_LINE=""
if [ -n "$CA" ]; then
  [ -r "$CA" ] || fail "the CA file $CA (--ca, SWARM_LEADER_CA) cannot be read"
  if [ "$CA" != "$PREFIX/leader-ca.pem" ]; then cp "$CA" "$PREFIX/leader-ca.pem"; fi
  export SWARM_LEADER_CA="$PREFIX/leader-ca.pem"  # the helper's, and the agent's (fellow.env)
  CA_LINE="SWARM_LEADER_CA=$PREFIX/leader-ca.pem"
  say "trusting the CA in $CA for the leader's HTTPS"
fi

# The name this host proposes (the operator's, set on the session, wins): its NATS user is
# bound to the name the leader settles.
[ -n "$NAME" ] || NAME=$(hostname | cut -d. -f1 | tr -c 'A-Za-z0-9_\n-' '-' | cut -c1-64)
say "claiming join session $SESSION at $LEADER"
# The token goes on the helper's stdin (a here-document: no process's arguments).
"$PYTHON" "$HELPER" claim "$LEADER" "$SESSION" "$NAME" "$JOIN" >>"$LOG" 2>&1 <<END_TOKEN \
  || { cat "$LOG" >&2; exit 1; }
$TOKEN
END_TOKEN
TOKEN=""
# The secrets into their own 0600 files, the rest into variables; then join.json goes.
"$PYTHON" "$HELPER" private "$JOIN" secret "$SECRET_FILE" || fail "the leader sent no session secret"
NATS_URL=$("$PYTHON" "$HELPER" get "$JOIN" nats_url)
NAME=$("$PYTHON" "$HELPER" get "$JOIN" fellow_name)
PUBLIC_LEADER=$("$PYTHON" "$HELPER" get "$JOIN" leader_url)
[ -n "$PUBLIC_LEADER" ] || PUBLIC_LEADER="$LEADER"
CREDS_LINE=""
if "$PYTHON" "$HELPER" private "$JOIN" nats_creds "$PREFIX/fellow.creds"; then
  CREDS_LINE="SWARM_NATS_CREDS=$PREFIX/fellow.creds"
fi
PACKAGE=$("$PYTHON" "$HELPER" get "$JOIN" package_file)
SHA256=$("$PYTHON" "$HELPER" get "$JOIN" package_sha256)
rm -f "$JOIN"
say "fellow $NAME, NATS $NATS_URL${CREDS_LINE:+ (its own NATS user)}, package $PACKAGE"
ship

mkdir -p "$PREFIX/dist"
say "downloading $PACKAGE"
"$PYTHON" "$HELPER" fetch "$LEADER/api/v1/bootstrap/source" "$SHA256" "$PREFIX/dist/$PACKAGE" >>"$LOG" 2>&1 \
  || fail "the package did not check out; nothing was installed"
say "package sha256 $SHA256 verified"
ship

say "creating the venv $PREFIX/venv"
"$PYTHON" -m venv "$PREFIX/venv" >>"$LOG" 2>&1 || fail "could not create a venv (Debian: apt-get install python3-venv)"
if [ -n "$SITE_PACKAGES" ]; then
  SITE=$("$PREFIX/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$SITE_PACKAGES" >"$SITE/silentswarm-extra-site.pth"
  say "added $SITE_PACKAGES to the venv's path"
fi
# [fellow]: TensorFlow, which the base package leaves out (a leader host does not need it).
REQUIREMENT="$PREFIX/dist/${PACKAGE}[fellow]"
case "$NATS_URL" in
  ws://*|wss://*) REQUIREMENT="$PREFIX/dist/${PACKAGE}[fellow,websocket]" ;;  # NATS over WebSocket needs aiohttp
esac
say "installing $PACKAGE"
ship
# shellcheck disable=SC2086  # PIP_ARGS holds several arguments on purpose
"$PREFIX/venv/bin/python" -m pip install --disable-pip-version-check $PIP_ARGS "$REQUIREMENT" >>"$LOG" 2>&1 \
  || fail "pip could not install $PACKAGE (see the log above)"
say "installed"

mkdir -p "$PREFIX/state"
chmod 700 "$PREFIX/state"
rm -f "$PREFIX/fellow.env"  # written anew: 0600 (an older one may have had another mode)
cat >"$PREFIX/fellow.env" <<ENV
SWARM_NATS_URL=$NATS_URL
SWARM_FELLOW_NAME=$NAME
SWARM_STATE_DIR=$PREFIX/state
SWARM_FELLOW_PREFIX=$PREFIX
SWARM_FELLOW_PIP_ARGS="$PIP_ARGS"
SWARM_LEADER_URL=$PUBLIC_LEADER
$CREDS_LINE
$CA_LINE
ENV
say "wrote $PREFIX/fellow.env"
ship

if [ "$START" -eq 0 ]; then
  say "not starting the agent (--no-start): $PREFIX/venv/bin/swarm-agent"
  ship
  exit 0
fi
if [ "$USE_SYSTEMD" -eq 1 ] && command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1; then
  UNIT_DIR="${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user"
  mkdir -p "$UNIT_DIR"
  cat >"$UNIT_DIR/swarm-fellow.service" <<UNIT
[Unit]
Description=SilentSwarm fellow ($NAME)

[Service]
Type=notify
EnvironmentFile=$PREFIX/fellow.env
ExecStart=$PREFIX/venv/bin/swarm-agent
Restart=always
RestartSec=5

[Install]
WantedBy=default.target
UNIT
  systemctl --user daemon-reload
  systemctl --user enable --now swarm-fellow.service >>"$LOG" 2>&1 || fail "systemctl --user could not start the agent"
  say "started the agent as the systemd user unit swarm-fellow.service"
else
  # Without systemd: a background process, its pid in $PREFIX/fellow.pid.
  (
    set -a
    # shellcheck disable=SC1091  # written just above
    . "$PREFIX/fellow.env"
    set +a
    nohup "$PREFIX/venv/bin/swarm-agent" >>"$PREFIX/agent.log" 2>&1 &
    echo $! >"$PREFIX/fellow.pid"
  )
  say "started the agent in the background (pid $(cat "$PREFIX/fellow.pid"), log $PREFIX/agent.log)"
fi
ship
