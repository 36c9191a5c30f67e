// GatherRows (host_node_ops.h): the host reference of the row gather (row_gather.h).
#include <algorithm>
#include <cstring>

#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/types.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {

namespace {

const uint8_t* Translate(const void* p, std::span<const GatherWindow> windows) {
  return TranslateWindow(p, windows.data(), static_cast<int32_t>(windows.size()));
}

}  // namespace

void GatherRows(const GroupShape& shape, const RowGather& g,
                std::span<const GatherWindow> windows) {
  const int32_t S = shape.num_scales();
  const bool ll_scales =
      g.scales_kind == GatherScales::kLowLatency || g.scales_kind == GatherScales::kLowLatencyUe8m0;
  const bool ue8m0 = g.scales_kind == GatherScales::kLowLatencyUe8m0;
  for (int32_t b = 0; b < g.blocks; ++b) {
    const int64_t rows = std::clamp<int64_t>(g.counts[b], 0, g.block_rows);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = b * g.block_rows + i;
      const RowSource& src = g.sources[row];
      if (src.x == nullptr) continue;
      std::memcpy(static_cast<uint8_t*>(g.x) + row * g.row_bytes, Translate(src.x, windows),
                  static_cast<size_t>(g.row_bytes));
      if (src.scales == nullptr || g.scales_kind == GatherScales::kNone) continue;
      auto* out = static_cast<uint8_t*>(g.scales);
      const auto* scales = reinterpret_cast<const float*>(Translate(src.scales, windows));
      if (!ll_scales) {
        std::memcpy(out + row * S * sizeof(float), scales, sizeof(float) * S);
        continue;
      }
      internal::StoreLowLatencyScales(shape, ue8m0, out, b, i, scales);
    }
  }
}

}  // namespace epd::kernels::host
