// The daemon's side of a client-launched spanning rank's command channel
// (daemon/dataplane/exchange/span_commands.h, proto/abi/span_abi.h): the pure functions, and
// LockstepGroup taking a rank's requests from its command block and answering there
// (BackendRequestSource, PopBackendRequest, RankOpEnded), without a GPU.
#include "daemon/dataplane/exchange/span_commands.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/dataplane/lockstep_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/abi/span_abi.h"
#include "tests/common/specs.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using ::testing::HasSubstr;

constexpr auto kInvalid = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
constexpr auto kDeadline = static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded);

std::unique_ptr<abi::SpanControl> NewControl(uint64_t first_seq) {
  auto c = std::make_unique<abi::SpanControl>();
  InitSpanControl(*c, first_seq);
  return c;
}

/// What a client's posting kernel writes: every field, then seq.
void Post(abi::SpanControl& c, uint64_t seq, abi::OpKind op, int32_t T, uint32_t flags = 0,
          int32_t client_buffer = 0, uint64_t handle_seq = 0) {
  c.command.magic = abi::kSpanCommandMagic;
  c.command.op = static_cast<uint32_t>(op);
  c.command.flags = flags;
  c.command.num_tokens = T;
  c.command.expert_alignment = 1;
  c.command.client_buffer = client_buffer;
  c.command.handle_seq = handle_seq;
  abi::Atomic(c.command.seq).store(seq, std::memory_order_release);
}

TEST(SpanCommandsTest, InitLeavesNoOpPostedOrAnswered) {
  auto c = NewControl(5);
  EXPECT_EQ(c->magic, abi::kSpanControlMagic);
  EXPECT_EQ(c->version, abi::kSpanControlVersion);
  EXPECT_EQ(c->first_seq, 5u);
  EXPECT_EQ(c->command.seq, 4u);
  EXPECT_EQ(c->done_seq, 4u);
  abi::SpanCommand copy;
  abi::RequestSlot slot;
  EXPECT_FALSE(TakeSpanCommand(*c, 5, 5, &copy, &slot));
}

TEST(SpanCommandsTest, TakesOnlyTheNextOpAndCopiesIt) {
  auto c = NewControl(1);
  Post(*c, 2, abi::OpKind::kDispatch, 9, abi::kFlagFp8, 0, 0);
  abi::SpanCommand copy;
  abi::RequestSlot slot;
  EXPECT_FALSE(TakeSpanCommand(*c, 1, 1, &copy, &slot));  // A later seq than `newest` waits.
  c->command.seq = 1;
  ASSERT_TRUE(TakeSpanCommand(*c, 1, 1, &copy, &slot));
  EXPECT_FALSE(SpanCommandSkipped(copy));
  c->command.num_tokens = 1000;  // A rewrite after the copy changes nothing.
  EXPECT_EQ(slot.magic, abi::kRequestMagic);
  EXPECT_EQ(slot.seq, 1u);
  EXPECT_EQ(slot.op, static_cast<uint32_t>(abi::OpKind::kDispatch));
  EXPECT_EQ(slot.flags, abi::kFlagFp8);
  EXPECT_EQ(slot.num_tokens, 9);
  EXPECT_EQ(slot.expert_alignment, 1);
  EXPECT_EQ(slot.num_sms, 0);
  EXPECT_EQ(copy.num_tokens, 9);
}

TEST(SpanCommandsTest, ALaterOpWithinTheGroupsNextStandsForTheSkippedOne) {
  auto c = NewControl(1);
  Post(*c, 4, abi::OpKind::kCombine, 3);
  abi::SpanCommand copy;
  abi::RequestSlot slot;
  EXPECT_FALSE(TakeSpanCommand(*c, 2, 3, &copy, &slot));  // Beyond the group's next op.
  ASSERT_TRUE(TakeSpanCommand(*c, 3, 4, &copy, &slot));
  EXPECT_TRUE(SpanCommandSkipped(copy));
  EXPECT_EQ(slot.seq, 3u);
  const absl::Status st = CheckSpanCommand(copy);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(st.message(), HasSubstr("never posted op 3"));
  EXPECT_THAT(st.message(), HasSubstr("posted op 4"));
  // The client's own bytes cannot mark a command skipped.
  c->command.reserved[0] = copy.reserved[0];
  ASSERT_TRUE(TakeSpanCommand(*c, 4, 4, &copy, &slot));
  EXPECT_FALSE(SpanCommandSkipped(copy));
}

TEST(SpanCommandsTest, BadMagicOrOpBecomesAMalformedOp) {
  abi::SpanCommand c{};
  c.magic = abi::kSpanCommandMagic;
  for (uint32_t op : {0u, 6u, 7u, 99u}) {
    c.op = op;
    EXPECT_EQ(SlotFromSpanCommand(c).op, 0u) << op;
  }
  c.op = static_cast<uint32_t>(abi::OpKind::kLowLatencyCombine);
  EXPECT_EQ(SlotFromSpanCommand(c).op, c.op);
  c.magic = abi::kRequestMagic;
  EXPECT_EQ(SlotFromSpanCommand(c).op, 0u);
}

TEST(SpanCommandsTest, CheckNamesStreamOrderedAndTheClientBuffer) {
  abi::SpanCommand c{};
  c.magic = abi::kSpanCommandMagic;
  c.op = static_cast<uint32_t>(abi::OpKind::kLowLatencyDispatch);
  EXPECT_TRUE(CheckSpanCommand(c).ok());
  c.client_buffer = 2;
  absl::Status st = CheckSpanCommand(c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("client_buffer 2"));
  c.op = static_cast<uint32_t>(abi::OpKind::kDispatch);  // Not read for normal ops.
  EXPECT_TRUE(CheckSpanCommand(c).ok());
  c.flags = abi::kFlagStreamOrdered;
  st = CheckSpanCommand(c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("kFlagStreamOrdered"));
}

class SpanAnswerCopiesTest : public ::testing::Test {
 protected:
  SpanAnswerCopiesTest()
      : shape_(rules::ShapeOf(testing::MakeSpec(
            "g", {.num_ranks = 4, .num_experts = 8, .ll_max_tokens_per_rank = 8}))),
        L_(kernels::EndpointLayout::Compute(shape_)) {}
  kernels::GroupShape shape_;
  kernels::EndpointLayout L_;
};

TEST_F(SpanAnswerCopiesTest, LowLatencyDispatchMovesTheDaemonsBufferOntoTheClients) {
  OpPlan plan;
  plan.op = abi::OpKind::kLowLatencyDispatch;
  plan.ll_buffer = 1;
  const kernels::Region spans[] = {{L_.ll_recv_x[1].offset + 32, 64},
                                   {L_.ll_recv_count[1].offset, L_.ll_recv_count[1].bytes},
                                   {L_.ll_handle_pos[1].offset, 16},
                                   {L_.ll_recv_src_info[1].offset + 4, 8},
                                   {L_.ll_recv_scales[1].offset, 4}};
  abi::SpanCopy copies[5];
  ASSERT_EQ(SpanAnswerCopies(L_, plan, 0, spans, 5, copies), 5);
  const kernels::Region to[] = {L_.ll_recv_x[0], L_.ll_recv_count[0], L_.ll_handle_pos[0],
                                L_.ll_recv_src_info[0], L_.ll_recv_scales[0]};
  const kernels::Region from[] = {L_.ll_recv_x[1], L_.ll_recv_count[1], L_.ll_handle_pos[1],
                                  L_.ll_recv_src_info[1], L_.ll_recv_scales[1]};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(copies[i].src_offset, spans[i].offset) << i;
    EXPECT_EQ(copies[i].dst_offset, to[i].offset + (spans[i].offset - from[i].offset)) << i;
    EXPECT_EQ(copies[i].bytes, spans[i].bytes) << i;
  }
  // The same buffer at both ends: every offset kept.
  ASSERT_EQ(SpanAnswerCopies(L_, plan, 1, spans, 5, copies), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(copies[i].dst_offset, spans[i].offset) << i;
}

TEST_F(SpanAnswerCopiesTest, LowLatencyCombineMovesItsOutputBufferOnly) {
  OpPlan plan;
  plan.op = abi::OpKind::kLowLatencyCombine;
  plan.ll_out_buffer = 0;
  const kernels::Region spans[] = {{L_.ll_combined_x[0].offset, 512}, {L_.ll_recv_x[0].offset, 16}};
  abi::SpanCopy copies[2];
  ASSERT_EQ(SpanAnswerCopies(L_, plan, 1, spans, 2, copies), 2);
  EXPECT_EQ(copies[0].dst_offset, L_.ll_combined_x[1].offset);
  EXPECT_EQ(copies[1].dst_offset, spans[1].offset);
}

TEST_F(SpanAnswerCopiesTest, NormalOpsKeepTheirOffsetsAndTheCountIsClamped) {
  OpPlan plan;
  plan.op = abi::OpKind::kDispatch;
  plan.ll_buffer = 1;
  std::vector<kernels::Region> spans(abi::kMaxSpanCopies + 4,
                                     kernels::Region{L_.ll_recv_x[1].offset, 8});
  std::vector<abi::SpanCopy> copies(abi::kMaxSpanCopies);
  ASSERT_EQ(SpanAnswerCopies(L_, plan, 0, spans.data(), static_cast<int32_t>(spans.size()),
                             copies.data()),
            static_cast<int32_t>(abi::kMaxSpanCopies));
  EXPECT_EQ(copies[0].dst_offset, L_.ll_recv_x[1].offset);
  EXPECT_EQ(SpanAnswerCopies(L_, plan, 0, spans.data(), -3, copies.data()), 0);
}

TEST(SpanCommandsTest, AnswerWritesCopiesOnlyWhenOkAndTheMessageCut) {
  auto c = NewControl(1);
  const abi::SpanCopy copy{8, 16, 32};
  WriteSpanAnswer(*c, 1, absl::OkStatus(), 7, &copy, 1);
  EXPECT_EQ(c->done_seq, 1u);
  EXPECT_EQ(c->done_status_code, 0);
  EXPECT_EQ(c->done_num_recv_tokens, 7);
  ASSERT_EQ(c->num_copies, 1u);
  EXPECT_EQ(c->copies[0].dst_offset, 16u);
  EXPECT_EQ(c->results[1].seq, 1u);
  EXPECT_STREQ(c->results[1].message, "");
  WriteSpanAnswer(*c, 2, absl::InvalidArgumentError(std::string(1000, 'x')), 0, &copy, 1);
  EXPECT_EQ(c->done_seq, 2u);
  EXPECT_EQ(c->done_status_code, kInvalid);
  EXPECT_EQ(c->num_copies, 0u);
  EXPECT_EQ(std::strlen(c->results[2].message), abi::kCompletionMessageBytes - 1);
}

// ---- LockstepGroup with ranks whose requests come from their command blocks ----

/// A backend whose every rank is a client-launched spanning rank in miniature: its region's
/// data part holds a command block (after a 4 KiB "mirror"), requests come from there, every
/// op finishes at once (a dispatch receives 7 rows) and is answered there.
class CommandGroup : public LockstepGroup {
 public:
  static constexpr uint64_t kMirrorBytes = 4096;
  CommandGroup(const v1::GroupSpec& spec, uint32_t op_timeout_ms)
      : LockstepGroup(spec, Options(op_timeout_ms)), controls_(spec.num_ranks(), nullptr) {}

  abi::SpanControl& control(int32_t r) { return *controls_[r]; }
  int started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }

 protected:
  static LockstepOptions Options(uint32_t op_timeout_ms) {
    LockstepOptions o;
    o.op_timeout_ms = op_timeout_ms;
    return o;
  }
  uint64_t ShmDataBytes(const RankResources&) const override {
    return abi::SpanDataBytes(kMirrorBytes);
  }
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t) const override { return testing::TestDoorbellFd(); }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t, const std::string&,
                                                             v1::LaunchMode,
                                                             v1::EndpointInfo* info) override {
    info->set_backend("commands");
    return std::make_shared<RankResources>();
  }
  absl::Status RankRegionReady(int32_t rank, RankResources&, uint8_t* shm_data,
                               uint64_t first_seq) override {
    controls_[rank] =
        reinterpret_cast<abi::SpanControl*>(shm_data + abi::SpanControlOffset(kMirrorBytes));
    InitSpanControl(*controls_[rank], first_seq);
    return absl::OkStatus();
  }
  bool BackendRequestSource(int32_t) const override { return true; }
  bool PopBackendRequest(int32_t rank, uint64_t next_seq, abi::RequestSlot* slot) override {
    return TakeSpanCommand(*controls_[rank], next_seq, current_seq() + 1, &commands_[rank], slot);
  }
  absl::Status CheckRequest(int32_t rank, const abi::RequestSlot&) const override {
    return CheckSpanCommand(commands_[rank]);
  }
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>&,
                   std::span<RankOutcome> outcomes) override {
    ++started_;
    for (RankOutcome& o : outcomes) o.num_recv_tokens = plan.op == abi::OpKind::kDispatch ? 7 : 0;
    return true;
  }
  void RankOpEnded(int32_t rank, const abi::RequestSlot& slot, const RankOutcome& outcome,
                   const OpPlan* plan) override {
    const kernels::Region span{0, 64};
    abi::SpanCopy copy;
    const int32_t n =
        plan != nullptr
            ? SpanAnswerCopies(layout(), *plan, commands_[rank].client_buffer, &span, 1, &copy)
            : 0;
    WriteSpanAnswer(*controls_[rank], slot.seq, outcome.status, outcome.num_recv_tokens, &copy, n);
  }

 private:
  std::vector<abi::SpanControl*> controls_;
  abi::SpanCommand commands_[8]{};
  int started_ = 0;
};

class CommandGroupTest : public ::testing::Test {
 protected:
  void Open(int ranks, uint32_t op_timeout_ms) {
    v1::GroupSpec spec = testing::MakeSpec(
        "cmd", {.num_ranks = ranks, .num_experts = 2 * ranks, .ll_max_tokens_per_rank = 8});
    group_ = std::make_unique<CommandGroup>(spec, op_timeout_ms);
    for (int r = 0; r < ranks; ++r) {
      v1::EndpointInfo info;
      ASSERT_TRUE(group_->AttachRank(r, "", v1::LAUNCH_MODE_CLIENT, {}, &info).ok());
      ASSERT_EQ(info.first_seq(), 1u);
    }
  }
  /// Polls until rank r's done_seq is `seq` (or `ms` pass); its status code, -1 if none.
  int32_t Answer(int r, uint64_t seq, int ms = 3000) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    abi::SpanControl& c = group_->control(r);
    while (std::chrono::steady_clock::now() < end) {
      group_->Poll();
      if (abi::Atomic(c.done_seq).load(std::memory_order_acquire) == seq) {
        return c.done_status_code;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return -1;
  }
  std::unique_ptr<CommandGroup> group_;
};

TEST_F(CommandGroupTest, EveryRankPostsAndIsAnsweredInItsBlock) {
  Open(2, 1000);
  for (int r = 0; r < 2; ++r) Post(group_->control(r), 1, abi::OpKind::kDispatch, 3);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(Answer(r, 1), 0) << group_->control(r).results[1].message;
    EXPECT_EQ(group_->control(r).done_num_recv_tokens, 7);
    EXPECT_EQ(group_->control(r).num_copies, 1u);
  }
  EXPECT_EQ(group_->started(), 1);
  // The next op, a combine on the dispatch's handle.
  for (int r = 0; r < 2; ++r) Post(group_->control(r), 2, abi::OpKind::kCombine, 3, 0, 0, 1);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Answer(r, 2), 0) << group_->control(r).results[2].message;
}

TEST_F(CommandGroupTest, ABadCommandFailsTheOpForEveryRankAndTheGroupGoesOn) {
  Open(2, 1000);
  Post(group_->control(0), 1, abi::OpKind::kLowLatencyDispatch, 3, 0, /*client_buffer=*/5);
  Post(group_->control(1), 1, abi::OpKind::kLowLatencyDispatch, 3);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(Answer(r, 1), kInvalid);
    EXPECT_THAT(group_->control(r).results[1].message, HasSubstr("client_buffer 5"));
    EXPECT_EQ(group_->control(r).num_copies, 0u);
  }
  // T beyond ll_max_tokens_per_rank, then bad magic.
  Post(group_->control(0), 2, abi::OpKind::kLowLatencyDispatch, 3);
  Post(group_->control(1), 2, abi::OpKind::kLowLatencyDispatch, 1 << 20);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Answer(r, 2), kInvalid);
  Post(group_->control(0), 3, abi::OpKind::kGetDispatchLayout, 3);
  Post(group_->control(1), 3, abi::OpKind::kGetDispatchLayout, 3);
  group_->control(1).command.magic = 0;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Answer(r, 3), kInvalid);
  EXPECT_EQ(group_->started(), 0);
  // The group keeps going.
  for (int r = 0; r < 2; ++r) Post(group_->control(r), 4, abi::OpKind::kGetDispatchLayout, 3);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Answer(r, 4), 0);
  EXPECT_EQ(group_->started(), 1);
}

TEST_F(CommandGroupTest, ARankThatNeverPostsOrPostsAnotherSeqFailsTheOpAtOpTimeout) {
  Open(3, 200);
  Post(group_->control(0), 1, abi::OpKind::kGetDispatchLayout, 3);
  Post(group_->control(2), 1, abi::OpKind::kGetDispatchLayout, 3);
  Post(group_->control(1), 9, abi::OpKind::kGetDispatchLayout, 3);  // Not op 1: not taken.
  for (int r : {0, 2}) {
    EXPECT_EQ(Answer(r, 1), kDeadline);
    EXPECT_THAT(group_->control(r).results[1].message, HasSubstr("rank(s) 1"));
  }
  // Rank 1 posts op 1 late: answered at once with the op's error.
  Post(group_->control(1), 1, abi::OpKind::kGetDispatchLayout, 3);
  EXPECT_EQ(Answer(1, 1), kDeadline);
  EXPECT_THAT(group_->control(1).results[1].message, HasSubstr("arrived after op 1"));
}

TEST_F(CommandGroupTest, ARankWhoseKernelGaveUpOnAnOpCatchesUp) {
  Open(2, 200);
  // Rank 1's kernel gave up on op 1 and posted op 2: op 1 fails for both (naming rank 1),
  // then op 2 runs with both.
  Post(group_->control(0), 1, abi::OpKind::kGetDispatchLayout, 3);
  Post(group_->control(1), 2, abi::OpKind::kGetDispatchLayout, 3);
  EXPECT_EQ(Answer(0, 1), kDeadline);
  EXPECT_THAT(group_->control(0).results[1].message, HasSubstr("rank 1"));
  EXPECT_THAT(group_->control(0).results[1].message, HasSubstr("never posted op 1"));
  Post(group_->control(0), 2, abi::OpKind::kGetDispatchLayout, 3);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Answer(r, 2), 0) << group_->control(r).results[2].message;
  EXPECT_EQ(group_->started(), 1);
}

}  // namespace
}  // namespace epd
