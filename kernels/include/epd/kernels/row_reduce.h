// Combined rows whose reduction a combine leaves to its caller (DESIGN.md §5.5 "Rows on the
// GPU"): Combine and LowLatencyCombine (host_ops.h) can, instead of summing each token's
// rows into combined_x (and combined_topk_weights), record the token's terms (a ReduceTerm
// per row it sums, in the order it sums them) into a ReduceTable. The caller then reduces
// them: the CUDA backend with one kernel per rank straight into the rank's GPU area
// (cuda_reduce.h), the host reference with ReduceRows (host_node_ops.h). Both write exactly
// what the combine would have.
#pragma once

#include <cstdint>

#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::kernels {

/// One row a combined row sums: `x` [H] bf16 and, for a normal combine with weights,
/// `topk_weights` [K] f32 (the row's weights, summed into combined_topk_weights; else null).
/// `weight` multiplies each value of x first in a weighted reduce (a low-latency combine's
/// topk_weights[t, k]); unused otherwise. `x` null: the term is skipped (an unused slot).
/// Pointers are read as values only.
struct ReduceTerm {
  const bf16_bits* x = nullptr;
  const float* topk_weights = nullptr;
  float weight = 0.0f;
};

/// Where a combine records one rank's combined rows: `terms` [ReduceTableRows(shape) *
/// ReduceTermsPerRow(shape)] (the caller's memory), row t's terms at [t * terms_per_row,
/// (t + 1) * terms_per_row) in summation order, the unused ones with x null. The combine
/// sets `rows` (its T) and rewrites every slot of rows [0, rows); nothing past them.
struct ReduceTable {
  ReduceTerm* terms = nullptr;
  int32_t rows = 0;
};

/// One rank's reduce, as its caller runs it. Row t of combined_x, for t in [0, rows): per
/// channel h, acc = +0.0f, then for each term j ascending with x set: acc = acc + f32(x[h])
/// (`weighted`: acc = acc + (weight * f32(x[h]) rounded to f32)), rounded to f32 at each step
/// (no fused multiply-add), then one round to bf16 (nearest even). combined_topk_weights
/// (when set) [rows, K]: per k, w = +0.0f, then w = w + topk_weights[k] for each term with x
/// and topk_weights set, in the same order.
struct RowReduce {
  bf16_bits* combined_x = nullptr;         ///< Out [rows, H] bf16.
  float* combined_topk_weights = nullptr;  ///< Out [rows, K] f32, or null.
  int32_t rows = 0;                        ///< Rows to write.
  int32_t terms_per_row = 0;               ///< Slots per row in `terms`.
  const ReduceTerm* terms = nullptr;       ///< [rows * terms_per_row].
  bool weighted = false;                   ///< Low-latency: each term scaled by its weight.
};

/// Term slots per combined row: a token sums at most K rows (one per top-k choice; a normal
/// combine's distinct ranks are at most K too).
inline int32_t ReduceTermsPerRow(const GroupShape& shape) { return shape.num_topk; }

/// Rows of a rank's ReduceTable: a normal combine's T or a low-latency one's, the larger.
inline int32_t ReduceTableRows(const GroupShape& shape) {
  return shape.max_tokens_per_rank > shape.ll_max_tokens_per_rank ? shape.max_tokens_per_rank
                                                                  : shape.ll_max_tokens_per_rank;
}

}  // namespace epd::kernels
