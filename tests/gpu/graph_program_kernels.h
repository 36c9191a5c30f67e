// The toy FP8 expert of graph_program_test: it runs between a program's captured FP8
// low-latency dispatch and its combine on the rank's stream, dequantising the dispatch's
// recv_x and writing the combine's input. And PeekWordsAsync, with which the test's hang
// watchdog reads device words without a copy engine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/types.h"

namespace epd::testing {

/// Expert j's scale (exact in binary): 0.5 + 0.25 * (j % 4).
inline float ProgramExpertScale(int64_t j) { return 0.5f + 0.25f * static_cast<float>(j % 4); }

/// The FP8 scale of block `block` of row `row` of local expert j in low-latency recv_scales
/// storage (token index fastest, `cols` 4-byte columns of `rows` rows per expert): the f32,
/// or with `ue8m0` 2^(byte - 127) of byte block % 4 of word block / 4.
EPD_HD float ProgramScaleAt(const void* scales, bool ue8m0, size_t cols, int64_t rows, int64_t j,
                            int64_t row, int block) {
  if (!ue8m0) return static_cast<const float*>(scales)[(j * cols + block) * rows + row];
  const uint32_t word = static_cast<const uint32_t*>(scales)[(j * cols + block / 4) * rows + row];
  return kernels::FloatFromBits(((word >> (8 * (block % 4))) & 0xffu) << 23);
}

/// y[j, row, h] = bf16((f32(x[j, row, h]) * scale) * ProgramExpertScale(j)) for every element
/// of [El, rows, H] (x e4m3, scale = ProgramScaleAt of the low-latency recv_scales storage:
/// f32 [El, H/128, rows], or with `ue8m0` int32 [El, H/512, rows]; y bf16), each
/// product rounded to f32 (no fma), so the host computes the same bits. Enqueued on
/// `stream` (capturable). Errors: INTERNAL for a CUDA launch error.
absl::Status LaunchDequantScaleExperts(const kernels::e4m3_bits* x, const void* scales, bool ue8m0,
                                       kernels::bf16_bits* y, int64_t El, int64_t rows, int64_t H,
                                       cudaStream_t stream);

/// Words PeekWordsAsync reads at most; host_mapped holds kPeekWords + 1 words.
inline constexpr int kPeekWords = 32;

/// One block on `stream` copies `n` (<= kPeekWords) 64-bit words from device address
/// `src` (8-byte aligned) to host_mapped[0, n), then writes `ticket` to
/// host_mapped[kPeekWords]: the host polls that word (bounded) instead of synchronising
/// the stream. host_mapped is pinned host memory (cudaHostAlloc; under UVA kernels
/// reach it directly). A kernel, not a copy: a copy could queue behind copies that wait
/// on the GPU (epd/kernels/cuda_program.h). Errors: INTERNAL for a launch error.
absl::Status PeekWordsAsync(const void* src, int n, uint64_t* host_mapped, uint64_t ticket,
                            cudaStream_t stream);

}  // namespace epd::testing
