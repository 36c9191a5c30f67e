// A grid-stride byte copy shared by the copy kernels (handoff.cu, mirror_copy.cu).
#pragma once

#include <cstdint>

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
