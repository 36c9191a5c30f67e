#!/usr/bin/env bash
# Shows that no_copy_engine_on_op_path.sh can fail: it must refuse a tree with a
# device-to-host copy in an op-path source and accept the same tree without it, or with a
# marked copy toward the device. Usage: lint_selftest.sh LINT_SCRIPT
set -euo pipefail
lint="${1:?usage: $0 LINT_SCRIPT}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/daemon" "$tmp/kernels/cuda" "$tmp/client"
copy='cudaMemcpyAsync(&n, p, 4, cudaMemcpyDeviceToHost, s);'
echo "void F() { $copy }" > "$tmp/daemon/op.cc"
if "$lint" "$tmp" 2>/dev/null; then
  echo "FAIL: the lint accepted a device-to-host copy in daemon/op.cc" >&2
  exit 1
fi
echo "void F() { cudaMemcpyAsync(d, h, 4, cudaMemcpyDefault, s); }  // copy-engine-lint: to the device" \
  > "$tmp/daemon/op.cc"
"$lint" "$tmp" >/dev/null || { echo "FAIL: the lint refused a marked copy" >&2; exit 1; }
echo "// $copy (a comment may name the call)" > "$tmp/daemon/op.cc"
"$lint" "$tmp" >/dev/null || { echo "FAIL: the lint refused a comment" >&2; exit 1; }
echo "the lint refuses an unmarked device-to-host copy and accepts marked copies and comments"
