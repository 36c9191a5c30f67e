// The host data plane in-process: endpoints opened by the real client code
// (internal::OpenEndpoint) on a HostDataPlane, ops run from one thread per rank, results
// compared with kernels/host run directly on the same inputs. Also the failure paths:
// garbage in a ring slot, a rank that never arrives, a rank leaving mid-op, stale
// handles, client-side input errors — after each, the group keeps working.
#include "daemon/host_data_plane.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "client/endpoint_internal.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "shm_abi.h"
#include "shm_region.h"

namespace epd {
namespace {

using kernels::bf16_bits;
using kernels::FloatToBf16;

v1::GroupSpec Spec(const std::string& name, int R, int E, int H, int K, int M, int Mll, bool fp8) {
  v1::GroupSpec s;
  s.set_name(name);
  s.set_num_ranks(R);
  s.set_num_experts(E);
  s.set_hidden(H);
  s.set_num_topk(K);
  s.set_max_tokens_per_rank(M);
  s.set_ll_max_tokens_per_rank(Mll);
  s.set_use_fp8(fp8);
  return s;
}

/// One rank's random inputs.
struct RankData {
  int T = 0;
  std::vector<bf16_bits> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<int64_t> xs, ks;
  DLTensor x_t{}, idx_t{}, w_t{};
  void Make(int T_, int H, int K, int E, uint32_t seed) {
    T = T_;
    std::mt19937 rng(seed);
    std::normal_distribution<float> g;
    x.resize(static_cast<size_t>(T) * H);
    for (auto& v : x) v = FloatToBf16(g(rng));
    idx.resize(static_cast<size_t>(T) * K);
    w.resize(idx.size());
    for (int t = 0; t < T; ++t) {
      std::vector<int> experts(E);
      for (int e = 0; e < E; ++e) experts[e] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < K; ++k) {
        idx[static_cast<size_t>(t) * K + k] = (rng() % 5 == 0) ? -1 : experts[k];
        w[static_cast<size_t>(t) * K + k] = static_cast<float>(rng() % 1000) / 1000.f;
      }
    }
    xs = {T, H};
    ks = {T, K};
    x_t = epd::MakeDLTensor(x.data(), {kDLBfloat, 16, 1}, xs);
    idx_t = epd::MakeDLTensor(idx.data(), {kDLInt, 64, 1}, ks);
    w_t = epd::MakeDLTensor(w.data(), {kDLFloat, 32, 1}, ks);
  }
};

/// A copy of `src`'s elements starting `misalign` bytes past a 16-byte aligned address, and
/// a DLTensor over it of the same dtype and shape, misaligned through its byte_offset
/// (`via_byte_offset`) or through its data pointer.
struct MisalignedCopy {
  std::vector<uint8_t> bytes;  // operator new: 16-byte aligned.
  std::vector<int64_t> shape;
  DLTensor t{};
  MisalignedCopy(const DLTensor& src, uint64_t misalign, bool via_byte_offset)
      : shape(src.shape, src.shape + src.ndim) {
    size_t n = src.dtype.bits / 8;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    bytes.resize(n + 16);
    std::memcpy(bytes.data() + misalign, static_cast<const uint8_t*>(src.data) + src.byte_offset,
                n);
    t = epd::MakeDLTensor(bytes.data() + (via_byte_offset ? 0 : misalign), src.dtype, shape);
    if (via_byte_offset) t.byte_offset = misalign;
  }
  MisalignedCopy(const MisalignedCopy&) = delete;
  MisalignedCopy& operator=(const MisalignedCopy&) = delete;
};

/// Expects `st` to be the client's INVALID_ARGUMENT for a misaligned `name` of op `op`:
/// naming the op, the tensor, its byte_offset and the alignment its dtype requires.
void ExpectMisalignedError(const absl::Status& st, const std::string& op, const std::string& name,
                           uint64_t byte_offset, int alignment) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  const std::string msg(st.message());
  EXPECT_NE(msg.find(op + ": " + name + " starts at address 0x"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte_offset " + std::to_string(byte_offset) + ")"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not aligned to " + std::to_string(alignment) + " bytes"), std::string::npos)
      << msg;
}

class HostDataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostDataPlaneOptions o;
    o.op_timeout_ms = 500;
    o.host_threads = 2;
    auto plane = MakeHostDataPlane(o);
    ASSERT_TRUE(plane.ok()) << plane.status();
    plane_ = std::move(*plane);
  }

  /// Creates a group and opens every rank's endpoint.
  void Open(const v1::GroupSpec& spec) {
    spec_ = spec;
    auto g = plane_->CreateGroup(spec);
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = std::move(*g);
    endpoints_.clear();
    for (int r = 0; r < spec.num_ranks(); ++r) endpoints_.push_back(Attach(r));
  }

  std::unique_ptr<Endpoint> Attach(int r) {
    v1::EndpointInfo info;
    absl::Status st = group_->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, &info);
    EXPECT_TRUE(st.ok()) << st;
    DataPlaneGroup* g = group_.get();
    auto ep = internal::OpenEndpoint(info, spec_, [g, r] {
      g->DetachRank(r);
      return absl::OkStatus();
    });
    EXPECT_TRUE(ep.ok()) << ep.status();
    return ep.ok() ? std::move(*ep) : nullptr;
  }

  /// Runs fn(rank) on one thread per rank and joins.
  void OnEveryRank(const std::function<void(int)>& fn, int skip = -1) {
    std::vector<std::thread> threads;
    for (int r = 0; r < spec_.num_ranks(); ++r) {
      if (r != skip) threads.emplace_back(fn, r);
    }
    for (auto& t : threads) t.join();
  }

  /// Runs `submit(r)` (an op call) on every rank, rank 0's with a misaligned tensor `name`:
  /// rank 0's op is refused at once (ExpectMisalignedError); every other rank's op fails at
  /// Wait with INVALID_ARGUMENT naming rank 0 (the refused rank told the daemon).
  template <typename Submit>
  void ExpectRank0Misaligned(const std::string& op_name, const std::string& name,
                             uint64_t byte_offset, int alignment, Submit submit) {
    OnEveryRank([&](int r) {
      auto op = submit(r);
      if (r == 0) {
        ASSERT_FALSE(op.ok());
        return ExpectMisalignedError(op.status(), op_name, name, byte_offset, alignment);
      }
      ASSERT_TRUE(op.ok()) << op.status();
      auto res = op->Wait(absl::Seconds(10));
      ASSERT_FALSE(res.ok());
      EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
      EXPECT_NE(res.status().message().find("rank 0"), std::string::npos) << res.status();
    });
  }

  std::unique_ptr<DataPlane> plane_;
  v1::GroupSpec spec_;
  std::unique_ptr<DataPlaneGroup> group_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
};

TEST_F(HostDataPlaneTest, DispatchCombineMatchKernelsHost) {
  const int R = 3, E = 6, H = 256, K = 2, M = 16;
  Open(Spec("g", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(r == 1 ? 0 : 5 + 4 * r, H, K, E, 10 + r);

  // Oracle: kernels/host on the same inputs.
  kernels::GroupShape shape{R, E, H, K, M, 0, false};
  std::vector<std::vector<bf16_bits>> ox(R, std::vector<bf16_bits>(R * M * H));
  std::vector<std::vector<int64_t>> oidx(R, std::vector<int64_t>(R * M * K));
  std::vector<std::vector<float>> ow(R, std::vector<float>(R * M * K));
  std::vector<std::vector<int32_t>> ocnt(R, std::vector<int32_t>(E / R)),
      osrc(R, std::vector<int32_t>(R * M)), opos(R, std::vector<int32_t>(M * R)),
      opre(R, std::vector<int32_t>(R));
  std::vector<kernels::host::DispatchRankArgs> da(R);
  for (int r = 0; r < R; ++r) {
    da[r].num_tokens = in[r].T;
    da[r].x = in[r].x.data();
    da[r].topk_idx = in[r].idx.data();
    da[r].topk_weights = in[r].w.data();
    da[r].recv_capacity = R * M;
    da[r].recv_x = ox[r].data();
    da[r].recv_topk_idx = oidx[r].data();
    da[r].recv_topk_weights = ow[r].data();
    da[r].recv_tokens_per_expert = ocnt[r].data();
    da[r].recv_src_info = osrc[r].data();
    da[r].send_pos = opos[r].data();
    da[r].rank_prefix = opre[r].data();
  }
  ASSERT_TRUE(kernels::host::Dispatch(shape, {false, 4}, da).ok());

  std::vector<DispatchResult> got(R);
  OnEveryRank([&](int r) {
    DispatchArgs a;
    a.x = &in[r].x_t;
    a.topk_idx = &in[r].idx_t;
    a.topk_weights = &in[r].w_t;
    a.expert_alignment = 4;
    auto op = endpoints_[r]->Dispatch(a);
    ASSERT_TRUE(op.ok()) << op.status();
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_TRUE(res.ok()) << res.status();
    got[r] = *res;
  });
  for (int r = 0; r < R; ++r) {
    const int N = da[r].num_recv_tokens;
    ASSERT_EQ(got[r].num_recv_tokens, N) << "rank " << r;
    ASSERT_EQ(got[r].recv_x.shape(), (std::vector<int64_t>{N, H}));
    EXPECT_EQ(0, std::memcmp(got[r].recv_x.data(), ox[r].data(), size_t(N) * H * 2)) << r;
    EXPECT_EQ(0, std::memcmp(got[r].recv_topk_idx.data(), oidx[r].data(), size_t(N) * K * 8)) << r;
    EXPECT_EQ(0, std::memcmp(got[r].recv_topk_weights.data(), ow[r].data(), size_t(N) * K * 4))
        << r;
    EXPECT_EQ(0,
              std::memcmp(got[r].num_recv_tokens_per_expert.data(), ocnt[r].data(), (E / R) * 4));
    EXPECT_EQ(0, std::memcmp(got[r].recv_src_info.data(), osrc[r].data(), size_t(N) * 4));
  }

  // Combine: each rank returns 2 * its received rows; oracle on the same rows.
  std::vector<std::vector<bf16_bits>> expert_out(R);
  std::vector<std::vector<int64_t>> eshape(R);
  std::vector<DLTensor> et(R);
  std::vector<std::vector<bf16_bits>> oc(R);
  std::vector<kernels::host::CombineRankArgs> ca(R);
  for (int r = 0; r < R; ++r) {
    const int N = got[r].num_recv_tokens;
    expert_out[r].resize(size_t(N) * H);
    for (size_t i = 0; i < expert_out[r].size(); ++i) {
      expert_out[r][i] = FloatToBf16(2.f * kernels::Bf16ToFloat(got[r].recv_x.as<bf16_bits>()[i]));
    }
    eshape[r] = {N, H};
    et[r] = epd::MakeDLTensor(expert_out[r].data(), {kDLBfloat, 16, 1}, eshape[r]);
    oc[r].resize(size_t(in[r].T) * H);
    ca[r] = {in[r].T, opos[r].data(), N, expert_out[r].data(), nullptr, oc[r].data(), nullptr};
  }
  ASSERT_TRUE(kernels::host::Combine(shape, ca).ok());
  OnEveryRank([&](int r) {
    CombineArgs a;
    a.x = &et[r];
    a.handle = &got[r].handle;
    auto op = endpoints_[r]->Combine(a);
    ASSERT_TRUE(op.ok()) << op.status();
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_EQ(res->combined_x.shape(), (std::vector<int64_t>{in[r].T, H}));
    // A rank with no tokens (T = 0) has nothing to compare (and null data pointers).
    EXPECT_TRUE(oc[r].empty() ||
                std::memcmp(res->combined_x.data(), oc[r].data(), oc[r].size() * 2) == 0)
        << r;
  });
}

TEST_F(HostDataPlaneTest, LowLatencyRoundTripAndStaleHandle) {
  const int R = 2, E = 4, H = 128, K = 2, Mll = 8;
  Open(Spec("ll", R, E, H, K, 4, Mll, true));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(Mll - r, H, K, E, 77 + r);
  std::vector<LowLatencyDispatchResult> first(R);
  // Round 3: x produced in the endpoint's dispatch input and the expert outputs in its
  // combine input (LowLatencyDispatchInput / LowLatencyCombineInput: nothing is staged).
  for (int round = 0; round < 4; ++round) {
    const bool in_place = round == 3;
    OnEveryRank([&](int r) {
      LowLatencyDispatchArgs a;
      a.x = &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      a.use_fp8 = round == 1;
      std::vector<int64_t> xs{in[r].T, H};
      DLTensor x_in{};
      if (in_place) {
        const TensorView v = endpoints_[r]->LowLatencyDispatchInput();
        ASSERT_EQ(v.shape(), (std::vector<int64_t>{Mll, H}));
        std::memcpy(v.data(), in[r].x.data(), in[r].x.size() * sizeof(bf16_bits));
        x_in = epd::MakeDLTensor(v.data(), {kDLBfloat, 16, 1}, xs);
        a.x = &x_in;
      }
      auto op = endpoints_[r]->LowLatencyDispatch(a);
      ASSERT_TRUE(op.ok()) << op.status();
      auto d = op->Wait(absl::Seconds(10));
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->handle.buffer, round % 2);
      if (round == 0) first[r] = *d;
      // Expert output = the received bf16 rows (identity expert) for the combine.
      std::vector<bf16_bits> y(size_t(E / R) * R * Mll * H, 0);
      if (!a.use_fp8) std::memcpy(y.data(), d->recv_x.data(), y.size() * 2);
      std::vector<int64_t> ys{E / R, R * Mll, H};
      DLTensor yt = epd::MakeDLTensor(y.data(), {kDLBfloat, 16, 1}, ys);
      LowLatencyCombineArgs c;
      c.x = &yt;
      const TensorView combine_in = endpoints_[r]->LowLatencyCombineInput();
      if (in_place) {
        ASSERT_EQ(combine_in.nbytes(), y.size() * sizeof(bf16_bits));
        std::memcpy(combine_in.data(), y.data(), combine_in.nbytes());
        c.x = &combine_in.dl();
      }
      c.topk_idx = &in[r].idx_t;
      c.topk_weights = &in[r].w_t;
      c.handle = &d->handle;
      auto cop = endpoints_[r]->LowLatencyCombine(c);
      ASSERT_TRUE(cop.ok()) << cop.status();
      auto res = cop->Wait(absl::Seconds(10));
      ASSERT_TRUE(res.ok()) << res.status();
      ASSERT_EQ(res->combined_x.shape(), (std::vector<int64_t>{in[r].T, H}));
      if (!a.use_fp8) {
        // Identity experts: combined = bf16(Σ_k w_k * x) over unmasked k.
        for (int t = 0; t < in[r].T; ++t) {
          for (int h = 0; h < H; ++h) {
            float acc = 0.f;
            for (int k = 0; k < K; ++k) {
              if (in[r].idx[t * K + k] < 0) continue;
              acc += in[r].w[t * K + k] * kernels::Bf16ToFloat(in[r].x[t * H + h]);
            }
            ASSERT_EQ(res->combined_x.as<bf16_bits>()[t * H + h], FloatToBf16(acc))
                << "rank " << r << " t " << t << " h " << h;
          }
        }
      }
    });
  }
  // The first dispatch's buffers were reused by the third: its handle is stale.
  OnEveryRank([&](int r) {
    std::vector<bf16_bits> y(size_t(E / R) * R * Mll * H, 0);
    std::vector<int64_t> ys{E / R, R * Mll, H};
    DLTensor yt = epd::MakeDLTensor(y.data(), {kDLBfloat, 16, 1}, ys);
    LowLatencyCombineArgs c;
    c.x = &yt;
    c.topk_idx = &in[r].idx_t;
    c.topk_weights = &in[r].w_t;
    c.handle = &first[r].handle;
    auto cop = endpoints_[r]->LowLatencyCombine(c);
    ASSERT_TRUE(cop.ok());
    auto res = cop->Wait(absl::Seconds(10));
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), absl::StatusCode::kFailedPrecondition) << res.status();
  });
}

// Only the latest kCompletionCapacity ops of an endpoint can be waited for: Wait on an
// older op, whose completion record a later op reused, is FAILED_PRECONDITION at once
// (it used to wait op_timeout + 5 s and then call the daemon dead).
TEST_F(HostDataPlaneTest, WaitOnAnOpWhoseCompletionWasReusedFailsAtOnce) {
  const int E = 4, H = 128, K = 2, Mll = 8;
  Open(Spec("old", 1, E, H, K, 4, Mll, true));
  RankData in;
  in.Make(Mll, H, K, E, 5);
  constexpr int kOps = static_cast<int>(abi::kCompletionCapacity) + 6;
  std::vector<PendingOp<LowLatencyDispatchResult>> ops;
  for (int i = 0; i < kOps; ++i) {
    LowLatencyDispatchArgs a;
    a.x = &in.x_t;
    a.topk_idx = &in.idx_t;
    auto op = endpoints_[0]->LowLatencyDispatch(a);
    ASSERT_TRUE(op.ok()) << "op " << i << ": " << op.status();
    ops.push_back(std::move(*op));
  }
  ASSERT_TRUE(ops.back().Wait(absl::Seconds(10)).ok());
  const auto start = std::chrono::steady_clock::now();
  auto old = ops.front().Wait(absl::Seconds(10));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  ASSERT_FALSE(old.ok());
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition) << old.status();
  EXPECT_NE(old.status().message().find("latest 64 ops"), std::string::npos) << old.status();
  // The latest 64 are still there.
  EXPECT_TRUE(ops[kOps - static_cast<int>(abi::kCompletionCapacity)].Wait(absl::Seconds(10)).ok());
}

TEST_F(HostDataPlaneTest, MissingRankTimesOutNamingItThenGroupRecovers) {
  const int R = 3, E = 3, H = 128, K = 1, M = 4;
  Open(Spec("t", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(2, H, K, E, r);
  auto start = std::chrono::steady_clock::now();
  OnEveryRank(
      [&](int r) {
        auto op = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
        ASSERT_TRUE(op.ok());
        auto res = op->Wait(absl::Seconds(10));
        ASSERT_FALSE(res.ok());
        EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded);
        EXPECT_NE(res.status().message().find("rank(s) 2"), std::string::npos) << res.status();
      },
      /*skip=*/2);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 0.5 + 1.0);
  // The late rank's request for that op fails at once; then all ranks work in step.
  auto late = endpoints_[2]->GetDispatchLayout(in[2].idx_t);
  ASSERT_TRUE(late.ok());
  auto late_res = late->Wait(absl::Seconds(5));
  EXPECT_EQ(late_res.status().code(), absl::StatusCode::kDeadlineExceeded);
  OnEveryRank([&](int r) {
    auto op = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_TRUE(res.ok()) << res.status();
  });
}

TEST_F(HostDataPlaneTest, GarbageSlotIsRejectedNotExecuted) {
  const int R = 2, E = 2, H = 128, K = 1, M = 4;
  spec_ = Spec("garbage", R, E, H, K, M, 0, false);
  auto g = plane_->CreateGroup(spec_);
  ASSERT_TRUE(g.ok());
  group_ = std::move(*g);
  endpoints_.clear();
  endpoints_.push_back(Attach(0));
  // Map rank 1's region a second time before its client does (the daemon unlinks the
  // name once the client has mapped it), as a misbehaving process on the node could.
  v1::EndpointInfo info;
  ASSERT_TRUE(group_->AttachRank(1, "", v1::LAUNCH_MODE_UNSPECIFIED, &info).ok());
  auto evil = ShmRegion::Open(info.shm_name(), info.shm_bytes());
  ASSERT_TRUE(evil.ok()) << evil.status();
  DataPlaneGroup* gp = group_.get();
  auto ep1 = internal::OpenEndpoint(info, spec_, [gp] {
    gp->DetachRank(1);
    return absl::OkStatus();
  });
  ASSERT_TRUE(ep1.ok());
  endpoints_.push_back(std::move(*ep1));

  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(3, H, K, E, r);
  auto* h = reinterpret_cast<abi::EndpointShmHeader*>(evil->data());
  auto* ring = reinterpret_cast<abi::RequestSlot*>(evil->data() + h->ring_offset);
  for (int i = 0; i < 3; ++i) {
    uint64_t head = abi::Atomic(h->ring_head).load();
    std::memset(&ring[(head + 1) % abi::kRingCapacity], 0xAB + i, sizeof(abi::RequestSlot));
    abi::Atomic(h->ring_head).store(head + 1);
  }
  // Every garbage slot is dropped and counted; the group's ops run normally.
  for (int round = 0; round < 2; ++round) {
    OnEveryRank([&](int r) {
      auto op = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
      ASSERT_TRUE(op.ok()) << op.status();
      auto res = op->Wait(absl::Seconds(10));
      ASSERT_TRUE(res.ok()) << res.status();
      int32_t sum = 0;
      for (int e = 0; e < E; ++e) sum += res->num_tokens_per_expert.as<int32_t>()[e];
      EXPECT_EQ(sum, 3 - std::count(in[r].idx.begin(), in[r].idx.end(), -1));
    });
  }
  EXPECT_EQ(abi::Atomic(h->rejected_requests).load(), 3u);
}

TEST_F(HostDataPlaneTest, ClientInputErrorsFailTheOpForAllAndKeepLockstep) {
  const int R = 2, E = 4, H = 128, K = 2, M = 4;
  Open(Spec("bad", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(3, H, K, E, r);
  RankData too_many;
  too_many.Make(M + 1, H, K, E, 5);
  OnEveryRank([&](int r) {
    DispatchArgs a;
    a.x = r == 0 ? &too_many.x_t : &in[r].x_t;
    a.topk_idx = r == 0 ? &too_many.idx_t : &in[r].idx_t;
    auto op = endpoints_[r]->Dispatch(a);
    if (r == 0) {
      ASSERT_FALSE(op.ok());
      EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(op.status().message().find("max_tokens_per_rank"), std::string::npos);
      return;
    }
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
    EXPECT_NE(res.status().message().find("rank 0"), std::string::npos) << res.status();
  });
  // An out-of-range expert id is caught by the op itself, for every rank.
  in[1].idx[1] = E;
  OnEveryRank([&](int r) {
    DispatchArgs a;
    a.x = &in[r].x_t;
    a.topk_idx = &in[r].idx_t;
    auto op = endpoints_[r]->Dispatch(a);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
  });
  in[1].idx[1] = 0;
  OnEveryRank([&](int r) {
    DispatchArgs a;
    a.x = &in[r].x_t;
    a.topk_idx = &in[r].idx_t;
    auto op = endpoints_[r]->Dispatch(a);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_TRUE(res.ok()) << res.status();
  });
}

TEST_F(HostDataPlaneTest, RankLeavingMidOpFailsOthersThenRejoinWorks) {
  const int R = 2, E = 2, H = 128, K = 1, M = 4;
  Open(Spec("leave", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(2, H, K, E, r);
  std::thread waiter([&] {
    auto op = endpoints_[0]->GetDispatchLayout(in[0].idx_t);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_FALSE(res.ok());
    EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_NE(res.status().message().find("rank 1 left"), std::string::npos) << res.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(endpoints_[1]->Leave().ok());
  waiter.join();
  // Ops after leaving fail cleanly on the client.
  auto after = endpoints_[1]->GetDispatchLayout(in[1].idx_t);
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  endpoints_[1] = Attach(1);
  ASSERT_NE(endpoints_[1], nullptr);
  OnEveryRank([&](int r) {
    auto op = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(10));
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->is_token_in_rank.shape(), (std::vector<int64_t>{2, R}));
  });
}

TEST_F(HostDataPlaneTest, ShutdownFailsInFlightAndLaterOpsWithUnavailable) {
  const int R = 2, E = 2, H = 128, K = 1, M = 4;
  Open(Spec("down", R, E, H, K, M, 0, false));
  RankData in;
  in.Make(2, H, K, E, 1);
  auto start = std::chrono::steady_clock::now();
  std::thread waiter([&] {
    auto op = endpoints_[0]->GetDispatchLayout(in.idx_t);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(30));
    EXPECT_EQ(res.status().code(), absl::StatusCode::kUnavailable) << res.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  plane_->Shutdown();
  waiter.join();
  // Well before op_timeout (500 ms) + 5 s: the shutdown itself completed the op.
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.45);
  auto later = endpoints_[1]->GetDispatchLayout(in.idx_t);
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable) << later.status();
}

TEST_F(HostDataPlaneTest, ShmIsPrivateAndUnlinkedOnceMapped) {
  spec_ = Spec("shm", 1, 1, 128, 1, 2, 0, false);
  auto g = plane_->CreateGroup(spec_);
  ASSERT_TRUE(g.ok());
  group_ = std::move(*g);
  v1::EndpointInfo info;
  ASSERT_TRUE(group_->AttachRank(0, "", v1::LAUNCH_MODE_UNSPECIFIED, &info).ok());
  const std::string path = "/dev/shm" + info.shm_name();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // 128 random bits in the name.
  EXPECT_GE(info.shm_name().size(), std::string("/epd-ep-").size() + 32);
  auto ep = internal::OpenEndpoint(info, spec_, [] { return absl::OkStatus(); });
  ASSERT_TRUE(ep.ok()) << ep.status();
  // The engine unlinks the name once the client has mapped the region.
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = ::stat(path.c_str(), &st) != 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(gone) << path << " still exists";
  // Released endpoints unlink too (an endpoint whose client never mapped it).
  v1::GroupSpec spec2 = Spec("shm2", 1, 1, 128, 1, 2, 0, false);
  auto g2 = plane_->CreateGroup(spec2);
  ASSERT_TRUE(g2.ok());
  v1::EndpointInfo info2;
  ASSERT_TRUE((*g2)->AttachRank(0, "", v1::LAUNCH_MODE_UNSPECIFIED, &info2).ok());
  (*g2)->DetachRank(0);
  EXPECT_NE(::stat(("/dev/shm" + info2.shm_name()).c_str(), &st), 0);
}

TEST_F(HostDataPlaneTest, EngineSleepsWhenIdleAndWakesForWork) {
  Open(Spec("idle", 1, 1, 128, 1, 2, 0, false));
  RankData in;
  in.Make(2, 128, 1, 1, 3);
  // Let the engine go to sleep, then measure this process's CPU time while idle.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  struct rusage before {
  }, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::getrusage(RUSAGE_SELF, &after);
  auto cpu_us = [](const struct rusage& r) {
    return r.ru_utime.tv_sec * 1e6 + r.ru_utime.tv_usec + r.ru_stime.tv_sec * 1e6 +
           r.ru_stime.tv_usec;
  };
  // A spinning engine would burn ~300 ms of CPU here; a sleeping one well under 10%.
  EXPECT_LT(cpu_us(after) - cpu_us(before), 30000.0);
  // The sleeping engine is woken by the doorbell: ops still complete promptly.
  for (int i = 0; i < 20; ++i) {
    auto op = endpoints_[0]->GetDispatchLayout(in.idx_t);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(2));
    ASSERT_TRUE(res.ok()) << res.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // engine sleeps again
  }
}

TEST_F(HostDataPlaneTest, MisalignedDispatchInputsAreRejectedNamingThemThenTheNextOpIsCorrect) {
  const int R = 2, E = 4, H = 128, K = 2, M = 4;
  Open(Spec("align", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(3, H, K, E, 40 + r);
  // Each rank's received rows and expert ids from a dispatch of its own inputs.
  auto dispatch_all = [&] {
    std::vector<std::vector<uint8_t>> out(R);
    OnEveryRank([&](int r) {
      DispatchArgs a;
      a.x = &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      a.topk_weights = &in[r].w_t;
      auto op = endpoints_[r]->Dispatch(a);
      ASSERT_TRUE(op.ok()) << op.status();
      auto res = op->Wait(absl::Seconds(10));
      ASSERT_TRUE(res.ok()) << res.status();
      const size_t N = static_cast<size_t>(res->num_recv_tokens);
      const auto* rx = static_cast<const uint8_t*>(res->recv_x.data());
      const auto* ri = static_cast<const uint8_t*>(res->recv_topk_idx.data());
      const auto* rw = static_cast<const uint8_t*>(res->recv_topk_weights.data());
      out[r].assign(rx, rx + N * H * 2);
      out[r].insert(out[r].end(), ri, ri + N * K * 8);
      out[r].insert(out[r].end(), rw, rw + N * K * 4);
    });
    return out;
  };
  const std::vector<std::vector<uint8_t>> reference = dispatch_all();
  ASSERT_FALSE(reference[0].empty());

  struct Case {
    const char* name;
    const DLTensor* src;
    uint64_t misalign;
    bool via_byte_offset;
    int alignment;
  };
  for (const Case& c :
       {Case{"x", &in[0].x_t, 1, true, 2}, Case{"topk_idx", &in[0].idx_t, 4, false, 8},
        Case{"topk_weights", &in[0].w_t, 2, true, 4}}) {
    SCOPED_TRACE(c.name);
    MisalignedCopy bad(*c.src, c.misalign, c.via_byte_offset);
    ExpectRank0Misaligned(
        "Dispatch", c.name, c.via_byte_offset ? c.misalign : 0, c.alignment, [&](int r) {
          DispatchArgs a;
          a.x = &in[r].x_t;
          a.topk_idx = &in[r].idx_t;
          a.topk_weights = &in[r].w_t;
          if (r == 0) {
            const std::string name = c.name;
            (name == "x" ? a.x : name == "topk_idx" ? a.topk_idx : a.topk_weights) = &bad.t;
          }
          return endpoints_[r]->Dispatch(a);
        });
    // The next op on the same endpoints is correct: the same results as before.
    EXPECT_EQ(dispatch_all(), reference);
  }
}

TEST_F(HostDataPlaneTest, MisalignedLayoutAndLowLatencyInputsAreRejectedThenTheNextOpIsCorrect) {
  const int R = 2, E = 4, H = 128, K = 2, Mll = 4;
  Open(Spec("align-ll", R, E, H, K, 4, Mll, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(Mll - r, H, K, E, 50 + r);
  // The experts' outputs each rank's low-latency combine sends: [E/R, R*Mll, H] bf16.
  std::vector<std::vector<bf16_bits>> y(R);
  std::vector<int64_t> ys{E / R, R * Mll, H};
  std::vector<DLTensor> yt(R);
  for (int r = 0; r < R; ++r) {
    y[r].resize(size_t(E / R) * R * Mll * H);
    for (size_t i = 0; i < y[r].size(); ++i) y[r][i] = FloatToBf16(float((i * 7 + r) % 13) / 8.f);
    yt[r] = epd::MakeDLTensor(y[r].data(), {kDLBfloat, 16, 1}, ys);
  }
  // Every rank's low-latency dispatch of its inputs, into d.
  std::vector<LowLatencyDispatchResult> d(R);
  auto ll_dispatch_all = [&] {
    OnEveryRank([&](int r) {
      LowLatencyDispatchArgs a;
      a.x = &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      auto op = endpoints_[r]->LowLatencyDispatch(a);
      ASSERT_TRUE(op.ok()) << op.status();
      auto res = op->Wait(absl::Seconds(10));
      ASSERT_TRUE(res.ok()) << res.status();
      d[r] = *res;
    });
  };
  // Each rank's layout, then its low-latency dispatch and combine (of y).
  auto run_all = [&] {
    std::vector<std::vector<uint8_t>> out(R);
    OnEveryRank([&](int r) {
      auto lop = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
      ASSERT_TRUE(lop.ok()) << lop.status();
      auto layout = lop->Wait(absl::Seconds(10));
      ASSERT_TRUE(layout.ok()) << layout.status();
      const auto* pe = static_cast<const uint8_t*>(layout->num_tokens_per_expert.data());
      const auto* tr = static_cast<const uint8_t*>(layout->is_token_in_rank.data());
      out[r].assign(pe, pe + E * 4);
      out[r].insert(out[r].end(), tr, tr + in[r].T * R);
    });
    ll_dispatch_all();
    OnEveryRank([&](int r) {
      const auto* rc = static_cast<const uint8_t*>(d[r].recv_count.data());
      out[r].insert(out[r].end(), rc, rc + (E / R) * 4);
      LowLatencyCombineArgs c;
      c.x = &yt[r];
      c.topk_idx = &in[r].idx_t;
      c.topk_weights = &in[r].w_t;
      c.handle = &d[r].handle;
      auto cop = endpoints_[r]->LowLatencyCombine(c);
      ASSERT_TRUE(cop.ok()) << cop.status();
      auto combined = cop->Wait(absl::Seconds(10));
      ASSERT_TRUE(combined.ok()) << combined.status();
      const auto* cx = static_cast<const uint8_t*>(combined->combined_x.data());
      out[r].insert(out[r].end(), cx, cx + size_t(in[r].T) * H * 2);
    });
    return out;
  };
  const std::vector<std::vector<uint8_t>> reference = run_all();
  ASSERT_FALSE(reference[0].empty());
  {  // GetDispatchLayout: int64 topk_idx 4 bytes past an 8-byte boundary.
    MisalignedCopy bad(in[0].idx_t, 4, true);
    ExpectRank0Misaligned("GetDispatchLayout", "topk_idx", 4, 8, [&](int r) {
      return endpoints_[r]->GetDispatchLayout(r == 0 ? bad.t : in[r].idx_t);
    });
    EXPECT_EQ(run_all(), reference);
  }
  {  // LowLatencyDispatch: bf16 x at an odd address (data pointer, byte_offset 0).
    MisalignedCopy bad(in[0].x_t, 1, false);
    ExpectRank0Misaligned("LowLatencyDispatch", "x", 0, 2, [&](int r) {
      LowLatencyDispatchArgs a;
      a.x = r == 0 ? &bad.t : &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      return endpoints_[r]->LowLatencyDispatch(a);
    });
    EXPECT_EQ(run_all(), reference);
  }
  {  // LowLatencyCombine (after a dispatch): f32 topk_weights 2 bytes past a 4-byte boundary.
    MisalignedCopy bad(in[0].w_t, 2, true);
    ll_dispatch_all();
    ExpectRank0Misaligned("LowLatencyCombine", "topk_weights", 2, 4, [&](int r) {
      LowLatencyCombineArgs c;
      c.x = &yt[r];
      c.topk_idx = &in[r].idx_t;
      c.topk_weights = r == 0 ? &bad.t : &in[r].w_t;
      c.handle = &d[r].handle;
      return endpoints_[r]->LowLatencyCombine(c);
    });
    EXPECT_EQ(run_all(), reference);
  }
}

}  // namespace
}  // namespace epd
