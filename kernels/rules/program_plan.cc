// The graph-program plan: decoding, validation and the fixed buffers of each step.
#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "epd/kernels/op_rules.h"

namespace epd::rules {

void AssignProgramBuffers(std::vector<ProgramStepPlan>& steps) {
  int dispatches = 0, combines = 0, last_dispatch_buffer = -1;
  for (ProgramStepPlan& st : steps) {
    if (st.op == abi::OpKind::kLowLatencyDispatch) {
      st.buffer = dispatches++ % kernels::kLowLatencyBuffers;
      st.out_buffer = 0;
      last_dispatch_buffer = st.buffer;
    } else {
      st.out_buffer = combines++ % kernels::kLowLatencyBuffers;
      st.buffer = last_dispatch_buffer;  // -1 until a dispatch: fixed cyclically below.
    }
  }
  // A combine before the program's first dispatch pairs with its last one (cyclically).
  for (ProgramStepPlan& st : steps) {
    if (st.op != abi::OpKind::kLowLatencyDispatch && st.buffer < 0) {
      st.buffer = last_dispatch_buffer;
    }
  }
}

absl::StatusOr<std::vector<ProgramStepPlan>> PlanProgram(const abi::RequestSlot& slot,
                                                         const kernels::GroupShape& shape) {
  if (shape.ll_max_tokens_per_rank == 0) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            "RegisterProgram: the group has no low-latency mode (spec.ll_max_tokens_per_rank = 0)"),
        errors::Reason::kProgramInvalid);
  }
  const uint64_t n = slot.program_num_steps;
  if (n < 1 || n > abi::kMaxProgramSteps) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat("RegisterProgram: ", n, " steps, outside [1, ",
                                                abi::kMaxProgramSteps, "]")),
        errors::Reason::kProgramInvalid);
  }
  std::vector<ProgramStepPlan> steps(n);
  bool any_dispatch = false, any_combine = false;
  for (uint32_t i = 0; i < n; ++i) {
    const uint8_t b = abi::ProgramStepByte(slot, i);
    ProgramStepPlan& st = steps[i];
    st.op = static_cast<abi::OpKind>(b & 0xf);
    st.use_fp8 = b & abi::kProgramStepFp8;
    st.round_scale = b & abi::kProgramStepRoundScale;
    st.use_ue8m0 = b & abi::kProgramStepUe8m0;
    const bool dispatch = st.op == abi::OpKind::kLowLatencyDispatch;
    if ((b & 0x80) != 0 || (!dispatch && st.op != abi::OpKind::kLowLatencyCombine)) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("RegisterProgram: step ", i, " (byte 0x", absl::Hex(b), ") is ",
                           abi::OpKindName(b & 0xf),
                           "; a program step must be LowLatencyDispatch or LowLatencyCombine")),
          errors::Reason::kProgramInvalid);
    }
    if (!dispatch && (st.use_fp8 || st.round_scale || st.use_ue8m0)) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "RegisterProgram: step ", i,
                                    " (LowLatencyCombine) has use_fp8/round_scale/use_ue8m0 set")),
                                errors::Reason::kProgramInvalid);
    }
    if (st.round_scale && !st.use_fp8) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("RegisterProgram: step ", i, " has round_scale without use_fp8")),
          errors::Reason::kProgramInvalid);
    }
    if (absl::Status format = CheckScaleFormat(absl::StrCat("RegisterProgram: step ", i),
                                               st.use_fp8, st.round_scale, st.use_ue8m0, shape);
        !format.ok()) {
      return format;
    }
    if (st.use_fp8 && !shape.use_fp8) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("RegisterProgram: step ", i,
                                                  " uses FP8 but the group has use_fp8 = false")),
          errors::Reason::kProgramInvalid);
    }
    if (st.use_fp8 && shape.hidden % kernels::kFp8BlockChannels != 0) {
      return errors::WithReason(
          absl::InvalidArgumentError(
              absl::StrCat("RegisterProgram: step ", i,
                           " uses FP8, which needs hidden % 128 == 0, hidden = ", shape.hidden)),
          errors::Reason::kProgramInvalid);
    }
    any_dispatch |= dispatch;
    any_combine |= !dispatch;
  }
  if (any_combine && !any_dispatch) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            "RegisterProgram: the program has a LowLatencyCombine but no LowLatencyDispatch"),
        errors::Reason::kProgramInvalid);
  }
  AssignProgramBuffers(steps);
  return steps;
}

std::string ProgramStepName(const ProgramStepPlan& step) {
  std::string s = abi::OpKindName(step.op);
  if (step.op == abi::OpKind::kLowLatencyDispatch) {
    absl::StrAppend(&s, "{use_fp8=", step.use_fp8 ? "true" : "false",
                    ", round_scale=", step.round_scale ? "true" : "false",
                    step.use_ue8m0 ? ", use_ue8m0=true" : "", "}");
  }
  return s;
}

}  // namespace epd::rules
