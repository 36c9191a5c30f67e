// A grid-stride byte copy shared by the copy kernels (handoff.cu, mirror_copy.cu).
#pragma once

#include <algorithm>
#include <cstdint>

namespace epd::kernels::cuda {

/// Threads per block of the copy kernels.
inline constexpr int kCopyThreads = 512;

/// Blocks of a copy kernel moving `bytes` (its largest piece): one per 64 KiB, at least 1,
/// at most `max_blocks` (copies across PCIe or NVLink want many requests in flight).
inline uint64_t CopyBlocks(uint64_t bytes, uint64_t max_blocks) {
  constexpr uint64_t kBytesPerBlock = 64 * 1024;
  return std::clamp<uint64_t>((bytes + kBytesPerBlock - 1) / kBytesPerBlock, 1, max_blocks);
}

}  // namespace epd::kernels::cuda

namespace epd::kernels::cuda::device {

/// Copies bytes [0, n) of `src` to `dst`, this thread taking element `first` and every
/// `stride`-th after it (a grid-stride loop): 16-byte vectors when both ends are 16-byte
/// aligned, single bytes for the rest.
__device__ __forceinline__ void CopyBytes(uint8_t* dst, const uint8_t* src, uint64_t n,
                                          uint64_t first, uint64_t stride) {
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
  uint64_t done = 0;
  if (aligned) {
    const uint64_t vectors = n / 16;
    for (uint64_t i = first; i < vectors; i += stride) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    done = vectors * 16;
  }
  for (uint64_t i = done + first; i < n; i += stride) dst[i] = src[i];
}

}  // namespace epd::kernels::cuda::device
