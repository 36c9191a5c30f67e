#!/usr/bin/env bash
# Runs N seeded instances of epd_chaos at once (host backend), for long runs on a machine
# with many cores (the GPU machine's CPUs):
#
#   tests/chaos/parallel.sh [--instances=N] [--seconds=S] [--seed=BASE] [--out=DIR] [-- args]
#
# Instance i gets --seed=BASE+i and writes DIR/chaos_<i>.log. GPUs are hidden from the
# daemons (CUDA_VISIBLE_DEVICES=""): a CUDA build of epd opens every GPU at start-up even
# with --backend=host, and many daemons doing so at once miss their start-up deadline.
# Binaries: EPD_CHAOS_BINARY (default: epd_chaos on PATH, then build/tests/epd_chaos), and
# EPD_BINARY / EPCTL_BINARY / EPD_MN_CLIENT_BINARY as epd_chaos reads them.
# Prints one line per instance (seed, cycles, passed, seconds, result) and the total
# instance-time; exits 1 if any instance failed.
set -uo pipefail

instances=4
seconds=600
seed=$(date +%s)
out=""
extra=()
while (($#)); do
  case "$1" in
    --instances=*) instances=${1#*=} ;;
    --seconds=*) seconds=${1#*=} ;;
    --seed=*) seed=${1#*=} ;;
    --out=*) out=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "parallel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if ! [[ "$instances" =~ ^[1-9][0-9]*$ && "$seconds" =~ ^[1-9][0-9]*$ && "$seed" =~ ^[0-9]+$ ]]; then
  echo "parallel.sh: --instances, --seconds and --seed must be positive integers" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=${EPD_CHAOS_BINARY:-$(command -v epd_chaos || echo "$root/build/tests/epd_chaos")}
[[ -x "$bin" ]] || { echo "parallel.sh: no epd_chaos at $bin (set EPD_CHAOS_BINARY)" >&2; exit 2; }
out=${out:-$(mktemp -d /tmp/epd-chaos-parallel.XXXXXX)}
mkdir -p "$out"

echo "parallel.sh: $instances instance(s) x ${seconds}s, seeds $seed..$((seed + instances - 1)), logs in $out"
pids=()
for ((i = 0; i < instances; ++i)); do
  CUDA_VISIBLE_DEVICES="" timeout $((seconds + 300)) "$bin" --seconds="$seconds" \
    --seed=$((seed + i)) "${extra[@]}" >"$out/chaos_$i.log" 2>&1 &
  pids+=($!)
done
failed=0
total_seconds=0
printf '%-9s %-12s %7s %7s %8s  %s\n' instance seed cycles passed seconds result
for ((i = 0; i < instances; ++i)); do
  wait "${pids[$i]}"
  rc=$?
  log="$out/chaos_$i.log"
  # The summary's "total" row: cycles and passes; its header line: the seconds.
  read -r cycles passed < <(awk '$1 == "total" {print $2, $3}' "$log" | tail -1)
  secs=$(sed -n 's/^\[chaos\] summary (seed=[0-9]*, \([0-9]*\) s):.*/\1/p' "$log" | tail -1)
  result=$([[ $rc == 0 ]] && echo passed || echo "FAILED (rc=$rc): $(grep -m1 'FAILED seed=' "$log")")
  ((rc == 0)) || failed=1
  total_seconds=$((total_seconds + ${secs:-0}))
  printf '%-9s %-12s %7s %7s %8s  %s\n' "$i" $((seed + i)) "${cycles:-?}" "${passed:-?}" \
    "${secs:-?}" "$result"
done
echo "parallel.sh: ${total_seconds} s ($((total_seconds / 60)) min) of chaos in all, over $instances instance(s)"
exit $failed
