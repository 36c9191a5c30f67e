// The op descriptor table, request flags and the spec/FP8/limit rules (op_rules.h).
#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "epd/kernels/op_rules.h"

namespace epd::rules {
namespace {

using abi::OpKind;

constexpr OpDescriptor kTable[] = {
    {OpKind::kInvalid, "Invalid", false, false, false, false, false, 0},
    {OpKind::kGetDispatchLayout, "GetDispatchLayout", true, false, false, false, false, 0},
    {OpKind::kDispatch, "Dispatch", true, false, false, true, true,
     abi::kFlagFp8 | abi::kFlagCachedHandle | abi::kFlagDispatchWeights},
    {OpKind::kCombine, "Combine", true, false, false, true, false, abi::kFlagCombineWeights},
    {OpKind::kLowLatencyDispatch, "LowLatencyDispatch", true, true, false, true, true,
     abi::kFlagFp8 | abi::kFlagRoundScale | abi::kFlagUe8m0},
    {OpKind::kLowLatencyCombine, "LowLatencyCombine", true, true, false, true, false, 0},
    {OpKind::kRegisterProgram, "RegisterProgram", false, false, true, true, false, 0},
    {OpKind::kUnregisterProgram, "UnregisterProgram", false, false, true, true, false, 0},
};
static_assert(sizeof(kTable) / sizeof(kTable[0]) == abi::kMaxOpKind + 1,
              "one descriptor per abi::OpKind");

}  // namespace

const OpDescriptor& Describe(uint32_t op) { return op <= abi::kMaxOpKind ? kTable[op] : kTable[0]; }

RequestOptions DecodeFlags(uint32_t flags) {
  RequestOptions o;
  o.use_fp8 = flags & abi::kFlagFp8;
  o.round_scale = flags & abi::kFlagRoundScale;
  o.use_ue8m0 = flags & abi::kFlagUe8m0;
  o.cached_handle = flags & abi::kFlagCachedHandle;
  o.combine_weights = flags & abi::kFlagCombineWeights;
  o.dispatch_weights = flags & abi::kFlagDispatchWeights;
  o.stream_ordered = flags & abi::kFlagStreamOrdered;
  o.client_error = flags & abi::kFlagClientError;
  return o;
}

uint32_t EncodeFlags(const RequestOptions& o) {
  return (o.use_fp8 ? abi::kFlagFp8 : 0) | (o.round_scale ? abi::kFlagRoundScale : 0) |
         (o.use_ue8m0 ? abi::kFlagUe8m0 : 0) | (o.cached_handle ? abi::kFlagCachedHandle : 0) |
         (o.combine_weights ? abi::kFlagCombineWeights : 0) |
         (o.dispatch_weights ? abi::kFlagDispatchWeights : 0) |
         (o.stream_ordered ? abi::kFlagStreamOrdered : 0) |
         (o.client_error ? abi::kFlagClientError : 0);
}

absl::Status CheckFp8(abi::OpKind op, absl::string_view what, const kernels::GroupShape& shape,
                      absl::string_view group) {
  if (op == OpKind::kLowLatencyDispatch && shape.hidden % kernels::kFp8BlockChannels != 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(what, ": use_fp8 needs hidden % 128 == 0, hidden = ", shape.hidden)),
        errors::Reason::kOpInputInvalid);
  }
  if (!shape.use_fp8) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  what, ": use_fp8 but group ", group, " has use_fp8 = false")),
                              errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

bool Fp8Allowed(abi::OpKind op, const kernels::GroupShape& shape) {
  return shape.use_fp8 &&
         (op != OpKind::kLowLatencyDispatch || shape.hidden % kernels::kFp8BlockChannels == 0);
}

absl::Status CheckScaleFormat(absl::string_view what, bool use_fp8, bool round_scale,
                              bool use_ue8m0, const kernels::GroupShape& shape) {
  if (!use_ue8m0) return absl::OkStatus();
  if (!use_fp8) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(what, ": use_ue8m0 needs use_fp8")),
        errors::Reason::kOpInputInvalid);
  }
  if (!round_scale) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(what, ": use_ue8m0 needs round_scale (UE8M0 holds powers of two only)")),
        errors::Reason::kOpInputInvalid);
  }
  if (shape.hidden % kernels::kUe8m0WordChannels != 0) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  what, ": use_ue8m0 needs hidden % ", kernels::kUe8m0WordChannels,
                                  " == 0, hidden = ", shape.hidden)),
                              errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

int32_t MaxTokens(abi::OpKind op, const kernels::GroupShape& shape) {
  return IsLowLatency(op) ? shape.ll_max_tokens_per_rank : shape.max_tokens_per_rank;
}

absl::Status CheckRequestShape(abi::OpKind op, const RequestOptions& options, int32_t num_tokens,
                               int32_t num_sms, int32_t expert_alignment,
                               const kernels::GroupShape& shape, absl::string_view group) {
  const OpDescriptor& d = Describe(op);
  if (d.low_latency && shape.ll_max_tokens_per_rank == 0) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat(d.name, " needs spec.ll_max_tokens_per_rank > 0 (group ", group, ")")),
        errors::Reason::kSpecInvalid);
  }
  const int32_t max_tokens = MaxTokens(op, shape);
  if (num_tokens < 0 || num_tokens > max_tokens) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  d.name, ": num_tokens ", num_tokens, " outside [0, ", max_tokens,
                                  "] (", d.low_latency ? "ll_" : "", "max_tokens_per_rank)")),
                              errors::Reason::kTokensOverCapacity);
  }
  if (num_sms < 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(d.name, ": num_sms ", num_sms, " < 0")),
        errors::Reason::kOpInputInvalid);
  }
  if (op == OpKind::kDispatch) {
    if (expert_alignment < 1 || expert_alignment > (1 << 20)) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("Dispatch: expert_alignment ", expert_alignment, " outside [1, 2^20]")),
          errors::Reason::kOpInputInvalid);
    }
    if (options.use_fp8 && !shape.use_fp8) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("Dispatch: FP8 input but group ", group, " has use_fp8 = false")),
          errors::Reason::kOpInputInvalid);
    }
  }
  if (op == OpKind::kLowLatencyDispatch) {
    absl::Status format =
        CheckScaleFormat(d.name, options.use_fp8, options.round_scale, options.use_ue8m0, shape);
    if (!format.ok() || !options.use_fp8) return format;
    return CheckFp8(op, d.name, shape, group);
  }
  return absl::OkStatus();
}

int64_t FirstBadTopkEntry(const kernels::GroupShape& shape, int32_t num_tokens,
                          const int64_t* topk_idx) {
  const int64_t n = static_cast<int64_t>(num_tokens > 0 ? num_tokens : 0) * shape.num_topk;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = topk_idx[i];
    if (e < -1 || e >= shape.num_experts) return i;
  }
  return -1;
}

}  // namespace epd::rules
