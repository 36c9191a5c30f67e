#!/usr/bin/env bash
# Issue 4's launch-mode benchmark on a GPU machine: `epd_bench --mode=launch` without MPS,
# then again with the MPS control daemon started by deploy/mps/start-mps.sh (the bench reads
# whether MPS is active from the daemon's GetStats and labels the daemon-launched figure
# "daemon+mps"), then MPS is stopped again. Run from the repository root.
#
#   tests/bench/run_launch.sh [OUT_DIR] [-- extra epd_bench flags]
#
# epd_bench and epd are taken from PATH (e.g. after `source .device-xx/env.sh`), or from
# $EPD_BENCH / $EPD_BINARY. Writes OUT_DIR/launch.txt, launch.json, launch_mps.txt and
# launch_mps.json (OUT_DIR default: .). Exit code: 0 when both runs measured everything.
set -uo pipefail

out=${1:-.}
shift || true
[[ "${1:-}" == "--" ]] && shift
bench=${EPD_BENCH:-$(command -v epd_bench)}
epd=${EPD_BINARY:-$(command -v epd)}
if [[ -z "$bench" || -z "$epd" ]]; then
  echo "run_launch.sh: epd_bench or epd not found (PATH, \$EPD_BENCH, \$EPD_BINARY)" >&2
  exit 2
fi
mkdir -p "$out"
rc=0

limit=${EPD_BENCH_TIMEOUT:-150}  # seconds per epd_bench run
run() {  # run NAME: table, then JSON
  timeout "$limit" "$bench" --backend=cuda --mode=launch --epd="$epd" "$@" 2>&1 |
    tee "$out/$name.txt" || rc=1
  timeout "$limit" "$bench" --backend=cuda --mode=launch --epd="$epd" --json "$@" \
    >"$out/$name.json" || rc=1
}

echo "== launch modes, MPS off ($(date -u +%FT%TZ))"
name=launch run "$@"

echo "== launch modes, MPS on ($(date -u +%FT%TZ))"
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/run/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
if deploy/mps/start-mps.sh; then
  name=launch_mps run "$@"
  deploy/mps/stop-mps.sh || rc=1
else
  echo "run_launch.sh: MPS could not be started: the daemon-launched figure under MPS was" \
       "NOT measured" | tee "$out/launch_mps.txt"
  rc=1
fi
exit $rc
