#!/usr/bin/env bash
# Prints the Debian packages that hold the shared libraries some binaries load, one per
# line: what a runtime image needs to install to run them (the Dockerfile's runtime stage
# uses it, so the list always matches what was linked).
#
#   deploy/runtime-packages.sh [--strict] [--ignore GLOB]... BINARY...
#
# Libraries of the NVIDIA driver (libcuda.so.1, libnvidia-*) are skipped: the NVIDIA
# container toolkit (or the host's driver) provides them at run time. A library that no
# package owns (e.g. a CUDA toolkit unpacked from a tarball) is reported on stderr;
# with --strict that is an error (exit 1). --ignore GLOB skips libraries whose file name
# matches GLOB (ones the caller ships itself, e.g. 'libcudart.so.*').
set -euo pipefail

strict=0
ignores=()
while (($# > 0)); do
  case "$1" in
    --strict) strict=1; shift ;;
    --ignore) ignores+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
if (($# == 0)); then
  echo "usage: runtime-packages.sh [--strict] [--ignore GLOB]... BINARY..." >&2
  exit 2
fi

unowned=0
declare -A packages=()
while read -r name path; do
  case "$name" in
    libcuda.so.*|libnvidia-*) continue ;;  # the driver's, injected at run time
  esac
  for glob in "${ignores[@]}"; do
    # shellcheck disable=SC2053  # $glob is a pattern on purpose
    [[ "$name" == $glob ]] && continue 2
  done
  if [[ "$path" == "not" ]]; then  # "libfoo.so => not found"
    echo "runtime-packages: $name: not found by the dynamic loader" >&2
    unowned=1
    continue
  fi
  # dpkg knows a file by the path its package installed (on merged-/usr systems that may
  # be /lib/... or /usr/lib/...): try the path as printed, then with symlinks resolved.
  owner=$(dpkg-query -S "$path" 2>/dev/null ||
          dpkg-query -S "$(readlink -f "$path")" 2>/dev/null ||
          dpkg-query -S "${path#/usr}" 2>/dev/null || true)
  if [[ -z "$owner" ]]; then
    echo "runtime-packages: $name ($path): no Debian package owns it" >&2
    unowned=1
    continue
  fi
  # "pkg:arch: /path" (or "pkg1, pkg2: /path" for a shared directory): keep the names.
  for p in $(printf '%s\n' "${owner%%: /*}" | tr ',' ' '); do
    packages[${p%%:*}]=1
  done
done < <(ldd "$@" | awk '$2 == "=>" { print $1, $3 }' | sort -u)

printf '%s\n' "${!packages[@]}" | sort
if ((strict && unowned)); then
  exit 1
fi
