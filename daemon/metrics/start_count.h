// epd_restarts_total: epd counts its own starts in a small state file (DaemonConfig
// metrics_state_file), so that a restart is visible in the metrics of the process that
// follows it. Honest about its scope: the count lives as long as the file (under systemd,
// /run/epd with RuntimeDirectoryPreserve=restart: since boot; in a pod, an emptyDir: since
// the pod started).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace epd::metrics {

/// The state file a config names: `configured` when set, "" for "off", else "epd.starts"
/// in the directory of `socket_path`.
std::string StartCountPath(const std::string& configured, const std::string& socket_path);

/// Reads the number of earlier starts from `path` (0 when the file does not exist), writes
/// that number + 1 back (a temporary file renamed over it, mode 0644) and returns the
/// number read: the restarts before this start. Errors name the path: a file that does not
/// hold one decimal number (INVALID_ARGUMENT; it is then rewritten as 1), or I/O
/// (the errno text).
absl::StatusOr<uint64_t> RecordStart(const std::string& path);

}  // namespace epd::metrics
