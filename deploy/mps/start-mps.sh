#!/usr/bin/env bash
# Starts the CUDA MPS control daemon, so that epd's kernels and its clients' kernels run
# side by side on a GPU instead of time-slicing (docs/DEPLOYMENT.md §4). Idempotent: does
# nothing when it already runs.
#
#   deploy/mps/start-mps.sh [--exclusive]
#
# --exclusive also sets every GPU to EXCLUSIVE_PROCESS compute mode (only the MPS server
# then holds a context; a process that bypasses MPS fails instead of time-slicing).
# Environment (the same for epd and every client): CUDA_MPS_PIPE_DIRECTORY (default
# /run/nvidia-mps, not /tmp: epd.service has PrivateTmp=yes), CUDA_MPS_LOG_DIRECTORY
# (default /var/log/nvidia-mps). MPS serves one uid at a time: run it, epd and the clients
# as the same user.
set -euo pipefail

export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/run/nvidia-mps}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
log() { printf '[start-mps] %s\n' "$*"; }

exclusive=0
case "${1:-}" in
  "") ;;
  --exclusive) exclusive=1 ;;
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "start-mps.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "start-mps.sh: nvidia-cuda-mps-control not found: it ships with the NVIDIA driver" \
       "utilities (e.g. package nvidia-utils / nvidia-cuda-mps)." >&2
  exit 1
fi

# Running already? The control daemon answers queries on its control socket (a unix
# socket "control" in the pipe directory; a FIFO in old drivers).
if [[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]] &&
   echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
  log "MPS control daemon already running (pipes in $CUDA_MPS_PIPE_DIRECTORY); nothing to do"
  exit 0
fi

mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ((exclusive)); then
  log "setting every GPU to EXCLUSIVE_PROCESS compute mode"
  nvidia-smi -c EXCLUSIVE_PROCESS
fi
log "starting: nvidia-cuda-mps-control -d (pipes $CUDA_MPS_PIPE_DIRECTORY," \
    "logs $CUDA_MPS_LOG_DIRECTORY)"
nvidia-cuda-mps-control -d

# -d forks; wait (bounded) until the control pipe answers.
for _ in $(seq 1 50); do
  if echo get_server_list | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
    log "MPS control daemon running; set CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY" \
        "for epd and its clients"
    exit 0
  fi
  sleep 0.1
done
echo "start-mps.sh: the MPS control daemon did not answer within 5 s;" \
     "see $CUDA_MPS_LOG_DIRECTORY/control.log" >&2
exit 1
