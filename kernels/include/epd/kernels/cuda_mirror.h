// Copies between a rank's GPU data area and its pinned host-mapped mirror (the CUDA backend
// across nodes, DESIGN.md §5.5): kernels, never cudaMemcpy (docs/CUDA_BACKEND.md "No copy
// engine on the op path").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/layout.h"

namespace epd::kernels::cuda {

/// Enqueues ONE kernel on `stream` that copies every range of `spans` (num_spans entries,
/// in memory the kernel can read: host-mapped pinned or device, not rewritten before the
/// kernel ran) from `src` + offset to `dst` + offset (the same offsets at both ends: the GPU
/// area and its mirror share the EndpointLayout; 16-byte vectors where both ends are 16-byte
/// aligned), and then, when `signal` is not null, stores `signal_value` to it (uint64,
/// release at system scope: host-mapped pinned memory the host polls) once every block's
/// copies are visible to the host: the last block to finish stores it (a ticket on
/// *counter, a uint32 device word that is 0 before and after; two copies sharing a counter
/// must not run at the same time). `total_bytes` (the ranges' sum) sizes the grid. Errors:
/// INVALID_ARGUMENT for num_spans outside [0, kMaxAreaSpans], a null pointer where one is
/// needed; INTERNAL for a launch error.
absl::Status CopySpansAsync(uint8_t* dst, const uint8_t* src, const Region* spans,
                            int32_t num_spans, uint64_t total_bytes, uint32_t* counter,
                            uint64_t* signal, uint64_t signal_value, cudaStream_t stream);

}  // namespace epd::kernels::cuda
