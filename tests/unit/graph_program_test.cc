// Graph-mode program registration on the CPU (DESIGN.md §3.2):
// the program encoding and its fixed buffers (DecodeProgram), LockstepGroup's rules with a
// backend that accepts programs (every rank must register the same program, a mismatch
// names the step; ring ops are refused while armed, at once, and late ranks get the same
// error; a second register is refused; unregister disarms), and the host backend's clear
// refusal. The CUDA backend's program runs are tested on the GPU
// (tests/gpu/graph_program_test.cc).
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/dataplane/lockstep_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"
#include "tests/unit/fake_data_plane.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using ::testing::HasSubstr;
using testing::RawRing;

using Op = abi::OpKind;
constexpr auto kD = abi::EncodeProgramStep(Op::kLowLatencyDispatch, false, false);
constexpr auto kD8 = abi::EncodeProgramStep(Op::kLowLatencyDispatch, true, false);
constexpr auto kC = abi::EncodeProgramStep(Op::kLowLatencyCombine, false, false);

v1::GroupSpec LlSpec(const std::string& name, bool fp8 = true) {
  v1::GroupSpec spec = testing::SmallSpec(name);
  spec.set_ll_max_tokens_per_rank(8);
  spec.set_use_fp8(fp8);
  return spec;
}

/// A RegisterProgram slot of `steps` (shm_abi.h encoding; steps beyond the slot's room,
/// kMaxProgramSteps, are counted in program_num_steps but not encoded).
abi::RequestSlot ProgramSlot(const std::vector<uint8_t>& steps) {
  abi::RequestSlot slot{};
  slot.magic = abi::kRequestMagic;
  slot.op = static_cast<uint32_t>(Op::kRegisterProgram);
  slot.program_num_steps = steps.size();
  for (size_t i = 0; i < steps.size() && i < abi::kMaxProgramSteps; ++i) {
    slot.program_steps[i / 8] |= static_cast<uint64_t>(steps[i]) << (8 * (i % 8));
  }
  return slot;
}

/// Publishes `slot` (its seq set to the ring's next) on `info`'s ring; returns the seq.
class ProgramRing {
 public:
  ProgramRing(const v1::EndpointInfo& info, DataPlaneGroup& group)
      : ring_(RawRing::Open(info, group)), next_seq_(info.first_seq()) {}
  uint64_t Submit(abi::RequestSlot slot) {
    slot.seq = next_seq_++;
    abi::EndpointShmHeader* h = ring_->header();
    auto* ring =
        reinterpret_cast<abi::RequestSlot*>(reinterpret_cast<uint8_t*>(h) + h->ring_offset);
    const uint64_t head = abi::Atomic(h->ring_head).load();
    std::memcpy(&ring[(head + 1) % abi::kRingCapacity], &slot, sizeof(slot));
    abi::Atomic(h->ring_head).store(head + 1, std::memory_order_release);
    return slot.seq;
  }
  uint64_t SubmitOp(Op op) {
    abi::RequestSlot slot{};
    slot.magic = abi::kRequestMagic;
    slot.op = static_cast<uint32_t>(op);
    slot.expert_alignment = 1;
    return Submit(slot);
  }
  RawRing& raw() { return *ring_; }

 private:
  std::unique_ptr<RawRing> ring_;
  uint64_t next_seq_;
};

// ---- DecodeProgram -------------------------------------------------------------------------

TEST(DecodeProgramTest, FixedBuffersPerStep) {
  const kernels::GroupShape shape = ShapeOf(LlSpec("decode"));
  auto p = DecodeProgram(ProgramSlot({kD8, kC}), shape);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 2u);
  EXPECT_EQ((*p)[0].op, Op::kLowLatencyDispatch);
  EXPECT_TRUE((*p)[0].use_fp8);
  EXPECT_EQ((*p)[0].buffer, 0);
  EXPECT_EQ((*p)[1].op, Op::kLowLatencyCombine);
  EXPECT_EQ((*p)[1].buffer, 0);
  EXPECT_EQ((*p)[1].out_buffer, 0);
  // Two layers: dispatches alternate buffers, each combine pairs with its dispatch.
  p = DecodeProgram(ProgramSlot({kD, kC, kD, kC}), shape);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[2].buffer, 1);
  EXPECT_EQ((*p)[3].buffer, 1);
  EXPECT_EQ((*p)[3].out_buffer, 1);
  // A combine first pairs with the program's last dispatch (cyclically).
  p = DecodeProgram(ProgramSlot({kC, kD, kD}), shape);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)[0].buffer, 1);
}

TEST(DecodeProgramTest, Ue8m0StepNeedsFp8RoundScaleAndHidden512) {
  constexpr auto kUe8m0 = abi::EncodeProgramStep(Op::kLowLatencyDispatch, true, true, true);
  static_assert((kUe8m0 & abi::kProgramStepUe8m0) != 0);
  v1::GroupSpec spec = LlSpec("ue8m0");
  spec.set_hidden(1024);
  auto p = DecodeProgram(ProgramSlot({kUe8m0, kC}), ShapeOf(spec));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE((*p)[0].use_fp8 && (*p)[0].round_scale && (*p)[0].use_ue8m0);
  EXPECT_FALSE((*p)[1].use_ue8m0);
  EXPECT_EQ(ProgramStepName((*p)[0]),
            "LowLatencyDispatch{use_fp8=true, round_scale=true, use_ue8m0=true}");
  const struct {
    uint8_t step;
    int32_t hidden;
    const char* text;
  } bad[] = {
      {kUe8m0, 256, "step 0: use_ue8m0 needs hidden % 512 == 0, hidden = 256"},
      {abi::EncodeProgramStep(Op::kLowLatencyDispatch, true, false, true), 1024,
       "step 0: use_ue8m0 needs round_scale"},
      {static_cast<uint8_t>(kC | abi::kProgramStepUe8m0), 1024,
       "step 0 (LowLatencyCombine) has use_fp8/round_scale/use_ue8m0 set"},
  };
  for (const auto& b : bad) {
    spec.set_hidden(b.hidden);
    p = DecodeProgram(ProgramSlot({b.step, kD}), ShapeOf(spec));
    ASSERT_FALSE(p.ok()) << b.text;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(p.status().message(), HasSubstr(b.text));
  }
}

TEST(DecodeProgramTest, BadProgramsNameTheStep) {
  const kernels::GroupShape shape = ShapeOf(LlSpec("decode", /*fp8=*/false));
  struct Case {
    std::vector<uint8_t> steps;
    absl::StatusCode code;
    const char* text;
  };
  const std::vector<Case> cases = {
      {{}, absl::StatusCode::kInvalidArgument, "0 steps"},
      {std::vector<uint8_t>(17, kD), absl::StatusCode::kInvalidArgument, "17 steps"},
      {{kD, static_cast<uint8_t>(Op::kDispatch)},
       absl::StatusCode::kInvalidArgument,
       "step 1 (byte 0x2) is Dispatch"},
      {{kD8}, absl::StatusCode::kInvalidArgument, "step 0 uses FP8"},
      {{abi::EncodeProgramStep(Op::kLowLatencyDispatch, false, true)},
       absl::StatusCode::kInvalidArgument,
       "round_scale without use_fp8"},
      {{kC}, absl::StatusCode::kInvalidArgument, "no LowLatencyDispatch"},
  };
  for (const Case& c : cases) {
    auto p = DecodeProgram(ProgramSlot(c.steps), shape);
    ASSERT_FALSE(p.ok()) << c.text;
    EXPECT_EQ(p.status().code(), c.code) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr(c.text));
  }
  v1::GroupSpec no_ll = testing::SmallSpec("noll");
  auto p = DecodeProgram(ProgramSlot({kD}), ShapeOf(no_ll));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
}

// ---- LockstepGroup rules with a backend that accepts programs ------------------------------

/// Runs every op at once (OK) and accepts programs; records what it started.
class ProgramGroup : public LockstepGroup {
 public:
  explicit ProgramGroup(const v1::GroupSpec& spec) : LockstepGroup(spec, Options()) {}
  std::vector<abi::OpKind> started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }
  size_t program_steps() {
    std::lock_guard<std::mutex> lock(mu_);
    return program_steps_;
  }
  bool armed() {
    std::lock_guard<std::mutex> lock(mu_);
    return program_armed_;
  }

 protected:
  static LockstepOptions Options() {
    LockstepOptions o;
    o.op_timeout_ms = 2000;
    return o;
  }
  uint64_t ShmDataBytes(const RankResources&) const override { return 0; }
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t) const override { return testing::TestDoorbellFd(); }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t, const std::string&,
                                                             v1::LaunchMode,
                                                             v1::EndpointInfo* info) override {
    info->set_backend("program-test");
    return std::shared_ptr<RankResources>();
  }
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>&,
                   std::span<RankOutcome>) override {
    started_.push_back(plan.op);
    if (plan.op == Op::kRegisterProgram) program_steps_ = plan.program.size();
    return true;
  }
  absl::Status CheckProgram(int32_t) const override { return absl::OkStatus(); }

 private:
  std::vector<abi::OpKind> started_;
  size_t program_steps_ = 0;
};

class ProgramRulesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    group_ = std::make_unique<ProgramGroup>(LlSpec("rules"));
    for (int r = 0; r < 2; ++r) {
      v1::EndpointInfo info;
      ASSERT_TRUE(group_->AttachRank(r, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
      rings_.push_back(std::make_unique<ProgramRing>(info, *group_));
    }
  }
  std::optional<abi::Completion> Await(int r, uint64_t seq, int ms = 3000) {
    return rings_[r]->raw().Await(seq, std::chrono::milliseconds(ms), [this] { group_->Poll(); });
  }
  /// Both ranks' completions of `seq` have `code` and mention `text`.
  void ExpectBoth(uint64_t seq, absl::StatusCode code, const std::string& text) {
    for (int r = 0; r < 2; ++r) {
      auto c = Await(r, seq);
      ASSERT_TRUE(c.has_value()) << "rank " << r << " got no completion of " << seq;
      EXPECT_EQ(c->status_code, static_cast<int32_t>(code)) << "rank " << r << ": " << c->message;
      EXPECT_THAT(std::string(c->message), HasSubstr(text)) << "rank " << r;
    }
  }

  std::unique_ptr<ProgramGroup> group_;
  std::vector<std::unique_ptr<ProgramRing>> rings_;
};

// The low-latency buffer rule (rules::LowLatencyParity) counts failed ops too, so the
// buffer is a function of the op kinds each client submitted; a failed dispatch's handle is
// refused; a rejoining rank learns the count at its first_seq.
TEST_F(ProgramRulesTest, LowLatencyParityCountsFailedOps) {
  auto submit = [&](Op op, uint32_t flags, uint64_t handle_seq = 0) {
    abi::RequestSlot slot{};
    slot.magic = abi::kRequestMagic;
    slot.op = static_cast<uint32_t>(op);
    slot.flags = flags;
    slot.expert_alignment = 1;
    slot.handle_seq = handle_seq;
    uint64_t seq = 0;
    for (auto& ring : rings_) seq = ring->Submit(slot);
    return seq;
  };
  auto buffer_of = [&](uint64_t seq) {
    auto c = Await(0, seq);
    return c.has_value() && c->status_code == 0 ? c->buffer : -1;
  };
  const uint64_t failed = submit(Op::kLowLatencyDispatch, abi::kFlagClientError);  // Buffer 0.
  ExpectBoth(failed, absl::StatusCode::kInvalidArgument, "rejected its own inputs");
  const uint64_t d1 = submit(Op::kLowLatencyDispatch, 0);
  EXPECT_EQ(buffer_of(d1), 1);
  const uint64_t c_failed = submit(Op::kLowLatencyCombine, 0, failed);
  ExpectBoth(c_failed, absl::StatusCode::kFailedPrecondition, "last two low-latency dispatches");
  const uint64_t c1 = submit(Op::kLowLatencyCombine, 0, d1);
  EXPECT_EQ(buffer_of(c1), 1);  // The failed combine took ll_combined_x[0].
  const uint64_t d2 = submit(Op::kLowLatencyDispatch, 0);
  EXPECT_EQ(buffer_of(d2), 0);
  ExpectBoth(submit(Op::kLowLatencyCombine, 0, d1), absl::StatusCode::kOk, "");  // Both held.
  // A rejoining rank starts from the group's count (3 dispatches, 3 combines).
  group_->DetachRank(1);
  v1::EndpointInfo info;
  ASSERT_TRUE(group_->AttachRank(1, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
  EXPECT_EQ(info.first_ll_dispatches(), 3u);
  EXPECT_EQ(info.first_ll_combines(), 3u);
}

TEST_F(ProgramRulesTest, MismatchedProgramsFailNamingTheStep) {
  const uint64_t seq = rings_[0]->Submit(ProgramSlot({kD8, kC}));
  rings_[1]->Submit(ProgramSlot({kD, kC}));
  ExpectBoth(seq, absl::StatusCode::kFailedPrecondition,
             "step 0 is LowLatencyDispatch{use_fp8=true, round_scale=false} at rank 0 but "
             "LowLatencyDispatch{use_fp8=false, round_scale=false} at rank 1");
  EXPECT_FALSE(group_->armed());
  // A shorter program differs at its missing step.
  const uint64_t seq2 = rings_[0]->Submit(ProgramSlot({kD, kC}));
  rings_[1]->Submit(ProgramSlot({kD}));
  ExpectBoth(seq2, absl::StatusCode::kFailedPrecondition,
             "step 1 is LowLatencyCombine at rank 0 but (no step)");
  EXPECT_FALSE(group_->armed());
  EXPECT_TRUE(group_->started().empty());
}

TEST_F(ProgramRulesTest, RingOpsRefusedWhileArmedThenUnregisterDisarms) {
  const uint64_t reg = rings_[0]->Submit(ProgramSlot({kD8, kC}));
  rings_[1]->Submit(ProgramSlot({kD8, kC}));
  ExpectBoth(reg, absl::StatusCode::kOk, "");
  EXPECT_TRUE(group_->armed());
  EXPECT_EQ(group_->program_steps(), 2u);

  // Rank 0 alone submits a ring op: refused at once (rank 1 has not submitted it).
  const uint64_t op = rings_[0]->SubmitOp(Op::kLowLatencyDispatch);
  auto c0 = Await(0, op);
  ASSERT_TRUE(c0.has_value());
  EXPECT_EQ(c0->status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(c0->message), HasSubstr("graph-mode program armed"));
  EXPECT_THAT(std::string(c0->message), HasSubstr("LowLatencyDispatch"));
  // Rank 1's late request for that op gets the same error.
  rings_[1]->SubmitOp(Op::kLowLatencyDispatch);
  auto c1 = Await(1, op);
  ASSERT_TRUE(c1.has_value());
  EXPECT_EQ(c1->status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(std::string(c1->message), HasSubstr("graph-mode program armed"));

  // A second register while armed is refused too.
  const uint64_t again = rings_[0]->Submit(ProgramSlot({kD8, kC}));
  rings_[1]->Submit(ProgramSlot({kD8, kC}));
  ExpectBoth(again, absl::StatusCode::kFailedPrecondition, "");

  const uint64_t unreg = rings_[0]->SubmitOp(Op::kUnregisterProgram);
  rings_[1]->SubmitOp(Op::kUnregisterProgram);
  ExpectBoth(unreg, absl::StatusCode::kOk, "");
  EXPECT_FALSE(group_->armed());
  // Ring ops run again.
  const uint64_t layout = rings_[0]->SubmitOp(Op::kGetDispatchLayout);
  rings_[1]->SubmitOp(Op::kGetDispatchLayout);
  ExpectBoth(layout, absl::StatusCode::kOk, "");
  EXPECT_EQ(group_->started(), (std::vector<Op>{Op::kRegisterProgram, Op::kUnregisterProgram,
                                                Op::kGetDispatchLayout}));
}

// ---- the host backend refuses programs ------------------------------------------------------

TEST(HostDataPlaneProgramTest, RegisterIsUnimplementedNamingTheCudaBackend) {
  HostDataPlaneOptions o;
  o.op_timeout_ms = 2000;
  o.host_threads = 1;
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok()) << plane.status();
  auto group = (*plane)->CreateGroup(LlSpec("hostprog"));
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<std::unique_ptr<ProgramRing>> rings;
  for (int r = 0; r < 2; ++r) {
    v1::EndpointInfo info;
    ASSERT_TRUE((*group)->AttachRank(r, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
    rings.push_back(std::make_unique<ProgramRing>(info, **group));
  }
  const uint64_t seq = rings[0]->Submit(ProgramSlot({kD8, kC}));
  rings[1]->Submit(ProgramSlot({kD8, kC}));
  for (int r = 0; r < 2; ++r) {
    auto c = rings[r]->raw().Await(seq, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "rank " << r << " got no completion";
    EXPECT_EQ(c->status_code, static_cast<int32_t>(absl::StatusCode::kUnimplemented)) << c->message;
    EXPECT_THAT(std::string(c->message), HasSubstr("need the CUDA backend"));
  }
  // The group keeps working.
  const uint64_t next = rings[0]->SubmitOp(Op::kGetDispatchLayout);
  rings[1]->SubmitOp(Op::kGetDispatchLayout);
  for (int r = 0; r < 2; ++r) {
    auto c = rings[r]->raw().Await(next, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, 0) << c->message;
  }
}

}  // namespace
}  // namespace epd
