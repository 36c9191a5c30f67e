#!/usr/bin/env bash
# The Python suites (CTest python.pytest, label python):
#   tests/python/run_pytest.sh BUILD_DIR [pytest arguments]
# 1. checks that the interpreter (EPD_PYTHON, default /usr/bin/python3) has torch, numpy,
#    pytest, setuptools, venv and pybind11's headers: a missing one FAILS the test, naming
#    the Debian package (deploy/install-deps.sh installs them all);
# 2. creates BUILD_DIR/python/venv (python3 -m venv --system-site-packages) once;
# 3. pip installs client/python into it (--no-build-isolation, no index: no network),
#    against BUILD_DIR's libepdclient.so, from a copy under BUILD_DIR/python/src so the
#    source tree stays clean;
# 4. runs pytest -v on tests/python, which starts BUILD_DIR/daemon/epd --backend=host.
# EPD_SKIP_PYTHON_TESTS=1 skips everything (exit 77, which CTest reports as skipped) with
# the reason printed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:?usage: run_pytest.sh BUILD_DIR [pytest arguments]}" && pwd)
shift
fail() { echo "run_pytest.sh: FAILED: $*" >&2; exit 1; }
step() { echo "==> run_pytest.sh: $*"; }

if [[ "${EPD_SKIP_PYTHON_TESTS:-0}" == 1 ]]; then
  echo "run_pytest.sh: skipped: EPD_SKIP_PYTHON_TESTS=1 (the Python suites did not run)"
  exit 77
fi

python=${EPD_PYTHON:-/usr/bin/python3}
[[ -x "$python" ]] || fail "no Python interpreter at $python (set EPD_PYTHON)"
step "checking $python ($("$python" --version 2>&1))"
missing=()
for pair in torch:python3-torch numpy:python3-numpy pytest:python3-pytest \
            setuptools:python3-setuptools venv:python3-venv ensurepip:python3-venv; do
  "$python" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair%%:*} (Debian: ${pair#*:})")
done
if ! "$python" -c "import pybind11" 2>/dev/null && [[ ! -f /usr/include/pybind11/pybind11.h ]]; then
  missing+=("pybind11 headers (Debian: pybind11-dev)")
fi
((${#missing[@]} == 0)) ||
  fail "$python lacks: ${missing[*]}; run deploy/install-deps.sh (or set EPD_SKIP_PYTHON_TESTS=1 to skip on purpose)"
[[ -x "$build/daemon/epd" ]] || fail "$build/daemon/epd not built"
[[ -e "$build/client/libepdclient.so" ]] || fail "$build/client/libepdclient.so not built"

work=$build/python
venv=$work/venv
if [[ ! -x "$venv/bin/python" ]]; then
  step "creating $venv"
  "$python" -m venv --system-site-packages "$venv" || fail "python3 -m venv"
fi

step "pip install client/python and client/python/deep_ep_dropin into $venv (against $build/client/libepdclient.so)"
rm -rf "$work/src"
mkdir -p "$work/src"
cp -r "$root/client/python/." "$work/src/"
rm -rf "$work/src/build" "$work/src"/*.egg-info
if command -v ccache >/dev/null 2>&1; then
  export CC="ccache ${CC:-gcc}" CXX="ccache ${CXX:-g++}"
fi
EPD_SOURCE_DIR=$root EPD_BUILD_DIR=$build PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$venv/bin/pip" install --no-build-isolation --no-deps --force-reinstall "$work/src" \
  >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; fail "pip install client/python"; }
# The drop-in `deep_ep` package (re-exports epd.deep_ep) for the deep_ep suites.
PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$venv/bin/pip" install --no-build-isolation --no-deps --force-reinstall \
  "$work/src/deep_ep_dropin" >"$work/pip-dropin.log" 2>&1 ||
  { cat "$work/pip-dropin.log" >&2; fail "pip install client/python/deep_ep_dropin"; }
installed=$(cd "$work" && "$venv/bin/python" -c "import epd, os; print(os.path.dirname(epd.__file__))") ||
  fail "import epd in $venv"
[[ "$installed" == "$venv"/* ]] || fail "import epd found $installed, not the venv's"

step "pytest -v tests/python (epd: $build/daemon/epd --backend=host)"
cd "$work"
EPD_BUILD_DIR=$build EPD_BINARY=$build/daemon/epd \
  "$venv/bin/python" -m pytest -v -p no:cacheprovider "$here" "$@"
