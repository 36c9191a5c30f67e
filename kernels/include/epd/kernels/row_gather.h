// Received rows whose copies a node op leaves to its caller (DESIGN.md §5.5 "Rows on the
// GPU"): NodeDispatch and NodeLowLatencyDispatch (host_node_ops.h) can, instead of copying
// each received row's x bytes (and FP8 scales) into the rank's receive region, record where
// the row is (a RowSource per destination row). The caller then gathers the rows: the CUDA
// backend with one kernel per rank straight into the rank's GPU area (cuda_gather.h), the
// host reference with GatherRows (below). Both write exactly what the node op would have.
#pragma once

#include <cstdint>

#include "epd/kernels/layout.h"

namespace epd::kernels {

/// Where one received row is: its x bytes (`x`, the row's row_bytes) and, for an FP8 op,
/// its S f32 scales as the source holds them (`scales`, else null). `x` null: the
/// destination row is not written. Both are read as values only.
struct RowSource {
  const void* x = nullptr;
  const float* scales = nullptr;
};

/// How a gather writes the scales of a row.
enum class GatherScales : int32_t {
  kNone = 0,             ///< No scales (BF16).
  kRows = 1,             ///< [rows, S] f32, row-major (a normal FP8 dispatch's recv_scales).
  kLowLatency = 2,       ///< LowLatencyScaleOffset f32 (block = local expert, row in it).
  kLowLatencyUe8m0 = 3,  ///< LowLatencyScaleOffset UE8M0 bytes (Ue8m0Code of each scale).
};

/// One rank's rows to gather. Block b holds rows [b * block_rows, b * block_rows +
/// min(counts[b], block_rows)) of `x`; a row whose RowSource::x is null is skipped. A normal
/// dispatch is one block of N rows (block_rows = the receive capacity), a low-latency one a
/// block per local expert (block_rows = R * Mll).
struct RowGather {
  void* x = nullptr;                   ///< Out [blocks * block_rows, row_bytes].
  int64_t row_bytes = 0;               ///< Bytes of one row (H for e4m3, 2H for bf16).
  int32_t blocks = 0;                  ///< Blocks (local experts, or 1).
  int64_t block_rows = 0;              ///< Row capacity of a block.
  const int32_t* counts = nullptr;     ///< [blocks] rows per block (clamped to block_rows).
  const RowSource* sources = nullptr;  ///< [blocks * block_rows].
  GatherScales scales_kind = GatherScales::kNone;
  void* scales = nullptr;  ///< Out: per scales_kind (kRows [rows, S] f32, else the ll region).
};

/// A window of memory whose rows a gather reads from another copy of it: a source pointer
/// p in [from, from + bytes) is read at to + (p - from) (a local rank's host mirror and its
/// GPU area, which hold the same inputs at the same offsets; the exchange's quantized rows
/// and their GPU copy). The windows are tried in order; a pointer in none is read as is.
struct GatherWindow {
  const uint8_t* from = nullptr;
  uint64_t bytes = 0;
  const uint8_t* to = nullptr;
};

/// Most windows one gather takes.
inline constexpr int32_t kMaxGatherWindows = 64;

/// `p` as a gather or reduce reads it: through the first of `windows` [0, n) that holds it,
/// else as is (host and device alike).
EPD_HD const uint8_t* TranslateWindow(const void* p, const GatherWindow* windows, int32_t n) {
  const auto* q = static_cast<const uint8_t*>(p);
  for (int32_t i = 0; i < n; ++i) {
    if (q >= windows[i].from && q < windows[i].from + windows[i].bytes) {
      return windows[i].to + (q - windows[i].from);
    }
  }
  return q;
}

/// Rows of a rank's RowSource table: a normal dispatch's receive capacity or a low-latency
/// one's El * R * Mll, the larger.
inline int64_t RowSourceRows(const GroupShape& shape) {
  const int64_t ll = int64_t{shape.num_local_experts()} * shape.ll_rows_per_expert();
  return shape.max_recv_tokens() > ll ? shape.max_recv_tokens() : ll;
}

}  // namespace epd::kernels
