// GatherWindow translation (cuda_gather.h), shared by the row gather and the row reduce.
#pragma once

#include <cstdint>

#include "epd/kernels/cuda_gather.h"

namespace epd::kernels::cuda::device {

/// `p` read through the first of windows [0, n) that holds it (at its device copy), else
/// `p` itself.
__device__ __forceinline__ const uint8_t* Translate(const void* p, const GatherWindow* w,
                                                    int32_t n) {
  const auto* q = static_cast<const uint8_t*>(p);
  for (int32_t i = 0; i < n; ++i) {
    if (q >= w[i].from && q < w[i].from + w[i].bytes) return w[i].to + (q - w[i].from);
  }
  return q;
}

}  // namespace epd::kernels::cuda::device
