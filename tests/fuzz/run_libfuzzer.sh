#!/usr/bin/env bash
# One libFuzzer target for a bounded time (CTest label libfuzzer, tests/sanitize.sh):
#
#   run_libfuzzer.sh BINARY SEED_CORPUS WORK_DIR SECONDS
#
# The fuzzer starts from the checked-in seeds (SEED_CORPUS, tests/fuzz/corpus/<target>/,
# read only) and writes what it finds new to WORK_DIR/corpus; a crash, leak or timeout
# leaves its input in WORK_DIR (crash-*, leak-*, timeout-*) and fails the test with
# libFuzzer's report. Reproduce with: BINARY WORK_DIR/crash-<sha1>.
set -euo pipefail
(($# == 4)) || { echo "usage: $0 BINARY SEED_CORPUS WORK_DIR SECONDS" >&2; exit 2; }
binary=$1 seeds=$2 work=$3 seconds=$4
mkdir -p "$work/corpus"
[[ -d "$seeds" ]] || { echo "run_libfuzzer.sh: no seed corpus at $seeds" >&2; exit 2; }
# -timeout: one input may take at most 10 s (the targets bound their own calls to 4 s);
# -rss_limit_mb: generous for ASan, still catches a runaway allocation.
exec "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$seeds"
