// The byte ranges of a rank's data area an op crosses between the GPU and a host mirror
// (mirror_spans.h).
#include "daemon/dataplane/exchange/mirror_spans.h"

#include <algorithm>

#include "epd/kernels/op_rules.h"

namespace epd {
namespace {

/// Appends span [offset, offset + bytes) (nothing when empty) and adds its bytes to *total.
void Add(kernels::Region* spans, int32_t* n, uint64_t* total, uint64_t offset, uint64_t bytes) {
  if (bytes == 0 || *n >= kernels::kMaxAreaSpans) return;
  spans[(*n)++] = {offset, bytes};
  *total += bytes;
}

/// `rows` rows of `row_bytes` at the start of `r`, clamped to the region.
uint64_t Rows(const kernels::Region& r, int64_t rows, uint64_t row_bytes) {
  return std::min<uint64_t>(r.bytes, static_cast<uint64_t>(std::max<int64_t>(rows, 0)) * row_bytes);
}

/// Appends rows [first, last) of `row_bytes` of region `r`, clamped to the region.
void AddRows(kernels::Region* spans, int32_t* n, uint64_t* total, const kernels::Region& r,
             int64_t first, int64_t last, uint64_t row_bytes) {
  const uint64_t begin = Rows(r, first, row_bytes), end = Rows(r, last, row_bytes);
  if (end > begin) Add(spans, n, total, r.offset + begin, end - begin);
}

}  // namespace

SourceRows RowsFromSources(const std::vector<int32_t>& counts, int32_t width, int32_t to,
                           int32_t first, int32_t count) {
  SourceRows out;
  for (int32_t s = 0; s < first; ++s) out.start += counts[int64_t{s} * width + to];
  for (int32_t s = first; s < first + count; ++s) out.rows += counts[int64_t{s} * width + to];
  return out;
}

int32_t MirrorInputSpans(const kernels::GroupShape& s, const kernels::EndpointLayout& L,
                         const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                         int32_t num_recv_tokens, const std::vector<int32_t>& ll_counts,
                         kernels::Region* spans, uint64_t* total, bool rows_quantized,
                         const BackendRows& backend) {
  const bool rows_on_backend = backend.on;
  const rules::RequestOptions f = rules::DecodeFlags(plan.flags);
  const int64_t T = slot.num_tokens, H = s.hidden, K = s.num_topk;
  int32_t n = 0;
  *total = 0;
  auto add = [&](const kernels::Region& region, uint64_t bytes) {
    Add(spans, &n, total, region.offset, std::min(bytes, region.bytes));
  };
  switch (plan.op) {
    case abi::OpKind::kGetDispatchLayout:
      add(L.in_topk_idx, Rows(L.in_topk_idx, T, K * 8));
      break;
    case abi::OpKind::kDispatch:
      if (!rows_on_backend) {
        add(L.in_x, Rows(L.in_x, T, f.use_fp8 ? H : 2 * H));
        if (f.use_fp8) add(L.in_scales, Rows(L.in_scales, T, uint64_t(s.num_scales()) * 4));
      }
      if (!f.cached_handle) add(L.in_topk_idx, Rows(L.in_topk_idx, T, K * 8));
      if (f.dispatch_weights) add(L.in_topk_weights, Rows(L.in_topk_weights, T, K * 4));
      break;
    case abi::OpKind::kCombine: {
      const int64_t N = num_recv_tokens, R = s.num_ranks;
      // Rows received from this node's ranks (ascending source rank: a range) stay on the
      // GPU when the backend reduces them from there.
      int64_t skip_begin = N, skip_end = N;
      if (rows_on_backend && backend.dispatch_counts != nullptr &&
          backend.dispatch_counts->size() == static_cast<size_t>(R * R)) {
        const SourceRows local = RowsFromSources(*backend.dispatch_counts, static_cast<int32_t>(R),
                                                 r, backend.local_first, backend.local_count);
        skip_begin = std::clamp<int64_t>(local.start, 0, N);
        skip_end = std::clamp<int64_t>(local.start + local.rows, skip_begin, N);
      }
      AddRows(spans, &n, total, L.in_combine_x, 0, skip_begin, 2 * H);
      AddRows(spans, &n, total, L.in_combine_x, skip_end, N, 2 * H);
      if (f.combine_weights) {
        AddRows(spans, &n, total, L.in_combine_weights, 0, skip_begin, K * 4);
        AddRows(spans, &n, total, L.in_combine_weights, skip_end, N, K * 4);
      }
      break;
    }
    case abi::OpKind::kLowLatencyDispatch:
      if (!(rows_quantized && f.use_fp8) && !rows_on_backend) add(L.in_x, Rows(L.in_x, T, 2 * H));
      add(L.in_topk_idx, Rows(L.in_topk_idx, T, K * 8));
      break;
    case abi::OpKind::kLowLatencyCombine: {
      add(L.in_topk_idx, Rows(L.in_topk_idx, T, K * 8));
      add(L.in_topk_weights, Rows(L.in_topk_weights, T, K * 4));
      const int32_t El = s.num_local_experts(), E = s.num_experts, R = s.num_ranks;
      const int64_t rpe = s.ll_rows_per_expert();
      if (El + 2 > kernels::kMaxAreaSpans) {  // Too many experts for one span each: all rows.
        add(L.in_ll_combine_x, L.in_ll_combine_x.bytes);
        break;
      }
      // Per local expert, the rows its dispatch received (what the exchange reads), but for
      // those from this node's ranks (a range: ascending source rank) when the backend
      // reduces them from the GPU areas and there are spans enough for two ranges each.
      const bool skip = rows_on_backend && 2 * El + 2 <= kernels::kMaxAreaSpans;
      const std::vector<int32_t>& c = ll_counts;
      for (int32_t j = 0; j < El; ++j) {
        const int32_t e = r * El + j;
        const int64_t rows = std::clamp<int64_t>(RowsFromSources(c, E, e, 0, R).rows, 0, rpe);
        const SourceRows local =
            skip ? RowsFromSources(c, E, e, backend.local_first, backend.local_count)
                 : SourceRows{rows, 0};
        const int64_t skip_begin = std::clamp<int64_t>(local.start, 0, rows);
        const int64_t skip_end = std::clamp<int64_t>(local.start + local.rows, skip_begin, rows);
        const kernels::Region block{L.in_ll_combine_x.offset + uint64_t(j) * rpe * 2 * H,
                                    uint64_t(rows) * 2 * H};
        AddRows(spans, &n, total, block, 0, skip_begin, 2 * H);
        AddRows(spans, &n, total, block, skip_end, rows, 2 * H);
      }
      break;
    }
    default:
      break;
  }
  return n;
}

int32_t MirrorOutputSpans(const kernels::GroupShape& s, const kernels::EndpointLayout& L,
                          const OpPlan& plan, const abi::RequestSlot& slot,
                          const RankOutcome& outcome, const uint8_t* data, kernels::Region* spans,
                          uint64_t* total, bool rows_gathered) {
  const rules::RequestOptions f = rules::DecodeFlags(plan.flags);
  const int64_t T = slot.num_tokens, H = s.hidden, K = s.num_topk, R = s.num_ranks;
  const int64_t S = s.num_scales(), El = s.num_local_experts();
  int32_t n = 0;
  *total = 0;
  auto add = [&](const kernels::Region& region, uint64_t bytes) {
    Add(spans, &n, total, region.offset, std::min(bytes, region.bytes));
  };
  switch (plan.op) {
    case abi::OpKind::kGetDispatchLayout:
      add(L.layout_tokens_per_rank, L.layout_tokens_per_rank.bytes);
      add(L.layout_tokens_per_expert, L.layout_tokens_per_expert.bytes);
      add(L.layout_is_token_in_rank, Rows(L.layout_is_token_in_rank, T, R));
      break;
    case abi::OpKind::kDispatch: {
      const int64_t N = outcome.num_recv_tokens;
      if (!rows_gathered) {
        add(L.recv_x, Rows(L.recv_x, N, f.use_fp8 ? H : 2 * H));
        if (f.use_fp8) add(L.recv_scales, Rows(L.recv_scales, N, S * 4));
      }
      add(L.recv_topk_idx, Rows(L.recv_topk_idx, N, K * 8));
      add(L.recv_topk_weights, Rows(L.recv_topk_weights, N, K * 4));
      add(L.recv_tokens_per_expert, L.recv_tokens_per_expert.bytes);
      add(L.recv_src_info, Rows(L.recv_src_info, N, 4));
      add(L.send_pos, Rows(L.send_pos, T, R * 4));
      add(L.rank_prefix, L.rank_prefix.bytes);
      add(L.recv_count, L.recv_count.bytes);
      break;
    }
    case abi::OpKind::kCombine:
      if (rows_gathered) break;  // Every output is the reduce's.
      add(L.combined_x, Rows(L.combined_x, T, 2 * H));
      if (f.combine_weights) add(L.combined_topk_weights, Rows(L.combined_topk_weights, T, K * 4));
      break;
    case abi::OpKind::kLowLatencyDispatch: {
      const int b = plan.ll_buffer;
      const int64_t rpe = s.ll_rows_per_expert();
      const uint64_t xb = f.use_fp8 ? H : 2 * H;
      if (f.use_fp8 && !rows_gathered) add(L.ll_recv_scales[b], L.ll_recv_scales[b].bytes);
      add(L.ll_recv_count[b], L.ll_recv_count[b].bytes);
      add(L.ll_handle_pos[b], Rows(L.ll_handle_pos[b], T, K * 4));
      if (2 * El + 3 > kernels::kMaxAreaSpans) {  // Too many experts for spans each: all rows.
        if (!rows_gathered) add(L.ll_recv_x[b], L.ll_recv_x[b].bytes);
        add(L.ll_recv_src_info[b], L.ll_recv_src_info[b].bytes);
        break;
      }
      // Per local expert, the rows it received (the count the exchange wrote to the
      // daemon-private mirror).
      const auto* count = reinterpret_cast<const int32_t*>(data + L.ll_recv_count[b].offset);
      for (int64_t j = 0; j < El; ++j) {
        const int64_t rows = std::clamp<int64_t>(count[j], 0, rpe);
        if (!rows_gathered) {
          Add(spans, &n, total, L.ll_recv_x[b].offset + uint64_t(j * rpe) * xb,
              uint64_t(rows) * xb);
        }
        Add(spans, &n, total, L.ll_recv_src_info[b].offset + uint64_t(j * rpe) * 4,
            uint64_t(rows) * 4);
      }
      break;
    }
    case abi::OpKind::kLowLatencyCombine:
      if (rows_gathered) break;
      add(L.ll_combined_x[plan.ll_out_buffer], Rows(L.ll_combined_x[plan.ll_out_buffer], T, 2 * H));
      break;
    default:
      break;
  }
  return n;
}

kernels::RowGather DispatchRowGather(const kernels::GroupShape& s, const kernels::EndpointLayout& L,
                                     const OpPlan& plan, uint8_t* area, const uint8_t* data,
                                     const kernels::RowSource* sources) {
  const rules::RequestOptions f = rules::DecodeFlags(plan.flags);
  kernels::RowGather g;
  g.row_bytes = f.use_fp8 ? s.hidden : 2 * s.hidden;
  g.sources = sources;
  if (plan.op == abi::OpKind::kDispatch) {
    g.x = area + L.recv_x.offset;
    g.blocks = 1;
    g.block_rows = s.max_recv_tokens();
    g.counts = reinterpret_cast<const int32_t*>(data + L.recv_count.offset);
    g.scales_kind = f.use_fp8 ? kernels::GatherScales::kRows : kernels::GatherScales::kNone;
    g.scales = area + L.recv_scales.offset;
  } else if (plan.op == abi::OpKind::kLowLatencyDispatch) {
    const int b = plan.ll_buffer;
    g.x = area + L.ll_recv_x[b].offset;
    g.blocks = s.num_local_experts();
    g.block_rows = s.ll_rows_per_expert();
    g.counts = reinterpret_cast<const int32_t*>(data + L.ll_recv_count[b].offset);
    g.scales_kind = !f.use_fp8    ? kernels::GatherScales::kNone
                    : f.use_ue8m0 ? kernels::GatherScales::kLowLatencyUe8m0
                                  : kernels::GatherScales::kLowLatency;
    g.scales = area + L.ll_recv_scales[b].offset;
  }
  return g;
}

kernels::RowReduce CombineRowReduce(const kernels::GroupShape& s, const kernels::EndpointLayout& L,
                                    const OpPlan& plan, uint8_t* area,
                                    const kernels::ReduceTable& table) {
  const rules::RequestOptions f = rules::DecodeFlags(plan.flags);
  const int64_t H = s.hidden, K = s.num_topk;
  kernels::RowReduce r;
  r.terms = table.terms;
  r.terms_per_row = kernels::ReduceTermsPerRow(s);
  const kernels::Region* x = nullptr;
  int64_t capacity = kernels::ReduceTableRows(s);
  if (plan.op == abi::OpKind::kCombine) {
    x = &L.combined_x;
    if (f.combine_weights) {
      r.combined_topk_weights = reinterpret_cast<float*>(area + L.combined_topk_weights.offset);
      capacity = std::min<int64_t>(capacity, L.combined_topk_weights.bytes / (4 * K));
    }
  } else if (plan.op == abi::OpKind::kLowLatencyCombine) {
    x = &L.ll_combined_x[plan.ll_out_buffer];
    r.weighted = true;
  } else {
    return r;
  }
  r.combined_x = reinterpret_cast<kernels::bf16_bits*>(area + x->offset);
  capacity = std::min<int64_t>(capacity, x->bytes / (2 * H));
  r.rows = static_cast<int32_t>(std::clamp<int64_t>(table.rows, 0, capacity));
  return r;
}

}  // namespace epd
