#!/usr/bin/env bash
# Checks every example DaemonConfig: deploy/examples/*.textproto and the config embedded
# in deploy/k8s/configmap.yaml.
#
#   deploy/examples/check-configs.sh [BUILD_DIR]     (BUILD_DIR default: build/)
#
# 1. protoc parses each file as text-format epd.v1.DaemonConfig (an unknown field, a bad
#    enum value or a syntax error fails, naming the line);
# 2. when BUILD_DIR/daemon/epd exists, epd itself loads each file (`epd --config=FILE
#    --check_config`: parse + validate, then exit) and must accept it.
# Exits non-zero when any file is rejected.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${1:-$ROOT/build}
EPD="$BUILD_DIR/daemon/epd"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

files=("$ROOT"/deploy/examples/*.textproto)
# The ConfigMap's epd.textproto, extracted without a YAML library: the lines of the
# literal block scalar after "epd.textproto: |", with the block's indentation removed.
awk '
  /^  epd\.textproto: \|/ { inblock = 1; next }
  inblock && /^    / { print substr($0, 5); next }
  inblock && /^[[:space:]]*$/ { print ""; next }
  inblock { inblock = 0 }
' "$ROOT/deploy/k8s/configmap.yaml" >"$tmp/k8s-configmap.textproto"
if [[ ! -s "$tmp/k8s-configmap.textproto" ]]; then
  echo "check-configs: no epd.textproto block found in deploy/k8s/configmap.yaml" >&2
  exit 1
fi
files+=("$tmp/k8s-configmap.textproto")

failed=0
for f in "${files[@]}"; do
  name=${f#"$ROOT"/}
  [[ "$f" == "$tmp"/* ]] && name="deploy/k8s/configmap.yaml (data.epd.textproto)"
  if ! err=$(protoc --proto_path="$ROOT/proto" --encode=epd.v1.DaemonConfig \
               epd/v1/config.proto <"$f" 2>&1 >/dev/null); then
    echo "  FAIL  $name: protoc: $err"
    failed=1
    continue
  fi
  if [[ -x "$EPD" ]]; then
    if ! out=$("$EPD" --config="$f" --check_config 2>&1); then
      echo "  FAIL  $name: epd --check_config: $out"
      failed=1
      continue
    fi
    echo "  ok    $name (protoc, epd --check_config)"
  else
    echo "  ok    $name (protoc; $EPD not built, epd's own check skipped)"
  fi
done
exit "$failed"
