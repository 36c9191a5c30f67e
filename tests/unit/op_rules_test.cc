// The op rules (epd/kernels/op_rules.h): the descriptor table, flags, FP8 and limit rules,
// the low-latency buffer parity, the handle table and the graph-program plan.
#include "epd/kernels/op_rules.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::rules {
namespace {

using ::testing::HasSubstr;
using Op = abi::OpKind;

kernels::GroupShape Shape(int32_t hidden = 256, bool fp8 = true, int32_t mll = 8) {
  kernels::GroupShape s;
  s.num_ranks = 2;
  s.num_experts = 4;
  s.hidden = hidden;
  s.num_topk = 2;
  s.max_tokens_per_rank = 16;
  s.ll_max_tokens_per_rank = mll;
  s.use_fp8 = fp8;
  return s;
}

// Every op kind has its row, named as the ABI names it; out-of-range values get kInvalid's.
TEST(OpRulesTest, DescriptorTableCoversEveryOpKind) {
  for (uint32_t op = 0; op <= abi::kMaxOpKind; ++op) {
    EXPECT_EQ(static_cast<uint32_t>(Describe(op).op), op);
    EXPECT_STREQ(Describe(op).name, abi::OpKindName(op));
  }
  EXPECT_EQ(Describe(abi::kMaxOpKind + 1).op, Op::kInvalid);
  EXPECT_TRUE(IsLowLatency(Op::kLowLatencyDispatch));
  EXPECT_TRUE(IsLowLatency(Op::kLowLatencyCombine));
  EXPECT_FALSE(IsLowLatency(Op::kDispatch));
  EXPECT_FALSE(Describe(Op::kGetDispatchLayout).exchanges_data);
  EXPECT_TRUE(Describe(Op::kCombine).exchanges_data);
  EXPECT_TRUE(Describe(Op::kRegisterProgram).program_op);
  EXPECT_FALSE(Describe(Op::kRegisterProgram).data_op);
}

TEST(OpRulesTest, FlagsRoundTrip) {
  for (uint32_t f = 0; f <= abi::kAllRequestFlags; ++f) EXPECT_EQ(EncodeFlags(DecodeFlags(f)), f);
  EXPECT_TRUE(DecodeFlags(abi::kFlagCachedHandle).cached_handle);
  EXPECT_FALSE(DecodeFlags(abi::kFlagCachedHandle).use_fp8);
}

TEST(OpRulesTest, ShapeOfCopiesTheSpec) {
  struct FakeSpec {
    int32_t num_ranks() const { return 2; }
    int32_t num_experts() const { return 8; }
    int32_t hidden() const { return 128; }
    int32_t num_topk() const { return 3; }
    int32_t max_tokens_per_rank() const { return 5; }
    int32_t ll_max_tokens_per_rank() const { return 7; }
    bool use_fp8() const { return true; }
  };
  const kernels::GroupShape s = ShapeOf(FakeSpec{});
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.num_experts, 8);
  EXPECT_EQ(s.hidden, 128);
  EXPECT_EQ(s.num_topk, 3);
  EXPECT_EQ(s.max_tokens_per_rank, 5);
  EXPECT_EQ(s.ll_max_tokens_per_rank, 7);
  EXPECT_TRUE(s.use_fp8);
}

// FP8: spec.use_fp8 for every op; hidden % 128 for the quantizing low-latency dispatch.
TEST(OpRulesTest, Fp8Rule) {
  EXPECT_TRUE(Fp8Allowed(Op::kLowLatencyDispatch, Shape(256, true)));
  EXPECT_FALSE(Fp8Allowed(Op::kLowLatencyDispatch, Shape(192, true)));
  EXPECT_TRUE(Fp8Allowed(Op::kDispatch, Shape(192, true)));
  EXPECT_FALSE(Fp8Allowed(Op::kDispatch, Shape(256, false)));
  absl::Status st = CheckFp8(Op::kLowLatencyDispatch, "LowLatencyDispatch", Shape(192), "g");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("hidden % 128 == 0, hidden = 192"));
  st = CheckFp8(Op::kLowLatencyDispatch, "X", Shape(256, false), "g");
  EXPECT_THAT(st.message(), HasSubstr("X: use_fp8 but group g has use_fp8 = false"));
}

TEST(OpRulesTest, RequestShapeLimits) {
  const RequestOptions none;
  EXPECT_TRUE(CheckRequestShape(Op::kDispatch, none, 16, 0, 1, Shape(), "g").ok());
  EXPECT_EQ(CheckRequestShape(Op::kDispatch, none, 17, 0, 1, Shape(), "g").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(CheckRequestShape(Op::kLowLatencyDispatch, none, 9, 0, 1, Shape(), "g").message(),
              HasSubstr("outside [0, 8] (ll_max_tokens_per_rank)"));
  EXPECT_EQ(
      CheckRequestShape(Op::kLowLatencyCombine, none, 0, 0, 1, Shape(256, true, 0), "g").code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(CheckRequestShape(Op::kCombine, none, 1, -1, 1, Shape(), "g").message(),
              HasSubstr("num_sms -1 < 0"));
  EXPECT_THAT(CheckRequestShape(Op::kDispatch, none, 1, 0, 0, Shape(), "g").message(),
              HasSubstr("expert_alignment 0 outside [1, 2^20]"));
  RequestOptions fp8;
  fp8.use_fp8 = true;
  EXPECT_THAT(CheckRequestShape(Op::kDispatch, fp8, 1, 0, 1, Shape(256, false), "g").message(),
              HasSubstr("FP8 input but group g has use_fp8 = false"));
  EXPECT_THAT(CheckRequestShape(Op::kLowLatencyDispatch, fp8, 1, 0, 1, Shape(192), "g").message(),
              HasSubstr("hidden % 128"));
}

// use_ue8m0 (DeepEP's packed UE8M0 scales) needs use_fp8, round_scale and hidden % 512 == 0;
// the flag round-trips, is an option of the low-latency dispatch only and must be agreed.
TEST(OpRulesTest, Ue8m0Rule) {
  const kernels::GroupShape h512 = Shape(512), h256 = Shape(256);
  EXPECT_TRUE(CheckScaleFormat("X", false, false, false, h256).ok());
  EXPECT_TRUE(CheckScaleFormat("X", true, true, false, h256).ok());
  EXPECT_TRUE(CheckScaleFormat("X", true, true, true, h512).ok());
  absl::Status st = CheckScaleFormat("X", false, true, true, h512);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("X: use_ue8m0 needs use_fp8"));
  st = CheckScaleFormat("X", true, false, true, h512);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("X: use_ue8m0 needs round_scale"));
  st = CheckScaleFormat("X", true, true, true, h256);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("X: use_ue8m0 needs hidden % 512 == 0, hidden = 256"));

  RequestOptions o;
  o.use_fp8 = o.round_scale = o.use_ue8m0 = true;
  EXPECT_TRUE(CheckRequestShape(Op::kLowLatencyDispatch, o, 1, 0, 1, h512, "g").ok());
  EXPECT_THAT(CheckRequestShape(Op::kLowLatencyDispatch, o, 1, 0, 1, h256, "g").message(),
              HasSubstr("LowLatencyDispatch: use_ue8m0 needs hidden % 512 == 0"));
  o.round_scale = false;
  EXPECT_THAT(CheckRequestShape(Op::kLowLatencyDispatch, o, 1, 0, 1, h512, "g").message(),
              HasSubstr("LowLatencyDispatch: use_ue8m0 needs round_scale"));
  o.round_scale = true;
  o.use_fp8 = false;
  EXPECT_THAT(CheckRequestShape(Op::kLowLatencyDispatch, o, 1, 0, 1, h512, "g").message(),
              HasSubstr("LowLatencyDispatch: use_ue8m0 needs use_fp8"));

  EXPECT_TRUE(DecodeFlags(abi::kFlagUe8m0).use_ue8m0);
  EXPECT_FALSE(DecodeFlags(abi::kFlagFp8 | abi::kFlagRoundScale).use_ue8m0);
  EXPECT_EQ(EncodeFlags({.use_ue8m0 = true}), abi::kFlagUe8m0);
  EXPECT_NE(Describe(Op::kLowLatencyDispatch).option_flags & abi::kFlagUe8m0, 0u);
  EXPECT_EQ(Describe(Op::kDispatch).option_flags & abi::kFlagUe8m0, 0u);
  EXPECT_NE(kAgreedFlags & abi::kFlagUe8m0, 0u);
}

// The parity is a function of the op kinds counted, whatever their outcome: d c d c
// alternates the dispatch buffer (round % 2), and d d keeps two dispatches' buffers apart.
TEST(OpRulesTest, LowLatencyParityCountsEveryOp) {
  LowLatencyParity p;
  EXPECT_EQ(p.LatestDispatchBuffer(), -1);
  for (int round = 0; round < 4; ++round) {
    EXPECT_EQ(p.DispatchBuffer(), round % 2);
    p.Advance(Op::kLowLatencyDispatch);
    EXPECT_EQ(p.LatestDispatchBuffer(), round % 2);
    EXPECT_EQ(p.CombineOutBuffer(), round % 2);
    p.Advance(Op::kLowLatencyCombine);
    p.Advance(Op::kDispatch);  // Other kinds do not move it.
    p.Advance(Op::kRegisterProgram);
  }
  EXPECT_EQ(p.dispatches, 4u);
  EXPECT_EQ(p.combines, 4u);
}

TEST(OpRulesTest, RoutingHandleWindow) {
  HandleTable h;
  EXPECT_EQ(h.Check(Op::kCombine, 0, 1, 3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(h.Check(Op::kDispatch, 0, 0, 3).ok());  // A fresh dispatch uses no handle.
  h.DispatchDone(/*seq=*/2, /*cached=*/false, /*num_tokens=*/3, /*num_recv_tokens=*/5, false);
  h.DispatchDone(4, /*cached=*/true, 3, 5, false);
  EXPECT_TRUE(h.Check(Op::kCombine, 0, 2, 3).ok());
  EXPECT_TRUE(h.Check(Op::kCombine, 0, 4, 3).ok());
  EXPECT_TRUE(h.Check(Op::kDispatch, abi::kFlagCachedHandle, 4, 3).ok());
  EXPECT_THAT(h.Check(Op::kCombine, 0, 5, 3).message(), HasSubstr("valid: ops 2..4"));
  EXPECT_THAT(h.Check(Op::kCombine, 0, 2, 4).message(),
              HasSubstr("num_tokens 4 != the handle's 3"));
  EXPECT_EQ(h.num_recv_tokens(), 5);
  h.DispatchDone(6, false, 1, 1, true);  // The next dispatch invalidates the handle.
  EXPECT_EQ(h.Check(Op::kCombine, 0, 4, 3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(h.routing_fp8());
  h.Forget(6);
  EXPECT_EQ(h.routing_seq(), 0u);
}

// A low-latency dispatch owns its buffer until the buffer is taken again; a failed one
// takes the buffer too, leaving it owned by nobody.
TEST(OpRulesTest, LowLatencyHandleOwnership) {
  HandleTable h;
  LowLatencyParity p;
  auto dispatch = [&](uint64_t seq, int32_t T, bool ok) {
    h.LowLatencyDispatchEnded(seq, p.DispatchBuffer(), T, ok);
    p.Advance(Op::kLowLatencyDispatch);
  };
  dispatch(1, 4, true);
  dispatch(2, 5, true);
  EXPECT_EQ(h.LowLatencyBufferOf(1), 0);
  EXPECT_EQ(h.LowLatencyBufferOf(2), 1);
  EXPECT_TRUE(h.Check(Op::kLowLatencyCombine, 0, 1, 4).ok());
  EXPECT_THAT(h.Check(Op::kLowLatencyCombine, 0, 2, 4).message(),
              HasSubstr("num_tokens 4 != the handle's 5"));
  dispatch(3, 6, false);  // Failed: buffer 0 is gone, op 2's stays.
  EXPECT_EQ(h.LowLatencyBufferOf(1), -1);
  EXPECT_EQ(h.Check(Op::kLowLatencyCombine, 0, 1, 4).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h.LowLatencyBufferOf(3), -1);
  EXPECT_EQ(h.LowLatencyBufferOf(2), 1);
  EXPECT_EQ(h.LowLatencyBufferOf(0), -1);  // 0 is never a handle.
  h.ClearLowLatency();
  EXPECT_EQ(h.LowLatencyBufferOf(2), -1);
}

abi::RequestSlot Slot(const std::vector<uint8_t>& steps) {
  abi::RequestSlot slot{};
  slot.program_num_steps = steps.size();
  for (size_t i = 0; i < steps.size() && i < abi::kMaxProgramSteps; ++i) {
    slot.program_steps[i / 8] |= static_cast<uint64_t>(steps[i]) << (8 * (i % 8));
  }
  return slot;
}

TEST(OpRulesTest, ProgramPlanBuffers) {
  constexpr auto kD = abi::EncodeProgramStep(Op::kLowLatencyDispatch, false, false);
  constexpr auto kC = abi::EncodeProgramStep(Op::kLowLatencyCombine, false, false);
  auto p = PlanProgram(Slot({kC, kD, kD, kC}), Shape());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[0].buffer, 1);  // Before the first dispatch: the program's last one.
  EXPECT_EQ((*p)[0].out_buffer, 0);
  EXPECT_EQ((*p)[1].buffer, 0);
  EXPECT_EQ((*p)[2].buffer, 1);
  EXPECT_EQ((*p)[3].buffer, 1);
  EXPECT_EQ((*p)[3].out_buffer, 1);
  EXPECT_EQ(ProgramStepName((*p)[1]), "LowLatencyDispatch{use_fp8=false, round_scale=false}");
  EXPECT_EQ(ProgramStepName((*p)[0]), "LowLatencyCombine");
  // The client's plan of the same steps matches the daemon's.
  std::vector<ProgramStepPlan> steps(4);
  steps[0].op = steps[3].op = Op::kLowLatencyCombine;
  steps[1].op = steps[2].op = Op::kLowLatencyDispatch;
  AssignProgramBuffers(steps);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(steps[i].buffer, (*p)[i].buffer) << i;
    EXPECT_EQ(steps[i].out_buffer, (*p)[i].out_buffer) << i;
  }
  EXPECT_EQ(PlanProgram(Slot({kC}), Shape()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanProgram(Slot({kD}), Shape(256, true, 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(PlanProgram(Slot({}), Shape()).status().message(),
              HasSubstr("0 steps, outside [1, 16]"));
}

TEST(OpRulesTest, TopkRange) {
  const kernels::GroupShape s = Shape();  // E = 4, K = 2.
  const int64_t ok[] = {0, -1, 3, 2};
  EXPECT_EQ(FirstBadTopkEntry(s, 2, ok), -1);
  const int64_t bad[] = {0, 1, 2, 4};
  EXPECT_EQ(FirstBadTopkEntry(s, 2, bad), 3);
  EXPECT_EQ(FirstBadTopkEntry(s, 1, bad), -1);  // Only num_tokens rows are read.
  const int64_t neg[] = {-2, 0};
  EXPECT_EQ(FirstBadTopkEntry(s, 1, neg), 0);
  EXPECT_EQ(FirstBadTopkEntry(s, 0, nullptr), -1);
}

}  // namespace
}  // namespace epd::rules
