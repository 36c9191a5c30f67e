#!/usr/bin/env bash
# The main job, from a fresh clone (README "Quick start"): installs the Debian packages,
# builds epd, epctl and the MoE demo in build/, starts epd on a temporary socket with
# --backend=auto, shows `epctl status`, runs the MoE layer demo (client/examples/
# moe_layer.cc) with EPD_DEMO_RANKS rank processes, then its Python twin: installs the epd
# Python package and the deep_ep drop-in into a venv (BUILD_DIR/python/venv, Debian's
# python3 with --system-site-packages for torch; no network) and runs client/examples/
# moe_layer.py through deep_ep. Stops epd (also on Ctrl-C or failure) and exits non-zero
# when either demo failed.
#
# Environment: EPD_JOIN_SECRET (default: a random one), EPD_BUILD_DIR (build/),
# EPD_BUILD_TYPE (Release), EPD_JOBS (nproc), EPD_DEMO_RANKS (1, 2, 4, 8, 16 or 32;
# default 8), EPD_BACKEND (auto|cuda|host), EPD_WITH_CUDA (AUTO|ON|OFF, as tests/run.sh),
# EPD_PYTHON (the interpreter of the venv; default /usr/bin/python3), EPD_DEMO_PYTHON
# (1; 0 skips the Python demo).
# A bad value is refused (exit 2, naming the variable) before anything is installed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${EPD_BUILD_DIR:-$ROOT/build}
BUILD_TYPE=${EPD_BUILD_TYPE:-Release}
JOBS=${EPD_JOBS:-$(nproc)}
RANKS=${EPD_DEMO_RANKS:-8}
BACKEND=${EPD_BACKEND:-auto}
EPD="$BUILD_DIR/daemon/epd"
EPCTL="$BUILD_DIR/client/epctl"
DEMO="$BUILD_DIR/client/moe_layer"
PYTHON=${EPD_PYTHON:-/usr/bin/python3}
PY_DEMO=${EPD_DEMO_PYTHON:-1}
VENV="$BUILD_DIR/python/venv"

step() { printf '\n==> %s\n' "$*"; }

# ---- the inputs, checked before anything is installed, built or started ----
usage_error() {
  echo "demo.sh: $*" >&2
  exit 2
}
case "$RANKS" in  # the demo's 32 experts are split evenly over the ranks
  1|2|4|8|16|32) ;;
  *) usage_error "EPD_DEMO_RANKS=$RANKS: must be a divisor of the demo's 32 experts:" \
       "1, 2, 4, 8, 16 or 32 (default 8)" ;;
esac
case "$BACKEND" in
  auto|cuda|host) ;;
  *) usage_error "EPD_BACKEND=$BACKEND: must be auto, cuda or host (default auto)" ;;
esac
case "${EPD_WITH_CUDA:-AUTO}" in
  AUTO|ON|OFF) ;;
  *) usage_error "EPD_WITH_CUDA=$EPD_WITH_CUDA: must be AUTO, ON or OFF (default AUTO)" ;;
esac
case "$BUILD_TYPE" in
  Release|RelWithDebInfo|Debug|MinSizeRel) ;;
  *) usage_error "EPD_BUILD_TYPE=$BUILD_TYPE: must be Release, RelWithDebInfo, Debug or" \
       "MinSizeRel (default Release)" ;;
esac
case "$PY_DEMO" in
  0|1) ;;
  *) usage_error "EPD_DEMO_PYTHON=$PY_DEMO: must be 1 (run the Python demo) or 0 (default 1)" ;;
esac
if [[ "$PY_DEMO" == 1 && ! -x "$PYTHON" ]]; then
  usage_error "EPD_PYTHON=$PYTHON: not an executable Python interpreter" \
    "(default /usr/bin/python3, Debian's, which has python3-torch)"
fi
if [[ ! "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
  usage_error "EPD_JOBS=$JOBS: must be a positive number of parallel build jobs" \
    "(default: the number of cores)"
fi

step "dependencies (deploy/install-deps.sh)"
"$ROOT/deploy/install-deps.sh"

step "configure $BUILD_DIR ($BUILD_TYPE)"
# CMakeLists.txt prints "epd: CUDA backend ON|OFF" and "epd: RDMA support ON|OFF".
configure_log=$(mktemp)
if ! cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
     -DEPD_WITH_CUDA="${EPD_WITH_CUDA:-AUTO}" >"$configure_log" 2>&1; then
  cat "$configure_log" >&2
  rm -f "$configure_log"
  echo "demo.sh: cmake configure failed" >&2
  exit 1
fi
grep -E '^-- epd: ' "$configure_log" || true
rm -f "$configure_log"
if grep -q '^EPD_WITH_CUDA:[A-Z]*=OFF' "$BUILD_DIR/CMakeCache.txt"; then
  echo "(EPD_WITH_CUDA=OFF in $BUILD_DIR: host backend only)"
fi

targets=(epd epctl)
have_demo=0
if [[ -f "$ROOT/client/examples/moe_layer.cc" ]]; then
  targets+=(moe_layer)
  have_demo=1
fi
if [[ "$PY_DEMO" == 1 ]]; then
  targets+=(epdclient_shared)  # libepdclient.so, which the Python package links
fi
step "build ${targets[*]} (ninja -j$JOBS)"
NINJA_STATUS="[%f/%t %es] " cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"

# ---- start epd on a temporary socket; stop it whatever happens next ----
tmp=$(mktemp -d "${TMPDIR:-/tmp}/epd-demo.XXXXXX")
sock="$tmp/epd.sock"
epd_pid=""
# shellcheck disable=SC2317  # invoked by the EXIT trap
stop_epd() {
  if [[ -n "$epd_pid" ]] && kill -0 "$epd_pid" 2>/dev/null; then
    echo
    echo "==> stopping epd (pid $epd_pid, SIGTERM)"
    kill -TERM "$epd_pid" 2>/dev/null || true
    for _ in $(seq 1 100); do  # epd exits within 5 s of SIGTERM; wait up to 10 s
      kill -0 "$epd_pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$epd_pid" 2>/dev/null; then
      echo "epd did not exit within 10 s of SIGTERM; killing it" >&2
      kill -KILL "$epd_pid" 2>/dev/null || true
    fi
    wait "$epd_pid" 2>/dev/null && echo "epd exited 0" || echo "epd exited with status $?"
  fi
  rm -rf "$tmp"
}
trap stop_epd EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "start epd --socket=$sock --backend=$BACKEND (log: $tmp/epd.log)"
"$EPD" --socket="$sock" --backend="$BACKEND" --log_level=info >"$tmp/epd.log" 2>&1 &
epd_pid=$!

# Wait (bounded: CUDA start-up on many GPUs takes a few seconds) for health SERVING.
ready=0
for _ in $(seq 1 300); do
  if ! kill -0 "$epd_pid" 2>/dev/null; then
    echo "epd exited during start-up; its log:" >&2
    cat "$tmp/epd.log" >&2
    epd_pid=""
    exit 1
  fi
  if "$EPCTL" --socket="$sock" health >/dev/null 2>&1; then
    ready=1
    break
  fi
  sleep 0.1
done
if ((!ready)); then
  echo "epd did not report SERVING within 30 s; its log:" >&2
  cat "$tmp/epd.log" >&2
  exit 1
fi
sed 's/^/  epd| /' "$tmp/epd.log"

step "epctl status"
"$EPCTL" --socket="$sock" status

if ((!have_demo)); then
  step "the MoE demo is not built yet"
  echo "client/examples/moe_layer.cc does not exist in this tree, so only epd and" \
       "epctl status were shown."
  exit 0
fi

step "MoE layer demo: $RANKS ranks (router -> dispatch -> expert FFN -> combine)"
# The group's join secret for every rank (docs/SECURITY.md "Groups, owners, secrets,
# quotas"): only processes that present it may join the demo group's ranks. Handed over in
# the environment, as MASTER_ADDR is.
if [[ -z "${EPD_JOIN_SECRET:-}" ]]; then
  EPD_JOIN_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
fi
export EPD_JOIN_SECRET
status=0
"$DEMO" --socket="$sock" --num_ranks="$RANKS" || status=$?

step "epctl groups after the demo"
"$EPCTL" --socket="$sock" groups || true

# ---- the Python twin: the epd package + deep_ep drop-in in a venv, moe_layer.py ----
py_status=0
py_result="skipped (EPD_DEMO_PYTHON=0)"
backend_now=$("$EPCTL" --socket="$sock" status | sed -n 's/^backend: \([a-z]*\).*/\1/p' || true)
if [[ "$PY_DEMO" == 1 ]]; then
  step "Python: venv $VENV ($PYTHON, --system-site-packages)"
  if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  dropin=()
  [[ -d "$ROOT/client/python/deep_ep_dropin" ]] && dropin=("$ROOT/client/python/deep_ep_dropin")
  step "pip install --no-build-isolation client/python ${dropin[*]:+client/python/deep_ep_dropin} (no network)"
  # setup.py finds libepdclient.so in EPD_BUILD_DIR; the extension keeps an rpath to it.
  EPD_BUILD_DIR="$BUILD_DIR" PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$VENV/bin/pip" install --quiet --no-build-isolation --no-deps --force-reinstall \
    "$ROOT/client/python" "${dropin[@]}"
  "$VENV/bin/python" -c 'import epd; print("epd", epd.__version__, "from", epd.__file__)'
  if [[ "$backend_now" == cuda ]] &&
     ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    py_result="skipped: epd runs the CUDA backend and this torch has no CUDA"
    step "Python MoE layer demo $py_result (EPD_BACKEND=host runs it on the CPU)"
  else
    step "Python MoE layer demo: $RANKS ranks through deep_ep (client/examples/moe_layer.py)"
    "$VENV/bin/python" "$ROOT/client/examples/moe_layer.py" --socket="$sock" \
      --num-ranks="$RANKS" || py_status=$?
    if ((py_status == 0)); then
      py_result="passed"
    else
      py_result="FAILED (exit status $py_status)"
    fi
  fi
fi

if ((status == 0 && py_status == 0)); then
  step "demo passed: the $RANKS-rank MoE layer through epd matches the single-process result" \
    "(C++); Python through deep_ep: $py_result"
else
  step "demo FAILED (C++ exit status $status; Python: $py_result); epd's log:"
  sed 's/^/  epd| /' "$tmp/epd.log"
fi
((status == 0)) || exit "$status"
exit "$py_status"
