// The CUDA row gather (row_gather.h): a rank's received rows copied by one kernel from where
// the exchange left them (host-mapped receive region and staging, or another rank's GPU
// area) into the rank's GPU area (DESIGN.md §5.5 "Rows on the GPU").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_gather.h"

namespace epd::kernels::cuda {

using ::epd::kernels::GatherWindow;
using ::epd::kernels::kMaxGatherWindows;

/// Most blocks (local experts) one gather takes.
inline constexpr int32_t kMaxGatherBlocks = 1024;

/// Enqueues ONE kernel on `stream` that writes every row of `g` (and its scales) exactly as
/// kernels::host::GatherRows does. `g.sources`, `g.counts` and `windows` (`num_windows`
/// entries) must be memory the kernel can read (host-mapped pinned or device) and stay
/// unchanged until it ran; every RowSource pointer must be readable by the GPU (host-mapped
/// pinned, registered host memory with the same address on the device, or device memory),
/// after the windows' translation. Errors: INVALID_ARGUMENT for blocks outside [0,
/// kMaxGatherBlocks], num_windows outside [0, kMaxGatherWindows], a negative row size or
/// capacity, or a null table; INTERNAL for a launch error.
absl::Status GatherRowsAsync(const GroupShape& shape, const RowGather& g,
                             const GatherWindow* windows, int32_t num_windows, cudaStream_t stream);

/// Enqueues ONE kernel on `stream` that quantizes rows [num_rows, H] bf16 `x` (device
/// memory) to e4m3 `out` [num_rows, H] and f32 `scales` [num_rows, S], each row exactly as
/// kernels::host::QuantizeRowFp8 does (the same amax, Fp8Scale and rounding: bit for bit).
/// `out` and `scales` may be host-mapped (the exchange's quantized rows across nodes);
/// `out_copy` / `scales_copy`, when not null, get the same bytes (a device copy that the
/// row gather reads instead of the host's: GatherWindow). Errors: INVALID_ARGUMENT for
/// num_rows < 0 or a null pointer with rows; INTERNAL for a launch error.
absl::Status QuantizeRowsFp8Async(const GroupShape& shape, int32_t num_rows, const bf16_bits* x,
                                  bool round_scale, e4m3_bits* out, float* scales,
                                  cudaStream_t stream, e4m3_bits* out_copy = nullptr,
                                  float* scales_copy = nullptr);

}  // namespace epd::kernels::cuda
