// Graph-mode program helpers without copies (DESIGN.md §3.2), defined in
// kernels/cuda/program_ops.cu (with ProgramAckAsync, declared in cuda_ops.h).
//
// Why kernels and not cudaMemcpyAsync: a program instance is enqueued on the daemon's rank
// stream long before its go wait passes, and a copy enqueued on a stream goes to a
// copy-engine queue that the context's streams share, where it waits for the stream's
// earlier work: a device-to-host copy of the daemon's waiting instance blocked the later
// device-to-host copies of other streams of the process (seen on the H200: the test's
// cudaMemcpy of the results waited for ever, since the go it needed comes only with the
// next replay). A kernel or a stream memory operation stays on its stream's own queue.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "epd/kernels/cuda_ops.h"

namespace epd::kernels::cuda {

/// Copies the 64-bit word at device address `word` to `host_mapped` (pinned host memory
/// allocated with cudaHostAllocMapped) with one tiny kernel on `stream`; valid once the
/// stream has passed it. Errors: INVALID_ARGUMENT for a null pointer, INTERNAL for a
/// launch error.
absl::Status ReadWordAsync(const uint64_t* word, uint64_t* host_mapped, cudaStream_t stream);

}  // namespace epd::kernels::cuda
