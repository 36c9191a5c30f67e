// Low-latency dispatch and combine on the CPU (host_ops.h: LowLatencyDispatch,
// LowLatencyCombine).
// Both check every argument (and every expert id and handle entry) before writing
// anything, then split the per-token work over chunks of each source rank's tokens. Every
// (token, expert) pair owns its receive row, and every token owns its combined row, so the
// results are identical for any thread count.
// LowLatencyCombine summation order (the CUDA kernels match it): for each channel,
// acc = +0.0f, then for k = 0, 1, ..., K-1 with topk_idx[t, k] >= 0:
// p = w[t, k] * f32(y) rounded to f32, acc = acc + p rounded to f32 (no fused multiply-add;
// this file is compiled as ISO C++, where GCC does not contract), then one round to bf16.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/op_rules.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace {

absl::Status CheckLowLatencyShape(const GroupShape& shape, const char* op) {
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  if (shape.ll_max_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": low-latency ops are disabled (ll_max_tokens_per_rank = ",
                     shape.ll_max_tokens_per_rank, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LowLatencyDispatch(const GroupShape& shape, const LowLatencyDispatchOptions& options,
                                std::span<LowLatencyDispatchRankArgs> args,
                                const HostExecution& exec) {
  using internal::CheckPointer;
  constexpr const char* kOp = "LowLatencyDispatch";
  EPD_RETURN_IF_ERROR(CheckLowLatencyShape(shape, kOp));
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, args.size(), kOp));
  EPD_RETURN_IF_ERROR(internal::CheckFp8Hidden(shape, options.use_fp8, kOp));
  EPD_RETURN_IF_ERROR(
      rules::CheckScaleFormat(kOp, options.use_fp8, options.round_scale, options.use_ue8m0, shape));
  const int32_t num_ranks = shape.num_ranks;
  const int32_t num_experts = shape.num_experts;
  const int32_t num_topk = shape.num_topk;
  const int32_t experts_per_rank = shape.num_local_experts();
  const int32_t num_scales = shape.num_scales();
  const int64_t hidden = shape.hidden;
  const int64_t ll_max_tokens = shape.ll_max_tokens_per_rank;
  const int64_t rows_per_expert = shape.ll_rows_per_expert();

  for (int32_t s = 0; s < num_ranks; ++s) {
    const LowLatencyDispatchRankArgs& a = args[s];
    EPD_RETURN_IF_ERROR(internal::CheckNumTokens(s, a.num_tokens, shape.ll_max_tokens_per_rank,
                                                 "ll_max_tokens_per_rank"));
    const bool has_tokens = a.num_tokens > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(a.x, has_tokens, kOp, s, "x"));
    EPD_RETURN_IF_ERROR(CheckTopkIdx(shape, s, a.num_tokens, a.topk_idx));
    EPD_RETURN_IF_ERROR(CheckPointer(a.handle_pos, has_tokens, kOp, s, "handle_pos"));
  }

  // count[s * E + e]: tokens of source s routed to expert e (a duplicate in a row once).
  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<int32_t>& count = scratch.count_to_expert;
  count.assign(static_cast<size_t>(num_ranks) * num_experts, 0);
  ctx.ParallelFor(num_ranks, [&](int64_t s, int) {
    const LowLatencyDispatchRankArgs& a = args[s];
    int32_t* c = count.data() + s * num_experts;
    for (int32_t t = 0; t < a.num_tokens; ++t) {
      const int64_t* row = a.topk_idx + static_cast<int64_t>(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        if (row[k] >= 0 && !internal::IsDuplicateInRow(row, k)) ++c[row[k]];
      }
    }
  });
  // base[s * E + e]: first row of source s in expert e's block; total[e]: rows of e.
  std::vector<int32_t>& base = scratch.expert_base;
  std::vector<int32_t>& total = scratch.expert_total;
  base.assign(count.size(), 0);
  total.assign(num_experts, 0);
  for (int32_t e = 0; e < num_experts; ++e) {
    for (int32_t s = 0; s < num_ranks; ++s) {
      base[static_cast<size_t>(s) * num_experts + e] = total[e];
      total[e] += count[static_cast<size_t>(s) * num_experts + e];
    }
  }
  for (int32_t r = 0; r < num_ranks; ++r) {
    const LowLatencyDispatchRankArgs& a = args[r];
    bool receives = false;
    for (int32_t j = 0; j < experts_per_rank; ++j) receives |= total[r * experts_per_rank + j] > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_count, true, kOp, r, "recv_count"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_x, receives, kOp, r, "recv_x"));
    EPD_RETURN_IF_ERROR(
        CheckPointer(a.recv_scales, receives && options.use_fp8, kOp, r, "recv_scales"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.recv_src_info, receives, kOp, r, "recv_src_info"));
  }

  // ---- Everything is valid: write the outputs.
  for (int32_t r = 0; r < num_ranks; ++r) {
    for (int32_t j = 0; j < experts_per_rank; ++j) {
      args[r].recv_count[j] = total[r * experts_per_rank + j];
    }
  }
  // handle_pos, per source in token order (rows [T, Mll) of handle_pos are not written).
  // next[e] starts at base[s * E + e] and counts up in place (each source owns its row).
  ctx.ParallelFor(num_ranks, [&](int64_t s, int) {
    const LowLatencyDispatchRankArgs& a = args[s];
    int32_t* next = base.data() + s * num_experts;
    for (int32_t t = 0; t < a.num_tokens; ++t) {
      const int64_t* row = a.topk_idx + static_cast<int64_t>(t) * num_topk;
      int32_t* pos = a.handle_pos + static_cast<int64_t>(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = row[k];
        if (e < 0) {
          pos[k] = -1;
          continue;
        }
        int j = 0;
        while (row[j] != e) ++j;  // first k with this expert
        pos[k] = j < k ? pos[j] : next[e]++;
      }
    }
  });

  const int64_t out_row_bytes = options.use_fp8 ? hidden : hidden * 2;
  const internal::TokenChunks chunks(internal::TokenCounts(args, scratch),
                                     internal::GrainForRowBytes(out_row_bytes * num_topk),
                                     scratch.first_chunk);
  // One quantized row [H] e4m3 + scales [S] per thread slot (FP8 only).
  if (options.use_fp8) {
    scratch.fp8_row.resize(static_cast<size_t>(ctx.threads()) * hidden);
    scratch.fp8_scales.resize(static_cast<size_t>(ctx.threads()) * num_scales);
  }
  ctx.ParallelFor(chunks.size(), [&](int64_t c, int slot) {
    const internal::TokenChunk chunk = chunks[c];
    const int32_t s = chunk.rank;
    const LowLatencyDispatchRankArgs& src = args[s];
    e4m3_bits* q = options.use_fp8 ? scratch.fp8_row.data() + slot * hidden : nullptr;
    float* q_scales = options.use_fp8
                          ? scratch.fp8_scales.data() + static_cast<int64_t>(slot) * num_scales
                          : nullptr;
    for (int32_t t = chunk.begin; t < chunk.end; ++t) {
      const bf16_bits* x_row = src.x + static_cast<int64_t>(t) * hidden;
      const void* out_row = x_row;
      if (options.use_fp8) {
        QuantizeRowFp8(x_row, shape.hidden, options.round_scale, q, q_scales);
        out_row = q;
      }
      const int64_t* idx = src.topk_idx + static_cast<int64_t>(t) * num_topk;
      const int32_t* pos = src.handle_pos + static_cast<int64_t>(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = idx[k];
        if (e < 0 || internal::IsDuplicateInRow(idx, k)) continue;
        const LowLatencyDispatchRankArgs& dst = args[e / experts_per_rank];
        const int64_t row = (e % experts_per_rank) * rows_per_expert + pos[k];
        std::memcpy(static_cast<uint8_t*>(dst.recv_x) + row * out_row_bytes, out_row,
                    static_cast<size_t>(out_row_bytes));
        if (options.use_fp8) {
          internal::StoreLowLatencyScales(shape, options.use_ue8m0, dst.recv_scales,
                                          e % experts_per_rank, pos[k], q_scales);
        }
        dst.recv_src_info[row] = static_cast<int32_t>(s * ll_max_tokens + t);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status LowLatencyCombine(const GroupShape& shape, std::span<LowLatencyCombineRankArgs> args,
                               const HostExecution& exec) {
  using internal::CheckPointer;
  constexpr const char* kOp = "LowLatencyCombine";
  EPD_RETURN_IF_ERROR(CheckLowLatencyShape(shape, kOp));
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, args.size(), kOp));
  const int32_t num_ranks = shape.num_ranks;
  const int32_t num_topk = shape.num_topk;
  const int32_t experts_per_rank = shape.num_local_experts();
  const int64_t hidden = shape.hidden;
  const int64_t rows_per_expert = shape.ll_rows_per_expert();

  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<uint8_t>& read_from = scratch.marks;  // [R]: some token reads rank r's x.
  read_from.assign(num_ranks, 0);
  for (int32_t s = 0; s < num_ranks; ++s) {
    const LowLatencyCombineRankArgs& a = args[s];
    EPD_RETURN_IF_ERROR(internal::CheckNumTokens(s, a.num_tokens, shape.ll_max_tokens_per_rank,
                                                 "ll_max_tokens_per_rank"));
    const bool has_tokens = a.num_tokens > 0;
    EPD_RETURN_IF_ERROR(CheckTopkIdx(shape, s, a.num_tokens, a.topk_idx));
    EPD_RETURN_IF_ERROR(CheckPointer(a.topk_weights, has_tokens, kOp, s, "topk_weights"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.handle_pos, has_tokens, kOp, s, "handle_pos"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.combined_x, has_tokens, kOp, s, "combined_x"));
    for (int64_t i = 0; i < static_cast<int64_t>(a.num_tokens) * num_topk; ++i) {
      if (a.topk_idx[i] < 0) continue;
      const int32_t row = a.handle_pos[i];
      const LowLatencyCombineRankArgs& owner = args[a.topk_idx[i] / experts_per_rank];
      if (owner.x_first_row != nullptr) {
        const int64_t j = a.topk_idx[i] % experts_per_rank;
        const int64_t first = owner.x_first_row[j];
        if (row < first || row >= first + owner.x_num_rows[j]) {
          return absl::InvalidArgumentError(
              absl::StrCat(kOp, ": handle_pos of rank ", s, " at token ", i / num_topk, ", k ",
                           i % num_topk, " = ", row, " is outside the rows [", first, ", ",
                           first + owner.x_num_rows[j], ") present of expert ", a.topk_idx[i]));
        }
      } else if (row < 0 || row >= rows_per_expert) {
        return absl::InvalidArgumentError(absl::StrCat(
            kOp, ": handle_pos of rank ", s, " at token ", i / num_topk, ", k ", i % num_topk,
            " = ", row, " is outside [0, num_ranks * ll_max_tokens_per_rank = ", rows_per_expert,
            ") for expert ", a.topk_idx[i]));
      }
      read_from[a.topk_idx[i] / experts_per_rank] = 1;
    }
  }
  for (int32_t r = 0; r < num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(CheckPointer(args[r].x, read_from[r] != 0, kOp, r, "x"));
  }
  for (LowLatencyCombineRankArgs& a : args) {
    if (a.reduce != nullptr) a.reduce->rows = a.num_tokens;
  }

  const internal::TokenChunks chunks(internal::TokenCounts(args, scratch),
                                     internal::GrainForRowBytes(hidden * 2 * num_topk),
                                     scratch.first_chunk);
  // One f32 accumulator row [H] per thread slot.
  scratch.acc.resize(static_cast<size_t>(ctx.threads()) * hidden);
  ctx.ParallelFor(chunks.size(), [&](int64_t c, int slot) {
    const internal::TokenChunk chunk = chunks[c];
    const LowLatencyCombineRankArgs& dst = args[chunk.rank];
    float* acc = scratch.acc.data() + static_cast<int64_t>(slot) * hidden;
    for (int32_t t = chunk.begin; t < chunk.end; ++t) {
      std::fill(acc, acc + hidden, 0.0f);
      const int64_t* idx = dst.topk_idx + static_cast<int64_t>(t) * num_topk;
      const float* w = dst.topk_weights + static_cast<int64_t>(t) * num_topk;
      const int32_t* pos = dst.handle_pos + static_cast<int64_t>(t) * num_topk;
      // Recorded (row_reduce.h: one slot per k, in k order) or summed.
      ReduceTerm* term =
          dst.reduce != nullptr ? dst.reduce->terms + static_cast<int64_t>(t) * num_topk : nullptr;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = idx[k];
        if (e < 0) {
          if (term != nullptr) term[k] = {};
          continue;
        }
        const LowLatencyCombineRankArgs& owner = args[e / experts_per_rank];
        const int64_t j = e % experts_per_rank;
        const bf16_bits* y =
            owner.x_first_row == nullptr
                ? owner.x + (j * rows_per_expert + pos[k]) * hidden
                : owner.x + (owner.x_block_start[j] + pos[k] - owner.x_first_row[j]) * hidden;
        const float weight = w[k];
        if (term != nullptr) {
          term[k] = {y, nullptr, weight};
          continue;
        }
        for (int64_t h = 0; h < hidden; ++h) {
          const float product = weight * Bf16ToFloat(y[h]);
          acc[h] += product;
        }
      }
      if (term != nullptr) continue;
      bf16_bits* out = dst.combined_x + static_cast<int64_t>(t) * hidden;
      for (int64_t h = 0; h < hidden; ++h) out[h] = FloatToBf16(acc[h]);
    }
  });
  return absl::OkStatus();
}

}  // namespace epd::kernels::host
