// Graph-mode program helpers without copies (DESIGN.md §3.2), defined in
// kernels/cuda/program_ops.cu (with ProgramAckAsync, declared in cuda_ops.h). Kernels, not
// cudaMemcpyAsync: a copy enqueued behind a program instance's go wait would hold the
// context's shared copy-engine queue and block other streams' copies (docs/CUDA_BACKEND.md
// "Rule: never enqueue a copy behind a program's go wait").
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
