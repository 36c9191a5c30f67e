#!/usr/bin/env bash
# epd under AddressSanitizer and UndefinedBehaviorSanitizer (what tests/run.sh runs in CI):
#
#   ./tests/sanitize.sh                    build-asan-ubsan: ASan (+ LeakSanitizer) and UBSan
#                                          in one build (-fsanitize=address,undefined minus
#                                          vptr, every check fatal): what CI runs
#   ./tests/sanitize.sh address            build-asan only  (-fsanitize=address, + LeakSanitizer)
#   ./tests/sanitize.sh undefined          build-ubsan only (-fsanitize=undefined minus vptr, every check fatal)
#
# Each build is host-only (EPD_WITH_CUDA=OFF), compiled with Debian's clang 14
# (deploy/install-deps.sh installs it) through the EPD_SANITIZE option of CMakeLists.txt
# (presets asan and ubsan configure build-asan and build-ubsan). Only epd's own code is
# instrumented: gRPC, protobuf and abseil are Debian's, which ASan and UBSan allow.
# Each runs the CTest labels security, unit and integration: real epd and client processes,
# every one of them instrumented. ASan and UBSan are compatible: the one build with both
# runs every test once under both checks. Each build holds only what its labels run (the target
# epd_sanitizer_tests of tests/CMakeLists.txt: no multinode, chaos or bench programs, no
# g++ fuzz drivers). The unit suites labelled cpu (compute only) run two at a time, every
# other test one at a time. The ASan builds also build every fuzz target against clang's
# libFuzzer (EPD_LIBFUZZER; epd's code gets libFuzzer's edge counters) and run each for
# 10 s from its seed corpus, tests/fuzz/corpus/<target>/ (label libfuzzer). A finding
# fails the test that made it: ASan and UBSan abort the process at the first error
# (-fno-sanitize-recover=all for UBSan), and LeakSanitizer makes a leaking process exit
# non-zero when it exits; every test checks exit codes. No suppressions are needed: gRPC,
# protobuf and abseil keep what they hold at exit reachable, so LeakSanitizer finds
# nothing of theirs.
#
# Environment: EPD_JOBS (default nproc), EPD_SANITIZE_CC / EPD_SANITIZE_CXX (default
# clang-14 / clang++-14), CTEST_PARALLEL_LEVEL (default 1), EPD_CPU_TEST_JOBS (default 2:
# the label cpu). Extra arguments after the kinds go to ctest (e.g. `./tests/sanitize.sh
# address -- -R Startup`).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
JOBS=${EPD_JOBS:-$(nproc)}
CC_BIN=${EPD_SANITIZE_CC:-clang-14}
CXX_BIN=${EPD_SANITIZE_CXX:-clang++-14}
START=$(date +%s)

kinds=()
while (($# > 0)); do
  case "$1" in
    address|undefined|address,undefined) kinds+=("$1"); shift ;;
    --) shift; break ;;
    *) echo "sanitize.sh: unknown argument '$1' (address, undefined, address,undefined, or --" \
            "ctest arguments)" >&2
       exit 2 ;;
  esac
done
((${#kinds[@]} > 0)) || kinds=(address,undefined)

for tool in "$CC_BIN" "$CXX_BIN"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "sanitize.sh: $tool not found: run deploy/install-deps.sh (clang-14)" >&2
    exit 1
  fi
done

# Findings are reported with file:line (llvm-symbolizer, Debian's llvm-14).
symbolizer=/usr/lib/llvm-14/bin/llvm-symbolizer
if [[ -x "$symbolizer" ]]; then export ASAN_SYMBOLIZER_PATH="$symbolizer"; fi
# ASan stops at the first error (the default) with a report naming the stacks; leaks are
# reported when each process exits (detect_leaks); static initialisation order is checked.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:check_initialization_order=1:strict_init_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

for kind in "${kinds[@]}"; do
  labels='security|unit|integration'
  libfuzzer=OFF
  case "$kind" in
    # The ASan builds also build every fuzz target against libFuzzer and run each for
    # EPD_LIBFUZZER_SECONDS (10) from its seed corpus (CTest label libfuzzer).
    address) dir=$ROOT/build-asan; libfuzzer=ON; labels="$labels|libfuzzer" ;;
    address,undefined) dir=$ROOT/build-asan-ubsan; libfuzzer=ON; labels="$labels|libfuzzer" ;;
    undefined) dir=$ROOT/build-ubsan ;;
  esac
  begin=$(date +%s)
  echo "==> [sanitize.sh] $kind: configure $dir ($CXX_BIN, host only)"
  cmake -S "$ROOT" -B "$dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
    -DEPD_WITH_CUDA=OFF -DEPD_SANITIZE="$kind" -DEPD_LIBFUZZER="$libfuzzer" \
    -DEPD_BUILD_TESTS=ON >/dev/null
  echo "==> [sanitize.sh] $kind: build epd_sanitizer_tests (ninja -j$JOBS)"
  NINJA_STATUS="[%f/%t %es] " cmake --build "$dir" -j "$JOBS" --target epd_sanitizer_tests
  built=$(date +%s)
  echo "==> [sanitize.sh] $kind: ctest -L '$labels'"
  # The compute-only unit suites (label cpu) two at a time, then the rest one at a time.
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -L "$labels" -L cpu \
    --parallel "${EPD_CPU_TEST_JOBS:-2}" "$@"
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -L "$labels" -LE cpu \
    --parallel "${CTEST_PARALLEL_LEVEL:-1}" "$@"
  echo "==> [sanitize.sh] $kind: built in $((built - begin)) s, tests ran in" \
       "$(($(date +%s) - built)) s"
done
echo "==> [sanitize.sh] done in $(($(date +%s) - START)) s"
