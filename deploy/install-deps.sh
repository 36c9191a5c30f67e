#!/usr/bin/env bash
# Installs every Debian package that building and testing epd needs (Debian 12 "bookworm";
# the same names exist on Ubuntu 24.04). Used by deploy/demo.sh, tests/run.sh, .ci/run and
# the Dockerfile's build stage, so all of them build against the same packages.
#
#   deploy/install-deps.sh            install what is missing (apt only when needed)
#   deploy/install-deps.sh --check    only report; exit 1 when something is missing
#   deploy/install-deps.sh --list     print the package list and exit
#
# Idempotent: when every package is already installed (checked with dpkg-query) apt is not
# run at all. Non-interactive (DEBIAN_FRONTEND=noninteractive). Uses sudo only when not
# root. The CUDA toolkit is not a Debian package and is not installed here: when nvcc is
# found (on PATH or at /usr/local/cuda/bin/nvcc) the CUDA backend is built, otherwise
# everything else still builds and tests (see README.md, "Quick start").
set -euo pipefail

# One package per line, grouped by what needs it. Keep the Dockerfile's build stage in
# mind: it runs this script, so a package added here is in the image build too.
PACKAGES=(
  # toolchain
  cmake ninja-build g++ pkg-config git ca-certificates
  # control plane: gRPC, protobuf (+ the protoc gRPC plugin), abseil, logging
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev
  # Peer service: HMAC-SHA256 of the daemons' handshake (libcrypto; libgrpc++-dev pulls it in)
  libssl-dev
  # data plane: RDMA verbs + connection manager, DLPack tensors
  libibverbs-dev librdmacm-dev libdlpack-dev
  # tests (cpp-httplib: the metrics tests' HTTP client; epd's listener is its own, DESIGN.md §10)
  libgtest-dev libgmock-dev libcpp-httplib-dev
  # Python package (client/python) and its tests (tests/python): pybind11 headers, a venv
  # with pip/setuptools/wheel, and torch (CPU), numpy, pytest for the suites
  pybind11-dev python3 python3-dev python3-venv python3-pip python3-setuptools python3-wheel
  python3-pybind11 python3-torch python3-numpy python3-pytest
  # style check (.clang-format)
  clang-format
  # sanitizer builds (tests/sanitize.sh): clang 14, its ASan/UBSan runtimes, llvm-symbolizer
  clang-14 libclang-rt-14-dev llvm-14
)

log() { printf '[install-deps] %s\n' "$*"; }

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  --list) printf '%s\n' "${PACKAGES[@]}"; exit 0 ;;
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "install-deps.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "install-deps.sh: dpkg-query not found: this script needs a Debian or Ubuntu system." >&2
  exit 1
fi

# A package counts as present when dpkg says "install ok installed".
missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  if [[ "$status" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  log "all ${#PACKAGES[@]} packages already installed; nothing to do"
else
  log "missing ${#missing[@]} of ${#PACKAGES[@]} packages: ${missing[*]}"
  if [[ "$mode" == check ]]; then
    exit 1
  fi
  SUDO=()
  if [[ "$(id -u)" -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "install-deps.sh: not root and sudo is not installed; run as root:" >&2
      echo "  apt-get install -y --no-install-recommends ${missing[*]}" >&2
      exit 1
    fi
    SUDO=(sudo)
    log "not root: using sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  log "running: ${SUDO[*]:+${SUDO[*]} }apt-get update"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  log "running: ${SUDO[*]:+${SUDO[*]} }apt-get install -y --no-install-recommends ${missing[*]}"
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    --no-install-recommends -o Dpkg::Options::=--force-confdef \
    -o Dpkg::Options::=--force-confold "${missing[@]}"
  log "installed: ${missing[*]}"
fi

# CUDA is optional; say which way the build will go (EPD_WITH_CUDA=OFF, as demo.sh and
# tests/run.sh take it, skips it whatever is installed).
if [[ "${EPD_WITH_CUDA:-AUTO}" == "OFF" ]]; then
  log "CUDA: EPD_WITH_CUDA=OFF: the CUDA backend is not built (host backend only)"
elif command -v nvcc >/dev/null 2>&1; then
  log "CUDA: nvcc found at $(command -v nvcc): the CUDA backend will be built"
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  log "CUDA: nvcc found at /usr/local/cuda/bin/nvcc: the CUDA backend will be built"
else
  log "CUDA: no nvcc found: the CUDA backend is skipped (host backend only)." \
      "Install the CUDA 13 toolkit to /usr/local/cuda to build it."
fi
