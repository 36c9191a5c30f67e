// The byte ranges of a rank's data area that an op crosses between where the client sees
// the area and where the exchange reads and writes it: on the CUDA backend across nodes, the
// rank's GPU area and its pinned host mirror (DESIGN.md §5.5). Only the rows the op uses:
// T input rows, the N rows a dispatch received, each expert's received rows. Pure functions
// of the shape and the op, so the host backend's tests can check them (HostDataPlaneOptions::
// stage_through_mirror) where no GPU is.
#pragma once

#include <cstdint>
#include <vector>

#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_gather.h"
#include "epd/kernels/row_reduce.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// Where a combine's rows from source ranks [first, first + count) lie among the rows that
/// column `to` of `counts` received (`counts` [R, width] source major: a normal dispatch's
/// [R, R] with `to` a rank, a low-latency one's [R, E] with `to` an expert): rows [start,
/// start + rows), the sources' rows being in ascending source order.
struct SourceRows {
  int64_t start = 0, rows = 0;
};
SourceRows RowsFromSources(const std::vector<int32_t>& counts, int32_t width, int32_t to,
                           int32_t first, int32_t count);

/// The ranges of rank `rank`'s area that the exchange reads for op `plan` with the rank's
/// validated `slot`, into `spans` (capacity kernels::kMaxAreaSpans); returns their number
/// and sets *total to their bytes. `num_recv_tokens`: the N of the rank's routing dispatch
/// (HandleTable; a normal combine reads N rows). `ll_counts`: the rows of the low-latency
/// combine's dispatch, [R, E] source major (NodeExchange::LowLatencyCounts); unused for
/// other ops. Empty ranges are left out. `rows_quantized`: a low-latency FP8 dispatch's
/// tokens were quantized on the GPU into the exchange's rows (NodeExchangeHost::
/// ExchangeRowsQuantized), so its x is not among the ranges. `backend`: what the backend's
/// kernels read from the GPU areas themselves, never from the mirror (BackendRows).
struct BackendRows {
  /// A dispatch's token rows (x, and a normal FP8 dispatch's scales) are read by the
  /// backend's pack and gathers; a combine's rows (and weights) received from this node's
  /// ranks by its reduce.
  bool on = false;
  int32_t local_first = 0, local_count = 0;  ///< This node's ranks.
  /// [R, R] rows of the normal combine's routing dispatch from each rank to each rank
  /// (NodeExchange::DispatchCounts); the low-latency combine's are `ll_counts`.
  const std::vector<int32_t>* dispatch_counts = nullptr;
};
int32_t MirrorInputSpans(const kernels::GroupShape& shape, const kernels::EndpointLayout& layout,
                         const OpPlan& plan, const abi::RequestSlot& slot, int32_t rank,
                         int32_t num_recv_tokens, const std::vector<int32_t>& ll_counts,
                         kernels::Region* spans, uint64_t* total, bool rows_quantized = false,
                         const BackendRows& backend = {});

/// The ranges of a rank's area that op `plan` wrote, once the exchange finished it with
/// `outcome` (a dispatch's N), into `spans` (capacity kernels::kMaxAreaSpans); returns their
/// number and sets *total. `data` is the area the exchange wrote (a low-latency dispatch's
/// per-expert received counts are read from its ll_recv_count, clamped to the region).
/// `rows_gathered`: a dispatch's received rows (x and FP8 scales) were left to a row gather
/// (NodeExchangeHost::ExchangeRowSources), or a combine's outputs (combined_x and
/// combined_topk_weights) to a row reduce (ExchangeReduceTable), and are not among the
/// ranges.
int32_t MirrorOutputSpans(const kernels::GroupShape& shape, const kernels::EndpointLayout& layout,
                          const OpPlan& plan, const abi::RequestSlot& slot,
                          const RankOutcome& outcome, const uint8_t* data, kernels::Region* spans,
                          uint64_t* total, bool rows_gathered = false);

/// The row gather of dispatch `plan` whose received rows were left to the backend
/// (MirrorOutputSpans' rows_gathered): into `area` (the rank's area as its client sees it),
/// from `sources` (NodeExchangeHost::ExchangeRowSources), with the counts the exchange wrote
/// into `data` (the daemon-private area it worked on: recv_count, or the buffer's
/// ll_recv_count). Zero blocks for an op that is not a dispatch.
kernels::RowGather DispatchRowGather(const kernels::GroupShape& shape,
                                     const kernels::EndpointLayout& layout, const OpPlan& plan,
                                     uint8_t* area, const uint8_t* data,
                                     const kernels::RowSource* sources);

/// The row reduce of combine `plan` whose outputs were left to the backend (MirrorOutputSpans'
/// rows_gathered): into `area` (the rank's area as its client sees it), from `table` (what
/// the combine recorded: NodeExchangeHost::ExchangeReduceTable), its rows clamped to the
/// table and to the outputs. Zero rows for an op that is not a combine.
kernels::RowReduce CombineRowReduce(const kernels::GroupShape& shape,
                                    const kernels::EndpointLayout& layout, const OpPlan& plan,
                                    uint8_t* area, const kernels::ReduceTable& table);

}  // namespace epd
