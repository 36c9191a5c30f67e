#!/usr/bin/env bash
# Checks every example DaemonConfig: deploy/examples/*.textproto and the config embedded
# in deploy/k8s/configmap.yaml.
#
#   deploy/examples/check-configs.sh [BUILD_DIR]     (BUILD_DIR default: build/)
#
# 1. protoc parses each file as text-format epd.v1.DaemonConfig (an unknown field, a bad
#    enum value or a syntax error fails, naming the line);
# 2. when BUILD_DIR/daemon/epd exists, epd itself loads each file and must accept it:
#    with `epd --config=FILE --check_config` where epd has that flag, otherwise by starting
#    epd on a copy of the file without its machine-specific fields (socket_path, listen,
#    metrics_listen (a fixed port that may be taken here), backend, socket_group: a group that need not exist here; peer_listen, peer_advertise,
#    peer_secret_file, tcp_listen: another machine's addresses and secret; transport: rdma
#    needs a device here, while its rdma { } settings are still checked as written), with
#    a temporary socket and
#    --backend=host, waiting until it serves (`epctl health`, or the socket appearing),
#    and stopping it with SIGTERM, which must exit 0. Every other field (modes, timeouts,
#    limits, log level, GPU list) is epd's to check as written.
# Exits non-zero when any file is rejected.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD_DIR=${1:-$ROOT/build}
EPD="$BUILD_DIR/daemon/epd"
EPCTL="$BUILD_DIR/client/epctl"
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

# Starts epd on config $1 (machine-specific fields overridden), waits until it serves,
# stops it. Prints what happened; returns non-zero when epd rejected the file or failed.
serve_once() {
  local sock="$tmp/check.sock" log="$tmp/check.log" pid served=0
  rm -f "$sock"
  # The machine-specific fields are dropped from the copy rather than overridden or
  # cleared by flags (`--listen=` and `--socket_group=` would clear theirs, README
  # "Configuration"): the copy then holds exactly what is checked.
  grep -v -E '^[[:space:]]*(socket_path|listen|backend|socket_group|peer_listen|peer_advertise|peer_secret_file|tcp_listen|transport|metrics_listen)[[:space:]]*:' "$1" \
    >"$tmp/check.textproto"
  "$EPD" --config="$tmp/check.textproto" --socket="$sock" --backend=host >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do  # up to 10 s
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" && echo "epd exited 0 before serving: $(tail -3 "$log")" ||
        echo "epd rejected it (exit $?): $(tail -3 "$log")"
      return 1
    fi
    if [[ -x "$EPCTL" ]]; then
      "$EPCTL" --socket="$sock" health >/dev/null 2>&1 && served=1
    elif [[ -S "$sock" ]]; then
      served=1
    fi
    ((served)) && break
    sleep 0.1
  done
  if ((!served)); then
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    echo "epd did not serve within 10 s: $(tail -3 "$log")"
    return 1
  fi
  kill -TERM "$pid"
  if ! wait "$pid"; then
    echo "epd did not exit 0 on SIGTERM: $(tail -3 "$log")"
    return 1
  fi
  [[ -x "$EPCTL" ]] && echo "SERVING, then exit 0 on SIGTERM" ||
    echo "socket up, then exit 0 on SIGTERM"
}

has_check_flag=0
if [[ -x "$EPD" ]] && "$EPD" --helpfull 2>&1 | grep -q -- '-check_config'; then
  has_check_flag=1
fi

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
    if ((has_check_flag)); then
      if ! out=$("$EPD" --config="$f" --check_config 2>&1); then
        echo "  FAIL  $name: epd --check_config: $out"
        failed=1
        continue
      fi
      echo "  ok    $name (protoc, epd --check_config)"
    else
      if ! out=$(serve_once "$f"); then
        echo "  FAIL  $name: $out"
        failed=1
        continue
      fi
      echo "  ok    $name (protoc; epd served with it: $out)"
    fi
  else
    echo "  ok    $name (protoc; $EPD not built, epd's own check skipped)"
  fi
done
exit "$failed"
