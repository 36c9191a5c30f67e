#!/usr/bin/env bash
# Runs DeepEP's own V1 tests (tests/legacy/test_intranode.py and test_low_latency.py of
# DeepEP v2.1.0), unmodified, against the `deep_ep` drop-in on a CUDA machine, through a
# real epd --backend=cuda, in both launch modes. Their files are not part of epd: pass the
# folder that holds them (keep it out of git, e.g. .scratch/deepep/).
#
#   tests/python/gpu/run_deepep_conformance.sh DEEPEP_TESTS_DIR [client|daemon ...]
#
# Needs: epd and epctl on PATH (or EPD_BIN_DIR), libepdclient.so and epd.h findable by
# client/python/setup.py (EPD_PREFIX), a python3 with torch (CUDA) and pybind11. Ranks that
# share one GPU need MPS for their kernels to run side by side: the script starts it with
# deploy/mps/start-mps.sh when nvidia-cuda-mps-control exists and stops it at the end.
# Environment: EPD_CONFORMANCE_ARGS (extra arguments to both tests, e.g.
# "--num-processes 8"), EPD_CONFORMANCE_TIMEOUT (seconds per test, default 900).
# Output: each test's own output, then one line per (test, mode) with its exit status.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
tests_dir=${1:?usage: run_deepep_conformance.sh DEEPEP_TESTS_DIR [client|daemon ...]}
shift
modes=("$@")
((${#modes[@]})) || modes=(client daemon)
tests_dir=$(cd "$tests_dir" && pwd)
for f in test_intranode.py test_low_latency.py; do
  [[ -f "$tests_dir/$f" ]] || { echo "no $tests_dir/$f" >&2; exit 2; }
done
[[ -n "${EPD_BIN_DIR:-}" ]] && export PATH="$EPD_BIN_DIR:$PATH"
command -v epd >/dev/null || { echo "epd not on PATH (set EPD_BIN_DIR)" >&2; exit 2; }

work=$(mktemp -d)
site="$work/site"
echo "==> installing client/python and client/python/deep_ep_dropin into $site"
python3 -m pip install -q --no-build-isolation --no-deps --no-index --target "$site" \
  "$ROOT/client/python" "$ROOT/client/python/deep_ep_dropin" || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import deep_ep, epd; print("deep_ep from", deep_ep.__file__, "| epd", epd.__version__)' || exit 1

mps_started=0
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/run/nvidia-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
  bash "$ROOT/deploy/mps/start-mps.sh" && mps_started=1
fi

epd_pid=
cleanup() {
  [[ -n "$epd_pid" ]] && { kill -TERM "$epd_pid" 2>/dev/null; wait "$epd_pid" 2>/dev/null; }
  ((mps_started)) && bash "$ROOT/deploy/mps/stop-mps.sh" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT

export EPD_SOCKET="$work/epd.sock"
epd --socket="$EPD_SOCKET" --backend=cuda >"$work/epd.log" 2>&1 &
epd_pid=$!
for _ in $(seq 1 300); do
  epctl --socket="$EPD_SOCKET" health >/dev/null 2>&1 && break
  kill -0 "$epd_pid" 2>/dev/null || { cat "$work/epd.log"; echo "epd did not start" >&2; exit 1; }
  sleep 0.1
done

results=()
status=0
cd "$tests_dir" || exit 1
for mode in "${modes[@]}"; do
  for t in test_intranode.py test_low_latency.py; do
    echo
    echo "==> $t, launch mode $mode ($(date -u +%H:%M:%S))"
    start=$(date +%s)
    # shellcheck disable=SC2086
    EPD_LAUNCH_MODE=$mode PYTHONUNBUFFERED=1 timeout "${EPD_CONFORMANCE_TIMEOUT:-900}" \
      python3 "$t" ${EPD_CONFORMANCE_ARGS:-}
    rc=$?
    results+=("$t launch_mode=$mode: exit $rc in $(($(date +%s) - start)) s")
    ((rc == 0)) || status=1
  done
done
echo
echo "==> epd log (last 20 lines)"
tail -20 "$work/epd.log"
echo
echo "==> DeepEP conformance"
printf '  %s\n' "${results[@]}"
exit $status
