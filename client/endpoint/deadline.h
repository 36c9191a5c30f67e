// Deadlines of the client's waits on a steady clock, saturating instead of overflowing.
#pragma once

#include <chrono>

#include "absl/time/time.h"

namespace epd::internal {

/// `start + timeout` on the steady clock: time_point::max() (no limit) for an infinite
/// timeout or one too large to add without overflow, `start` for a zero or negative one.
inline std::chrono::steady_clock::time_point DeadlineAfter(
    std::chrono::steady_clock::time_point start, absl::Duration timeout) {
  using Clock = std::chrono::steady_clock;
  if (timeout <= absl::ZeroDuration()) return start;
  const absl::Duration room =
      absl::FromChrono(std::chrono::nanoseconds(Clock::time_point::max() - start));
  if (timeout >= room) return Clock::time_point::max();
  return start + std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(timeout));
}

}  // namespace epd::internal
