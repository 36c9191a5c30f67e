// Rank masking on the host backend in-process (GroupSpec.on_rank_failure = MASK): endpoints
// opened by the real client code on a HostDataPlane group, one thread per rank. A rank
// masked by UpdateRankMask, by leaving, or by missing op_timeout: the others' ops complete
// without it, equal to kernels/host's results with its experts dropped, and report the mask;
// a process rejoining the masked slot is in step at the next op; FAIL groups refuse masks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/endpoint/endpoint_internal.h"
#include "client/epctl/format.h"
#include "daemon/control/group_registry.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/logging.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/op_rules.h"
#include "tests/common/dtypes.h"
#include "tests/common/mask_reference.h"
#include "tests/common/specs.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;
using ::epd::testing::LlRoundInputs;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int R = 4, E = 8, H = 128, K = 2, Mll = 8;
constexpr uint32_t kOpTimeoutMs = 500;

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

  /// Rank r's dispatch of its inputs: `Args` is LowLatencyDispatchArgs or DispatchArgs.
  template <typename Args>
  auto DispatchOf(int r) {
    LlRoundInputs& in = in_[r];
    std::vector<int64_t> xs{in.num_tokens, H}, ks{in.num_tokens, K};
    DLTensor x = MakeDLTensor(in.x.data(), kBf16, xs);
    DLTensor idx = MakeDLTensor(in.topk_idx.data(), kI64, ks);
    Args d;
    d.x = &x;
    d.topk_idx = &idx;
    auto op = [&] {
      if constexpr (std::is_same_v<Args, DispatchArgs>) {
        return eps_[r]->Dispatch(d);
      } else {
        return eps_[r]->LowLatencyDispatch(d);
      }
    }();
    using Result = std::decay_t<decltype(op->Wait())>;
    return op.ok() ? op->Wait(absl::Seconds(5)) : Result(op.status());
  }
  absl::StatusOr<LowLatencyDispatchResult> Dispatch(int r) {
    return DispatchOf<LowLatencyDispatchArgs>(r);
  }
  absl::StatusOr<DispatchResult> NormalDispatch(int r) { return DispatchOf<DispatchArgs>(r); }

  /// Whether rank r's combine result (`mask`, `combined_x`) is `ref`'s; the mask in `*out`.
  static absl::Status MatchesReference(int r, const OpMask& mask, const TensorView& combined_x,
                                       const absl::StatusOr<testing::LlRoundReference>& ref,
                                       OpMask* out) {
    if (out) *out = mask;
    if (!ref.ok()) return ref.status();
    if (mask.dropped_pairs != ref->dropped_pairs[r]) {
      return absl::InternalError(absl::StrCat("rank ", r, ": dropped_pairs ", mask.dropped_pairs,
                                              ", reference ", ref->dropped_pairs[r]));
    }
    const size_t bytes = ref->combined_x[r].size() * sizeof(kernels::bf16_bits);
    if (combined_x.nbytes() < static_cast<int64_t>(bytes) ||
        std::memcmp(combined_x.data(), ref->combined_x[r].data(), bytes) != 0) {
      return absl::InternalError(absl::StrCat("rank ", r,
                                              ": combined_x differs from the "
                                              "reference with the masked rank left out"));
    }
    return absl::OkStatus();
  }

  /// Rank r's low-latency combine of `dispatched` (identity experts: the received rows are
  /// its input as they are), compared with the reference of `masked`; its mask in `*mask`.
  absl::Status Combine(int r, const LowLatencyDispatchResult& dispatched,
                       const std::vector<uint8_t>& masked, OpMask* mask) {
    LlRoundInputs& in = in_[r];
    std::vector<int64_t> ks{in.num_tokens, K};
    DLTensor idx = MakeDLTensor(in.topk_idx.data(), kI64, ks);
    DLTensor w = MakeDLTensor(in.topk_weights.data(), kF32, ks);
    Endpoint& ep = *eps_[r];
    TensorView input = ep.LowLatencyCombineInput();
    std::memcpy(input.data(), dispatched.recv_x.data(), dispatched.recv_x.nbytes());
    LowLatencyCombineArgs c;
    c.x = &input.dl();
    c.topk_idx = &idx;
    c.topk_weights = &w;
    c.handle = &dispatched.handle;
    auto op = ep.LowLatencyCombine(c);
    if (!op.ok()) return op.status();
    auto res = op->Wait(absl::Seconds(5));
    if (!res.ok()) return res.status();
    return MatchesReference(
        r, res->mask, res->combined_x,
        testing::LowLatencyRoundReference(rules::ShapeOf(spec_), in_, masked, masked), mask);
  }

  /// One low-latency round of rank r (Dispatch, then Combine checked against `masked`).
  absl::Status Round(int r, const std::vector<uint8_t>& masked, OpMask* combine_mask = nullptr) {
    auto d = Dispatch(r);
    if (!d.ok()) return d.status();
    return Combine(r, *d, masked, combine_mask);
  }

  /// Rank r's normal combine of `dispatched` (identity experts), compared with the
  /// reference of `dispatch_masked` / `combine_masked`; its mask in `*mask`.
  absl::Status NormalCombine(int r, const DispatchResult& dispatched,
                             const std::vector<uint8_t>& dispatch_masked,
                             const std::vector<uint8_t>& combine_masked, OpMask* mask) {
    std::vector<kernels::bf16_bits> y(size_t(dispatched.num_recv_tokens) * H);
    std::memcpy(y.data(), dispatched.recv_x.data(), y.size() * sizeof(y[0]));
    std::vector<int64_t> ys{dispatched.num_recv_tokens, H};
    DLTensor yt = MakeDLTensor(y.data(), kBf16, ys);
    CombineArgs c;
    c.x = &yt;
    c.handle = &dispatched.handle;
    auto op = eps_[r]->Combine(c);
    if (!op.ok()) return op.status();
    auto res = op->Wait(absl::Seconds(5));
    if (!res.ok()) return res.status();
    return MatchesReference(
        r, res->mask, res->combined_x,
        testing::NormalRoundReference(rules::ShapeOf(spec_), in_, dispatch_masked, combine_masked),
        mask);
  }

  /// Round() on every rank of `ranks` at once; the statuses by rank.
  std::vector<absl::Status> Rounds(const std::vector<int>& ranks,
                                   const std::vector<uint8_t>& masked,
                                   std::vector<OpMask>* masks = nullptr) {
    std::vector<absl::Status> st(R);
    std::vector<OpMask> m(R);
    std::vector<std::thread> threads;
    for (int r : ranks) threads.emplace_back([&, r] { st[r] = Round(r, masked, &m[r]); });
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

TEST_F(RankMaskTest, RejoinBetweenDispatchAndCombineIsMaskedForThatOpOnly) {
  eps_[3].reset();
  std::vector<absl::StatusOr<LowLatencyDispatchResult>> dispatched(3, absl::UnknownError(""));
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) threads.emplace_back([&, r] { dispatched[r] = Dispatch(r); });
    for (auto& t : threads) t.join();
  }
  for (const auto& d : dispatched) ASSERT_TRUE(d.ok()) << d.status();
  // Rank 3 rejoins while the others are between their dispatch and their combine; its
  // first op, a dispatch, is not the group's (a combine): the combine runs without it.
  ::testing::internal::CaptureStderr();
  ASSERT_NO_FATAL_FAILURE(Open(3));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("group masked: rank 3 rejoined its masked slot and is unmasked (no op "
                        "was running)"));
  std::vector<absl::Status> st(3);
  std::vector<OpMask> masks(3);
  absl::StatusOr<LowLatencyDispatchResult> stray = absl::UnknownError("");
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] { st[r] = Combine(r, *dispatched[r], kRank3, &masks[r]); });
    }
    threads.emplace_back([&] { stray = Dispatch(3); });
    for (auto& t : threads) t.join();
  }
  for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(masks[0].num_masked, 1);
  EXPECT_EQ(stray.status().code(), absl::StatusCode::kFailedPrecondition) << stray.status();
  // Its error says it comes back by itself, not to unmask it.
  EXPECT_THAT(stray.status().message(),
              HasSubstr("runs without rank 3: the rank is masked for this op only"));
  EXPECT_THAT(stray.status().message(), HasSubstr("will be unmasked at the next op boundary"));
  EXPECT_THAT(stray.status().message(), Not(HasSubstr("unmask it")));
  // From the next op on it takes part.
  for (const absl::Status& s : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(masks[3].num_masked, 0);
  EXPECT_EQ(masks[0].num_masked, 0);
}

// A rank unmasked while it lags behind the group: the ops that ran without it fail for it
// naming it unmasked now, not masked.
TEST_F(RankMaskTest, AnUnmaskedLaggingRankIsNotNamedMasked) {
  ASSERT_TRUE(group_->UpdateRankMask(std::vector<int32_t>{3}, {}, false).ok());
  for (int op = 0; op < 2; ++op) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) threads.emplace_back([&, r] { EXPECT_TRUE(Layout(r).ok()); });
    for (auto& t : threads) t.join();
  }
  // Two ops behind: the unmask applies once it has caught up, so the answer still names it.
  auto unmask = group_->UpdateRankMask({}, std::vector<int32_t>{3}, false);
  ASSERT_TRUE(unmask.ok()) << unmask.status();
  EXPECT_THAT(unmask->masked_ranks(), ::testing::ElementsAre(3));
  for (int op = 1; op <= 2; ++op) {
    absl::Status st = Layout(3);  // Its ops 1 and 2, which ran without it.
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(st.message(), HasSubstr(absl::StrCat("op ", op,
                                                     " of group masked ran without "
                                                     "rank 3, which was masked")));
    // It says how far behind the request is.
    EXPECT_THAT(st.message(),
                HasSubstr(absl::StrCat("the group is at op 3, ", 3 - op, " op(s) ahead")));
  }
  // Caught up: unmasked, never named masked again; its next op takes part.
  auto now = group_->GetRankMask();
  ASSERT_TRUE(now.ok());
  EXPECT_TRUE(now->masked_ranks().empty());
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) threads.emplace_back([&, r] { EXPECT_TRUE(Layout(r).ok()); });
  for (auto& t : threads) t.join();
}

TEST_F(RankMaskTest, NormalModeUnderAMaskAndADeathBetweenDispatchAndCombine) {
  // Rank 3 masked for both ops: dispatch and combine equal the reference without it.
  ASSERT_TRUE(group_->UpdateRankMask(std::vector<int32_t>{3}, {}, false).ok());
  std::vector<absl::Status> st(3);
  std::vector<OpMask> masks(3);
  auto survivors = [&](const std::function<absl::Status(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) threads.emplace_back([&, r] { st[r] = fn(r); });
    for (auto& t : threads) t.join();
    for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
  };
  std::thread in_step([&] {  // Rank 3 keeps its place: its two ops fail as masked.
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(Layout(3).code(), absl::StatusCode::kFailedPrecondition);
    }
  });
  survivors([&](int r) {
    auto d = NormalDispatch(r);
    if (!d.ok()) return d.status();
    if (d->mask.num_masked != 1) return absl::InternalError("dispatch: num_masked != 1");
    return NormalCombine(r, *d, kRank3, kRank3, &masks[r]);
  });
  in_step.join();
  EXPECT_EQ(masks[0].dropped_pairs, 0) << "the dispatch routed nothing to rank 3";
  // Every rank dispatches, then rank 3 leaves before the combine: the others' combine leaves
  // its rows out (zeros from it) and reports the routes dropped.
  ASSERT_TRUE(group_->UpdateRankMask({}, {}, true).ok());
  std::vector<absl::StatusOr<DispatchResult>> d(R, absl::UnknownError(""));
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) threads.emplace_back([&, r] { d[r] = NormalDispatch(r); });
    for (auto& t : threads) t.join();
  }
  for (const auto& x : d) ASSERT_TRUE(x.ok()) << x.status();
  eps_[3].reset();
  survivors([&](int r) { return NormalCombine(r, *d[r], kNone, kRank3, &masks[r]); });
  int dropped = 0;
  for (int r = 0; r < 3; ++r) dropped += masks[r].dropped_pairs;
  EXPECT_GT(dropped, 0) << "the inputs route some tokens to rank 3";
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

TEST_F(RankMaskTest, EveryRankMaskedRefusesOpsAtOnceAndAnUnmaskBringsTheGroupBack) {
  auto all = group_->UpdateRankMask(std::vector<int32_t>{0, 1, 2, 3}, {}, false);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->masked_ranks_size(), R);
  // No op runs while every rank is masked: each one submitted fails at once, naming it.
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status st = Layout(0);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(st.message(), HasSubstr("every rank of group masked is masked"));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kOpTimeoutMs))
        << "op " << i;
  }
  for (int r = 1; r < R; ++r) {
    absl::Status st = Layout(r);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  }
  // Rank 0 unmasks itself: no op is in progress, so the unmask applies at once.
  auto self = group_->UpdateRankMask({}, std::vector<int32_t>{0}, false);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_THAT(self->masked_ranks(), ::testing::ElementsAre(1, 2, 3));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(Layout(0).ok());
  OpMask mask;
  absl::Status round = Round(0, {0, 1, 1, 1}, &mask);
  EXPECT_TRUE(round.ok()) << round;
  EXPECT_EQ(mask.num_masked, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kOpTimeoutMs));
}

TEST_F(RankMaskTest, EveryRankMaskedThenCleanedRunsTheNextOpWithEveryRank) {
  ASSERT_TRUE(group_->UpdateRankMask(std::vector<int32_t>{0, 1, 2, 3}, {}, false).ok());
  std::vector<absl::Status> st(R);
  auto all = [&] {
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) threads.emplace_back([&, r] { st[r] = Layout(r); });
    for (auto& t : threads) t.join();
  };
  all();
  for (const absl::Status& s : st) EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  auto clean = group_->UpdateRankMask({}, {}, true);
  ASSERT_TRUE(clean.ok()) << clean.status();
  EXPECT_TRUE(clean->masked_ranks().empty()) << clean->ShortDebugString();
  all();
  for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
}

TEST_F(RankMaskTest, LastRankMaskingItselfAfterTheOthersDiedCanUnmaskItself) {
  for (int r = 1; r < R; ++r) eps_[r].reset();  // Their processes died: masked.
  ASSERT_TRUE(group_->UpdateRankMask(std::vector<int32_t>{0}, {}, false).ok());
  absl::Status refused = Layout(0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  auto self = group_->UpdateRankMask({}, std::vector<int32_t>{0}, false);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_THAT(self->masked_ranks(), ::testing::ElementsAre(1, 2, 3));
  const auto start = std::chrono::steady_clock::now();
  absl::Status st = Layout(0);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kOpTimeoutMs));
}

TEST_F(RankMaskTest, FarBehindRankUnmaskingItselfIsUnmaskedOnceCaughtUp) {
  // Rank 3 misses op_timeout: masked; the others run two rounds (4 ops) without it.
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3)) ASSERT_TRUE(st.ok()) << st;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3)) ASSERT_TRUE(st.ok()) << st;
  // Rank 3, 4 ops behind, unmasks itself: it stays masked until it has caught up.
  auto self = group_->UpdateRankMask({}, std::vector<int32_t>{3}, false);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_THAT(self->masked_ranks(), ::testing::ElementsAre(3));
  const auto start = std::chrono::steady_clock::now();
  std::vector<OpMask> masks;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3, &masks)) EXPECT_TRUE(st.ok()) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kOpTimeoutMs))
      << "the survivors waited for the rank still behind";
  EXPECT_EQ(masks[0].num_masked, 1);
  // It catches up: the ops that ran without it fail at once; then it takes part.
  for (int i = 0; i < 6; ++i) {
    absl::Status st = Layout(3);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(st.message(), HasSubstr("without rank 3"));
  }
  auto mask = group_->GetRankMask();
  ASSERT_TRUE(mask.ok());
  EXPECT_TRUE(mask->masked_ranks().empty()) << "caught up: unmasked";
  for (const absl::Status& st : Rounds({0, 1, 2, 3}, kNone, &masks)) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(masks[3].num_masked, 0);
}

TEST_F(RankMaskTest, BehindRankAsSlowAsTheOthersIsWaitedForOnceItSubmits) {
  // Rank 3 misses op_timeout: masked; the others run two rounds (4 ops) without it.
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3)) ASSERT_TRUE(st.ok()) << st;
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3)) ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(group_->UpdateRankMask({}, std::vector<int32_t>{3}, false).ok());
  // The others take 20 ms per step, rank 3 30 ms, a refused step too: were the others not
  // to wait for it, rank 3 would fall further behind for as long as they run.
  std::atomic<bool> back{false};
  const auto start = std::chrono::steady_clock::now();
  const auto give_up = start + std::chrono::seconds(4);
  std::vector<std::thread> ranks;
  std::vector<int> failed(R, 0);
  for (int r = 0; r < R; ++r) {
    ranks.emplace_back([&, r] {
      while (std::chrono::steady_clock::now() < give_up && !(r != 3 && back)) {
        absl::Status st = Layout(r);
        if (r == 3 && st.ok()) {
          back = true;
          return;
        }
        if (!st.ok() && r != 3) ++failed[r];
        std::this_thread::sleep_for(std::chrono::milliseconds(r == 3 ? 30 : 20));
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_TRUE(back) << "rank 3 never took part again";
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            std::chrono::milliseconds(kOpTimeoutMs + 1000));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(failed[r], 0) << "rank " << r;
}

TEST_F(RankMaskTest, RankCatchingUpWhileAnOpIsCollectedIsUnmaskedAtTheBoundaryAfterIt) {
  // Rank 3 misses op_timeout: masked; the others run a round (2 ops) without it.
  for (const absl::Status& st : Rounds({0, 1, 2}, kRank3)) ASSERT_TRUE(st.ok()) << st;
  auto self = group_->UpdateRankMask({}, std::vector<int32_t>{3}, false);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_THAT(self->masked_ranks(), ::testing::ElementsAre(3)) << "behind: still masked";
  // Ranks 0 and 1 arrive at the next op: it is being collected.
  absl::Status first[2];
  std::thread t0([&] { first[0] = Layout(0); });
  std::thread t1([&] { first[1] = Layout(1); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Rank 3 catches up now: its two stale ops fail at once; its request for the op being
  // collected is refused as masked (the mask never changes while ranks are collected).
  for (int i = 0; i < 2; ++i) {
    absl::Status st = Layout(3);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_THAT(st.message(), HasSubstr("without rank 3"));
  }
  absl::Status collected = Layout(3);
  EXPECT_EQ(collected.code(), absl::StatusCode::kFailedPrecondition) << collected;
  EXPECT_THAT(collected.message(), HasSubstr("the rank is masked"));
  EXPECT_TRUE(Layout(2).ok());
  t0.join();
  t1.join();
  EXPECT_TRUE(first[0].ok()) << first[0];
  EXPECT_TRUE(first[1].ok()) << first[1];
  // Unmasked at the boundary after that op: in step from the next one.
  auto mask = group_->GetRankMask();
  ASSERT_TRUE(mask.ok());
  EXPECT_TRUE(mask->masked_ranks().empty());
  std::vector<OpMask> masks;
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
  EXPECT_THAT(bad.status().message(), HasSubstr("unmask: rank 1 is also in mask"));
  // A list longer than num_ranks is refused by its length, before any rank is looked at.
  bad = group_->UpdateRankMask(std::vector<int32_t>{0, 1, 2, 3, 0}, {}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("mask: 5 ranks listed, more than the 4 ranks"));
  bad = group_->UpdateRankMask({}, std::vector<int32_t>(1'000'000, 1), false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("unmask: 1000000 ranks listed"));
  // Each rank once in both lists together.
  bad = group_->UpdateRankMask(std::vector<int32_t>{2, 2}, {}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("mask: rank 2 is listed twice"));
  bad = group_->UpdateRankMask({}, std::vector<int32_t>{1, 1}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("unmask: rank 1 is listed twice"));
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

// An unspecified policy is FAIL, and the refusal says so rather than naming only UNSPECIFIED.
TEST(RankMaskPolicyTest, UnspecifiedPolicyIsNamedAsFail) {
  auto plane = MakeHostDataPlane({});
  ASSERT_TRUE(plane.ok());
  auto g = (*plane)->CreateGroup(MaskSpec("plain", v1::RANK_FAILURE_POLICY_UNSPECIFIED));
  ASSERT_TRUE(g.ok());
  auto m = (*g)->UpdateRankMask(std::vector<int32_t>{1}, {}, false);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(m.status().message(),
              HasSubstr("RANK_FAILURE_POLICY_UNSPECIFIED (= RANK_FAILURE_POLICY_FAIL)"));
  EXPECT_THAT((*g)->GetRankMask().status().message(), HasSubstr("(= RANK_FAILURE_POLICY_FAIL)"));
}

TEST(RankMaskPolicyTest, AMaskChangeOfManyRanksIsOneLogLineNamingFour) {
  auto plane = MakeHostDataPlane({});
  ASSERT_TRUE(plane.ok());
  constexpr int kWide = 64;
  v1::GroupSpec spec = testing::MakeSpec("wide", {.num_ranks = kWide,
                                                  .num_experts = kWide,
                                                  .hidden = H,
                                                  .num_topk = K,
                                                  .max_tokens_per_rank = Mll,
                                                  .ll_max_tokens_per_rank = Mll});
  spec.set_on_rank_failure(v1::RANK_FAILURE_POLICY_MASK);
  auto g = (*plane)->CreateGroup(spec);
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<int32_t> all(kWide);
  for (int32_t r = 0; r < kWide; ++r) all[r] = r;
  ::testing::internal::CaptureStderr();
  auto m = (*g)->UpdateRankMask(all, {}, false);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->masked_ranks_size(), kWide);
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StrContains(line, "masked (mask epoch")) lines.emplace_back(line);
  }
  ASSERT_EQ(lines.size(), 1u) << log;
  EXPECT_THAT(lines[0], HasSubstr("group wide: ranks 0, 1, 2, 3 and 60 more masked (mask epoch 1, "
                                  "64 of 64 ranks masked)"));
  EXPECT_EQ(BoundedRankList(std::vector<int32_t>{5}, 4), "5");
  EXPECT_EQ(BoundedRankList(std::vector<int32_t>{1, 2, 3, 4}, 4), "1, 2, 3, 4");
  EXPECT_EQ(BoundedRankList(std::vector<int32_t>{1, 2, 3, 4, 5}, 4, ","), "1,2,3,4 and 1 more");
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
  // MASK runs on the host backend, and on the CUDA backend daemon-launched on one node;
  // elsewhere Join refuses it, naming the fields and why.
  EXPECT_TRUE(CheckRankFailurePolicy(MaskSpec("s"), "host").ok());
  EXPECT_TRUE(CheckRankFailurePolicy(MaskSpec("s"), "cuda", v1::LAUNCH_MODE_DAEMON).ok());
  st = CheckRankFailurePolicy(MaskSpec("s"), "cuda", v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("spec.on_rank_failure"));
  EXPECT_THAT(st.message(), HasSubstr("launch_mode LAUNCH_MODE_CLIENT"));
  EXPECT_TRUE(CheckRankFailurePolicy(fail, "cuda", v1::LAUNCH_MODE_CLIENT).ok());
  v1::GroupSpec spanning = MaskSpec("s");
  spanning.add_nodes()->set_num_ranks(2);
  spanning.add_nodes()->set_num_ranks(2);
  // Across nodes MASK runs on the host backend (the nodes agree on each op's mask through
  // the exchange); the CUDA backend's spanning path refuses it, naming why.
  EXPECT_TRUE(CheckRankFailurePolicy(spanning, "host").ok());
  st = CheckRankFailurePolicy(spanning, "cuda", v1::LAUNCH_MODE_DAEMON);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("spec.on_rank_failure"));
  EXPECT_THAT(st.message(), HasSubstr("across nodes"));
  EXPECT_TRUE(CheckRankFailurePolicy(fail, "cuda").ok());
}

/// Join and the mask RPCs through the registry (a fake data plane of `backend`).
class RankMaskRegistryTest : public ::testing::Test {
 protected:
  void Start(const std::string& backend) {
    state_ = std::make_shared<testing::FakeDataPlaneState>();
    state_->backend = backend;
    plane_ = std::make_unique<testing::FakeDataPlane>(state_);
    registry_ =
        std::make_unique<GroupRegistry>(plane_.get(), testing::OneGpu(), GroupRegistry::Options{});
  }
  std::string Session(int64_t pid) {
    return registry_->OpenSession(PeerCredentials{.pid = pid, .uid = 1000, .gid = 1000}, "t")
        .value_or("");
  }
  absl::StatusOr<v1::EndpointInfo> Join(const std::string& session, int32_t rank,
                                        const v1::GroupSpec& spec, const std::string& gpu = "") {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_gpu_uuid(gpu);
    return registry_->Join(request);
  }
  absl::Status Update(const std::string& session, int32_t rank, std::vector<int32_t> mask) {
    v1::UpdateRankMaskRequest request;
    request.set_group("reg");
    request.set_rank(rank);
    request.set_session_id(session);
    for (int32_t m : mask) request.add_mask(m);
    return registry_->UpdateRankMask(request).status();
  }
  std::shared_ptr<testing::FakeDataPlaneState> state_;
  std::unique_ptr<testing::FakeDataPlane> plane_;
  std::unique_ptr<GroupRegistry> registry_;
};

TEST_F(RankMaskRegistryTest, JoinTakesMaskOnTheCudaBackendDaemonLaunchedOnly) {
  Start("cuda");
  // Client-launched, asked for by name or as the data plane's default: refused, naming both
  // fields.
  auto join_client = [&](const std::string& session, int rank, const v1::GroupSpec& spec,
                         v1::LaunchMode mode) {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(rank);
    request.set_session_id(session);
    request.set_gpu_uuid(testing::kGpuA);
    request.set_launch_mode(mode);
    return registry_->Join(request);
  };
  absl::StatusOr<v1::EndpointInfo> e =
      join_client(Session(1), 0, MaskSpec("reg"), v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("spec.on_rank_failure"));
  EXPECT_THAT(e.status().message(), HasSubstr("launch_mode"));
  state_->default_launch_mode = v1::LAUNCH_MODE_CLIENT;
  e = join_client(Session(1), 0, MaskSpec("reg"), v1::LAUNCH_MODE_UNSPECIFIED);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("LAUNCH_MODE_CLIENT"));
  // Daemon-launched: taken; a FAIL group may still be client-launched.
  e = join_client(Session(2), 0, MaskSpec("reg"), v1::LAUNCH_MODE_DAEMON);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->launch_mode(), v1::LAUNCH_MODE_DAEMON);
  e = join_client(Session(3), 1, MaskSpec("reg"), v1::LAUNCH_MODE_UNSPECIFIED);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->launch_mode(), v1::LAUNCH_MODE_DAEMON);
  EXPECT_TRUE(join_client(Session(4), 0, MaskSpec("other", v1::RANK_FAILURE_POLICY_FAIL),
                          v1::LAUNCH_MODE_CLIENT)
                  .ok());
}

TEST_F(RankMaskRegistryTest, JoinComparesThePolicyAndTheRpcsCheckTheCaller) {
  Start("host");
  const std::string a = Session(1), b = Session(2);
  ASSERT_TRUE(Join(a, 0, MaskSpec("reg")).ok());
  absl::StatusOr<v1::EndpointInfo> e = Join(b, 1, MaskSpec("reg", v1::RANK_FAILURE_POLICY_FAIL));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("on_rank_failure"));
  ASSERT_TRUE(Join(b, 1, MaskSpec("reg")).ok());
  // b does not hold rank 0; nobody holds rank 2.
  EXPECT_EQ(Update(b, 0, {1}).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Update(b, 2, {1}).code(), absl::StatusCode::kFailedPrecondition);
  v1::GetRankMaskRequest get;
  get.set_group("reg");
  get.set_rank(0);
  get.set_session_id(b);
  EXPECT_EQ(registry_->GetRankMask(get).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(RankMaskPolicyTest, EpctlGroupsShowsThePolicy) {
  v1::ListGroupsResponse groups;
  *groups.add_groups()->mutable_spec() = MaskSpec("masking");
  *groups.add_groups()->mutable_spec() = MaskSpec("failing", v1::RANK_FAILURE_POLICY_FAIL);
  const std::string text = epctl::FormatGroups(groups);
  EXPECT_THAT(text, HasSubstr("ON_RANK_FAILURE"));
  EXPECT_THAT(text, ::testing::ContainsRegex("masking .* mask "));
  EXPECT_THAT(text, ::testing::ContainsRegex("failing .* fail +- "));
  EXPECT_THAT(text, HasSubstr("MASKED"));
  // The masked ranks and the epoch, at most 8 named.
  v1::RankMask* m = groups.mutable_groups(0)->mutable_rank_mask();
  m->set_epoch(4);
  for (int32_t r : {1, 3}) m->add_masked_ranks(r);
  EXPECT_THAT(epctl::FormatGroups(groups),
              ::testing::ContainsRegex("masking .* mask +1,3 \\(epoch 4\\)"));
  for (int32_t r = 4; r < 14; ++r) m->add_masked_ranks(r);
  EXPECT_THAT(epctl::FormatGroups(groups), HasSubstr("1,3,4,5,6,7,8,9,+4 (epoch 4)"));
  m->clear_masked_ranks();
  EXPECT_THAT(epctl::FormatGroups(groups), HasSubstr("none (epoch 4)"));
}

}  // namespace
}  // namespace epd
