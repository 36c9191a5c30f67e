// Argument checks shared by the host ops (see internal.h), and CheckTopkIdx.
#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/op_rules.h"
#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace internal {

absl::Status CheckGroupShape(const GroupShape& shape) {
  if (shape.num_ranks < 1) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "GroupShape.num_ranks = ", shape.num_ranks, " must be >= 1")),
                              errors::Reason::kOpInputInvalid);
  }
  if (shape.num_experts < shape.num_ranks || shape.num_experts % shape.num_ranks != 0) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "GroupShape.num_experts = ", shape.num_experts,
                                  " must be a positive multiple of num_ranks = ", shape.num_ranks)),
                              errors::Reason::kOpInputInvalid);
  }
  if (shape.hidden < 1) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "GroupShape.hidden = ", shape.hidden, " must be >= 1")),
                              errors::Reason::kOpInputInvalid);
  }
  if (shape.num_topk < 1) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "GroupShape.num_topk = ", shape.num_topk, " must be >= 1")),
                              errors::Reason::kOpInputInvalid);
  }
  if (shape.max_tokens_per_rank < 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "GroupShape.max_tokens_per_rank = ", shape.max_tokens_per_rank, " must be >= 0")),
        errors::Reason::kOpInputInvalid);
  }
  if (shape.ll_max_tokens_per_rank < 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "GroupShape.ll_max_tokens_per_rank = ", shape.ll_max_tokens_per_rank, " must be >= 0")),
        errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckFp8Hidden(const GroupShape& shape, bool fp8, const char* op) {
  if (fp8 && shape.hidden % kFp8BlockChannels != 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(op, ": FP8 needs hidden % ", kFp8BlockChannels,
                                                " == 0, hidden = ", shape.hidden)),
        errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckNumRankArgs(const GroupShape& shape, size_t num_args, const char* op) {
  if (num_args != static_cast<size_t>(shape.num_ranks)) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(op, ": got args for ", num_args, " ranks, num_ranks = ", shape.num_ranks)),
        errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckNumTokens(int32_t rank, int32_t num_tokens, int32_t capacity,
                            const char* capacity_name) {
  if (num_tokens < 0 || num_tokens > capacity) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  "rank ", rank, ": num_tokens = ", num_tokens, " is outside [0, ",
                                  capacity_name, " = ", capacity, "]")),
                              errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckPointer(const void* ptr, bool needed, const char* op, int32_t rank,
                          const char* field) {
  if (needed && ptr == nullptr) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(op, ": rank ", rank, ": ", field, " is null")),
        errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchReceiver(const DispatchRankArgs& a, int32_t rank, int64_t total, bool fp8,
                                   bool cached, bool with_weights) {
  constexpr const char* kOp = "Dispatch";
  if (total > a.recv_capacity) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  kOp, ": rank ", rank, " receives ", total,
                                  " tokens, more than its recv_capacity = ", a.recv_capacity)),
                              errors::Reason::kOpInputInvalid);
  }
  const bool receives = total > 0;
  EPD_RETURN_IF_ERROR(CheckPointer(a.recv_x, receives, kOp, rank, "recv_x"));
  EPD_RETURN_IF_ERROR(CheckPointer(a.recv_scales, receives && fp8, kOp, rank, "recv_scales"));
  EPD_RETURN_IF_ERROR(CheckPointer(a.recv_src_info, receives, kOp, rank, "recv_src_info"));
  EPD_RETURN_IF_ERROR(
      CheckPointer(a.recv_topk_idx, receives && !cached, kOp, rank, "recv_topk_idx"));
  return CheckPointer(a.recv_topk_weights, receives && with_weights, kOp, rank,
                      "recv_topk_weights");
}

absl::Status CheckTopkIdxImpl(const GroupShape& shape, int32_t rank, int32_t num_tokens,
                              const int64_t* topk_idx) {
  if (num_tokens <= 0) return absl::OkStatus();
  if (topk_idx == nullptr) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            rank >= 0
                ? absl::StrCat("rank ", rank, ": topk_idx is null with num_tokens = ", num_tokens)
                : absl::StrCat("topk_idx is null with num_tokens = ", num_tokens)),
        errors::Reason::kOpInputInvalid);
  }
  const int64_t i = rules::FirstBadTopkEntry(shape, num_tokens, topk_idx);
  if (i >= 0) {
    const int64_t k_count = shape.num_topk;
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat("topk_idx", rank >= 0 ? absl::StrCat(" of rank ", rank) : std::string(),
                         " at token ", i / k_count, ", k ", i % k_count, " = ", topk_idx[i],
                         " is outside [-1, num_experts = ", shape.num_experts, ")")),
        errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

}  // namespace internal

absl::Status CheckTopkIdx(const GroupShape& shape, int32_t rank, int32_t num_tokens,
                          const int64_t* topk_idx) {
  return internal::CheckTopkIdxImpl(shape, rank, num_tokens, topk_idx);
}

}  // namespace epd::kernels::host
