// The bounded wait of a data plane's graceful stop for its GPUs (the CUDA backend's
// CudaDataPlaneImpl::Shutdown, docs/CUDA_BACKEND.md "Stopping"), and its report: how long
// each phase may take, a polling loop with a deadline, and the log line. Backend-independent
// (no CUDA), so the host tests cover it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace epd {

/// How long a graceful stop waits for the clients' staging kernels still to come (their
/// writes land in the daemon's GPU memory, which goes with the daemon) and for the
/// daemon's streams to go idle, before it releases what still waits from the host.
inline constexpr int64_t kGpuDrainStagingMs = 1000;
inline constexpr absl::Duration kGpuDrainStagingBound = absl::Milliseconds(kGpuDrainStagingMs);
/// How long it then waits, at most, for the streams released from the host to go idle.
inline constexpr int64_t kGpuDrainIdleMs = 250;
inline constexpr absl::Duration kGpuDrainIdleBound = absl::Milliseconds(kGpuDrainIdleMs);
/// The whole GPU drain's bound: Daemon::Shutdown's drain_grace (500 ms), this, and the gRPC
/// servers' 1 s stay well inside the 4 s after which epd's main exits regardless
/// (kShutdownHardLimit, daemon/core/daemon.h).
inline constexpr absl::Duration kGpuDrainBound =
    absl::Milliseconds(kGpuDrainStagingMs + kGpuDrainIdleMs);

/// What a graceful stop did on the GPUs, for its log line (DescribeGpuDrain).
struct GpuDrainReport {
  int32_t groups = 0;             ///< Groups stopped.
  int32_t ops_failed = 0;         ///< Requests completed with the stop's error.
  int32_t programs_disarmed = 0;  ///< Armed graph-mode programs released.
  /// Clients' staging kernels of requests in flight that had not written ready_seq when
  /// the stop began, and of those, the ones still missing at kGpuDrainStagingBound
  /// ("group G rank R op N": that client's stream writes into freed memory if it ever runs
  /// the staging, and under MPS its CUDA context then fails).
  int32_t stagings_awaited = 0;
  std::vector<std::string> stagings_missed;
  /// Streams (named "group G rank R", or "engine aux stream of GPU d") still busy when the
  /// bound passed; empty when the GPUs went idle.
  std::vector<std::string> busy;
  absl::Duration staging_wait;  ///< From the start of the drain to its first phase's end.
  absl::Duration took;          ///< The whole drain.
};

/// The stop's log line: the counts, how long the GPUs took to drain, and what was left
/// (named) when they did not within the bound.
std::string DescribeGpuDrain(const GpuDrainReport& report);

/// Calls `done` every `interval` until it returns true or `deadline` has passed (it is
/// called at least once, and once more at or after the deadline at most). Returns its last
/// result. Sleeps between calls; for shutdown paths, never the hot path.
bool PollUntil(const std::function<bool()>& done, absl::Time deadline,
               absl::Duration interval = absl::Milliseconds(1));

}  // namespace epd
