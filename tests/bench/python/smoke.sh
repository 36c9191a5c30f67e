#!/usr/bin/env bash
# CTest bench.py_overhead_smoke (labels bench, python): py_overhead.py runs end to end at a
# tiny shape (2 ranks, a few ops) against its own epd --backend=host and prints its table
# and JSON. It checks that the bench works, not its figures (no timed assertion).
#   tests/bench/python/smoke.sh BUILD_DIR
# Uses the venv python.pytest builds (BUILD_DIR/python/venv, CTest runs that test first);
# without it the test is skipped (exit 77) with the reason printed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "${1:?usage: smoke.sh BUILD_DIR}" && pwd)
fail() { echo "smoke.sh: FAILED: $*" >&2; exit 1; }

if [[ "${EPD_SKIP_PYTHON_TESTS:-0}" == 1 ]]; then
  echo "smoke.sh: skipped: EPD_SKIP_PYTHON_TESTS=1"
  exit 77
fi
python=$build/python/venv/bin/python
if [[ ! -x "$python" ]] || ! "$python" -c "import epd" 2>/dev/null; then
  echo "smoke.sh: skipped: no venv with the epd package at $build/python/venv" \
       "(CTest python.pytest builds it: ctest -R 'python.pytest|py_overhead')"
  exit 77
fi
[[ -x "$build/daemon/epd" ]] || fail "$build/daemon/epd not built"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
EPD_BUILD_DIR=$build "$python" "$here/py_overhead.py" --epd "$build/daemon/epd" \
  --build-dir "$build/tests/bench/python" --ranks 2 --tokens 8 --hidden 256 --topk 2 \
  --experts 4 --mll 8 --iters 3 --blocks 1 --warmup 1 --alloc-iters 2 --timeout 60 \
  --json "$out/result.json" | tee "$out/table.txt" || fail "py_overhead.py exited non-zero"
for row in "dispatch submit (CPU)" "dispatch complete (CPU, op done)" \
           "dispatch: added per op" "combine: added per op" "combine end to end (wait)" \
           "new tensor objects (low-latency results)"; do
  grep -qF "$row" "$out/table.txt" || fail "the table has no row '$row'"
done
"$python" - "$out/result.json" <<'PY' || fail "the JSON output is incomplete"
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["verdict"] in ("PASS", "MISS"), doc["verdict"]
rows = {r["figure"]: r for r in doc["rows"]}
for name in ("dispatch submit (CPU)", "combine complete (CPU, op done)"):
    for path in ("cpp", "python"):
        assert rows[name][path]["n"] == 3 * 2, (name, path, rows[name][path])
        assert rows[name][path]["p50_us"] > 0, (name, path)
assert doc["allocation"]["ops"] > 0
PY
echo "smoke.sh: py_overhead.py ran and printed its table and JSON"
