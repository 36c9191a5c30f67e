// FP8 e4m3 quantization of one token row (host_ops.h: QuantizeRowFp8).
#include <algorithm>
#include <cmath>

#include "epd/kernels/host_ops.h"

namespace epd::kernels::host {

void QuantizeRowFp8(const bf16_bits* x, int32_t hidden, bool round_scale, e4m3_bits* out,
                    float* scales) {
  for (int32_t begin = 0, block = 0; begin < hidden; begin += kFp8BlockChannels, ++block) {
    const int32_t end = std::min(hidden, begin + kFp8BlockChannels);
    // amax over the block; fmaxf ignores NaN (as the CUDA max reduction does).
    float amax = 0.0f;
    for (int32_t h = begin; h < end; ++h) amax = std::fmax(amax, std::fabs(Bf16ToFloat(x[h])));
    const float scale = Fp8Scale(amax, round_scale);
    scales[block] = scale;
    for (int32_t h = begin; h < end; ++h) out[h] = QuantizeE4m3(Bf16ToFloat(x[h]), scale);
  }
}

}  // namespace epd::kernels::host
