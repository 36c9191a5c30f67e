// File-descriptor budget of the epd process: RLIMIT_NOFILE raised at start-up, and the
// check that refuses new joins while descriptors run low (so that the listener, gRPC and
// the endpoints already joined keep the descriptors they need).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epd {

/// RLIMIT_NOFILE of this process.
struct FdLimit {
  uint64_t soft = 0;
  uint64_t hard = 0;
};

/// This process's RLIMIT_NOFILE. INTERNAL naming errno when getrlimit fails.
absl::StatusOr<FdLimit> GetFdLimit();

/// Raises RLIMIT_NOFILE's soft limit to its hard limit (nothing to do when they are equal)
/// and returns the limits before and after. INTERNAL naming both limits and errno when
/// setrlimit fails (the soft limit then stays).
struct FdLimitChange {
  FdLimit before;
  FdLimit after;
};
absl::StatusOr<FdLimitChange> RaiseFdLimitToHard();

/// Descriptors this process has open (the entries of /proc/self/fd, not counting the one
/// used to read it). RESOURCE_EXHAUSTED when not even that one can be opened (EMFILE,
/// ENFILE), INTERNAL for another failure.
absl::StatusOr<uint64_t> CountOpenFds();

/// OK while at least `min_free` descriptors are free below the soft limit (0 = never
/// refuses). Otherwise RESOURCE_EXHAUSTED for `what` (e.g. "JoinGroup") naming the
/// descriptors open, the limit, min_free_fds, and what to do.
absl::Status CheckFreeFds(uint32_t min_free, absl::string_view what);

}  // namespace epd
