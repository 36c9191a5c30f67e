// The C ABI (epd/epd.h) against a real `epd --backend=host`: ranks in threads run layout →
// dispatch → combine and low-latency dispatch → combine through the C calls, and the same
// inputs through the C++ API in a second group; every output matches byte for byte, the
// layout matches a reference computed here and identity experts combine back to x. Bad
// inputs (NULL handles and arguments, struct_size too small, a wrong dtype, a stale routing
// handle, an op of a destroyed endpoint, a result of the wrong kind) give the documented
// code and a message naming the field; hostile ones (text that is not UTF-8, a join secret
// length past its buffer, non-zero reserved handle fields, a byte_offset that wraps around)
// are refused before anything is read or sent, and a huge finite wait timeout waits.
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "epd/client.h"
#include "epd/epd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kRanks = 2, kExperts = 8, kHidden = 256, kTopk = 3, kTokens = 12, kMll = 16;

/// A tensor owned by the test: bytes and shape, with a DLTensor over them.
struct Tensor {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape;
  DLDataType dtype{};
  DLTensor dl{};
  Tensor(DLDataType t, std::vector<int64_t> s) : shape(std::move(s)), dtype(t) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bytes.resize(n * t.bits / 8);
    dl = MakeDLTensor(bytes.data(), dtype, shape);
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(bytes.data());
  }
};

/// The bytes of a result view (empty for an absent one).
std::vector<uint8_t> Bytes(const DLTensor& t) {
  if (t.ndim == 0 || t.data == nullptr) return {};
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  const auto* p = static_cast<const uint8_t*>(t.data) + t.byte_offset;
  return std::vector<uint8_t>(p, p + n * t.dtype.bits / 8);
}

/// A copy of a result view the test owns (e.g. identity experts' outputs from recv_x).
std::unique_ptr<Tensor> CopyOf(const DLTensor& t) {
  auto copy = std::make_unique<Tensor>(t.dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim));
  copy->bytes = Bytes(t);
  copy->dl.data = copy->bytes.data();
  return copy;
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

/// One rank's inputs: x [T, H] bf16 (small exact values), topk_idx [T, K] (some -1, some
/// repeated experts), topk_weights [T, K] f32.
struct Inputs {
  Tensor x{kBf16, {kTokens, kHidden}};
  Tensor topk_idx{kI64, {kTokens, kTopk}};
  Tensor topk_weights{kF32, {kTokens, kTopk}};
  explicit Inputs(int rank) {
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHidden; ++h) {
        x.as<uint16_t>()[t * kHidden + h] = Bf16(((rank * 31 + t * 7 + h) % 17 - 8) / 4.0f);
      }
      for (int k = 0; k < kTopk; ++k) {
        int64_t e = (rank * 5 + t * 3 + k * 2) % kExperts;
        if ((t + k) % 7 == 3) e = -1;
        if (t % 5 == 1 && k == 2) e = topk_idx.as<int64_t>()[t * kTopk];  // Repeated.
        topk_idx.as<int64_t>()[t * kTopk + k] = e;
        topk_weights.as<float>()[t * kTopk + k] = 0.25f * (k + 1);
      }
    }
  }
};

/// Every output of one rank's op sequence, as bytes.
struct Outputs {
  std::vector<std::vector<uint8_t>> tensors;
  std::vector<int32_t> counts;  // num_recv_tokens.
  void Add(const DLTensor& t) { tensors.push_back(Bytes(t)); }
};

/// Join options of rank `rank` of a group of `ranks` (the test's shape, FP8 and LL on).
epd_join_options_t JoinOptions(const char* name, int ranks, int rank) {
  epd_join_options_t j{};
  j.struct_size = sizeof(j);
  j.name = name;
  j.num_ranks = ranks;
  j.num_experts = kExperts;
  j.hidden = kHidden;
  j.num_topk = kTopk;
  j.max_tokens_per_rank = kTokens;
  j.ll_max_tokens_per_rank = kMll;
  j.use_fp8 = 1;
  j.rank = rank;
  return j;
}

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcessOptions o;
    o.tcp = false;
    o.log_level = "info";
    o.extra_args = {"--op_timeout=10s"};
    auto epd = DaemonProcess::Start(o);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  epd_client_t* Connect() {
    epd_client_options_t o{};
    o.struct_size = sizeof(o);
    o.socket_path = epd_->socket_path().c_str();
    o.client_name = "c_api_test";
    epd_client_t* client = nullptr;
    EXPECT_EQ(epd_client_connect(&o, &client), EPD_OK) << epd_last_error();
    return client;
  }

  std::unique_ptr<DaemonProcess> epd_;
};

#define EXPECT_C_OK(call) EXPECT_EQ((call), EPD_OK) << #call << ": " << epd_last_error()
#define ASSERT_C_OK(call) ASSERT_EQ((call), EPD_OK) << #call << ": " << epd_last_error()

/// Waits for the op held by `op` and reads its result of type R with `get`; false on error.
template <typename R>
bool Await(epd_op_t* op, epd_status_t (*get)(const epd_op_t*, R*), R* result) {
  *result = R{};
  result->struct_size = sizeof(R);
  EXPECT_C_OK(epd_op_wait(op, 20000));
  EXPECT_C_OK(get(op, result));
  return !::testing::Test::HasFailure();
}

/// One rank through the C ABI: layout, dispatch, combine (identity experts), low-latency
/// dispatch (bf16, then FP8) and combine.
void RunRankC(epd_client_t* client, int rank, Outputs* out) {
  Inputs in(rank);
  epd_join_options_t j = JoinOptions("c_group", kRanks, rank);
  epd_endpoint_t* ep = nullptr;
  ASSERT_C_OK(epd_client_join(client, &j, &ep));
  epd_op_t* op = nullptr;
  ASSERT_C_OK(epd_op_create(&op));

  epd_layout_args_t la{sizeof(la), &in.topk_idx.dl, nullptr};
  ASSERT_C_OK(epd_get_dispatch_layout(ep, &la, op));
  EXPECT_EQ(epd_op_kind(op), EPD_OP_GET_DISPATCH_LAYOUT);
  epd_layout_result_t lr;
  ASSERT_TRUE(Await(op, epd_op_layout_result, &lr));
  out->Add(lr.num_tokens_per_rank);
  out->Add(lr.num_tokens_per_expert);
  out->Add(lr.is_token_in_rank);

  epd_dispatch_args_t da{};
  da.struct_size = sizeof(da);
  da.x = &in.x.dl;
  da.topk_idx = &in.topk_idx.dl;
  da.topk_weights = &in.topk_weights.dl;
  ASSERT_C_OK(epd_dispatch(ep, &da, op));
  epd_dispatch_result_t dr;
  ASSERT_TRUE(Await(op, epd_op_dispatch_result, &dr));
  for (const DLTensor* t : {&dr.recv_x, &dr.recv_scales, &dr.recv_topk_idx, &dr.recv_topk_weights,
                            &dr.num_recv_tokens_per_expert, &dr.recv_src_info, &dr.recv_count}) {
    out->Add(*t);
  }
  out->counts.push_back(dr.num_recv_tokens);
  EXPECT_EQ(dr.recv_x.shape[0], dr.num_recv_tokens);
  const epd_handle_t handle = dr.handle;  // Copied: the op holder is reused below.
  EXPECT_EQ(handle.low_latency, 0);

  // Identity experts: recv_x goes back as the combine's x (copied: the view is read-only).
  std::unique_ptr<Tensor> y = CopyOf(dr.recv_x);
  epd_combine_args_t ca{};
  ca.struct_size = sizeof(ca);
  ca.x = &y->dl;
  ca.handle = &handle;
  ASSERT_C_OK(epd_combine(ep, &ca, op));
  epd_combine_result_t cr;
  ASSERT_TRUE(Await(op, epd_op_combine_result, &cr));
  out->Add(cr.combined_x);
  EXPECT_EQ(cr.combined_topk_weights.ndim, 0);

  for (int use_fp8 = 0; use_fp8 <= 1; ++use_fp8) {
    epd_ll_dispatch_args_t lda{};
    lda.struct_size = sizeof(lda);
    lda.x = &in.x.dl;
    lda.topk_idx = &in.topk_idx.dl;
    lda.use_fp8 = use_fp8;
    ASSERT_C_OK(epd_low_latency_dispatch(ep, &lda, op));
    epd_ll_dispatch_result_t ldr;
    ASSERT_TRUE(Await(op, epd_op_ll_dispatch_result, &ldr));
    for (const DLTensor* t : {&ldr.recv_x, &ldr.recv_scales, &ldr.recv_count, &ldr.recv_src_info}) {
      out->Add(*t);
    }
    EXPECT_EQ(ldr.handle.low_latency, 1);
    EXPECT_EQ(ldr.handle.use_fp8, use_fp8);
    if (use_fp8) {
      // Token index fastest: [E/R, R*Mll, H/128] with strides {H/128 * R*Mll, 1, R*Mll}.
      const int64_t rows = kRanks * kMll, S = kHidden / 128;
      ASSERT_EQ(ldr.recv_scales.ndim, 3);
      ASSERT_NE(ldr.recv_scales.strides, nullptr);
      EXPECT_EQ(std::vector<int64_t>(ldr.recv_scales.strides, ldr.recv_scales.strides + 3),
                (std::vector<int64_t>{S * rows, 1, rows}));
    }
    if (use_fp8) continue;
    // Combine from the endpoint's own combine input region, filled with recv_x.
    DLTensor region{};
    ASSERT_C_OK(epd_low_latency_combine_input(ep, &region));
    ASSERT_EQ(region.ndim, 3);
    const std::vector<uint8_t> recv = Bytes(ldr.recv_x);
    ASSERT_EQ(recv.size(), Bytes(region).size());
    std::memcpy(region.data, recv.data(), recv.size());
    const epd_handle_t ll_handle = ldr.handle;
    epd_ll_combine_args_t lca{};
    lca.struct_size = sizeof(lca);
    lca.x = &region;
    lca.topk_idx = &in.topk_idx.dl;
    lca.topk_weights = &in.topk_weights.dl;
    lca.handle = &ll_handle;
    ASSERT_C_OK(epd_low_latency_combine(ep, &lca, op));
    epd_ll_combine_result_t lcr;
    ASSERT_TRUE(Await(op, epd_op_ll_combine_result, &lcr));
    out->Add(lcr.combined_x);
  }
  epd_op_destroy(op);
  EXPECT_C_OK(epd_endpoint_leave(ep));
  epd_endpoint_destroy(ep);
}

/// The same sequence through the C++ API.
void RunRankCpp(Client& client, int rank, Outputs* out) {
  Inputs in(rank);
  epd::JoinOptions j;
  j.spec = MakeSpec("cpp_group", {.num_ranks = kRanks,
                                  .num_experts = kExperts,
                                  .hidden = kHidden,
                                  .num_topk = kTopk,
                                  .max_tokens_per_rank = kTokens,
                                  .ll_max_tokens_per_rank = kMll,
                                  .use_fp8 = true});
  j.rank = rank;
  auto ep = client.Join(j);
  ASSERT_TRUE(ep.ok()) << ep.status();
  auto layout = (*ep)->GetDispatchLayout(in.topk_idx.dl);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto lr = layout->Wait(absl::Seconds(20));
  ASSERT_TRUE(lr.ok()) << lr.status();
  out->Add(lr->num_tokens_per_rank.dl());
  out->Add(lr->num_tokens_per_expert.dl());
  out->Add(lr->is_token_in_rank.dl());

  DispatchArgs da;
  da.x = &in.x.dl;
  da.topk_idx = &in.topk_idx.dl;
  da.topk_weights = &in.topk_weights.dl;
  auto dispatch = (*ep)->Dispatch(da);
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  auto dr = dispatch->Wait(absl::Seconds(20));
  ASSERT_TRUE(dr.ok()) << dr.status();
  for (const TensorView* t :
       {&dr->recv_x, &dr->recv_scales, &dr->recv_topk_idx, &dr->recv_topk_weights,
        &dr->num_recv_tokens_per_expert, &dr->recv_src_info, &dr->recv_count}) {
    out->Add(t->dl());
  }
  out->counts.push_back(dr->num_recv_tokens);
  std::unique_ptr<Tensor> y = CopyOf(dr->recv_x.dl());
  CombineArgs ca;
  ca.x = &y->dl;
  ca.handle = &dr->handle;
  auto combine = (*ep)->Combine(ca);
  ASSERT_TRUE(combine.ok()) << combine.status();
  auto cr = combine->Wait(absl::Seconds(20));
  ASSERT_TRUE(cr.ok()) << cr.status();
  out->Add(cr->combined_x.dl());

  for (bool use_fp8 : {false, true}) {
    LowLatencyDispatchArgs lda;
    lda.x = &in.x.dl;
    lda.topk_idx = &in.topk_idx.dl;
    lda.use_fp8 = use_fp8;
    auto lld = (*ep)->LowLatencyDispatch(lda);
    ASSERT_TRUE(lld.ok()) << lld.status();
    auto ldr = lld->Wait(absl::Seconds(20));
    ASSERT_TRUE(ldr.ok()) << ldr.status();
    for (const TensorView* t :
         {&ldr->recv_x, &ldr->recv_scales, &ldr->recv_count, &ldr->recv_src_info}) {
      out->Add(t->dl());
    }
    if (use_fp8) continue;
    std::unique_ptr<Tensor> ly = CopyOf(ldr->recv_x.dl());
    LowLatencyCombineArgs lca;
    lca.x = &ly->dl;
    lca.topk_idx = &in.topk_idx.dl;
    lca.topk_weights = &in.topk_weights.dl;
    lca.handle = &ldr->handle;
    auto llc = (*ep)->LowLatencyCombine(lca);
    ASSERT_TRUE(llc.ok()) << llc.status();
    auto lcr = llc->Wait(absl::Seconds(20));
    ASSERT_TRUE(lcr.ok()) << lcr.status();
    out->Add(lcr->combined_x.dl());
  }
}

TEST_F(CApiTest, OpsThroughTheCAbiMatchTheCppApi) {
  epd_client_t* client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_NE(std::string(epd_client_session_id(client)), "");
  std::vector<Outputs> c(kRanks), cpp(kRanks);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { RunRankC(client, r, &c[r]); });
    for (auto& t : threads) t.join();
  }
  ClientOptions options;
  options.socket_path = epd_->socket_path();
  auto cpp_client = Client::Connect(options);
  ASSERT_TRUE(cpp_client.ok()) << cpp_client.status();
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { RunRankCpp(**cpp_client, r, &cpp[r]); });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(c[r].tensors.size(), cpp[r].tensors.size()) << "rank " << r;
    for (size_t i = 0; i < c[r].tensors.size(); ++i) {
      EXPECT_EQ(c[r].tensors[i], cpp[r].tensors[i]) << "rank " << r << " output " << i;
    }
    EXPECT_EQ(c[r].counts, cpp[r].counts) << "rank " << r;

    // The layout against a reference computed here.
    Inputs in(r);
    std::vector<int32_t> per_rank(kRanks, 0), per_expert(kExperts, 0);
    std::vector<uint8_t> in_rank(kTokens * kRanks, 0);
    for (int t = 0; t < kTokens; ++t) {
      std::set<int64_t> experts;
      for (int k = 0; k < kTopk; ++k) {
        if (int64_t e = in.topk_idx.as<int64_t>()[t * kTopk + k]; e >= 0) experts.insert(e);
      }
      std::set<int> ranks;
      for (int64_t e : experts) {
        ++per_expert[e];
        ranks.insert(static_cast<int>(e / (kExperts / kRanks)));
      }
      for (int rr : ranks) {
        ++per_rank[rr];
        in_rank[t * kRanks + rr] = 1;
      }
    }
    auto as_bytes = [](const auto& v) {
      const auto* p = reinterpret_cast<const uint8_t*>(v.data());
      return std::vector<uint8_t>(p, p + v.size() * sizeof(v[0]));
    };
    EXPECT_EQ(c[r].tensors[0], as_bytes(per_rank)) << "num_tokens_per_rank, rank " << r;
    EXPECT_EQ(c[r].tensors[1], as_bytes(per_expert)) << "num_tokens_per_expert, rank " << r;
    EXPECT_EQ(c[r].tensors[2], in_rank) << "is_token_in_rank, rank " << r;
    // Identity experts: a token received by one rank combines back to x bit for bit, a token
    // sent nowhere to +0.
    const std::vector<uint8_t>& combined = c[r].tensors[10];
    ASSERT_EQ(combined.size(), in.x.bytes.size());
    int singles = 0;
    for (int t = 0; t < kTokens; ++t) {
      const int n = in_rank[t * kRanks] + in_rank[t * kRanks + 1];
      const size_t row = static_cast<size_t>(kHidden) * 2;
      std::vector<uint8_t> got(combined.begin() + t * row, combined.begin() + (t + 1) * row);
      singles += n == 1;
      if (n == 1) {
        EXPECT_EQ(got, std::vector<uint8_t>(in.x.bytes.begin() + t * row,
                                            in.x.bytes.begin() + (t + 1) * row))
            << "rank " << r << " token " << t;
      } else if (n == 0) {
        EXPECT_EQ(got, std::vector<uint8_t>(row, 0)) << "rank " << r << " token " << t;
      }
    }
    EXPECT_GT(singles, 0) << "rank " << r;
  }

  epd_stats_t stats{};
  stats.struct_size = sizeof(stats);
  EXPECT_C_OK(epd_client_stats(client, &stats));
  EXPECT_STREQ(stats.backend, "host");
  EXPECT_GT(stats.ops_completed, 0u);
  epd_client_destroy(client);
}

// ---- FP8 low-latency scales: column-major storage and UE8M0 packing --------------------

constexpr int kUeHidden = 1024, kUeScales = kUeHidden / 128;

/// x [T, H] of rank `rank` for the scale tests: small integers times a power of two that
/// differs per 128-channel block, so blocks have different amax and exponents (exact bf16).
float UeX(int rank, int t, int h) {
  return static_cast<float>((rank * 31 + t * 7 + h) % 17 - 8) *
         std::ldexp(1.0f, (rank + t + h / 128) % 9 - 4);
}

/// The round_scale scale of block g of token t of rank `rank`, from its definition:
/// 2^ceil(log2(max(amax, 1e-4) / 448)).
float RoundScaleRef(int rank, int t, int g) {
  float amax = 0.0f;
  for (int h = g * 128; h < (g + 1) * 128; ++h) amax = std::max(amax, std::fabs(UeX(rank, t, h)));
  const double s = std::max(static_cast<double>(amax), 1e-4) / 448.0;
  return static_cast<float>(std::exp2(std::ceil(std::log2(s))));
}

/// One rank of a 2-rank group with hidden 1024: an FP8 low-latency dispatch with round_scale
/// and use_ue8m0 (recv_scales int32 [E/R, R*Mll, H/512], token fastest, each byte the biased
/// exponent of the scale), then one with round_scale only, passed with the first version's
/// struct_size (use_ue8m0 past it is not read): f32 [E/R, R*Mll, H/128], token fastest.
void RunUe8m0Rank(epd_client_t* client, int rank) {
  const int rows = kRanks * kMll, El = kExperts / kRanks;
  Tensor x(kBf16, {kTokens, kUeHidden});
  Inputs routing(rank);
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kUeHidden; ++h) x.as<uint16_t>()[t * kUeHidden + h] = Bf16(UeX(rank, t, h));
  }
  epd_join_options_t j = JoinOptions("ue8m0", kRanks, rank);
  j.hidden = kUeHidden;
  epd_endpoint_t* ep = nullptr;
  ASSERT_C_OK(epd_client_join(client, &j, &ep));
  epd_op_t* packed_op = nullptr;
  epd_op_t* f32_op = nullptr;
  ASSERT_C_OK(epd_op_create(&packed_op));
  ASSERT_C_OK(epd_op_create(&f32_op));

  epd_ll_dispatch_args_t a{};
  a.struct_size = sizeof(a);
  a.x = &x.dl;
  a.topk_idx = &routing.topk_idx.dl;
  a.use_fp8 = 1;
  a.round_scale = 1;
  a.use_ue8m0 = 1;
  ASSERT_C_OK(epd_low_latency_dispatch(ep, &a, packed_op));
  epd_ll_dispatch_result_t packed;
  ASSERT_TRUE(Await(packed_op, epd_op_ll_dispatch_result, &packed));
  a.struct_size = offsetof(epd_ll_dispatch_args_t, use_ue8m0);  // A first-version caller.
  ASSERT_C_OK(epd_low_latency_dispatch(ep, &a, f32_op));
  epd_ll_dispatch_result_t f32;
  ASSERT_TRUE(Await(f32_op, epd_op_ll_dispatch_result, &f32));

  const DLTensor& ps = packed.recv_scales;
  ASSERT_EQ(ps.ndim, 3);
  EXPECT_EQ(ps.dtype.code, kDLInt);
  EXPECT_EQ(ps.dtype.bits, 32);
  ASSERT_EQ(std::vector<int64_t>(ps.shape, ps.shape + 3),
            (std::vector<int64_t>{El, rows, kUeScales / 4}));
  ASSERT_NE(ps.strides, nullptr);
  ASSERT_EQ(std::vector<int64_t>(ps.strides, ps.strides + 3),
            (std::vector<int64_t>{kUeScales / 4 * rows, 1, rows}));
  const DLTensor& fs = f32.recv_scales;
  ASSERT_EQ(fs.ndim, 3);
  EXPECT_EQ(fs.dtype.code, kDLFloat);
  ASSERT_EQ(std::vector<int64_t>(fs.shape, fs.shape + 3),
            (std::vector<int64_t>{El, rows, kUeScales}));
  ASSERT_NE(fs.strides, nullptr);
  ASSERT_EQ(std::vector<int64_t>(fs.strides, fs.strides + 3),
            (std::vector<int64_t>{kUeScales * rows, 1, rows}));

  // Every received row against the reference of its source token (recv_src_info), read
  // through the views' strides.
  const auto* count = static_cast<const int32_t*>(packed.recv_count.data);
  const auto* src = static_cast<const int32_t*>(packed.recv_src_info.data);
  const auto* words = static_cast<const uint32_t*>(ps.data);
  const auto* scales = static_cast<const float*>(fs.data);
  int checked = 0;
  for (int e = 0; e < El; ++e) {
    ASSERT_EQ(count[e], static_cast<const int32_t*>(f32.recv_count.data)[e]);
    for (int i = 0; i < count[e]; ++i) {
      const int s = src[e * rows + i] / kMll, t = src[e * rows + i] % kMll;
      ASSERT_EQ(static_cast<const int32_t*>(f32.recv_src_info.data)[e * rows + i],
                src[e * rows + i]);
      for (int g = 0; g < kUeScales; ++g) {
        const float want = RoundScaleRef(s, t, g);
        const uint32_t word =
            words[e * ps.strides[0] + i * ps.strides[1] + (g / 4) * ps.strides[2]];
        const int code = static_cast<int>((word >> (8 * (g % 4))) & 0xff);
        EXPECT_EQ(code, std::ilogb(want) + 127)
            << "rank " << rank << " expert " << e << " row " << i << " block " << g;
        EXPECT_EQ(std::ldexp(1.0f, code - 127), want);
        EXPECT_EQ(scales[e * fs.strides[0] + i * fs.strides[1] + g * fs.strides[2]], want)
            << "rank " << rank << " expert " << e << " row " << i << " block " << g;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
  epd_op_destroy(packed_op);
  epd_op_destroy(f32_op);
  EXPECT_C_OK(epd_endpoint_leave(ep));
  epd_endpoint_destroy(ep);
}

TEST_F(CApiTest, LowLatencyScalesAreColumnMajorAndUe8m0Packed) {
  epd_client_t* client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { RunUe8m0Rank(client, r); });
  for (auto& t : threads) t.join();
  epd_client_destroy(client);
}

// use_ue8m0 without round_scale or use_fp8, or with hidden % 512 != 0, is INVALID_ARGUMENT
// naming the field; a struct_size before the first version's end is refused.
TEST_F(CApiTest, Ue8m0NeedsFp8RoundScaleAndHidden512) {
  epd_client_t* client = Connect();
  ASSERT_NE(client, nullptr);
  epd_join_options_t j = JoinOptions("ue8m0_bad", 1, 0);  // hidden 256
  epd_endpoint_t* ep = nullptr;
  ASSERT_C_OK(epd_client_join(client, &j, &ep));
  epd_op_t* op = nullptr;
  ASSERT_C_OK(epd_op_create(&op));
  Inputs in(0);
  epd_ll_dispatch_args_t a{};
  a.struct_size = sizeof(a);
  a.x = &in.x.dl;
  a.topk_idx = &in.topk_idx.dl;
  a.use_ue8m0 = 1;
  EXPECT_EQ(epd_low_latency_dispatch(ep, &a, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("use_ue8m0 needs use_fp8"));
  a.use_fp8 = 1;
  EXPECT_EQ(epd_low_latency_dispatch(ep, &a, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("use_ue8m0 needs round_scale"));
  a.round_scale = 1;
  EXPECT_EQ(epd_low_latency_dispatch(ep, &a, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("use_ue8m0 needs hidden % 512 == 0, hidden = 256"));
  a.struct_size = offsetof(epd_ll_dispatch_args_t, use_ue8m0) - 8;
  EXPECT_EQ(epd_low_latency_dispatch(ep, &a, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_ll_dispatch_args_t.struct_size="));
  // The same op without use_ue8m0 runs: f32 scales, token fastest.
  a.struct_size = sizeof(a);
  a.use_ue8m0 = 0;
  ASSERT_C_OK(epd_low_latency_dispatch(ep, &a, op));
  epd_ll_dispatch_result_t r;
  ASSERT_TRUE(Await(op, epd_op_ll_dispatch_result, &r));
  ASSERT_EQ(r.recv_scales.ndim, 3);
  ASSERT_NE(r.recv_scales.strides, nullptr);
  EXPECT_EQ(r.recv_scales.strides[2], kMll);
  epd_op_destroy(op);
  EXPECT_C_OK(epd_endpoint_leave(ep));
  epd_endpoint_destroy(ep);
  epd_client_destroy(client);
}

TEST_F(CApiTest, BadInputsGiveTheDocumentedCodeAndNameTheField) {
  epd_client_t* client = Connect();
  ASSERT_NE(client, nullptr);
  epd_join_options_t j = JoinOptions("bad", 1, 0);
  epd_endpoint_t* ep = nullptr;

  // NULL handles and arguments.
  EXPECT_EQ(epd_client_join(nullptr, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("client is NULL"));
  EXPECT_EQ(epd_client_join(client, nullptr, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("options is NULL"));
  // struct_size too small, and a launch mode out of range.
  j.struct_size = 16;
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_join_options_t.struct_size=16 is smaller than"));
  j.struct_size = sizeof(j);
  j.launch_mode = 7;
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("options.launch_mode=7"));
  j.launch_mode = EPD_LAUNCH_MODE_DEFAULT;
  // A spec field the daemon refuses, named by it.
  j.num_topk = 0;
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("num_topk"));
  j.num_topk = kTopk;
  ASSERT_C_OK(epd_client_join(client, &j, &ep));
  EXPECT_STREQ(epd_last_error(), "");

  epd_endpoint_info_t info{};
  info.struct_size = sizeof(info);
  ASSERT_C_OK(epd_endpoint_info(ep, &info));
  EXPECT_EQ(info.num_experts, kExperts);
  EXPECT_EQ(info.launch_mode, EPD_LAUNCH_MODE_DAEMON);
  EXPECT_EQ(info.cuda, 0);
  EXPECT_STREQ(info.group, "bad");
  EXPECT_STREQ(info.gpu_uuid, "");
  info.struct_size = 4;
  EXPECT_EQ(epd_endpoint_info(ep, &info), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_endpoint_info_t.struct_size=4"));

  epd_op_t* op = nullptr;
  ASSERT_C_OK(epd_op_create(&op));
  Inputs in(0);
  epd_dispatch_args_t da{};
  da.struct_size = sizeof(da);
  da.x = &in.x.dl;
  da.topk_idx = &in.topk_idx.dl;
  EXPECT_EQ(epd_dispatch(nullptr, &da, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("endpoint is NULL"));
  EXPECT_EQ(epd_dispatch(ep, &da, nullptr), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("op is NULL"));
  EXPECT_EQ(epd_dispatch(ep, nullptr, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("args is NULL"));
  EXPECT_EQ(epd_op_wait(nullptr, 0), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("op is NULL"));
  da.struct_size = sizeof(da) - 8;
  EXPECT_EQ(epd_dispatch(ep, &da, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_dispatch_args_t.struct_size="));
  da.struct_size = sizeof(da);

  // A wrong dtype: topk_idx as int32.
  Tensor idx32(kI32, {kTokens, kTopk});
  da.topk_idx = &idx32.dl;
  EXPECT_EQ(epd_dispatch(ep, &da, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("topk_idx"));
  EXPECT_THAT(epd_last_error(), HasSubstr("dtype"));
  EXPECT_EQ(epd_op_kind(op), EPD_OP_NONE);  // A refused op leaves the holder empty.
  da.topk_idx = &in.topk_idx.dl;

  // No stream on the host backend: enqueued refuses; wait gives the result. A missing tensor
  // is named.
  epd_layout_args_t no_idx{sizeof(no_idx), nullptr, nullptr};
  EXPECT_EQ(epd_get_dispatch_layout(ep, &no_idx, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("args.topk_idx is NULL"));
  epd_layout_args_t layout_args{sizeof(layout_args), &in.topk_idx.dl, nullptr};
  ASSERT_C_OK(epd_get_dispatch_layout(ep, &layout_args, op));
  EXPECT_NE(epd_op_seq(op), 0u);
  EXPECT_EQ(epd_op_enqueued(op), EPD_FAILED_PRECONDITION);
  ASSERT_C_OK(epd_op_wait(op, 20000));
  DLTensor ll_input{};
  ASSERT_C_OK(epd_low_latency_dispatch_input(ep, &ll_input));
  ASSERT_EQ(ll_input.ndim, 2);
  EXPECT_EQ(ll_input.shape[0], kMll);
  EXPECT_EQ(ll_input.shape[1], kHidden);

  // A stale routing handle: combine with the first of two dispatches' handles.
  ASSERT_C_OK(epd_dispatch(ep, &da, op));
  epd_dispatch_result_t dr{};
  dr.struct_size = sizeof(dr);
  EXPECT_EQ(epd_op_dispatch_result(op, &dr), EPD_FAILED_PRECONDITION);  // Not waited yet.
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_op_wait"));
  ASSERT_C_OK(epd_op_wait(op, 20000));
  epd_layout_result_t wrong{};
  wrong.struct_size = sizeof(wrong);
  EXPECT_EQ(epd_op_layout_result(op, &wrong), EPD_FAILED_PRECONDITION);
  EXPECT_THAT(epd_last_error(), HasSubstr("holds a dispatch result, not get_dispatch_layout"));
  dr.struct_size = 8;
  EXPECT_EQ(epd_op_dispatch_result(op, &dr), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("epd_dispatch_result_t.struct_size=8"));
  dr.struct_size = sizeof(dr);
  ASSERT_C_OK(epd_op_dispatch_result(op, &dr));
  const epd_handle_t first = dr.handle;
  ASSERT_C_OK(epd_dispatch(ep, &da, op));
  ASSERT_C_OK(epd_op_wait(op, 20000));
  ASSERT_C_OK(epd_op_dispatch_result(op, &dr));
  std::unique_ptr<Tensor> y = CopyOf(dr.recv_x);
  epd_combine_args_t ca{};
  ca.struct_size = sizeof(ca);
  ca.x = &y->dl;
  EXPECT_EQ(epd_combine(ep, &ca, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("args.handle is NULL"));
  ca.handle = &first;  // Submitted; the daemon refuses the stale handle, reported by wait.
  ASSERT_C_OK(epd_combine(ep, &ca, op));
  EXPECT_EQ(epd_op_wait(op, 20000), EPD_FAILED_PRECONDITION);
  EXPECT_THAT(epd_last_error(), HasSubstr("handle"));
  ca.handle = &dr.handle;
  ASSERT_C_OK(epd_combine(ep, &ca, op));
  ASSERT_C_OK(epd_op_wait(op, 20000));

  // JSON of stats and groups, with a buffer too small first.
  size_t length = 0;
  EXPECT_EQ(epd_client_list_groups_json(client, nullptr, 0, &length), EPD_OUT_OF_RANGE);
  EXPECT_THAT(epd_last_error(), HasSubstr("capacity=0 is too small"));
  std::string json(length + 1, '\0');
  ASSERT_C_OK(epd_client_list_groups_json(client, json.data(), json.size(), &length));
  EXPECT_THAT(json, HasSubstr("\"bad\""));
  ASSERT_EQ(epd_client_stats_json(client, nullptr, 0, &length), EPD_OUT_OF_RANGE);
  // Stats change between the two calls (uptime, metrics): leave room for a few more bytes.
  json.assign(length + 4096, '\0');
  ASSERT_C_OK(epd_client_stats_json(client, json.data(), json.size(), &length));
  EXPECT_THAT(json, HasSubstr("\"backend\":\"host\""));

  // Graph mode is the CUDA backend's; a step array with a bad struct_size is refused first.
  epd_program_step_t steps[2] = {{sizeof(epd_program_step_t), EPD_OP_LOW_LATENCY_DISPATCH, 0, 0},
                                 {sizeof(epd_program_step_t), EPD_OP_LOW_LATENCY_COMBINE, 0, 0}};
  steps[0].struct_size = 4;
  EXPECT_EQ(epd_register_program(ep, steps, 2, 1000), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("steps[0]: epd_program_step_t.struct_size=4"));
  steps[0].struct_size = sizeof(epd_program_step_t);
  EXPECT_EQ(epd_register_program(ep, steps, 2, 1000), EPD_UNIMPLEMENTED) << epd_last_error();

  // Leave: later ops FAILED_PRECONDITION. Destroyed: the held op answers FAILED_PRECONDITION.
  ASSERT_C_OK(epd_endpoint_leave(ep));
  EXPECT_EQ(epd_dispatch(ep, &da, op), EPD_FAILED_PRECONDITION) << epd_last_error();
  epd_endpoint_t* again = nullptr;
  j.name = "bad2";
  ASSERT_C_OK(epd_client_join(client, &j, &again));
  epd_layout_args_t la{sizeof(la), &in.topk_idx.dl, nullptr};
  ASSERT_C_OK(epd_get_dispatch_layout(again, &la, op));
  epd_endpoint_destroy(again);
  EXPECT_EQ(epd_op_wait(op, 1000), EPD_FAILED_PRECONDITION);
  EXPECT_THAT(epd_last_error(), HasSubstr("endpoint destroyed"));

  epd_op_destroy(op);
  epd_endpoint_destroy(ep);
  epd_client_destroy(client);
}

TEST_F(CApiTest, HostileArgumentsAreRefusedBeforeAnythingIsReadOrSent) {
  // Text that is not UTF-8 (protobuf would not send it) is refused naming the field; the
  // daemon is unaffected: a well-formed connect and join follow.
  epd_client_options_t o{};
  o.struct_size = sizeof(o);
  o.socket_path = epd_->socket_path().c_str();
  o.client_name = "bad\xff\xfename";
  epd_client_t* bad_client = nullptr;
  EXPECT_EQ(epd_client_connect(&o, &bad_client), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("client_name"));
  EXPECT_THAT(epd_last_error(), HasSubstr("not valid UTF-8 (at byte 3)"));
  EXPECT_EQ(bad_client, nullptr);
  ClientOptions cpp_options;
  cpp_options.socket_path = epd_->socket_path();
  cpp_options.client_name = std::string("nul\0name", 8);
  EXPECT_EQ(Client::Connect(cpp_options).status().code(), absl::StatusCode::kInvalidArgument);
  cpp_options.client_name = std::string(300, 'n');
  absl::Status too_long = Client::Connect(cpp_options).status();
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.message(), HasSubstr("client_name"));
  // No client_name: the process name, whatever bytes it holds, is sent as UTF-8.
  char comm[17] = {};
  ASSERT_EQ(prctl(PR_GET_NAME, comm), 0);
  ASSERT_EQ(prctl(PR_SET_NAME, "epd\xff\xfetest"), 0);
  cpp_options.client_name.clear();
  auto nameless = Client::Connect(cpp_options);
  ASSERT_EQ(prctl(PR_SET_NAME, comm), 0);
  EXPECT_TRUE(nameless.ok()) << nameless.status();

  epd_client_t* client = Connect();
  ASSERT_NE(client, nullptr);
  epd_join_options_t j = JoinOptions("hostile", 1, 0);
  epd_endpoint_t* ep = nullptr;
  j.name = "ho\xc3(stile";
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("spec.name"));
  EXPECT_THAT(epd_last_error(), HasSubstr("not valid UTF-8"));
  j.name = "hostile";
  j.gpu_uuid = "GPU-\xed\xa0\x80";  // An encoded surrogate.
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("gpu_uuid"));
  j.gpu_uuid = nullptr;
  // join_secret_len is checked before the secret is read: 2^40 bytes are never copied.
  const char secret[] = "s3cret";
  j.join_secret = secret;
  j.join_secret_len = size_t{1} << 40;
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("options.join_secret_len=1099511627776"));
  j.join_secret_len = 257;
  EXPECT_EQ(epd_client_join(client, &j, &ep), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("options.join_secret_len=257"));
  j.join_secret_len = sizeof(secret) - 1;
  ASSERT_C_OK(epd_client_join(client, &j, &ep));

  // A huge finite timeout waits (as an infinite one does) instead of failing at once.
  epd_op_t* op = nullptr;
  ASSERT_C_OK(epd_op_create(&op));
  Inputs in(0);
  epd_layout_args_t la{sizeof(la), &in.topk_idx.dl, nullptr};
  ASSERT_C_OK(epd_get_dispatch_layout(ep, &la, op));
  EXPECT_C_OK(epd_op_wait(op, std::numeric_limits<int64_t>::max()));

  // A byte_offset that wraps around (data - 2) is refused, naming the tensor and the offset.
  epd_dispatch_args_t da{};
  da.struct_size = sizeof(da);
  da.x = &in.x.dl;
  da.topk_idx = &in.topk_idx.dl;
  in.x.dl.byte_offset = static_cast<uint64_t>(-2);
  EXPECT_EQ(epd_dispatch(ep, &da, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("x.byte_offset=18446744073709551614"));
  in.x.dl.byte_offset = 0;
  ASSERT_C_OK(epd_dispatch(ep, &da, op));
  ASSERT_C_OK(epd_op_wait(op, -1));
  epd_dispatch_result_t dr{};
  dr.struct_size = sizeof(dr);
  ASSERT_C_OK(epd_op_dispatch_result(op, &dr));

  // Reserved handle fields must be zero.
  std::unique_ptr<Tensor> y = CopyOf(dr.recv_x);
  epd_handle_t handle = dr.handle;
  epd_combine_args_t ca{};
  ca.struct_size = sizeof(ca);
  ca.x = &y->dl;
  ca.handle = &handle;
  handle.reserved[1] = 7;
  EXPECT_EQ(epd_combine(ep, &ca, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("args.handle->reserved[1]=7 must be zero"));
  handle.reserved[1] = 0;
  handle.reserved0[0] = 1;
  da.cached = &handle;
  EXPECT_EQ(epd_dispatch(ep, &da, op), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("args.cached->reserved0[0]=1 must be zero"));
  handle.reserved0[0] = 0;
  ASSERT_C_OK(epd_combine(ep, &ca, op));
  EXPECT_C_OK(epd_op_wait(op, -1));

  // The C++ PendingOp::Wait with a huge finite Duration, on a dispatch that completes only
  // once the group's second rank dispatches, 200 ms later.
  auto cpp_client = Client::Connect(cpp_options);
  ASSERT_TRUE(cpp_client.ok()) << cpp_client.status();
  std::vector<std::unique_ptr<Endpoint>> cpp_eps;
  for (int rank = 0; rank < 2; ++rank) {
    epd::JoinOptions cpp_join;
    cpp_join.spec = MakeSpec("hostile_cpp");
    cpp_join.rank = rank;
    auto cpp_ep = (*cpp_client)->Join(cpp_join);
    ASSERT_TRUE(cpp_ep.ok()) << cpp_ep.status();
    cpp_eps.push_back(*std::move(cpp_ep));
  }
  Tensor x(kBf16, {4, 256}), idx(kI64, {4, 2});
  for (int i = 0; i < 8; ++i) idx.as<int64_t>()[i] = i % 8;
  DispatchArgs cpp_args;
  cpp_args.x = &x.dl;
  cpp_args.topk_idx = &idx.dl;
  auto pending = cpp_eps[0]->Dispatch(cpp_args);
  ASSERT_TRUE(pending.ok()) << pending.status();
  std::thread second([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto other = cpp_eps[1]->Dispatch(cpp_args);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_TRUE(other->Wait().ok());
  });
  auto dispatched = pending->Wait(absl::Milliseconds(std::numeric_limits<int64_t>::max()));
  second.join();
  EXPECT_TRUE(dispatched.ok()) << dispatched.status();

  epd_op_destroy(op);
  epd_endpoint_destroy(ep);
  epd_client_destroy(client);
}

}  // namespace
}  // namespace epd::testing
