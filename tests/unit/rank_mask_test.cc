// Rank masking on the host backend in-process (GroupSpec.on_rank_failure = MASK): endpoints
// opened by the real client code on a HostDataPlane group, one thread per rank. A rank
// masked by UpdateRankMask, by leaving, or by missing op_timeout: the others' ops complete
// without it, equal to kernels/host's results with its experts dropped, and report the mask;
// a process rejoining the masked slot is in step at the next op; FAIL groups refuse masks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/endpoint/endpoint_internal.h"
#include "client/epctl/format.h"
#include "daemon/control/spec_validation.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/op_rules.h"
#include "tests/common/dtypes.h"
#include "tests/common/mask_reference.h"
#include "tests/common/specs.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;
using ::epd::testing::LlRoundInputs;
using ::testing::HasSubstr;

constexpr int R = 4, E = 8, H = 128, K = 2, Mll = 8;
constexpr uint32_t kOpTimeoutMs = 300;

v1::GroupSpec MaskSpec(const std::string& name,
                       v1::RankFailurePolicy policy = v1::RANK_FAILURE_POLICY_MASK) {
  v1::GroupSpec spec = testing::MakeSpec(name, {.num_ranks = R,
                                                .num_experts = E,
                                                .hidden = H,
                                                .num_topk = K,
                                                .max_tokens_per_rank = Mll,
                                                .ll_max_tokens_per_rank = Mll});
  spec.set_on_rank_failure(policy);
  return spec;
}

/// Rank r's inputs: T = Mll - r tokens, random bf16 x, two distinct experts per token.
LlRoundInputs MakeInputs(int r) {
  LlRoundInputs in;
  in.num_tokens = Mll - r;
  std::mt19937 rng(40 + r);
  in.x.resize(size_t(in.num_tokens) * H);
  for (auto& v : in.x) v = kernels::FloatToBf16(float(rng() % 200) / 100.f - 1.f);
  for (int t = 0; t < in.num_tokens; ++t) {
    const int64_t a = rng() % E, b = (a + 1 + rng() % (E - 1)) % E;
    in.topk_idx.push_back(a);
    in.topk_idx.push_back(b);
    in.topk_weights.push_back(0.25f + float(rng() % 4) / 8);
    in.topk_weights.push_back(0.5f);
  }
  return in;
}

/// A MASK group of R ranks on a host data plane, each rank's endpoint opened in-process.
class RankMaskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostDataPlaneOptions o;
    o.op_timeout_ms = kOpTimeoutMs;
    o.host_threads = 1;
    auto plane = MakeHostDataPlane(o);
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = std::move(*plane);
    spec_ = MaskSpec("masked");
    auto g = plane_->CreateGroup(spec_);
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = std::move(*g);
    eps_.resize(R);
    for (int r = 0; r < R; ++r) ASSERT_NO_FATAL_FAILURE(Open(r));
    for (int r = 0; r < R; ++r) in_.push_back(MakeInputs(r));
  }
  void TearDown() override {
    eps_.clear();
    group_.reset();
  }

  /// Attaches rank r and opens its endpoint (a new process joining its slot).
  void Open(int r) {
    v1::EndpointInfo info;
    absl::Status st = group_->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
    ASSERT_TRUE(st.ok()) << st;
    auto fds = group_->TakeEndpointFds(r);
    ASSERT_TRUE(fds.ok()) << fds.status();
    DataPlaneGroup* g = group_.get();
    auto ep = internal::OpenEndpoint(info, spec_, *std::move(fds), [g, r] {
      g->DetachRank(r);
      return absl::OkStatus();
    });
    ASSERT_TRUE(ep.ok()) << ep.status();
    eps_[r] = std::move(*ep);
  }

  /// One low-latency round of rank r (dispatch, identity experts, combine); compares the
  /// combine with the reference of `masked` and records both ops' masks.
  absl::Status Round(int r, const std::vector<uint8_t>& masked, OpMask* dispatch_mask = nullptr,
                     OpMask* combine_mask = nullptr) {
    LlRoundInputs& in = in_[r];
    std::vector<int64_t> xs{in.num_tokens, H}, ks{in.num_tokens, K};
    DLTensor x = MakeDLTensor(in.x.data(), kBf16, xs);
    DLTensor idx = MakeDLTensor(in.topk_idx.data(), kI64, ks);
    DLTensor w = MakeDLTensor(in.topk_weights.data(), kF32, ks);
    Endpoint& ep = *eps_[r];
    LowLatencyDispatchArgs d;
    d.x = &x;
    d.topk_idx = &idx;
    auto dop = ep.LowLatencyDispatch(d);
    if (!dop.ok()) return dop.status();
    auto dres = dop->Wait(absl::Seconds(5));
    if (!dres.ok()) return dres.status();
    if (dispatch_mask) *dispatch_mask = dres->mask;
    // Identity experts: the received rows are the combine's input as they are.
    TensorView input = ep.LowLatencyCombineInput();
    std::memcpy(input.data(), dres->recv_x.data(), dres->recv_x.nbytes());
    LowLatencyCombineArgs c;
    c.x = &input.dl();
    c.topk_idx = &idx;
    c.topk_weights = &w;
    c.handle = &dres->handle;
    auto cop = ep.LowLatencyCombine(c);
    if (!cop.ok()) return cop.status();
    auto cres = cop->Wait(absl::Seconds(5));
    if (!cres.ok()) return cres.status();
    if (combine_mask) *combine_mask = cres->mask;
    auto ref = testing::LowLatencyRoundReference(rules::ShapeOf(spec_), in_, masked, masked);
    if (!ref.ok()) return ref.status();
    if (cres->mask.dropped_pairs != ref->dropped_pairs[r]) {
      return absl::InternalError(absl::StrCat("rank ", r, ": dropped_pairs ",
                                              cres->mask.dropped_pairs, ", reference ",
                                              ref->dropped_pairs[r]));
    }
    const size_t bytes = ref->combined_x[r].size() * sizeof(kernels::bf16_bits);
    if (cres->combined_x.nbytes() < static_cast<int64_t>(bytes) ||
        std::memcmp(cres->combined_x.data(), ref->combined_x[r].data(), bytes) != 0) {
      return absl::InternalError(absl::StrCat("rank ", r,
                                              ": combined_x differs from the "
                                              "reference with the masked experts dropped"));
    }
    return absl::OkStatus();
  }

  /// Round() on every rank of `ranks` at once; the statuses by rank.
  std::vector<absl::Status> Rounds(const std::vector<int>& ranks,
                                   const std::vector<uint8_t>& masked,
                                   std::vector<OpMask>* masks = nullptr) {
    std::vector<absl::Status> st(R);
    std::vector<OpMask> m(R);
    std::vector<std::thread> threads;
    for (int r : ranks) threads.emplace_back([&, r] { st[r] = Round(r, masked, nullptr, &m[r]); });
    for (auto& t : threads) t.join();
    if (masks) *masks = m;
    return st;
  }

  /// One GetDispatchLayout of rank r (an op that keeps a masked rank in step).
  absl::Status Layout(int r) {
    std::vector<int64_t> ks{in_[r].num_tokens, K};
    DLTensor idx = MakeDLTensor(in_[r].topk_idx.data(), kI64, ks);
    auto op = eps_[r]->GetDispatchLayout(idx);
    if (!op.ok()) return op.status();
    return op->Wait(absl::Seconds(5)).status();
  }

  std::unique_ptr<DataPlane> plane_;
  v1::GroupSpec spec_;
  std::unique_ptr<DataPlaneGroup> group_;
  std::vector<std::unique_ptr<Endpoint>> eps_;
  std::vector<LlRoundInputs> in_;
};

const std::vector<uint8_t> kNone(R, 0);
const std::vector<uint8_t> kRank3{0, 0, 0, 1};

TEST_F(RankMaskTest, FullGroupMatchesReferenceWithNoMask) {
  std::vector<OpMask> masks;
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(st.ok()) << st;
  for (const OpMask& m : masks) {
    EXPECT_EQ(m.epoch, 0u);
    EXPECT_EQ(m.num_masked, 0);
    EXPECT_EQ(m.dropped_pairs, 0);
  }
}

TEST_F(RankMaskTest, ExplicitMaskDropsExpertsThenCleanBringsTheRankBack) {
  auto mask = group_->UpdateRankMask(std::vector<int32_t>{3}, {}, false);
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->epoch(), 1u);
  EXPECT_THAT(mask->masked_ranks(), ::testing::ElementsAre(3));
  // Rank 3 keeps its place by calling the group's ops: each fails at once as masked.
  std::thread masked([&] {
    for (int i = 0; i < 2; ++i) {
      absl::Status st = Layout(3);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
      EXPECT_THAT(st.message(), HasSubstr("masked"));
    }
  });
  std::vector<OpMask> masks;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3, &masks)) EXPECT_TRUE(st.ok()) << st;
  masked.join();
  int dropped = 0;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(masks[r].epoch, 1u);
    EXPECT_EQ(masks[r].num_masked, 1);
    dropped += masks[r].dropped_pairs;
  }
  EXPECT_GT(dropped, 0) << "the inputs route some pairs to rank 3's experts";
  // Clean: from the next op on, every rank takes part again.
  auto clean = group_->UpdateRankMask({}, {}, true);
  ASSERT_TRUE(clean.ok()) << clean.status();
  EXPECT_EQ(clean->epoch(), 2u);
  EXPECT_TRUE(clean->masked_ranks().empty());
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(st.ok()) << st;
  for (const OpMask& m : masks) {
    EXPECT_EQ(m.epoch, 2u);
    EXPECT_EQ(m.num_masked, 0);
  }
}

TEST_F(RankMaskTest, LeavingRankIsMaskedAndARejoinIsInStepAtTheNextOp) {
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone)) ASSERT_TRUE(st.ok()) << st;
  eps_[3].reset();  // Leaves: DetachRank, as when its client's Session ends.
  auto mask = group_->GetRankMask();
  ASSERT_TRUE(mask.ok());
  EXPECT_EQ(mask->epoch(), 1u);
  EXPECT_THAT(mask->masked_ranks(), ::testing::ElementsAre(3));
  const auto start = std::chrono::steady_clock::now();
  std::vector<OpMask> masks;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3, &masks)) EXPECT_TRUE(st.ok()) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kOpTimeoutMs))
      << "the survivors did not wait for the departed rank";
  EXPECT_EQ(masks[0].num_masked, 1);
  // An unmask of the departed rank is refused: it comes back by rejoining.
  auto unmask = group_->UpdateRankMask({}, std::vector<int32_t>{3}, false);
  EXPECT_EQ(unmask.status().code(), absl::StatusCode::kFailedPrecondition) << unmask.status();
  // A new process joins rank 3's slot: it is unmasked and in step at once.
  ASSERT_NO_FATAL_FAILURE(Open(3));
  mask = group_->GetRankMask();
  ASSERT_TRUE(mask.ok());
  EXPECT_EQ(mask->epoch(), 2u);
  EXPECT_TRUE(mask->masked_ranks().empty());
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(masks[3].epoch, 2u);
  EXPECT_EQ(masks[3].num_masked, 0);
}

TEST_F(RankMaskTest, RankMissingOpTimeoutIsMaskedAndTheOpCompletesForTheOthers) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<OpMask> masks;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3, &masks)) EXPECT_TRUE(st.ok()) << st;
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(kOpTimeoutMs));
  EXPECT_LT(took, std::chrono::milliseconds(kOpTimeoutMs + 1000));
  EXPECT_EQ(masks[0].epoch, 1u);
  EXPECT_EQ(masks[0].num_masked, 1);
  // The late rank is alive: unmasked, it catches up (its ops that ran without it fail at
  // once) and then takes part.
  auto clean = group_->UpdateRankMask({}, {}, true);
  ASSERT_TRUE(clean.ok()) << clean.status();
  std::thread catch_up([&] {
    for (int i = 0; i < 2; ++i) {
      absl::Status st = Layout(3);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
      EXPECT_THAT(st.message(), HasSubstr("without rank 3"));
    }
  });
  catch_up.join();
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(masks[3].num_masked, 0);
}

TEST_F(RankMaskTest, UpdateRankMaskChecksRanks) {
  auto bad = group_->UpdateRankMask(std::vector<int32_t>{7}, {}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("rank 7 is outside [0, 4)"));
  bad = group_->UpdateRankMask({}, std::vector<int32_t>{-1}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("rank -1"));
  bad = group_->UpdateRankMask(std::vector<int32_t>{1}, std::vector<int32_t>{1}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto mask = group_->GetRankMask();
  ASSERT_TRUE(mask.ok());
  EXPECT_EQ(mask->epoch(), 0u) << "a refused update changes nothing";
}

TEST(RankMaskPolicyTest, FailGroupRefusesMasks) {
  auto plane = MakeHostDataPlane({});
  ASSERT_TRUE(plane.ok());
  auto g = (*plane)->CreateGroup(MaskSpec("failing", v1::RANK_FAILURE_POLICY_FAIL));
  ASSERT_TRUE(g.ok());
  auto m = (*g)->UpdateRankMask(std::vector<int32_t>{1}, {}, false);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(m.status().message(), HasSubstr("on_rank_failure"));
  EXPECT_EQ((*g)->GetRankMask().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RankMaskPolicyTest, SpecChecks) {
  v1::GroupSpec spec = MaskSpec("s");
  EXPECT_TRUE(ValidateGroupSpec(spec).ok());
  spec.set_on_rank_failure(static_cast<v1::RankFailurePolicy>(7));
  absl::Status st = ValidateGroupSpec(spec);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("spec.on_rank_failure: 7"));
  // Unspecified reads as FAIL; MASK differs from both.
  v1::GroupSpec fail = MaskSpec("s", v1::RANK_FAILURE_POLICY_FAIL);
  v1::GroupSpec unspecified = MaskSpec("s", v1::RANK_FAILURE_POLICY_UNSPECIFIED);
  EXPECT_TRUE(CheckSameSpec(fail, unspecified).ok());
  st = CheckSameSpec(fail, MaskSpec("s"));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("on_rank_failure"));
  // MASK runs on the host backend, one node; elsewhere Join refuses it, naming why.
  EXPECT_TRUE(CheckRankFailurePolicy(MaskSpec("s"), "host").ok());
  st = CheckRankFailurePolicy(MaskSpec("s"), "cuda");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("on_rank_failure"));
  v1::GroupSpec spanning = MaskSpec("s");
  spanning.add_nodes()->set_num_ranks(2);
  spanning.add_nodes()->set_num_ranks(2);
  st = CheckRankFailurePolicy(spanning, "host");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("spans nodes"));
  EXPECT_TRUE(CheckRankFailurePolicy(fail, "cuda").ok());
}

TEST(RankMaskPolicyTest, EpctlGroupsShowsThePolicy) {
  v1::ListGroupsResponse groups;
  *groups.add_groups()->mutable_spec() = MaskSpec("masking");
  *groups.add_groups()->mutable_spec() = MaskSpec("failing", v1::RANK_FAILURE_POLICY_FAIL);
  const std::string text = epctl::FormatGroups(groups);
  EXPECT_THAT(text, HasSubstr("ON_RANK_FAILURE"));
  EXPECT_THAT(text, ::testing::ContainsRegex("masking .* mask "));
  EXPECT_THAT(text, ::testing::ContainsRegex("failing .* fail "));
}

}  // namespace
}  // namespace epd
