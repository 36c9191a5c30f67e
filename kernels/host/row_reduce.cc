// ReduceRows (host_node_ops.h): the host reference of the row reduce (row_reduce.h). The
// operations are those of Combine (combine.cc) and LowLatencyCombine (low_latency.cc), in
// their order: per channel acc = +0.0f, acc += f32(x) (or acc += weight * f32(x), the
// product rounded to f32 first: this file is compiled as ISO C++, where GCC does not
// contract), one round to bf16. Channels are independent, so they are taken a block at a
// time with the accumulators on the stack: nothing is allocated.
#include <algorithm>

#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/types.h"

namespace epd::kernels::host {

void ReduceRows(const GroupShape& shape, const RowReduce& r,
                std::span<const GatherWindow> windows) {
  constexpr int64_t kChannels = 256;  // Accumulators per block of channels.
  const int64_t hidden = shape.hidden;
  const int32_t num_topk = shape.num_topk;
  const auto num_windows = static_cast<int32_t>(windows.size());
  for (int64_t t = 0; t < r.rows; ++t) {
    const ReduceTerm* terms = r.terms + t * r.terms_per_row;
    bf16_bits* out = r.combined_x + t * hidden;
    for (int64_t h0 = 0; h0 < hidden; h0 += kChannels) {
      const int64_t n = std::min(kChannels, hidden - h0);
      float acc[kChannels];
      std::fill(acc, acc + n, 0.0f);
      for (int32_t j = 0; j < r.terms_per_row; ++j) {
        const ReduceTerm& term = terms[j];
        if (term.x == nullptr) continue;
        const bf16_bits* x = reinterpret_cast<const bf16_bits*>(
                                 TranslateWindow(term.x, windows.data(), num_windows)) +
                             h0;
        if (r.weighted) {
          const float weight = term.weight;
          for (int64_t h = 0; h < n; ++h) {
            const float product = weight * Bf16ToFloat(x[h]);
            acc[h] += product;
          }
        } else {
          for (int64_t h = 0; h < n; ++h) acc[h] += Bf16ToFloat(x[h]);
        }
      }
      for (int64_t h = 0; h < n; ++h) out[h0 + h] = FloatToBf16(acc[h]);
    }
    if (r.combined_topk_weights == nullptr) continue;
    float* w_out = r.combined_topk_weights + t * num_topk;
    for (int32_t k = 0; k < num_topk; ++k) {
      float w = 0.0f;
      for (int32_t j = 0; j < r.terms_per_row; ++j) {
        if (terms[j].x != nullptr && terms[j].topk_weights != nullptr) {
          w += reinterpret_cast<const float*>(
              TranslateWindow(terms[j].topk_weights, windows.data(), num_windows))[k];
        }
      }
      w_out[k] = w;
    }
  }
}

}  // namespace epd::kernels::host
