// The host ops of a group that spans nodes, one node's part (DESIGN.md §5.1). Pure
// functions on plain memory, like host_ops.h: the daemon's exchange moves the bytes
// between nodes; these compute, from what this node holds (its own ranks' inputs and the
// rows other nodes sent it), exactly the outputs of the node's ranks that the whole-group
// ops of host_ops.h compute, bit for bit.
//
// Terms: the group's R ranks live on nodes, each node holding a contiguous range of them
// (NodeRanks). A "source view" is what this node holds of one source rank: for a local
// rank all of its T tokens; for a remote rank only the tokens that go to this node, in
// ascending token order, each with its token index. The counts every node sends every
// other node (RowCounts below) tell each node where its rows land at the other nodes.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_gather.h"

namespace epd::kernels::host {

/// This node's ranks of the group: [first, first + count).
struct NodeRanks {
  int32_t first = 0;
  int32_t count = 0;
  bool Has(int32_t rank) const { return rank >= first && rank < first + count; }
};

/// Whether token row `topk_idx` [K] (or, for a cached normal dispatch, `send_pos` [R])
/// has a destination on `node`: an expert of one of its ranks (normal and low-latency ops
/// alike: expert e lives on rank e / (E / R)), or a cached row >= 0 at one of its ranks.
/// Exactly one of topk_idx / send_pos is non-null.
bool GoesToNode(const GroupShape& shape, NodeRanks node, const int64_t* topk_idx,
                const int32_t* send_pos);

/// A normal dispatch's row counts of one source: to_rank[r] = tokens sent to rank r
/// (out [R]), from its (checked) topk_idx [T, K] or, for a cached re-dispatch, from its
/// cached send_pos [T, R] (exactly one non-null).
void CountDispatchRows(const GroupShape& shape, int32_t num_tokens, const int64_t* topk_idx,
                       const int32_t* cached_send_pos, int32_t* to_rank);

/// A low-latency dispatch's row counts of one source: to_expert[e] = tokens routed to
/// expert e, a duplicate in a row once (out [E]), from its checked topk_idx [T, K].
void CountLowLatencyRows(const GroupShape& shape, int32_t num_tokens, const int64_t* topk_idx,
                         int32_t* to_expert);

/// Quantizes rows [num_rows, H] bf16 to e4m3 `out` [num_rows, H] with scales `scales`
/// [num_rows, S] f32, each row exactly as QuantizeRowFp8 does (the rows split over `exec`'s
/// threads; no allocation with a pool).
void QuantizeRowsFp8(const GroupShape& shape, int32_t num_rows, const bf16_bits* x,
                     bool round_scale, e4m3_bits* out, float* scales,
                     const HostExecution& exec = {});

/// One source rank's inputs for PackNodeRows: its `num_tokens` tokens in order.
struct NodePackSource {
  int32_t num_tokens = 0;
  const int64_t* topk_idx = nullptr;    ///< [T, K] (null with send_pos).
  const int32_t* send_pos = nullptr;    ///< Cached dispatch: [T, R] (else null).
  const void* x = nullptr;              ///< [T, x_row_bytes] (bf16, or e4m3 when fp8).
  int64_t x_row_bytes = 0;              ///< Bytes of one row of x.
  const float* x_scales = nullptr;      ///< [T, S] f32, or null when there are none.
  const float* topk_weights = nullptr;  ///< [T, K] f32, or null when not sent.
};

/// Where PackNodeRows writes one (source, node) pair's rows: row m = the m-th token of the
/// source with a destination on `node` (GoesToNode), in ascending token order. Each output
/// is [rows, width] with the source's widths; null outputs are not written (send_pos is
/// written when the source has send_pos, else topk_idx).
struct NodePackJob {
  const NodePackSource* source = nullptr;
  NodeRanks node;
  int32_t* token = nullptr;       ///< [rows] token index.
  int64_t* topk_idx = nullptr;    ///< [rows, K].
  int32_t* send_pos = nullptr;    ///< [rows, R].
  float* topk_weights = nullptr;  ///< [rows, K] when the source has weights.
  void* x = nullptr;              ///< [rows, x_row_bytes].
  float* x_scales = nullptr;      ///< [rows, S] when the source has scales.
  int32_t* num_rows = nullptr;    ///< Out: rows written.
  /// Rows on the backend (DESIGN.md §5.5): when not null, x and x_scales are not copied;
  /// row m's source is recorded here instead ([rows]: the source's x row and scales row),
  /// for a row gather into x / x_scales (GatherRows with blocks = 1, counts = num_rows).
  RowSource* x_sources = nullptr;
};

/// Packs the rows of every job (a send staging for the daemon's exchange), the jobs split
/// over `exec`'s threads. Jobs must write disjoint memory; the sources are read only. No
/// checks: the caller has checked the sources' topk_idx / send_pos and sized the outputs.
void PackNodeRows(const GroupShape& shape, std::span<const NodePackJob> jobs,
                  const HostExecution& exec = {});

/// What this node holds of one source rank of a normal dispatch. token, topk_idx and
/// send_pos are checked and then read again: they must be memory nobody else writes while
/// the call runs (the daemon copies a peer's out of its receive region first); x, x_scales
/// and topk_weights are read as values only.
struct NodeDispatchSource {
  int32_t num_rows = 0;               ///< Rows present.
  const int32_t* token = nullptr;     ///< [num_rows] token index, ascending; null: row i = token i.
  const void* x = nullptr;            ///< [num_rows, H] bf16, or e4m3 when fp8.
  const float* x_scales = nullptr;    ///< [num_rows, S] f32 when fp8.
  const int64_t* topk_idx = nullptr;  ///< [num_rows, K] (not cached).
  const float* topk_weights = nullptr;  ///< [num_rows, K] f32 when the op carries weights.
  const int32_t* send_pos = nullptr;    ///< Cached: [num_rows, R] the cached handle's rows.
};

/// Normal dispatch, this node's part. `counts` [R, R]: tokens of source s sent to rank r,
/// every node's (the same matrix on every node). `sources` [R]: what this node holds of
/// every source. `local` [node.count]: the node's ranks' DispatchRankArgs with only the
/// output fields used (recv_*, rank_prefix, num_recv_tokens; and for a local source its
/// send_pos out [T, R], num_tokens, and cached_num_recv_tokens with a cached handle).
/// `with_weights`: the op carries topk_weights. Writes what Dispatch writes for these
/// ranks. Every remote row is checked against `counts` and the shape first (they come
/// from another daemon): INVALID_ARGUMENT naming the source rank, with outputs untouched,
/// and that rank in `*failed_source` (when not null; untouched for an error no one source
/// is the cause of).
absl::Status NodeDispatch(const GroupShape& shape, const DispatchOptions& options,
                          bool with_weights, NodeRanks node, std::span<const int32_t> counts,
                          std::span<const NodeDispatchSource> sources,
                          std::span<DispatchRankArgs> local, const HostExecution& exec = {},
                          int32_t* failed_source = nullptr);

/// What this node holds of one source rank of a low-latency dispatch. token and topk_idx
/// are checked and then read again: they must be memory nobody else writes while the call
/// runs; x and scales are read as values only.
struct NodeLowLatencySource {
  int32_t num_rows = 0;               ///< Rows present.
  const int32_t* token = nullptr;     ///< [num_rows] token index, ascending; null: row i = token i.
  const int64_t* topk_idx = nullptr;  ///< [num_rows, K].
  /// [num_rows, H]: bf16 (quantized here when use_fp8), or e4m3 when `quantized` (a local
  /// source may be quantized too: QuantizeRowsFp8 of all its tokens).
  const void* x = nullptr;
  const float* scales = nullptr;  ///< [num_rows, S] f32 when `quantized` (QuantizeRowFp8's).
  bool quantized = false;
};

/// Low-latency dispatch, this node's part. `counts` [R, E]: tokens of source s routed to
/// expert e (CountLowLatencyRows of every source, the same matrix on every node).
/// `sources` [R]; `local` [node.count]: the node's ranks' args (outputs recv_*, and for a
/// local source num_tokens and handle_pos out). Writes what LowLatencyDispatch writes for
/// these ranks; remote rows are checked first (INVALID_ARGUMENT, outputs untouched; the
/// source rank at fault in `*failed_source` as for NodeDispatch).
absl::Status NodeLowLatencyDispatch(const GroupShape& shape,
                                    const LowLatencyDispatchOptions& options, NodeRanks node,
                                    std::span<const int32_t> counts,
                                    std::span<const NodeLowLatencySource> sources,
                                    std::span<LowLatencyDispatchRankArgs> local,
                                    const HostExecution& exec = {},
                                    int32_t* failed_source = nullptr);

/// The host reference of a row gather (row_gather.h): copies every listed row of `g` and
/// its scales, exactly as NodeDispatch / NodeLowLatencyDispatch would have written them
/// without recv_row_src, or PackNodeRows without x_sources (and as the CUDA gather does),
/// each source pointer translated by the first of `windows` that holds it. No checks
/// beyond clamping each count to [0, block_rows]: the caller built `g` from its own
/// validated outputs.
void GatherRows(const GroupShape& shape, const RowGather& g,
                std::span<const GatherWindow> windows = {});

/// The host reference of a row reduce (row_reduce.h): writes every row of `r` exactly as
/// Combine / LowLatencyCombine would have without `reduce` (and as the CUDA reduce does):
/// the same f32 operations in the same order, the same rounding. No checks: the caller
/// built `r` from a table its own combine recorded, with rows within its outputs and the
/// table (a negative rows or terms_per_row writes nothing). Each term's pointers are
/// translated by the first of `windows` that holds them, as GatherRows does. Allocates
/// nothing.
void ReduceRows(const GroupShape& shape, const RowReduce& r,
                std::span<const GatherWindow> windows = {});

}  // namespace epd::kernels::host
