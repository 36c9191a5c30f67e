#!/usr/bin/env bash
# Installs a built tree and builds out-of-tree consumers against it (CTest install.consumer):
#   tests/install/run_consumer.sh BUILD_DIR
# 1. cmake --install BUILD_DIR into a temporary prefix; checks the layout (bin/epd,
#    bin/epctl, libepdclient.so with its SONAME links, <epd/epd.h> when the source has it,
#    the CMake package, epd.pc; no C++ API header) and that the installed binaries and the
#    library find every library they load (ldd) and run (--version);
# 2. builds the consumer (consumer/) as C and as C++ twice each: with
#    find_package(epd CONFIG) and with `pkg-config --cflags --libs epd` alone, and runs all
#    four (each checks that libepdclient reports the package's version).
# The temporary prefix is removed on exit (EPD_KEEP_PREFIX=1 keeps it and prints where).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:?usage: run_consumer.sh BUILD_DIR}" && pwd)
fail() { echo "run_consumer.sh: FAILED: $*" >&2; exit 1; }
step() { echo "==> run_consumer.sh: $*"; }

tmp=$(mktemp -d)
if [[ "${EPD_KEEP_PREFIX:-0}" == 1 ]]; then
  echo "run_consumer.sh: keeping $tmp"
else
  trap 'rm -rf "$tmp"' EXIT
fi
prefix=$tmp/prefix

step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log" >&2; fail "cmake --install"; }

# The library directory is GNUInstallDirs' (lib, or lib/<multiarch> for a /usr prefix).
pc=$(find "$prefix" -name epd.pc -path '*/pkgconfig/*' | head -1)
[[ -n "$pc" ]] || fail "no pkgconfig/epd.pc under $prefix"
libdir=$(dirname "$(dirname "$pc")")
for f in "$prefix/bin/epd" "$prefix/bin/epctl" "$libdir/libepdclient.so" \
         "$libdir/cmake/epd/epdConfig.cmake" "$libdir/cmake/epd/epdConfigVersion.cmake" \
         "$libdir/cmake/epd/epdTargets.cmake"; do
  [[ -e "$f" ]] || fail "${f#"$prefix"/} was not installed"
done
[[ -f "$prefix/include/epd/epd.h" ]] || fail "include/epd/epd.h was not installed"
[[ ! -e "$prefix/include/epd/client.h" ]] || fail "the C++ API header is installed (C ABI only)"
soname=$(objdump -p "$libdir/libepdclient.so" | awk '$1 == "SONAME" {print $2}')
[[ -L "$libdir/libepdclient.so" && -e "$libdir/$soname" ]] ||
  fail "libepdclient.so is not a link to its SONAME $soname"
"$here/check_exports.sh" "$libdir/libepdclient.so" "$prefix/include/epd/epd.h"
for f in "$prefix/bin/epd" "$prefix/bin/epctl" "$libdir/libepdclient.so"; do
  if ldd "$f" | grep -q 'not found'; then
    ldd "$f" >&2
    fail "${f#"$prefix"/} does not find every library it loads"
  fi
done
"$prefix/bin/epd" --version >/dev/null || fail "installed bin/epd --version"
"$prefix/bin/epctl" --version >/dev/null || fail "installed bin/epctl --version"

export PKG_CONFIG_PATH=$libdir/pkgconfig
version=$(pkg-config --modversion epd) || fail "pkg-config --modversion epd"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
for lang in C CXX; do
  step "$lang consumer: find_package(epd CONFIG)"
  # A clean environment: the consumer sees the installed prefix, nothing of the build tree.
  if ! { env -u CC -u CXX -u CMAKE_PREFIX_PATH cmake -S "$here/consumer" -B "$tmp/$lang" \
           "${generator[@]}" -DCMAKE_PREFIX_PATH="$prefix" -DEPD_CONSUMER_LANG="$lang" &&
         cmake --build "$tmp/$lang"; } >"$tmp/$lang.log" 2>&1; then
    cat "$tmp/$lang.log" >&2
    fail "$lang consumer (CMake)"
  fi
  "$tmp/$lang/consumer" || fail "$lang consumer (CMake) run"
done

step "C and CXX consumers: pkg-config --cflags --libs epd ($version)"
read -ra pc_flags <<<"$(pkg-config --cflags --libs epd)"
cc -std=c11 -Wall -Wextra -Werror -DEPD_EXPECTED_VERSION="\"$version\"" \
  "$here/consumer/consumer.c" "${pc_flags[@]}" -o "$tmp/consumer_c_pc" || fail "C consumer (pkg-config)"
c++ -std=c++17 -Wall -Wextra -Werror -DEPD_EXPECTED_VERSION="\"$version\"" \
  "$here/consumer/consumer.cc" "${pc_flags[@]}" -o "$tmp/consumer_cxx_pc" ||
  fail "CXX consumer (pkg-config)"
LD_LIBRARY_PATH=$libdir "$tmp/consumer_c_pc" || fail "C consumer (pkg-config) run"
LD_LIBRARY_PATH=$libdir "$tmp/consumer_cxx_pc" || fail "CXX consumer (pkg-config) run"
step "passed: installed tree, CMake package and pkg-config file build C and C++ consumers"
