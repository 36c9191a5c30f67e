// A toy expert for client_launch_test's CUDA-graph test: it runs between the captured
// low-latency dispatch and combine on the rank's stream, reading the dispatch's recv_x and
// writing the combine's input.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/types.h"

namespace epd::testing {

/// Expert j's scale: exact in binary, so y = x * scale is the same on host and device.
inline float ExpertScale(int64_t j) { return 0.5f + 0.25f * static_cast<float>(j % 4); }

/// y[j, row, h] = bf16(f32(x[j, row, h]) * ExpertScale(j)) for every element of
/// [El, rows, H] bf16 (every row, also those past recv_count), enqueued on `stream`
/// (capturable). Errors: INTERNAL for a CUDA launch error.
absl::Status LaunchScaleExperts(const kernels::bf16_bits* x, kernels::bf16_bits* y, int64_t El,
                                int64_t rows, int64_t H, cudaStream_t stream);

}  // namespace epd::testing
