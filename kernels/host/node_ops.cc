// One node's part of the host ops of a group that spans nodes (host_node_ops.h). The
// placement rules are those of dispatch.cc and low_latency.cc: receive rows grouped by
// source rank, then token; a source's rows at a destination counted in token order; the
// first row of a source at a destination is the sum of the earlier sources' counts. What
// this node cannot see (the other nodes' tokens) enters only through `counts`.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/op_rules.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace {

int64_t AlignUp(int64_t n, int64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

/// Checks a source view's row count and token indices: num_rows in [0, capacity], tokens
/// strictly ascending in [0, capacity).
absl::Status CheckSourceRows(const char* op, int32_t s, int32_t num_rows, const int32_t* token,
                             int32_t capacity) {
  if (num_rows < 0 || num_rows > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": source rank ", s, ": ", num_rows,
                                                   " rows, outside [0, ", capacity, "]"));
  }
  if (token == nullptr) return absl::OkStatus();
  for (int32_t i = 0; i < num_rows; ++i) {
    if (token[i] < 0 || token[i] >= capacity || (i > 0 && token[i] <= token[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": source rank ", s, ": row ", i,
                                                     " has token index ", token[i],
                                                     ", not ascending within [0, ", capacity, ")"));
    }
  }
  return absl::OkStatus();
}

/// Whether topk_idx row `row` [K] names an expert of rank `r`.
bool RowHasRank(const int64_t* row, int32_t num_topk, int64_t experts_per_rank, int32_t r) {
  for (int k = 0; k < num_topk; ++k) {
    if (row[k] >= 0 && row[k] / experts_per_rank == r) return true;
  }
  return false;
}

}  // namespace

bool GoesToNode(const GroupShape& shape, NodeRanks node, const int64_t* topk_idx,
                const int32_t* send_pos) {
  if (send_pos != nullptr) {
    for (int32_t r = node.first; r < node.first + node.count; ++r) {
      if (send_pos[r] >= 0) return true;
    }
    return false;
  }
  const int64_t experts_per_rank = shape.num_local_experts();
  for (int k = 0; k < shape.num_topk; ++k) {
    if (topk_idx[k] >= 0 && node.Has(static_cast<int32_t>(topk_idx[k] / experts_per_rank))) {
      return true;
    }
  }
  return false;
}

void CountDispatchRows(const GroupShape& shape, int32_t num_tokens, const int64_t* topk_idx,
                       const int32_t* cached_send_pos, int32_t* to_rank) {
  const int32_t num_ranks = shape.num_ranks;
  std::fill(to_rank, to_rank + num_ranks, 0);
  for (int32_t t = 0; t < num_tokens; ++t) {
    if (cached_send_pos != nullptr) {
      const int32_t* pos = cached_send_pos + static_cast<int64_t>(t) * num_ranks;
      for (int32_t r = 0; r < num_ranks; ++r) to_rank[r] += pos[r] >= 0 ? 1 : 0;
      continue;
    }
    const int64_t* row = topk_idx + static_cast<int64_t>(t) * shape.num_topk;
    for (int32_t r = 0; r < num_ranks; ++r) {
      to_rank[r] += RowHasRank(row, shape.num_topk, shape.num_local_experts(), r) ? 1 : 0;
    }
  }
}

void CountLowLatencyRows(const GroupShape& shape, int32_t num_tokens, const int64_t* topk_idx,
                         int32_t* to_expert) {
  std::fill(to_expert, to_expert + shape.num_experts, 0);
  for (int32_t t = 0; t < num_tokens; ++t) {
    const int64_t* row = topk_idx + static_cast<int64_t>(t) * shape.num_topk;
    for (int k = 0; k < shape.num_topk; ++k) {
      if (row[k] >= 0 && !internal::IsDuplicateInRow(row, k)) ++to_expert[row[k]];
    }
  }
}

void QuantizeRowsFp8(const GroupShape& shape, int32_t num_rows, const bf16_bits* x,
                     bool round_scale, e4m3_bits* out, float* scales, const HostExecution& exec) {
  if (num_rows <= 0) return;
  const int64_t hidden = shape.hidden;
  const int64_t S = shape.num_scales();
  const int64_t grain = internal::GrainForRowBytes(hidden * 2);
  const int64_t chunks = (num_rows + grain - 1) / grain;
  internal::OpContext ctx(exec);
  ctx.ParallelFor(chunks, [&](int64_t c, int) {
    const int64_t end = std::min<int64_t>(num_rows, (c + 1) * grain);
    for (int64_t t = c * grain; t < end; ++t) {
      QuantizeRowFp8(x + t * hidden, shape.hidden, round_scale, out + t * hidden, scales + t * S);
    }
  });
}

void PackNodeRows(const GroupShape& shape, std::span<const NodePackJob> jobs,
                  const HostExecution& exec) {
  const int32_t R = shape.num_ranks, K = shape.num_topk;
  const int64_t S = shape.num_scales();
  auto pack = [&](int64_t j, int) {
    const NodePackJob& job = jobs[j];
    const NodePackSource& src = *job.source;
    const bool cached = src.send_pos != nullptr;
    const auto* in_x = static_cast<const uint8_t*>(src.x);
    auto* out_x = static_cast<uint8_t*>(job.x);
    const size_t xb = static_cast<size_t>(src.x_row_bytes);
    int32_t m = 0;
    for (int32_t t = 0; t < src.num_tokens; ++t) {
      const int64_t* idx = cached ? nullptr : src.topk_idx + int64_t{t} * K;
      const int32_t* pos = cached ? src.send_pos + int64_t{t} * R : nullptr;
      if (!GoesToNode(shape, job.node, idx, pos)) continue;
      if (job.token != nullptr) job.token[m] = t;
      if (cached) {
        if (job.send_pos != nullptr) std::memcpy(job.send_pos + int64_t{m} * R, pos, 4 * size_t(R));
      } else if (job.topk_idx != nullptr) {
        std::memcpy(job.topk_idx + int64_t{m} * K, idx, 8 * size_t(K));
      }
      if (src.topk_weights != nullptr && job.topk_weights != nullptr) {
        std::memcpy(job.topk_weights + int64_t{m} * K, src.topk_weights + int64_t{t} * K,
                    4 * size_t(K));
      }
      if (job.x_sources != nullptr) {
        job.x_sources[m] = {in_x + t * xb,
                            src.x_scales != nullptr ? src.x_scales + t * S : nullptr};
        ++m;
        continue;
      }
      if (out_x != nullptr) std::memcpy(out_x + m * xb, in_x + t * xb, xb);
      if (src.x_scales != nullptr && job.x_scales != nullptr) {
        std::memcpy(job.x_scales + m * S, src.x_scales + t * S, 4 * size_t(S));
      }
      ++m;
    }
    if (job.num_rows != nullptr) *job.num_rows = m;
  };
  // Small stagings run on the caller: handing them to the pool costs more than the copies.
  constexpr int64_t kParallelBytes = 128 * 1024;
  int64_t bytes = 0;
  for (const NodePackJob& job : jobs) {
    // A recorded row costs its metadata and a RowSource, not its x bytes.
    const int64_t row = job.x_sources != nullptr
                            ? 4 + int64_t{R} * 4 + int64_t{K} * 12 + int64_t{sizeof(RowSource)}
                            : job.source->x_row_bytes;
    bytes += job.source->num_tokens * row;
  }
  if (bytes < kParallelBytes) {
    for (size_t j = 0; j < jobs.size(); ++j) pack(static_cast<int64_t>(j), 0);
    return;
  }
  internal::OpContext ctx(exec);
  ctx.ParallelFor(static_cast<int64_t>(jobs.size()), pack);
}

absl::Status NodeDispatch(const GroupShape& shape, const DispatchOptions& options,
                          bool with_weights, NodeRanks node, std::span<const int32_t> counts,
                          std::span<const NodeDispatchSource> sources,
                          std::span<DispatchRankArgs> local, const HostExecution& exec,
                          int32_t* failed_source) {
  using internal::CheckPointer;
  constexpr const char* kOp = "Dispatch";
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, sources.size(), kOp));
  EPD_RETURN_IF_ERROR(internal::CheckFp8Hidden(shape, options.fp8, kOp));
  const int32_t R = shape.num_ranks;
  const int32_t M = shape.max_tokens_per_rank;
  const int32_t K = shape.num_topk;
  const int32_t S = shape.num_scales();
  const int32_t El = shape.num_local_experts();
  const int64_t hidden = shape.hidden;
  if (options.expert_alignment < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": expert_alignment = ", options.expert_alignment, " must be >= 1"));
  }
  if (node.first < 0 || node.count < 1 || node.first + node.count > R ||
      local.size() != static_cast<size_t>(node.count) ||
      counts.size() != static_cast<size_t>(R) * R) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": node ranks [", node.first, ", ", node.first + node.count, ") with ", local.size(),
        " local args and ", counts.size(), " counts for num_ranks = ", R));
  }
  bool cached = false;
  for (const DispatchRankArgs& a : local) cached |= a.cached_send_pos != nullptr;
  if (cached) with_weights = false;

  // ---- Counts and sources, every remote byte before use.
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0 || counts[i] > M) {
      if (failed_source != nullptr) *failed_source = static_cast<int32_t>(i / R);
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": count of source rank ", i / R,
                                                     " to rank ", i % R, " = ", counts[i],
                                                     " is outside [0, ", M, "]"));
    }
  }
  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<int32_t>& seen_rows = scratch.count_to_rank;  // [R]: a source's rows per rank.
  auto check_source = [&](int32_t s) -> absl::Status {
    const NodeDispatchSource& v = sources[s];
    EPD_RETURN_IF_ERROR(CheckSourceRows(kOp, s, v.num_rows, v.token, M));
    if (node.Has(s) && (v.token != nullptr || v.num_rows != local[s - node.first].num_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": local source rank ", s, " must present all its ",
          local[s - node.first].num_tokens, " tokens in order, got ", v.num_rows, " rows"));
    }
    const bool rows = v.num_rows > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(v.x, rows, kOp, s, "x"));
    EPD_RETURN_IF_ERROR(CheckPointer(v.x_scales, rows && options.fp8, kOp, s, "x_scales"));
    EPD_RETURN_IF_ERROR(CheckPointer(v.topk_idx, rows && !cached, kOp, s, "topk_idx"));
    EPD_RETURN_IF_ERROR(CheckPointer(v.send_pos, rows && cached, kOp, s, "send_pos"));
    EPD_RETURN_IF_ERROR(CheckPointer(v.topk_weights, rows && with_weights, kOp, s, "topk_weights"));
    seen_rows.assign(R, 0);
    if (!rows) {
    } else if (cached) {
      CountDispatchRows(shape, v.num_rows, nullptr, v.send_pos, seen_rows.data());
    } else {
      EPD_RETURN_IF_ERROR(CheckTopkIdx(shape, s, v.num_rows, v.topk_idx));
      CountDispatchRows(shape, v.num_rows, v.topk_idx, nullptr, seen_rows.data());
    }
    for (int32_t r = node.first; r < node.first + node.count; ++r) {
      if (seen_rows[r] != counts[static_cast<size_t>(s) * R + r]) {
        return absl::InvalidArgumentError(
            absl::StrCat(kOp, ": source rank ", s, " presents ", seen_rows[r], " rows for rank ", r,
                         ", its count says ", counts[static_cast<size_t>(s) * R + r]));
      }
    }
    return absl::OkStatus();
  };
  for (int32_t s = 0; s < R; ++s) {
    if (absl::Status st = check_source(s); !st.ok()) {
      if (failed_source != nullptr) *failed_source = s;
      return st;
    }
  }

  // ---- Prefixes and receive counts of the local ranks; a cached handle's rows.
  std::vector<int64_t>& prefix = scratch.prefix;  // [node.count, R]
  prefix.assign(static_cast<size_t>(node.count) * R, 0);
  std::vector<int64_t>& num_recv = scratch.num_recv;  // [node.count]
  num_recv.assign(node.count, 0);
  for (int32_t i = 0; i < node.count; ++i) {
    const int32_t r = node.first + i;
    int64_t total = 0;
    for (int32_t s = 0; s < R; ++s) {
      prefix[static_cast<size_t>(i) * R + s] = total;
      total += counts[static_cast<size_t>(s) * R + r];
    }
    num_recv[i] = total;
    const DispatchRankArgs& a = local[i];
    EPD_RETURN_IF_ERROR(
        internal::CheckDispatchReceiver(a, r, total, options.fp8, cached, with_weights));
    if (!cached) continue;
    if (total != a.cached_num_recv_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": cached handle fills ", total, " rows of rank ", r,
                       ", cached_num_recv_tokens = ", a.cached_num_recv_tokens));
    }
    std::vector<uint8_t>& seen = scratch.marks;
    seen.assign(static_cast<size_t>(total), 0);
    for (int32_t s = 0; s < R; ++s) {
      const NodeDispatchSource& v = sources[s];
      for (int32_t j = 0; j < v.num_rows; ++j) {
        const int32_t row = v.send_pos[static_cast<int64_t>(j) * R + r];
        if (row == -1) continue;
        if (row < 0 || row >= total || seen[row]) {
          if (failed_source != nullptr) *failed_source = s;
          return absl::InvalidArgumentError(absl::StrCat(
              kOp, ": cached handle of rank ", s, " sends row ", j, " to row ", row, " of rank ", r,
              ", outside [0, ", total, ") or taken twice: not a handle of one dispatch"));
        }
        seen[row] = 1;
      }
    }
  }
  std::vector<int32_t>& per_expert = scratch.count_to_expert;  // [node.count * El]
  per_expert.assign(static_cast<size_t>(node.count) * El, 0);
  if (!cached) {
    const int64_t first_expert = static_cast<int64_t>(node.first) * El;
    for (int32_t s = 0; s < R; ++s) {
      const NodeDispatchSource& v = sources[s];
      for (int32_t j = 0; j < v.num_rows; ++j) {
        const int64_t* row = v.topk_idx + static_cast<int64_t>(j) * K;
        for (int k = 0; k < K; ++k) {
          const int64_t e = row[k] - first_expert;
          if (row[k] >= 0 && e >= 0 && e < static_cast<int64_t>(node.count) * El &&
              !internal::IsDuplicateInRow(row, k)) {
            ++per_expert[e];
          }
        }
      }
    }
    for (int32_t e = 0; e < node.count * El; ++e) {
      if (AlignUp(per_expert[e], options.expert_alignment) > INT32_MAX) {
        return absl::InvalidArgumentError(
            absl::StrCat(kOp, ": expert_alignment = ", options.expert_alignment,
                         " makes the aligned count of local expert ", e % El, " of rank ",
                         node.first + e / El, " overflow int32"));
      }
    }
  }

  if (exec.on_inputs_checked != nullptr && *exec.on_inputs_checked) (*exec.on_inputs_checked)();
  // ---- Everything is valid: write the outputs.
  for (int32_t i = 0; i < node.count; ++i) {
    DispatchRankArgs& a = local[i];
    a.num_recv_tokens = static_cast<int32_t>(num_recv[i]);
    for (int32_t s = 0; s < R; ++s) {
      a.rank_prefix[s] = static_cast<int32_t>(prefix[static_cast<size_t>(i) * R + s]);
    }
    if (!cached) {
      for (int32_t j = 0; j < El; ++j) {
        a.recv_tokens_per_expert[j] =
            static_cast<int32_t>(AlignUp(per_expert[i * El + j], options.expert_alignment));
      }
    }
  }
  // The local sources' handles: row of token t at every rank r of the group.
  for (int32_t i = 0; i < node.count; ++i) {
    const int32_t s = node.first + i;
    DispatchRankArgs& a = local[i];
    if (cached) {
      if (a.num_tokens > 0) {
        std::memmove(a.send_pos, a.cached_send_pos,
                     sizeof(int32_t) * static_cast<size_t>(a.num_tokens) * R);
      }
      continue;
    }
    std::vector<int32_t>& next = scratch.expert_base;  // [R]: next row of s at each rank.
    next.assign(R, 0);
    for (int32_t r = 0; r < R; ++r) {
      int32_t first = 0;
      for (int32_t s2 = 0; s2 < s; ++s2) first += counts[static_cast<size_t>(s2) * R + r];
      next[r] = first;
    }
    for (int32_t t = 0; t < a.num_tokens; ++t) {
      const int64_t* row = sources[s].topk_idx + static_cast<int64_t>(t) * K;
      int32_t* pos = a.send_pos + static_cast<int64_t>(t) * R;
      for (int32_t r = 0; r < R; ++r) pos[r] = RowHasRank(row, K, El, r) ? next[r]++ : -1;
    }
  }
  // Rows, per local destination, source by source in token order.
  const int64_t x_row_bytes = options.fp8 ? hidden : hidden * 2;
  ctx.ParallelFor(node.count, [&](int64_t i, int) {
    const int32_t r = node.first + static_cast<int32_t>(i);
    const DispatchRankArgs& dst = local[i];
    const int64_t first_local = static_cast<int64_t>(r) * El;
    for (int32_t s = 0; s < R; ++s) {
      const NodeDispatchSource& v = sources[s];
      int64_t next = prefix[static_cast<size_t>(i) * R + s];
      for (int32_t j = 0; j < v.num_rows; ++j) {
        const int64_t* idx = cached ? nullptr : v.topk_idx + static_cast<int64_t>(j) * K;
        int64_t row;
        if (cached) {
          row = v.send_pos[static_cast<int64_t>(j) * R + r];
        } else {
          row = RowHasRank(idx, K, El, r) ? next++ : -1;
        }
        if (row < 0) continue;
        const int32_t t = v.token != nullptr ? v.token[j] : j;
        const uint8_t* x_row = static_cast<const uint8_t*>(v.x) + j * x_row_bytes;
        const float* scales_row = options.fp8 ? v.x_scales + static_cast<int64_t>(j) * S : nullptr;
        if (dst.recv_row_src != nullptr) {
          dst.recv_row_src[row] = {x_row, scales_row};
        } else {
          std::memcpy(static_cast<uint8_t*>(dst.recv_x) + row * x_row_bytes, x_row,
                      static_cast<size_t>(x_row_bytes));
          if (options.fp8) std::memcpy(dst.recv_scales + row * S, scales_row, sizeof(float) * S);
        }
        dst.recv_src_info[row] = static_cast<int32_t>(static_cast<int64_t>(s) * M + t);
        if (cached) continue;
        int64_t* recv_idx = dst.recv_topk_idx + row * K;
        for (int k = 0; k < K; ++k) {
          const bool here = idx[k] >= first_local && idx[k] < first_local + El;
          recv_idx[k] = here ? idx[k] - first_local : -1;
        }
        if (dst.recv_topk_weights != nullptr) {
          const float* w = with_weights ? v.topk_weights + static_cast<int64_t>(j) * K : nullptr;
          float* recv_w = dst.recv_topk_weights + row * K;
          for (int k = 0; k < K; ++k) recv_w[k] = w != nullptr && recv_idx[k] >= 0 ? w[k] : 0.0f;
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status NodeLowLatencyDispatch(const GroupShape& shape,
                                    const LowLatencyDispatchOptions& options, NodeRanks node,
                                    std::span<const int32_t> counts,
                                    std::span<const NodeLowLatencySource> sources,
                                    std::span<LowLatencyDispatchRankArgs> local,
                                    const HostExecution& exec, int32_t* failed_source) {
  using internal::CheckPointer;
  constexpr const char* kOp = "LowLatencyDispatch";
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  if (shape.ll_max_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": low-latency ops are disabled (ll_max_tokens_per_rank = ",
                     shape.ll_max_tokens_per_rank, ")"));
  }
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, sources.size(), kOp));
  EPD_RETURN_IF_ERROR(internal::CheckFp8Hidden(shape, options.use_fp8, kOp));
  EPD_RETURN_IF_ERROR(
      rules::CheckScaleFormat(kOp, options.use_fp8, options.round_scale, options.use_ue8m0, shape));
  const int32_t R = shape.num_ranks;
  const int32_t E = shape.num_experts;
  const int32_t K = shape.num_topk;
  const int32_t El = shape.num_local_experts();
  const int32_t S = shape.num_scales();
  const int32_t Mll = shape.ll_max_tokens_per_rank;
  const int64_t hidden = shape.hidden;
  const int64_t rows_per_expert = shape.ll_rows_per_expert();
  if (node.first < 0 || node.count < 1 || node.first + node.count > R ||
      local.size() != static_cast<size_t>(node.count) ||
      counts.size() != static_cast<size_t>(R) * E) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": node ranks [", node.first, ", ", node.first + node.count, ") with ", local.size(),
        " local args and ", counts.size(), " counts for num_ranks = ", R));
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0 || counts[i] > Mll) {
      if (failed_source != nullptr) *failed_source = static_cast<int32_t>(i / E);
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": count of source rank ", i / E,
                                                     " to expert ", i % E, " = ", counts[i],
                                                     " is outside [0, ", Mll, "]"));
    }
  }
  const int32_t first_expert = node.first * El;
  const int32_t local_experts = node.count * El;
  const bool gathered = std::any_of(local.begin(), local.end(),
                                    [](const auto& a) { return a.recv_row_src != nullptr; });
  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<int32_t>& seen = scratch.expert_total;  // [E]: a source's rows per expert.
  auto check_source = [&](int32_t s) -> absl::Status {
    const NodeLowLatencySource& v = sources[s];
    EPD_RETURN_IF_ERROR(CheckSourceRows(kOp, s, v.num_rows, v.token, Mll));
    if (node.Has(s) && (v.token != nullptr || v.num_rows != local[s - node.first].num_tokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": local source rank ", s, " must present all its ",
          local[s - node.first].num_tokens, " tokens in order; got ", v.num_rows, " rows"));
    }
    if (options.use_fp8 && !v.quantized && v.num_rows > 0 && gathered) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": source rank ", s,
          " presents BF16 rows to an FP8 dispatch whose rows are gathered (recv_row_src)"));
    }
    if (v.quantized && !options.use_fp8) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": source rank ", s, " presents FP8 rows to a BF16 dispatch"));
    }
    const bool rows = v.num_rows > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(v.x, rows, kOp, s, "x"));
    EPD_RETURN_IF_ERROR(CheckPointer(v.scales, rows && v.quantized, kOp, s, "scales"));
    EPD_RETURN_IF_ERROR(CheckTopkIdx(shape, s, v.num_rows, v.topk_idx));
    if (rows) {
      seen.resize(E);
      CountLowLatencyRows(shape, v.num_rows, v.topk_idx, seen.data());
    } else {
      seen.assign(E, 0);
    }
    for (int32_t e = first_expert; e < first_expert + local_experts; ++e) {
      if (seen[e] != counts[static_cast<size_t>(s) * E + e]) {
        return absl::InvalidArgumentError(
            absl::StrCat(kOp, ": source rank ", s, " presents ", seen[e], " rows for expert ", e,
                         ", its count says ", counts[static_cast<size_t>(s) * E + e]));
      }
    }
    return absl::OkStatus();
  };
  for (int32_t s = 0; s < R; ++s) {
    if (absl::Status st = check_source(s); !st.ok()) {
      if (failed_source != nullptr) *failed_source = s;
      return st;
    }
  }
  for (int32_t i = 0; i < node.count; ++i) {
    const LowLatencyDispatchRankArgs& a = local[i];
    const int32_t r = node.first + i;
    bool receives = false;
    for (int32_t j = 0; j < El; ++j) {
      for (int32_t s = 0; s < R; ++s) {
        receives |= counts[static_cast<size_t>(s) * E + r * El + j] > 0;
      }
    }
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_count, true, kOp, r, "recv_count"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_x, receives, kOp, r, "recv_x"));
    EPD_RETURN_IF_ERROR(
        CheckPointer(a.recv_scales, receives && options.use_fp8, kOp, r, "recv_scales"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_src_info, receives, kOp, r, "recv_src_info"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.handle_pos, a.num_tokens > 0, kOp, r, "handle_pos"));
  }

  if (exec.on_inputs_checked != nullptr && *exec.on_inputs_checked) (*exec.on_inputs_checked)();
  // ---- Everything is valid: write the outputs.
  // base[s * E + e]: first row of source s in expert e's block.
  std::vector<int32_t>& base = scratch.expert_base;
  base.assign(static_cast<size_t>(R) * E, 0);
  for (int32_t e = 0; e < E; ++e) {
    int32_t total = 0;
    for (int32_t s = 0; s < R; ++s) {
      base[static_cast<size_t>(s) * E + e] = total;
      total += counts[static_cast<size_t>(s) * E + e];
    }
    if (e >= first_expert && e < first_expert + local_experts) {
      local[(e - first_expert) / El].recv_count[e % El] = total;
    }
  }
  // Handles of the local sources (as LowLatencyDispatch: a duplicate gets the first's row).
  std::vector<int32_t>& next = scratch.count_to_rank;  // [E]
  for (int32_t i = 0; i < node.count; ++i) {
    const int32_t s = node.first + i;
    const LowLatencyDispatchRankArgs& a = local[i];
    next.assign(base.begin() + static_cast<int64_t>(s) * E,
                base.begin() + static_cast<int64_t>(s + 1) * E);
    for (int32_t t = 0; t < a.num_tokens; ++t) {
      const int64_t* row = sources[s].topk_idx + static_cast<int64_t>(t) * K;
      int32_t* pos = a.handle_pos + static_cast<int64_t>(t) * K;
      for (int k = 0; k < K; ++k) {
        const int64_t e = row[k];
        if (e < 0) {
          pos[k] = -1;
          continue;
        }
        int j = 0;
        while (row[j] != e) ++j;
        pos[k] = j < k ? pos[j] : next[e]++;
      }
    }
  }
  // Rows, per local expert, source by source in token order.
  const int64_t out_row_bytes = options.use_fp8 ? hidden : hidden * 2;
  if (options.use_fp8) {
    scratch.fp8_row.resize(static_cast<size_t>(ctx.threads()) * hidden);
    scratch.fp8_scales.resize(static_cast<size_t>(ctx.threads()) * S);
  }
  ctx.ParallelFor(local_experts, [&](int64_t le, int slot) {
    const int32_t e = first_expert + static_cast<int32_t>(le);
    const int32_t j = e % El;
    const LowLatencyDispatchRankArgs& dst = local[le / El];
    e4m3_bits* q = options.use_fp8 ? scratch.fp8_row.data() + slot * hidden : nullptr;
    float* q_scales =
        options.use_fp8 ? scratch.fp8_scales.data() + static_cast<int64_t>(slot) * S : nullptr;
    for (int32_t s = 0; s < R; ++s) {
      const NodeLowLatencySource& v = sources[s];
      int64_t pos = base[static_cast<size_t>(s) * E + e];
      for (int32_t i = 0; i < v.num_rows; ++i) {
        const int64_t* idx = v.topk_idx + static_cast<int64_t>(i) * K;
        bool hit = false;
        for (int k = 0; k < K && !hit; ++k) hit = idx[k] == e;
        if (!hit) continue;
        const int32_t t = v.token != nullptr ? v.token[i] : i;
        const void* out_row;
        const float* row_scales = nullptr;
        if (v.quantized) {
          out_row = static_cast<const uint8_t*>(v.x) + i * hidden;
          row_scales = v.scales + static_cast<int64_t>(i) * S;
        } else if (options.use_fp8) {
          QuantizeRowFp8(static_cast<const bf16_bits*>(v.x) + i * hidden, shape.hidden,
                         options.round_scale, q, q_scales);
          out_row = q;
          row_scales = q_scales;
        } else {
          out_row = static_cast<const bf16_bits*>(v.x) + i * hidden;
        }
        const int64_t row = static_cast<int64_t>(j) * rows_per_expert + pos;
        if (dst.recv_row_src != nullptr) {
          dst.recv_row_src[row] = {out_row, row_scales};
        } else {
          std::memcpy(static_cast<uint8_t*>(dst.recv_x) + row * out_row_bytes, out_row,
                      static_cast<size_t>(out_row_bytes));
        }
        if (options.use_fp8 && dst.recv_row_src == nullptr) {
          internal::StoreLowLatencyScales(shape, options.use_ue8m0, dst.recv_scales, j, pos,
                                          row_scales);
        }
        dst.recv_src_info[row] = static_cast<int32_t>(static_cast<int64_t>(s) * Mll + t);
        ++pos;
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace epd::kernels::host
