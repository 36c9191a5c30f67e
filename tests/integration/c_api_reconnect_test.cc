// The C ABI's reconnect and rank-mask calls against a real `epd --backend=host`.
// Reconnect: one client holding both ranks of a group runs exact low-latency rounds, epd is
// killed and restarted on its socket, epd_client_reconnect re-binds both epd_endpoint_t
// handles in place (new Session, new buffers), an op held from before fails with
// UNAVAILABLE, and the next rounds are exact again. Rank masks: the calls' arguments and
// out-structs are checked as every C call's are, and a MASK group's mask goes through
// update / query / clean.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "epd/epd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 2, kExperts = 4, kHidden = 128, kTopk = 2, kTokens = 6, kMll = 8;

#define EXPECT_C_OK(call) EXPECT_EQ((call), EPD_OK) << #call << ": " << epd_last_error()
#define ASSERT_C_OK(call) ASSERT_EQ((call), EPD_OK) << #call << ": " << epd_last_error()

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// One rank's low-latency round: x (multiples of 1/4), two distinct experts per token (the
/// second -1 for every third token), weights 1/2 and 1/4; identity experts then combine
/// back to (Σ of the valid tokens' weights) * x, exactly.
struct Round {
  std::vector<uint16_t> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<int64_t> xs{kTokens, kHidden}, ks{kTokens, kTopk};
  DLTensor x_t{}, idx_t{}, w_t{};
  Round(int rank, int round) : x(kTokens * kHidden), idx(kTokens * kTopk), w(kTokens * kTopk) {
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHidden; ++h) {
        x[t * kHidden + h] = Bf16(float((rank * 5 + t * 3 + h + round) % 13 - 6) / 4.f);
      }
      const int64_t e0 = (rank + t + round) % kExperts;
      idx[t * kTopk] = e0;
      idx[t * kTopk + 1] = t % 3 == 2 ? -1 : (e0 + 1) % kExperts;
      w[t * kTopk] = 0.5f;
      w[t * kTopk + 1] = 0.25f;
    }
    x_t = Tensor(x.data(), kBf16, xs);
    idx_t = Tensor(idx.data(), kI64, ks);
    w_t = Tensor(w.data(), kF32, ks);
  }
  static DLTensor Tensor(void* data, DLDataType dtype, std::vector<int64_t>& shape) {
    DLTensor t{};
    t.data = data;
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
    return t;
  }
  /// combined_x [T, H] as expected, or the first difference.
  std::string Check(const DLTensor& combined) const {
    if (combined.ndim != 2 || combined.shape[0] != kTokens || combined.shape[1] != kHidden) {
      return "combined_x has the wrong shape";
    }
    const auto* y = static_cast<const uint16_t*>(combined.data);
    for (int t = 0; t < kTokens; ++t) {
      const float weight = idx[t * kTopk + 1] >= 0 ? 0.75f : 0.5f;
      for (int h = 0; h < kHidden; ++h) {
        const float want = weight * FromBf16(x[t * kHidden + h]);
        if (FromBf16(y[t * kHidden + h]) != want) {
          return "combined_x[" + std::to_string(t) + ", " + std::to_string(h) +
                 "] = " + std::to_string(FromBf16(y[t * kHidden + h])) + ", want " +
                 std::to_string(want);
        }
      }
    }
    return "";
  }
};

/// Rank `rank`'s low-latency dispatch and identity combine of round `round` ("" when exact).
std::string RunRound(epd_endpoint_t* ep, int rank, int round) {
  Round in(rank, round);
  epd_op_t* op = nullptr;
  if (epd_op_create(&op) != EPD_OK) return "epd_op_create failed";
  std::string verdict;
  epd_ll_dispatch_args_t d{};
  d.struct_size = sizeof(d);
  d.x = &in.x_t;
  d.topk_idx = &in.idx_t;
  epd_ll_dispatch_result_t dr{};
  dr.struct_size = sizeof(dr);
  epd_ll_combine_result_t cr{};
  cr.struct_size = sizeof(cr);
  if (epd_low_latency_dispatch(ep, &d, op) != EPD_OK || epd_op_wait(op, 20000) != EPD_OK ||
      epd_op_ll_dispatch_result(op, &dr) != EPD_OK) {
    verdict = std::string("dispatch: ") + epd_last_error();
  } else if (dr.mask.epoch != 0 || dr.mask.num_masked != 0 || dr.mask.dropped_pairs != 0) {
    verdict = "dispatch: a mask in a group that never masked a rank";
  } else {
    // Identity experts: the received rows go back as they are (a copy: the combine reads
    // its input while the next dispatch may write recv_x).
    int64_t n = 1;
    for (int i = 0; i < dr.recv_x.ndim; ++i) n *= dr.recv_x.shape[i];
    std::vector<uint16_t> y(static_cast<const uint16_t*>(dr.recv_x.data),
                            static_cast<const uint16_t*>(dr.recv_x.data) + n);
    std::vector<int64_t> ys(dr.recv_x.shape, dr.recv_x.shape + dr.recv_x.ndim);
    DLTensor y_t = Round::Tensor(y.data(), kBf16, ys);
    epd_ll_combine_args_t c{};
    c.struct_size = sizeof(c);
    c.x = &y_t;
    c.topk_idx = &in.idx_t;
    c.topk_weights = &in.w_t;
    c.handle = &dr.handle;
    if (epd_low_latency_combine(ep, &c, op) != EPD_OK || epd_op_wait(op, 20000) != EPD_OK ||
        epd_op_ll_combine_result(op, &cr) != EPD_OK) {
      verdict = std::string("combine: ") + epd_last_error();
    } else {
      verdict = in.Check(cr.combined_x);
    }
  }
  epd_op_destroy(op);
  return verdict;
}

class CApiReconnectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(UnixSocketOnly());
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    epd_client_options_t co{};
    co.struct_size = sizeof(co);
    co.socket_path = epd_->socket_path().c_str();
    co.client_name = "c_api_reconnect_test";
    ASSERT_C_OK(epd_client_connect(&co, &client_));
  }
  void TearDown() override {
    for (epd_endpoint_t* ep : endpoints_) epd_endpoint_destroy(ep);
    epd_client_destroy(client_);
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  static epd_join_options_t Join(const char* name, int rank, int32_t on_rank_failure = 0) {
    epd_join_options_t j{};
    j.struct_size = sizeof(j);
    j.name = name;
    j.num_ranks = kRanks;
    j.num_experts = kExperts;
    j.hidden = kHidden;
    j.num_topk = kTopk;
    j.max_tokens_per_rank = kTokens;
    j.ll_max_tokens_per_rank = kMll;
    j.rank = rank;
    j.on_rank_failure = on_rank_failure;
    return j;
  }

  /// Joins both ranks of `name` through this test's client.
  void JoinBoth(const char* name, int32_t on_rank_failure = 0) {
    for (int r = 0; r < kRanks; ++r) {
      epd_join_options_t j = Join(name, r, on_rank_failure);
      epd_endpoint_t* ep = nullptr;
      ASSERT_C_OK(epd_client_join(client_, &j, &ep));
      endpoints_.push_back(ep);
    }
  }

  /// A round on both ranks (threads); each rank's verdict.
  std::vector<std::string> BothRanks(int round) {
    std::vector<std::string> verdicts(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { verdicts[r] = RunRound(endpoints_[r], r, round); });
    }
    for (auto& t : threads) t.join();
    return verdicts;
  }

  std::unique_ptr<DaemonProcess> epd_;
  epd_client_t* client_ = nullptr;
  std::vector<epd_endpoint_t*> endpoints_;
};

TEST_F(CApiReconnectTest, ReconnectRebindsEveryEndpointInPlace) {
  JoinBoth("crc");
  EXPECT_THAT(BothRanks(1), ::testing::Each(""));
  const std::string session_before = epd_client_session_id(client_);
  DLTensor region_before{};
  ASSERT_C_OK(epd_low_latency_combine_input(endpoints_[0], &region_before));

  // Rank 0 alone submits: its op is in flight when epd dies.
  Round stale_in(0, 99);
  epd_ll_dispatch_args_t d{};
  d.struct_size = sizeof(d);
  d.x = &stale_in.x_t;
  d.topk_idx = &stale_in.idx_t;
  epd_op_t* stale = nullptr;
  ASSERT_C_OK(epd_op_create(&stale));
  ASSERT_C_OK(epd_low_latency_dispatch(endpoints_[0], &d, stale));

  epd_->Kill();
  ASSERT_TRUE(epd_->WaitExit(absl::Seconds(10)).ok());
  EXPECT_EQ(epd_op_wait(stale, 5000), EPD_UNAVAILABLE) << epd_last_error();
  // Nothing answers yet: a short reconnect fails with UNAVAILABLE naming the socket.
  EXPECT_EQ(epd_client_reconnect(client_, 200), EPD_UNAVAILABLE);
  EXPECT_THAT(epd_last_error(), HasSubstr(epd_->socket_path()));
  ASSERT_TRUE(epd_->Restart().ok()) << epd_->Logs();
  ASSERT_C_OK(epd_client_reconnect(client_, 20000));

  EXPECT_NE(std::string(epd_client_session_id(client_)), session_before);
  EXPECT_EQ(epd_op_wait(stale, 5000), EPD_UNAVAILABLE);
  EXPECT_THAT(epd_last_error(), HasSubstr("Reconnect"));
  epd_op_destroy(stale);
  // The region views are the new endpoint's (the old buffers stay mapped elsewhere).
  DLTensor region_after{};
  ASSERT_C_OK(epd_low_latency_combine_input(endpoints_[0], &region_after));
  EXPECT_NE(region_after.data, region_before.data);
  EXPECT_EQ(region_after.ndim, 3);

  EXPECT_THAT(BothRanks(2), ::testing::Each(""));
  EXPECT_THAT(BothRanks(3), ::testing::Each(""));
  // With the Session open there is nothing to do.
  EXPECT_C_OK(epd_client_reconnect(client_, 1000));
  EXPECT_THAT(BothRanks(4), ::testing::Each(""));
  EXPECT_EQ(epd_client_reconnect(nullptr, 1000), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("client is NULL"));
}

TEST_F(CApiReconnectTest, ALeftEndpointIsNotRejoined) {
  JoinBoth("crl");
  ASSERT_C_OK(epd_endpoint_leave(endpoints_[1]));
  epd_->Kill();
  ASSERT_TRUE(epd_->WaitExit(absl::Seconds(10)).ok());
  ASSERT_TRUE(epd_->Restart().ok()) << epd_->Logs();
  ASSERT_C_OK(epd_client_reconnect(client_, 20000));
  // Rank 1 is free again: another joiner takes it.
  epd_join_options_t j = Join("crl", 1);
  epd_endpoint_t* ep = nullptr;
  ASSERT_C_OK(epd_client_join(client_, &j, &ep));
  epd_endpoint_destroy(endpoints_[1]);
  endpoints_[1] = ep;
  EXPECT_THAT(BothRanks(1), ::testing::Each(""));
}

TEST_F(CApiReconnectTest, RankMaskCallsCheckTheirArguments) {
  JoinBoth("cma");
  epd_rank_mask_t out{};
  out.struct_size = sizeof(out);
  const int32_t one = 1;
  EXPECT_EQ(epd_endpoint_query_rank_mask(nullptr, &out), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("endpoint is NULL"));
  EXPECT_EQ(epd_endpoint_query_rank_mask(endpoints_[0], nullptr), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("out is NULL"));
  epd_rank_mask_t small{};
  small.struct_size = 4;
  EXPECT_EQ(epd_endpoint_query_rank_mask(endpoints_[0], &small), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_rank_mask_t.struct_size=4"));
  EXPECT_EQ(epd_endpoint_update_rank_mask(endpoints_[0], nullptr, 1, nullptr, 0, &out),
            EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("mask is NULL"));
  EXPECT_EQ(epd_endpoint_update_rank_mask(endpoints_[0], &one, 1, nullptr, size_t{1} << 40, &out),
            EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("num_unmask=1099511627776"));
  EXPECT_EQ(epd_endpoint_clean_rank_mask(nullptr, nullptr), EPD_INVALID_ARGUMENT);
  // A policy that is not an epd_rank_failure_t.
  epd_join_options_t j = Join("cmb", 0, 7);
  epd_endpoint_t* ep = nullptr;
  EXPECT_EQ(epd_client_join(client_, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("options.on_rank_failure=7"));
  EXPECT_EQ(ep, nullptr);
}

TEST_F(CApiReconnectTest, RankMaskUpdateQueryClean) {
  JoinBoth("cmm", EPD_RANK_FAILURE_MASK);
  int32_t ranks[4] = {-1, -1, -1, -1};
  epd_rank_mask_t out{};
  out.struct_size = sizeof(out);
  out.masked_ranks = ranks;
  out.masked_ranks_capacity = 4;
  ASSERT_C_OK(epd_endpoint_query_rank_mask(endpoints_[0], &out));
  EXPECT_EQ(out.num_masked, 0);
  const uint32_t epoch0 = out.epoch;

  const int32_t one = 1;
  ASSERT_C_OK(epd_endpoint_update_rank_mask(endpoints_[0], &one, 1, nullptr, 0, &out));
  EXPECT_EQ(out.num_masked, 1);
  EXPECT_EQ(ranks[0], 1);
  EXPECT_GT(out.epoch, epoch0);
  EXPECT_EQ(out.masked_ranks, ranks);  // The caller's array and capacity are kept.
  EXPECT_EQ(out.masked_ranks_capacity, 4);
  // Seen from the other rank too; too small an array says how many are needed.
  epd_rank_mask_t none{};
  none.struct_size = sizeof(none);
  EXPECT_EQ(epd_endpoint_query_rank_mask(endpoints_[1], &none), EPD_OUT_OF_RANGE);
  EXPECT_EQ(none.num_masked, 1);
  EXPECT_EQ(none.epoch, out.epoch);
  EXPECT_THAT(epd_last_error(), HasSubstr("masked_ranks_capacity=0"));
  // Out of range ranks are named.
  const int32_t bad = kRanks;
  EXPECT_EQ(epd_endpoint_update_rank_mask(endpoints_[0], &bad, 1, nullptr, 0, nullptr),
            EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("2"));

  ASSERT_C_OK(epd_endpoint_clean_rank_mask(endpoints_[1], &out));
  EXPECT_EQ(out.num_masked, 0);
  ASSERT_C_OK(epd_endpoint_update_rank_mask(endpoints_[0], &one, 1, nullptr, 0, nullptr));
  ASSERT_C_OK(epd_endpoint_update_rank_mask(endpoints_[0], nullptr, 0, &one, 1, &out));
  EXPECT_EQ(out.num_masked, 0);
}

TEST_F(CApiReconnectTest, RankMaskNeedsAMaskGroup) {
  JoinBoth("cmf", EPD_RANK_FAILURE_FAIL);
  const int32_t one = 1;
  EXPECT_EQ(epd_endpoint_update_rank_mask(endpoints_[0], &one, 1, nullptr, 0, nullptr),
            EPD_FAILED_PRECONDITION)
      << epd_last_error();
  EXPECT_THAT(epd_last_error(), HasSubstr("on_rank_failure"));
}

}  // namespace
}  // namespace epd::testing
