// Stream memory operations (cuStreamWriteValue64 / cuStreamWaitValue64): the stream-ordered
// hand-off words of daemon-launched mode (proto/abi/launch_flags.h), used by the daemon's
// engine and the client library. The driver entry points are resolved once at run time
// (cudaGetDriverEntryPointByVersion): nothing here links libcuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace epd {

/// OK when the driver offers cuStreamWriteValue64 / cuStreamWaitValue64; else
/// FAILED_PRECONDITION naming the missing entry point (or INTERNAL for a CUDA error).
absl::Status StreamMemOpsAvailable();

/// Enqueues on `stream` a 64-bit write of `value` to device address `address`, after the
/// stream's earlier work and with a memory barrier before it (everything the stream wrote
/// before is visible to whoever sees the value). The current device's context must be
/// current on this thread (call cudaSetDevice first on a thread that made no runtime call).
/// Errors: FAILED_PRECONDITION (no entry point), INTERNAL naming the driver call.
absl::Status StreamWriteValue64(cudaStream_t stream, void* address, uint64_t value);

/// Enqueues on `stream` a wait until the 64-bit word at device address `address` is >=
/// `value` (unsigned compare); the stream's later work runs only after it. The GPU does not
/// bound this wait: whoever enqueues it must make sure the word is eventually written.
/// Errors: as StreamWriteValue64.
absl::Status StreamWaitValue64Geq(cudaStream_t stream, const void* address, uint64_t value);

}  // namespace epd
