// Normal combine on the CPU (host_ops.h: Combine).
// Every argument and every handle entry is checked before anything is written. The sums
// are split over chunks of each source rank's tokens; each token's output row is computed
// by one thread in the fixed order below, so the result is identical for any thread
// count.
// Summation order (the CUDA kernels match it): for each channel, acc = +0.0f, then
// acc += f32(x_r[send_pos[t, r]]) for r = 0, 1, ..., R-1 where send_pos[t, r] >= 0, then
// one round to bf16 (round to nearest even). combined_topk_weights likewise, without the
// final rounding.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "epd/kernels/host_ops.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace {
constexpr const char* kOp = "Combine";
}  // namespace

absl::Status Combine(const GroupShape& shape, std::span<CombineRankArgs> args,
                     const HostExecution& exec) {
  using internal::CheckPointer;
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, args.size(), kOp));
  const int32_t num_ranks = shape.num_ranks;
  const int32_t num_topk = shape.num_topk;
  const int64_t hidden = shape.hidden;

  // Weights are reduced when any rank passes them; then every rank holding rows must.
  bool with_weights = false;
  for (const CombineRankArgs& a : args) with_weights |= a.topk_weights != nullptr;

  for (int32_t r = 0; r < num_ranks; ++r) {
    const CombineRankArgs& a = args[r];
    EPD_RETURN_IF_ERROR(internal::CheckNumTokens(r, a.num_tokens, shape.max_tokens_per_rank,
                                                 "max_tokens_per_rank"));
    if (a.num_recv_tokens < 0 || a.num_recv_tokens > shape.max_recv_tokens()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": rank ", r, ": num_recv_tokens = ", a.num_recv_tokens,
          " is outside [0, num_ranks * max_tokens_per_rank = ", shape.max_recv_tokens(), "]"));
    }
    const bool has_tokens = a.num_tokens > 0, holds_rows = a.num_recv_tokens > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(a.send_pos, has_tokens, kOp, r, "send_pos"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.combined_x, has_tokens, kOp, r, "combined_x"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.combined_topk_weights, has_tokens && with_weights, kOp, r,
                                     "combined_topk_weights"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.x, holds_rows, kOp, r, "x"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.topk_weights, holds_rows && with_weights, kOp, r,
                                     "topk_weights (other ranks pass weights)"));
  }
  const int32_t max_terms = ReduceTermsPerRow(shape);
  for (int32_t s = 0; s < num_ranks; ++s) {
    const CombineRankArgs& a = args[s];
    for (int32_t t = 0; t < a.num_tokens; ++t) {
      int32_t terms = 0;
      for (int32_t r = 0; r < num_ranks; ++r) {
        const int32_t row = a.send_pos[static_cast<int64_t>(t) * num_ranks + r];
        terms += row >= 0;
        if (row != -1 && (row < args[r].x_first_row || row >= args[r].num_recv_tokens)) {
          return absl::InvalidArgumentError(absl::StrCat(
              kOp, ": send_pos of rank ", s, " at token ", t, ", rank ", r, " = ", row,
              " is outside [-1, num_recv_tokens of rank ", r, " = ", args[r].num_recv_tokens, ")",
              args[r].x_first_row > 0
                  ? absl::StrCat(" or below its first present row ", args[r].x_first_row)
                  : std::string()));
        }
      }
      if (a.reduce != nullptr && terms > max_terms) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": send_pos of rank ", s, " at token ",
                                                       t, " names ", terms,
                                                       " ranks, more than num_topk = ", max_terms));
      }
    }
  }
  for (CombineRankArgs& a : args) {
    if (a.reduce != nullptr) a.reduce->rows = a.num_tokens;
  }

  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  const internal::TokenChunks chunks(internal::TokenCounts(args, scratch),
                                     internal::GrainForRowBytes(hidden * 2 * num_ranks),
                                     scratch.first_chunk);
  // One f32 accumulator row [H] per thread slot.
  scratch.acc.resize(static_cast<size_t>(ctx.threads()) * hidden);
  ctx.ParallelFor(chunks.size(), [&](int64_t c, int slot) {
    const internal::TokenChunk chunk = chunks[c];
    const CombineRankArgs& dst = args[chunk.rank];
    float* acc = scratch.acc.data() + static_cast<int64_t>(slot) * hidden;
    for (int32_t t = chunk.begin; t < chunk.end; ++t) {
      const int32_t* pos = dst.send_pos + static_cast<int64_t>(t) * num_ranks;
      if (dst.reduce != nullptr) {  // Recorded in the order summed below.
        ReduceTerm* term = dst.reduce->terms + static_cast<int64_t>(t) * max_terms;
        ReduceTerm* const end = term + max_terms;
        for (int32_t r = 0; r < num_ranks; ++r) {
          if (pos[r] < 0) continue;
          const int64_t row = pos[r] - args[r].x_first_row;
          *term++ = {args[r].x + row * hidden,
                     with_weights ? args[r].topk_weights + row * num_topk : nullptr, 0.0f};
        }
        std::fill(term, end, ReduceTerm{});
        continue;
      }
      std::fill(acc, acc + hidden, 0.0f);
      for (int32_t r = 0; r < num_ranks; ++r) {
        if (pos[r] < 0) continue;
        const bf16_bits* x_row =
            args[r].x + static_cast<int64_t>(pos[r] - args[r].x_first_row) * hidden;
        for (int64_t h = 0; h < hidden; ++h) acc[h] += Bf16ToFloat(x_row[h]);
      }
      bf16_bits* out = dst.combined_x + static_cast<int64_t>(t) * hidden;
      for (int64_t h = 0; h < hidden; ++h) out[h] = FloatToBf16(acc[h]);
      if (!with_weights) continue;
      float* w_out = dst.combined_topk_weights + static_cast<int64_t>(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        float w = 0.0f;
        for (int32_t r = 0; r < num_ranks; ++r) {
          if (pos[r] >= 0) {
            w +=
                args[r].topk_weights[static_cast<int64_t>(pos[r] - args[r].x_first_row) * num_topk +
                                     k];
          }
        }
        w_out[k] = w;
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace epd::kernels::host
