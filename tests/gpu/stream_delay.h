// A one-thread kernel that holds a stream for a while: a client whose stream is still busy
// with its own work when its daemon-launched op is submitted (tests/gpu/daemon_death_test.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace epd::testing {

/// Enqueues on `stream` a kernel of one thread that spins on %globaltimer for `ns`
/// nanoseconds (at most 60 s: a longer value is taken as 60 s), so that work enqueued
/// after it starts that much later. Errors: INTERNAL for a launch error.
absl::Status DelayStreamAsync(cudaStream_t stream, int64_t ns);

}  // namespace epd::testing
