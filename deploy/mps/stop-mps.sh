#!/usr/bin/env bash
# Stops the CUDA MPS control daemon (and with it the MPS server) started by start-mps.sh.
# Stop epd first: its CUDA contexts live in the MPS server. Idempotent.
#
#   deploy/mps/stop-mps.sh [--default-compute-mode]
#
# --default-compute-mode also puts every GPU back in DEFAULT compute mode (undoes
# start-mps.sh --exclusive).
set -euo pipefail

export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/run/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
log() { printf '[stop-mps] %s\n' "$*"; }

reset_mode=0
case "${1:-}" in
  "") ;;
  --default-compute-mode) reset_mode=1 ;;
  -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "stop-mps.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  log "nvidia-cuda-mps-control not found: MPS is not installed; nothing to stop"
  exit 0
fi

if [[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]] &&
   echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
  log "stopping the MPS control daemon (pipes in $CUDA_MPS_PIPE_DIRECTORY)"
  echo quit | timeout 10 nvidia-cuda-mps-control
  # quit returns before the daemon has exited; wait (bounded) for the pipe to go quiet.
  for _ in $(seq 1 100); do
    echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1 || break
    sleep 0.1
  done
  log "stopped"
else
  log "no MPS control daemon answers on $CUDA_MPS_PIPE_DIRECTORY; nothing to stop"
fi

if ((reset_mode)); then
  log "setting every GPU back to DEFAULT compute mode"
  nvidia-smi -c DEFAULT
fi
