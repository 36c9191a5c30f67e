// Normal (high-throughput) dispatch on the CPU (host_ops.h: Dispatch).
//
// Phases: (1) check every argument and compute each token's destination rows into
// temporaries, (2) check receive capacities, (3) only then write any output. Row copies
// are split over chunks of source tokens; every (token, destination) pair owns its
// destination row, so the result is identical for any thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/host_ops.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace {

constexpr const char* kOp = "Dispatch";

int64_t AlignUp(int64_t n, int64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

}  // namespace

absl::Status Dispatch(const GroupShape& shape, const DispatchOptions& options,
                      std::span<DispatchRankArgs> args, const HostExecution& exec) {
  using internal::CheckPointer;
  EPD_RETURN_IF_ERROR(internal::CheckGroupShape(shape));
  EPD_RETURN_IF_ERROR(internal::CheckNumRankArgs(shape, args.size(), kOp));
  if (options.expert_alignment < 1) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(kOp, ": expert_alignment = ", options.expert_alignment, " must be >= 1")),
        errors::Reason::kOpInputInvalid);
  }
  EPD_RETURN_IF_ERROR(internal::CheckFp8Hidden(shape, options.fp8, kOp));
  const int32_t num_ranks = shape.num_ranks;
  const int32_t num_experts = shape.num_experts;
  const int32_t num_topk = shape.num_topk;
  const int32_t experts_per_rank = shape.num_local_experts();
  const int32_t num_scales = shape.num_scales();
  const int64_t hidden = shape.hidden;

  // Cached re-dispatch when any rank passes a cached handle; then every rank with tokens
  // must. Weights are moved when any rank passes them; then every rank with tokens must.
  bool cached = false, with_weights = false;
  for (const DispatchRankArgs& a : args) {
    cached |= a.cached_send_pos != nullptr;
    with_weights |= a.topk_weights != nullptr && a.num_tokens > 0;
  }
  if (cached) with_weights = false;

  // ---- Per-source checks.
  for (int32_t s = 0; s < num_ranks; ++s) {
    const DispatchRankArgs& a = args[s];
    EPD_RETURN_IF_ERROR(internal::CheckNumTokens(s, a.num_tokens, shape.max_tokens_per_rank,
                                                 "max_tokens_per_rank"));
    const bool has_tokens = a.num_tokens > 0;
    EPD_RETURN_IF_ERROR(CheckPointer(a.x, has_tokens, kOp, s, "x"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.x_scales, has_tokens && options.fp8, kOp, s, "x_scales"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.send_pos, has_tokens, kOp, s, "send_pos"));
    EPD_RETURN_IF_ERROR(CheckPointer(a.rank_prefix, true, kOp, s, "rank_prefix"));
    if (cached) {
      EPD_RETURN_IF_ERROR(CheckPointer(a.cached_send_pos, has_tokens, kOp, s,
                                       "cached_send_pos (other ranks re-dispatch from a "
                                       "cached handle)"));
      if (a.cached_num_recv_tokens < 0 || a.cached_num_recv_tokens > a.recv_capacity) {
        return errors::WithReason(
            absl::InvalidArgumentError(absl::StrCat(
                kOp, ": rank ", s, ": cached_num_recv_tokens = ", a.cached_num_recv_tokens,
                " is outside [0, recv_capacity = ", a.recv_capacity, "]")),
            errors::Reason::kOpInputInvalid);
      }
    } else {
      EPD_RETURN_IF_ERROR(CheckTopkIdx(shape, s, a.num_tokens, a.topk_idx));
      EPD_RETURN_IF_ERROR(CheckPointer(a.topk_weights, has_tokens && with_weights, kOp, s,
                                       "topk_weights (other ranks pass weights)"));
      EPD_RETURN_IF_ERROR(
          CheckPointer(a.recv_tokens_per_expert, true, kOp, s, "recv_tokens_per_expert"));
    }
  }

  // ---- Routing into temporaries (in the scratch), per source s:
  // local_pos [T_s, R] at source_offset[s]: row at each destination, relative to this
  // source's first row there (non-cached only); count_to_rank [R] at s * R: tokens of s
  // sent to each rank; count_to_expert [E] at s * E: tokens of s routed to each expert
  // (duplicates in a row once; non-cached only).
  internal::OpContext ctx(exec);
  internal::ScratchState& scratch = ctx.scratch();
  std::vector<int32_t>& count_to_rank = scratch.count_to_rank;
  std::vector<int32_t>& count_to_expert = scratch.count_to_expert;
  count_to_rank.assign(static_cast<size_t>(num_ranks) * num_ranks, 0);
  if (!cached) {
    std::vector<int64_t>& offset = scratch.source_offset;
    offset.resize(static_cast<size_t>(num_ranks) + 1);
    offset[0] = 0;
    for (int32_t s = 0; s < num_ranks; ++s) {
      offset[s + 1] = offset[s] + static_cast<int64_t>(args[s].num_tokens) * num_ranks;
    }
    scratch.local_pos.assign(static_cast<size_t>(offset[num_ranks]), -1);
    count_to_expert.assign(static_cast<size_t>(num_ranks) * num_experts, 0);
    ctx.ParallelFor(num_ranks, [&](int64_t s, int) {
      const DispatchRankArgs& a = args[s];
      int32_t* to_rank = count_to_rank.data() + s * num_ranks;
      int32_t* to_expert = count_to_expert.data() + s * num_experts;
      for (int32_t t = 0; t < a.num_tokens; ++t) {
        const int64_t* row = a.topk_idx + static_cast<int64_t>(t) * num_topk;
        int32_t* pos = scratch.local_pos.data() + offset[s] + static_cast<int64_t>(t) * num_ranks;
        for (int k = 0; k < num_topk; ++k) {
          const int64_t e = row[k];
          if (e < 0 || internal::IsDuplicateInRow(row, k)) continue;
          ++to_expert[e];
          const int64_t r = e / experts_per_rank;
          if (pos[r] < 0) pos[r] = to_rank[r]++;
        }
      }
    });
  } else {
    // Count each source's rows per destination, checking every cached row is -1 or
    // inside that destination's cached row count.
    for (int32_t s = 0; s < num_ranks; ++s) {
      const DispatchRankArgs& a = args[s];
      int32_t* to_rank = count_to_rank.data() + static_cast<size_t>(s) * num_ranks;
      for (int32_t t = 0; t < a.num_tokens; ++t) {
        for (int32_t r = 0; r < num_ranks; ++r) {
          const int32_t row = a.cached_send_pos[static_cast<int64_t>(t) * num_ranks + r];
          if (row == -1) continue;
          if (row < 0 || row >= args[r].cached_num_recv_tokens) {
            return errors::WithReason(
                absl::InvalidArgumentError(
                    absl::StrCat(kOp, ": cached_send_pos of rank ", s, " at token ", t, ", rank ",
                                 r, " = ", row, " is outside [-1, cached_num_recv_tokens of rank ",
                                 r, " = ", args[r].cached_num_recv_tokens, ")")),
                errors::Reason::kOpInputInvalid);
          }
          ++to_rank[r];
        }
      }
    }
    // Every destination row must be written by exactly one source token.
    for (int32_t r = 0; r < num_ranks; ++r) {
      std::vector<uint8_t>& seen = scratch.marks;
      seen.assign(static_cast<size_t>(args[r].cached_num_recv_tokens), 0);
      int64_t filled = 0;
      for (int32_t s = 0; s < num_ranks; ++s) {
        for (int32_t t = 0; t < args[s].num_tokens; ++t) {
          const int32_t row = args[s].cached_send_pos[static_cast<int64_t>(t) * num_ranks + r];
          if (row < 0) continue;
          if (seen[row]) {
            return errors::WithReason(
                absl::InvalidArgumentError(absl::StrCat(
                    kOp, ": cached handle sends two tokens to row ", row, " of rank ", r,
                    " (second: rank ", s, " token ", t, "): not a handle of one dispatch")),
                errors::Reason::kOpInputInvalid);
          }
          seen[row] = 1;
          ++filled;
        }
      }
      if (filled != args[r].cached_num_recv_tokens) {
        return errors::WithReason(
            absl::InvalidArgumentError(
                absl::StrCat(kOp, ": cached handle fills ", filled, " rows of rank ", r,
                             ", cached_num_recv_tokens = ", args[r].cached_num_recv_tokens)),
            errors::Reason::kOpInputInvalid);
      }
    }
  }

  // ---- Per-destination row counts, prefixes and capacity / output checks.
  // prefix[r * R + s] = first row of source s at destination r.
  std::vector<int64_t>& prefix = scratch.prefix;
  std::vector<int64_t>& num_recv = scratch.num_recv;
  prefix.assign(static_cast<size_t>(num_ranks) * num_ranks, 0);
  num_recv.assign(num_ranks, 0);
  for (int32_t r = 0; r < num_ranks; ++r) {
    int64_t total = 0;
    for (int32_t s = 0; s < num_ranks; ++s) {
      prefix[static_cast<size_t>(r) * num_ranks + s] = total;
      total += count_to_rank[static_cast<size_t>(s) * num_ranks + r];
    }
    num_recv[r] = total;
    EPD_RETURN_IF_ERROR(
        internal::CheckDispatchReceiver(args[r], r, total, options.fp8, cached, with_weights));
  }
  if (!cached) {
    for (int32_t r = 0; r < num_ranks; ++r) {
      for (int32_t j = 0; j < experts_per_rank; ++j) {
        int64_t count = 0;
        for (int32_t s = 0; s < num_ranks; ++s) {
          count += count_to_expert[static_cast<size_t>(s) * num_experts +
                                   static_cast<size_t>(r) * experts_per_rank + j];
        }
        if (AlignUp(count, options.expert_alignment) > INT32_MAX) {
          return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                        kOp, ": expert_alignment = ", options.expert_alignment,
                                        " makes the aligned count of local expert ", j, " of rank ",
                                        r, " overflow int32")),
                                    errors::Reason::kOpInputInvalid);
        }
      }
    }
  }

  // ---- Everything is valid: write the outputs.
  for (int32_t r = 0; r < num_ranks; ++r) {
    DispatchRankArgs& a = args[r];
    a.num_recv_tokens = static_cast<int32_t>(num_recv[r]);
    for (int32_t s = 0; s < num_ranks; ++s) {
      a.rank_prefix[s] = static_cast<int32_t>(prefix[static_cast<size_t>(r) * num_ranks + s]);
    }
    if (!cached) {
      for (int32_t j = 0; j < experts_per_rank; ++j) {
        int64_t count = 0;
        for (int32_t s = 0; s < num_ranks; ++s) {
          count += count_to_expert[static_cast<size_t>(s) * num_experts +
                                   static_cast<size_t>(r) * experts_per_rank + j];
        }
        a.recv_tokens_per_expert[j] =
            static_cast<int32_t>(AlignUp(count, options.expert_alignment));
      }
    }
  }

  const int64_t x_row_bytes = options.fp8 ? hidden : hidden * 2;
  const internal::TokenChunks chunks(internal::TokenCounts(args, scratch),
                                     internal::GrainForRowBytes(x_row_bytes), scratch.first_chunk);
  const int64_t max_tokens = shape.max_tokens_per_rank;
  ctx.ParallelFor(chunks.size(), [&](int64_t c, int) {
    const internal::TokenChunk chunk = chunks[c];
    const int32_t s = chunk.rank;
    const DispatchRankArgs& src = args[s];
    for (int32_t t = chunk.begin; t < chunk.end; ++t) {
      int32_t* send_pos = src.send_pos + static_cast<int64_t>(t) * num_ranks;
      if (cached) {
        // memmove: send_pos may be the cached handle itself.
        std::memmove(send_pos, src.cached_send_pos + static_cast<int64_t>(t) * num_ranks,
                     sizeof(int32_t) * num_ranks);
      } else {
        const int32_t* local = scratch.local_pos.data() + scratch.source_offset[s] +
                               static_cast<int64_t>(t) * num_ranks;
        for (int32_t r = 0; r < num_ranks; ++r) {
          send_pos[r] =
              local[r] < 0
                  ? -1
                  : static_cast<int32_t>(prefix[static_cast<size_t>(r) * num_ranks + s] + local[r]);
        }
      }
      const auto* x_row = static_cast<const uint8_t*>(src.x) + t * x_row_bytes;
      for (int32_t r = 0; r < num_ranks; ++r) {
        const int64_t row = send_pos[r];
        if (row < 0) continue;
        const DispatchRankArgs& dst = args[r];
        std::memcpy(static_cast<uint8_t*>(dst.recv_x) + row * x_row_bytes, x_row,
                    static_cast<size_t>(x_row_bytes));
        if (options.fp8) {
          std::memcpy(dst.recv_scales + row * num_scales,
                      src.x_scales + static_cast<int64_t>(t) * num_scales,
                      sizeof(float) * num_scales);
        }
        dst.recv_src_info[row] = static_cast<int32_t>(s * max_tokens + t);
        if (cached) continue;
        const int64_t* idx = src.topk_idx + static_cast<int64_t>(t) * num_topk;
        int64_t* recv_idx = dst.recv_topk_idx + row * num_topk;
        const int64_t first_local = static_cast<int64_t>(r) * experts_per_rank;
        for (int k = 0; k < num_topk; ++k) {
          const bool local = idx[k] >= first_local && idx[k] < first_local + experts_per_rank;
          recv_idx[k] = local ? idx[k] - first_local : -1;
        }
        if (dst.recv_topk_weights != nullptr) {
          // Without weights: zeros (not what an earlier dispatch left there).
          const float* w =
              with_weights ? src.topk_weights + static_cast<int64_t>(t) * num_topk : nullptr;
          float* recv_w = dst.recv_topk_weights + row * num_topk;
          for (int k = 0; k < num_topk; ++k)
            recv_w[k] = w != nullptr && recv_idx[k] >= 0 ? w[k] : 0.0f;
        }
      }
    }
  });
  return absl::OkStatus();
}

}  // namespace epd::kernels::host
