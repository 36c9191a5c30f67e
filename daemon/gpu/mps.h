// MPS detection: whether the CUDA MPS control daemon serves this process. Sysfs-free and
// CUDA-free (a unix socket connect and /proc), so that tools without CUDA (epctl doctor) ask
// the same question the daemon does.
#pragma once

#include <string>

namespace epd {

/// Whether CUDA MPS is active for this process, and the evidence.
struct MpsStatus {
  bool active = false;
  std::string detail;  ///< e.g. "control socket /tmp/nvidia-mps/control accepts connections".
};

/// Detects the MPS control daemon for this process: active when the `control` unix socket
/// in $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps) accepts a connection (that is how
/// CUDA joins MPS; with driver 580 it is a SOCK_SEQPACKET socket).
/// A live nvidia-cuda-mps-* process (from /proc/*/comm, zombies ignored) without that
/// socket is reported in `detail` but is not active for this process.
MpsStatus DetectMps();

}  // namespace epd
