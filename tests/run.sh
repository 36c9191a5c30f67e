#!/usr/bin/env bash
# THE test command (README quick start, and what .ci/run calls):
#
#   ./tests/run.sh [extra ctest arguments, e.g. -L unit or -R Health]
#
# 1. installs the Debian packages (deploy/install-deps.sh; apt only when something is
#    missing);
# 2. configures build/ with CMake + Ninja (CUDA and RDMA on AUTO: the CUDA code is
#    compiled whenever nvcc exists, at /usr/local/cuda on CI, even without a GPU);
# 3. builds every target (tests included) with Ninja's [n/N] progress;
# 4. runs every CTest test but the GPU ones (labels unit, integration, multinode, fuzz,
#    security, install, python, and chaos: tests/chaos, about 2 minutes of seeded faults
#    whose seed it prints) with --output-on-failure: first the compute-only unit suites
#    (label cpu: kernels/host, op rules, spec tables, dtypes) two at a time, then the rest
#    one at a time; python (tests/python/run_pytest.sh) pip installs client/python into a
#    venv under the build directory and runs the pytest suites against a real epd
#    (EPD_SKIP_PYTHON_TESTS=1 skips it, reported as skipped);
# 5. builds epd and what the tests below run again under AddressSanitizer and
#    UndefinedBehaviorSanitizer together (build-asan-ubsan, -fsanitize=address,undefined)
#    with clang, host backend only, and runs the security, unit and integration tests there
#    (label cpu two at a time again), and every fuzz target against libFuzzer for 10 s
#    (label libfuzzer; tests/sanitize.sh); set EPD_SKIP_SANITIZERS=1 to skip it (a quick
#    local run);
# 6. runs the GPU tests (tests/gpu, CTest label gpu, one process each): without an NVIDIA
#    GPU (CI) each reports skipped with its reason; with one, an epd --backend=cuda runs on
#    a temporary socket for the end-to-end ones (EPD_TEST_SOCKET); set EPD_SKIP_GPU_TESTS=1
#    to skip the step.
# 7. checks that every example config in deploy/examples/ parses as a DaemonConfig.
#
# Environment: EPD_BUILD_DIR (default build/, the CI build directory), EPD_BUILD_TYPE
# (default Release, the same as deploy/demo.sh so the two quick-start commands share one
# build), EPD_JOBS (default nproc), EPD_WITH_CUDA (AUTO|ON|OFF), CTEST_PARALLEL_LEVEL
# (default 1: the integration tests time daemon behaviour, keep them off a loaded CPU),
# EPD_CPU_TEST_JOBS (default 2: the label cpu, which times nothing).
# Exits non-zero on the first failing step.
#
# CI's budget: 90 minutes on 2 cores with nothing cached. The time goes to the main build
# (CUDA code included), step 4's tests (~530 s: chaos 120 s, python 90 s), the sanitizer
# build (~1200 s uncached on 2 loaded cores) and its tests (~600-670 s). To keep it down:
# ASan and UBSan share one build (-fsanitize=address,undefined), so each sanitizer test is
# built and run once under both checks, not once per sanitizer; that build holds only what
# its labels run (target epd_sanitizer_tests); the label cpu runs two at a time (under ASan
# 98 s -> 53 s); the g++ fuzz drivers run 6 s each (fixed seed: the guided fuzzing is the
# libFuzzer runs). Estimated from those parts' measured times: a local dry run about 1620 s
# (2093 s before them), CI about 2500 s (3373 s before them).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${EPD_BUILD_DIR:-$ROOT/build}
BUILD_TYPE=${EPD_BUILD_TYPE:-Release}
JOBS=${EPD_JOBS:-$(nproc)}
START=$(date +%s)

SUMMARY=$(mktemp)
trap 'rm -f "$SUMMARY"' EXIT
step() { printf '\n==> [%s +%ds] %s\n' "$(date -u +%H:%M:%S)" "$(($(date +%s) - START))" "$*"; }
fail() { printf '\n[tests/run.sh] FAILED: %s\n' "$*" >&2; exit 1; }

step "1/7 dependencies (deploy/install-deps.sh)"
"$ROOT/deploy/install-deps.sh" || fail "installing dependencies"

step "2/7 configure $BUILD_DIR ($BUILD_TYPE, CUDA ${EPD_WITH_CUDA:-AUTO}, RDMA AUTO)"
configure_log=$(mktemp)
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja \
  -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
  -DEPD_WITH_CUDA="${EPD_WITH_CUDA:-AUTO}" \
  -DEPD_WITH_RDMA="${EPD_WITH_RDMA:-AUTO}" \
  -DEPD_BUILD_TESTS=ON | tee "$configure_log" || fail "cmake configure"
# CMakeLists.txt prints "epd: CUDA backend ON|OFF" and "epd: RDMA support ON|OFF".
if grep -q 'epd: CUDA backend ON' "$configure_log"; then
  echo "[tests/run.sh] CUDA code will be compiled (nvcc found)"
else
  echo "[tests/run.sh] CUDA backend not built (no nvcc, or EPD_WITH_CUDA=OFF)"
fi
rm -f "$configure_log"

step "3/7 build everything (ninja -j$JOBS)"
# Ninja prints [done/total] per edge; NINJA_STATUS adds the elapsed time.
NINJA_STATUS="[%f/%t %es] " cmake --build "$BUILD_DIR" -j "$JOBS" || fail "build"

step "4/7 ctest (unit, integration, multinode, chaos, fuzz, security, install, python)"
ctest --test-dir "$BUILD_DIR" --print-labels | sed 's/^/  /'
# --timeout is the default for tests that set none (integration and fuzz set their own).
# ctest's own summary line ("100% tests passed, 0 tests failed out of N") of every run is
# kept and printed again at the end, so the last lines of the log say what ran.
# Two runs: the compute-only unit suites (label cpu, tests/CMakeLists.txt) two at a time,
# then every other test one at a time (CTEST_PARALLEL_LEVEL).
ctest_log=$(mktemp)
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 -L cpu -LE gpu \
  --parallel "${EPD_CPU_TEST_JOBS:-2}" "$@" 2>&1 | tee "$ctest_log"
rc=${PIPESTATUS[0]}
set -e
grep -E 'tests passed|tests failed out of' "$ctest_log" | sed 's/^/  step 4 (cpu, 2 at a time): /' >>"$SUMMARY" || true
((rc == 0)) || fail "ctest -L cpu (see the output above)"
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 -LE 'gpu|cpu' \
  --parallel "${CTEST_PARALLEL_LEVEL:-1}" "$@" 2>&1 | tee "$ctest_log"
rc=${PIPESTATUS[0]}
set -e
grep -E 'tests passed|tests failed out of' "$ctest_log" | sed 's/^/  step 4 (unit, integration, multinode, chaos, fuzz, security, install, python): /' >>"$SUMMARY" || true
rm -f "$ctest_log"
((rc == 0)) || fail "ctest (see the output above)"

step "5/7 sanitizers: one ASan + UBSan build (clang, host backend)"
if [[ "${EPD_SKIP_SANITIZERS:-0}" == 1 ]]; then
  echo "[tests/run.sh] skipped: EPD_SKIP_SANITIZERS=1"
else
  san_log=$(mktemp)
  set +e
  EPD_JOBS="$JOBS" "$ROOT/tests/sanitize.sh" 2>&1 | tee "$san_log"
  rc=${PIPESTATUS[0]}
  set -e
  grep -E '^==> \[sanitize.sh\] .*: ctest|tests passed|tests failed out of' "$san_log" |
    sed 's/^/  step 5: /' >>"$SUMMARY" || true
  rm -f "$san_log"
  ((rc == 0)) || fail "sanitizer builds (see the output above)"
fi

step "6/7 GPU tests (ctest -L gpu)"
gpu_tests="$BUILD_DIR/tests/gpu/epd_gpu_tests"
if [[ "${EPD_SKIP_GPU_TESTS:-0}" == 1 ]]; then
  echo "[tests/run.sh] skipped: EPD_SKIP_GPU_TESTS=1"
elif [[ ! -x "$gpu_tests" ]]; then
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    fail "a GPU is present but $gpu_tests was not built (was the CUDA backend built?)"
  fi
  echo "[tests/run.sh] GPU tests not built (no CUDA backend) and no NVIDIA GPU: nothing to run"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  # Each test skips itself with the reason (no CUDA device); CTest reports them skipped.
  # Their names go to a log, not to the end of this output: nothing ran.
  gpu_log="$BUILD_DIR/gpu-tests-skipped.log"
  echo "[tests/run.sh] no NVIDIA GPU on this machine: every GPU test reports skipped" \
       "(names: $gpu_log)"
  ctest --test-dir "$BUILD_DIR" -L gpu --timeout 600 >"$gpu_log" 2>&1 ||
    { cat "$gpu_log"; fail "GPU tests"; }
  gpu_total=$(grep -cE '^[[:space:]]*[0-9]+ - .*[(]Skipped[)]' "$gpu_log" || true)
  echo "  step 6: $gpu_total GPU tests built, 0 run: no NVIDIA GPU (each skipped itself)" >>"$SUMMARY"
else
  nvidia-smi -L | sed 's/^/  /'
  # The end-to-end GPU tests talk to a real epd running the CUDA backend (EPD_TEST_SOCKET);
  # start one on a temporary socket for them and stop it afterwards.
  gpu_tmp=$(mktemp -d)
  "$BUILD_DIR/daemon/epd" --socket="$gpu_tmp/epd.sock" --backend=cuda \
    >"$gpu_tmp/epd.log" 2>&1 &
  gpu_epd=$!
  trap 'kill -TERM "$gpu_epd" 2>/dev/null; wait "$gpu_epd" 2>/dev/null; rm -rf "$gpu_tmp" "$SUMMARY"' EXIT
  for _ in $(seq 1 300); do
    "$BUILD_DIR/client/epctl" --socket="$gpu_tmp/epd.sock" health >/dev/null 2>&1 && break
    kill -0 "$gpu_epd" 2>/dev/null || { cat "$gpu_tmp/epd.log" >&2; fail "epd --backend=cuda did not start"; }
    sleep 0.1
  done
  "$BUILD_DIR/client/epctl" --socket="$gpu_tmp/epd.sock" status || fail "epd --backend=cuda not serving"
  # One process per test: the graph-mode program tests (GraphProgramTest,
  # CudaHotPathAllocProgramTest) need a process of their own and skip themselves otherwise.
  set +e
  EPD_TEST_SOCKET="$gpu_tmp/epd.sock" ctest --test-dir "$BUILD_DIR" -L gpu \
    --output-on-failure --timeout 600 2>&1 | tee "$gpu_tmp/ctest.log"
  rc=${PIPESTATUS[0]}
  set -e
  grep -E 'tests passed|tests failed out of' "$gpu_tmp/ctest.log" | sed 's/^/  step 6 (gpu): /' >>"$SUMMARY" || true
  ((rc == 0)) || fail "GPU tests (see the output above)"
fi

step "7/7 example configs parse as epd.v1.DaemonConfig"
"$ROOT/deploy/examples/check-configs.sh" "$BUILD_DIR" || fail "example configs"

step "all tests passed in $(($(date +%s) - START)) s"
echo "what ran (ctest's summary line of each run):"
cat "$SUMMARY"
