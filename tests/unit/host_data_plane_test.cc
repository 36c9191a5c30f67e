// The host data plane in-process: endpoints opened by the real client code
// (internal::OpenEndpoint) on a HostDataPlane, ops run from one thread per rank, results
// compared with kernels/host run directly on the same inputs. Also the failure paths:
// garbage in a ring slot, a rank that never arrives, a rank leaving mid-op, stale
// handles, client-side input errors — after each, the group keeps working.
#include "daemon/dataplane/host/host_data_plane.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/endpoint/endpoint_internal.h"
#include "common/os/shm_region.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/op_rules.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/contract_rules.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

using kernels::bf16_bits;
using kernels::FloatToBf16;

v1::GroupSpec Spec(const std::string& name, int R, int E, int H, int K, int M, int Mll, bool fp8) {
  return testing::MakeSpec(name, {.num_ranks = R,
                                  .num_experts = E,
                                  .hidden = H,
                                  .num_topk = K,
                                  .max_tokens_per_rank = M,
                                  .ll_max_tokens_per_rank = Mll,
                                  .use_fp8 = fp8});
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
    x_t = epd::MakeDLTensor(x.data(), kBf16, xs);
    idx_t = epd::MakeDLTensor(idx.data(), kI64, ks);
    w_t = epd::MakeDLTensor(w.data(), kF32, ks);
  }
};

/// Runs fn(r) for r in [0, n) on one thread each and joins, skipping `skip`.
void RunOnRanks(int n, const std::function<void(int)>& fn, int skip = -1) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    if (r != skip) threads.emplace_back(fn, r);
  }
  for (auto& t : threads) t.join();
}

/// Whether the first `bytes` of `view` equal `ref`.
bool SameBytes(const TensorView& view, const void* ref, size_t bytes) {
  return static_cast<size_t>(view.nbytes()) >= bytes && std::memcmp(view.data(), ref, bytes) == 0;
}

/// kernels/host's normal dispatch of every rank's `in` (the oracle): its outputs per rank.
struct DispatchReference {
  std::vector<std::vector<bf16_bits>> recv_x;
  std::vector<std::vector<int64_t>> recv_idx;
  std::vector<std::vector<float>> recv_w;
  std::vector<std::vector<int32_t>> tokens_per_expert, src_info, send_pos, prefix;
  std::vector<kernels::host::DispatchRankArgs> args;  ///< num_recv_tokens: each rank's N.

  /// Runs it (moving the weights when `weights`).
  void Run(const kernels::GroupShape& shape, const std::vector<RankData>& in, bool weights,
           int32_t expert_alignment) {
    const int R = shape.num_ranks;
    const int64_t N = shape.max_recv_tokens(), K = shape.num_topk;
    recv_x.assign(R, std::vector<bf16_bits>(N * shape.hidden));
    recv_idx.assign(R, std::vector<int64_t>(N * K));
    recv_w.assign(R, std::vector<float>(N * K));
    tokens_per_expert.assign(R, std::vector<int32_t>(shape.num_local_experts()));
    src_info.assign(R, std::vector<int32_t>(N));
    send_pos.assign(R, std::vector<int32_t>(int64_t{shape.max_tokens_per_rank} * R));
    prefix.assign(R, std::vector<int32_t>(R));
    args.assign(R, {});
    for (int r = 0; r < R; ++r) {
      kernels::host::DispatchRankArgs& a = args[r];
      a.num_tokens = in[r].T;
      a.x = in[r].x.data();
      a.topk_idx = in[r].idx.data();
      a.topk_weights = weights ? in[r].w.data() : nullptr;
      a.recv_capacity = N;
      a.recv_x = recv_x[r].data();
      a.recv_topk_idx = recv_idx[r].data();
      a.recv_topk_weights = recv_w[r].data();
      a.recv_tokens_per_expert = tokens_per_expert[r].data();
      a.recv_src_info = src_info[r].data();
      a.send_pos = send_pos[r].data();
      a.rank_prefix = prefix[r].data();
    }
    ASSERT_TRUE(kernels::host::Dispatch(shape, {false, expert_alignment}, args).ok());
  }
};

/// A well-behaved group beside an attacker in the same plane: fixed inputs, the results
/// kernels/host gives for them, and rounds of Dispatch, Combine, LowLatencyDispatch and
/// LowLatencyCombine on every rank whose every result must equal them exactly.
class VictimGroup {
 public:
  static constexpr int R = 2, E = 4, H = 128, K = 2, M = 8, Mll = 8, El = E / R;

  /// Creates group `name` on `plane`, opens its endpoints and computes the reference.
  void Open(DataPlane& plane, const std::string& name) {
    spec_ = Spec(name, R, E, H, K, M, Mll, false);
    auto g = plane.CreateGroup(spec_);
    ASSERT_TRUE(g.ok()) << g.status();
    group_ = std::move(*g);
    for (int r = 0; r < R; ++r) {
      v1::EndpointInfo info;
      ASSERT_TRUE(group_->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok());
      DataPlaneGroup* gp = group_.get();
      absl::StatusOr<EndpointFds> fds = gp->TakeEndpointFds(r);
      ASSERT_TRUE(fds.ok()) << fds.status();
      auto ep = internal::OpenEndpoint(info, spec_, *std::move(fds), [gp, r] {
        gp->DetachRank(r);
        return absl::OkStatus();
      });
      ASSERT_TRUE(ep.ok()) << ep.status();
      eps_.push_back(std::move(*ep));
    }
    in_.resize(R);
    for (int r = 0; r < R; ++r) in_[r].Make(Mll - 2 * r, H, K, E, 900 + r);
    ComputeReference();
  }

  /// One round on every rank: the first op error or mismatch, OK when every result was
  /// exact.
  absl::Status Round() {
    std::vector<absl::Status> st(R);
    RunOnRanks(R, [&](int r) { st[r] = RankRound(r); });
    for (const absl::Status& s : st) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  void ComputeReference() {
    const kernels::GroupShape shape{R, E, H, K, M, Mll, false};
    ASSERT_NO_FATAL_FAILURE(ref_.Run(shape, in_, /*weights=*/true, 1));
    // Combine of 2x the received rows.
    expert_out_.assign(R, {});
    expert_shape_.assign(R, {});
    expert_t_.assign(R, {});
    combined_.assign(R, {});
    std::vector<kernels::host::CombineRankArgs> ca(R);
    for (int r = 0; r < R; ++r) {
      const int N = ref_.args[r].num_recv_tokens;
      expert_out_[r].resize(static_cast<size_t>(N) * H);
      for (size_t i = 0; i < expert_out_[r].size(); ++i) {
        expert_out_[r][i] = FloatToBf16(2.f * kernels::Bf16ToFloat(ref_.recv_x[r][i]));
      }
      expert_shape_[r] = {N, H};
      expert_t_[r] = epd::MakeDLTensor(expert_out_[r].data(), kBf16, expert_shape_[r]);
      combined_[r].resize(static_cast<size_t>(in_[r].T) * H);
      ca[r] = {in_[r].T, ref_.send_pos[r].data(), N,      expert_out_[r].data(),
               nullptr,  combined_[r].data(),     nullptr};
    }
    ASSERT_TRUE(kernels::host::Combine(shape, ca).ok());
    // Low-latency dispatch, then a combine of identity experts (y = the received rows).
    ll_recv_x_.assign(R, std::vector<bf16_bits>(El * R * Mll * H));
    ll_count_.assign(R, std::vector<int32_t>(El));
    std::vector<std::vector<int32_t>> ll_src(R, std::vector<int32_t>(El * R * Mll)),
        handle(R, std::vector<int32_t>(Mll * K));
    std::vector<kernels::host::LowLatencyDispatchRankArgs> la(R);
    for (int r = 0; r < R; ++r) {
      la[r] = {in_[r].T, in_[r].x.data(),     in_[r].idx.data(), ll_recv_x_[r].data(),
               nullptr,  ll_count_[r].data(), ll_src[r].data(),  handle[r].data()};
    }
    ASSERT_TRUE(kernels::host::LowLatencyDispatch(shape, {}, la).ok());
    ll_y_shape_ = {El, R * Mll, H};
    ll_y_t_.assign(R, {});
    ll_combined_.assign(R, {});
    std::vector<kernels::host::LowLatencyCombineRankArgs> lc(R);
    for (int r = 0; r < R; ++r) {
      ll_y_t_[r] = epd::MakeDLTensor(ll_recv_x_[r].data(), kBf16, ll_y_shape_);
      ll_combined_[r].resize(static_cast<size_t>(in_[r].T) * H);
      lc[r] = {in_[r].T,         in_[r].idx.data(),    in_[r].w.data(),
               handle[r].data(), ll_recv_x_[r].data(), ll_combined_[r].data()};
    }
    ASSERT_TRUE(kernels::host::LowLatencyCombine(shape, lc).ok());
  }

  absl::Status Mismatch(int r, const char* what) const {
    return absl::DataLossError(
        absl::StrCat("victim group ", spec_.name(), " rank ", r, ": ", what, " differs"));
  }

  absl::Status RankRound(int r) {
    const size_t N = static_cast<size_t>(ref_.args[r].num_recv_tokens);
    const size_t T = static_cast<size_t>(in_[r].T);
    DispatchArgs a;
    a.x = &in_[r].x_t;
    a.topk_idx = &in_[r].idx_t;
    a.topk_weights = &in_[r].w_t;
    auto op = eps_[r]->Dispatch(a);
    if (!op.ok()) return op.status();
    auto d = op->Wait(absl::Seconds(30));
    if (!d.ok()) return d.status();
    if (d->num_recv_tokens != static_cast<int32_t>(N)) return Mismatch(r, "num_recv_tokens");
    if (!SameBytes(d->recv_x, ref_.recv_x[r].data(), N * H * 2) ||
        !SameBytes(d->recv_topk_idx, ref_.recv_idx[r].data(), N * K * 8) ||
        !SameBytes(d->recv_topk_weights, ref_.recv_w[r].data(), N * K * 4) ||
        !SameBytes(d->recv_src_info, ref_.src_info[r].data(), N * 4)) {
      return Mismatch(r, "Dispatch output");
    }
    CombineArgs c;
    c.x = &expert_t_[r];
    c.handle = &d->handle;
    auto cop = eps_[r]->Combine(c);
    if (!cop.ok()) return cop.status();
    auto combined = cop->Wait(absl::Seconds(30));
    if (!combined.ok()) return combined.status();
    if (!SameBytes(combined->combined_x, combined_[r].data(), T * H * 2)) {
      return Mismatch(r, "Combine output");
    }
    LowLatencyDispatchArgs la;
    la.x = &in_[r].x_t;
    la.topk_idx = &in_[r].idx_t;
    auto lop = eps_[r]->LowLatencyDispatch(la);
    if (!lop.ok()) return lop.status();
    auto ld = lop->Wait(absl::Seconds(30));
    if (!ld.ok()) return ld.status();
    if (!SameBytes(ld->recv_count, ll_count_[r].data(), El * 4)) return Mismatch(r, "recv_count");
    for (int j = 0; j < El; ++j) {
      const size_t block = static_cast<size_t>(j) * R * Mll * H;
      if (std::memcmp(ld->recv_x.as<bf16_bits>() + block, ll_recv_x_[r].data() + block,
                      static_cast<size_t>(ll_count_[r][j]) * H * 2) != 0) {
        return Mismatch(r, "LowLatencyDispatch recv_x");
      }
    }
    LowLatencyCombineArgs lc;
    lc.x = &ll_y_t_[r];
    lc.topk_idx = &in_[r].idx_t;
    lc.topk_weights = &in_[r].w_t;
    lc.handle = &ld->handle;
    auto lcop = eps_[r]->LowLatencyCombine(lc);
    if (!lcop.ok()) return lcop.status();
    auto lcombined = lcop->Wait(absl::Seconds(30));
    if (!lcombined.ok()) return lcombined.status();
    if (!SameBytes(lcombined->combined_x, ll_combined_[r].data(), T * H * 2)) {
      return Mismatch(r, "LowLatencyCombine output");
    }
    return absl::OkStatus();
  }

  v1::GroupSpec spec_;
  std::unique_ptr<DataPlaneGroup> group_;
  std::vector<std::unique_ptr<Endpoint>> eps_;
  std::vector<RankData> in_;
  DispatchReference ref_;
  std::vector<std::vector<bf16_bits>> expert_out_, combined_, ll_recv_x_, ll_combined_;
  std::vector<std::vector<int64_t>> expert_shape_;
  std::vector<std::vector<int32_t>> ll_count_;
  std::vector<DLTensor> expert_t_, ll_y_t_;
  std::vector<int64_t> ll_y_shape_;
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

  /// Creates the one-rank group `spec` and maps its endpoint as a raw ring (no client
  /// library); `info` gets the endpoint's EndpointInfo. Null on failure (reported).
  std::unique_ptr<testing::RawRing> OpenRawRing(const v1::GroupSpec& spec, v1::EndpointInfo* info) {
    spec_ = spec;
    auto g = plane_->CreateGroup(spec_);
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok()) return nullptr;
    group_ = std::move(*g);
    absl::Status st = group_->AttachRank(0, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, info);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return nullptr;
    return testing::RawRing::Open(*info, *group_);
  }

  std::unique_ptr<Endpoint> Attach(int r) {
    v1::EndpointInfo info;
    absl::Status st = group_->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
    EXPECT_TRUE(st.ok()) << st;
    DataPlaneGroup* g = group_.get();
    absl::StatusOr<EndpointFds> fds = g->TakeEndpointFds(r);
    EXPECT_TRUE(fds.ok()) << fds.status();
    if (!fds.ok()) return nullptr;
    auto ep = internal::OpenEndpoint(info, spec_, *std::move(fds), [g, r] {
      g->DetachRank(r);
      return absl::OkStatus();
    });
    EXPECT_TRUE(ep.ok()) << ep.status();
    return ep.ok() ? std::move(*ep) : nullptr;
  }

  /// Creates the two-rank group `spec` and opens both endpoints; returns a second mapping of
  /// rank 1's region, as a misbehaving client could make (it holds the region's descriptor).
  absl::StatusOr<ShmRegion> OpenWithRank1MappedTwice(const v1::GroupSpec& spec) {
    spec_ = spec;
    EPD_ASSIGN_OR_RETURN(group_, plane_->CreateGroup(spec_));
    endpoints_.clear();
    endpoints_.push_back(Attach(0));
    v1::EndpointInfo info;
    EPD_RETURN_IF_ERROR(group_->AttachRank(1, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info));
    EPD_ASSIGN_OR_RETURN(EndpointFds fds, group_->TakeEndpointFds(1));
    EPD_ASSIGN_OR_RETURN(ShmRegion second, ShmRegion::Map(ScopedFd(::dup(fds.region.get())),
                                                          info.shm_bytes(), "second mapping"));
    DataPlaneGroup* gp = group_.get();
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<Endpoint> rank1,
                         internal::OpenEndpoint(info, spec_, std::move(fds), [gp] {
                           gp->DetachRank(1);
                           return absl::OkStatus();
                         }));
    endpoints_.push_back(std::move(rank1));
    return second;
  }

  /// Runs fn(rank) on one thread per rank and joins.
  void OnEveryRank(const std::function<void(int)>& fn, int skip = -1) {
    RunOnRanks(spec_.num_ranks(), fn, skip);
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

// What a group's creation allocates privately is reported for the join's checks: at least
// the kernel scratch's R*M*R int32 of routing and each rank's [M, R] send_pos.
TEST_F(HostDataPlaneTest, GroupPrivateBytesCountsTheKernelScratch) {
  v1::GroupSpec spec;
  spec.set_name("big");
  spec.set_num_ranks(1024);
  spec.set_num_experts(1024);
  spec.set_hidden(256);
  spec.set_num_topk(2);
  spec.set_max_tokens_per_rank(1024);
  const uint64_t routing = uint64_t{1024} * 1024 * 1024 * sizeof(int32_t);
  EXPECT_GE(plane_->GroupPrivateBytes(spec), 2 * routing);
  spec.set_num_ranks(2);
  spec.set_num_experts(8);
  spec.set_max_tokens_per_rank(16);
  EXPECT_GT(plane_->GroupPrivateBytes(spec), 0u);
  EXPECT_LT(plane_->GroupPrivateBytes(spec), uint64_t{1} << 20);
}

TEST_F(HostDataPlaneTest, DispatchCombineMatchKernelsHost) {
  const int R = 3, E = 6, H = 256, K = 2, M = 16;
  Open(Spec("g", R, E, H, K, M, 0, false));
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(r == 1 ? 0 : 5 + 4 * r, H, K, E, 10 + r);

  // Oracle: kernels/host on the same inputs.
  kernels::GroupShape shape{R, E, H, K, M, 0, false};
  DispatchReference ref;
  ASSERT_NO_FATAL_FAILURE(ref.Run(shape, in, /*weights=*/true, 4));

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
    const int N = ref.args[r].num_recv_tokens;
    ASSERT_EQ(got[r].num_recv_tokens, N) << "rank " << r;
    ASSERT_EQ(got[r].recv_x.shape(), (std::vector<int64_t>{N, H}));
    EXPECT_EQ(0, std::memcmp(got[r].recv_x.data(), ref.recv_x[r].data(), size_t(N) * H * 2)) << r;
    EXPECT_EQ(0,
              std::memcmp(got[r].recv_topk_idx.data(), ref.recv_idx[r].data(), size_t(N) * K * 8))
        << r;
    EXPECT_EQ(0,
              std::memcmp(got[r].recv_topk_weights.data(), ref.recv_w[r].data(), size_t(N) * K * 4))
        << r;
    EXPECT_EQ(0, std::memcmp(got[r].num_recv_tokens_per_expert.data(),
                             ref.tokens_per_expert[r].data(), (E / R) * 4));
    EXPECT_EQ(0, std::memcmp(got[r].recv_src_info.data(), ref.src_info[r].data(), size_t(N) * 4));
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
    et[r] = epd::MakeDLTensor(expert_out[r].data(), kBf16, eshape[r]);
    oc[r].resize(size_t(in[r].T) * H);
    ca[r] = {in[r].T, ref.send_pos[r].data(), N,      expert_out[r].data(),
             nullptr, oc[r].data(),           nullptr};
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
        x_in = epd::MakeDLTensor(v.data(), kBf16, xs);
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
      DLTensor yt = epd::MakeDLTensor(y.data(), kBf16, ys);
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
    DLTensor yt = epd::MakeDLTensor(y.data(), kBf16, ys);
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

// The rules client.h and DESIGN.md §3.3 state (tests/common/contract_rules.h): duplicate
// experts, is_token_in_rank's dtype, recv_topk_weights without topk_weights, a cached
// re-dispatch's outputs, empty sums, the FP8 scale floor.
TEST_F(HostDataPlaneTest, ContractRulesOfClientHHold) {
  Open(testing::contract::Spec("contract"));
  std::vector<Endpoint*> eps;
  for (const auto& ep : endpoints_) eps.push_back(ep.get());
  testing::contract::CheckContractRules(eps, [](const TensorView& v) {
    const auto* p = static_cast<const uint8_t*>(v.data());
    return std::vector<uint8_t>(p, p + v.nbytes());
  });
}

// Only the latest kCompletionCapacity ops of an endpoint can be waited for: Wait on an
// older op, whose completion record a later op reused, is FAILED_PRECONDITION at once
// (not after op_timeout + 5 s with the daemon called dead).
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
  absl::StatusOr<ShmRegion> evil =
      OpenWithRank1MappedTwice(Spec("garbage", R, E, H, K, M, 0, false));
  ASSERT_TRUE(evil.ok()) << evil.status();

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

// A ring_head far past the tail is no client's requests: skipped whole and counted once,
// not drained slot by slot (2^62 slots would hold the engine thread for good).
TEST_F(HostDataPlaneTest, RingHeadFarAheadIsSkippedAtOnceNotDrained) {
  const int R = 2, E = 2, H = 128, K = 1, M = 4;
  absl::StatusOr<ShmRegion> evil =
      OpenWithRank1MappedTwice(Spec("head-ahead", R, E, H, K, M, 0, false));
  ASSERT_TRUE(evil.ok()) << evil.status();
  auto* h = reinterpret_cast<abi::EndpointShmHeader*>(evil->data());
  const uint64_t far = abi::Atomic(h->ring_head).load() + (uint64_t{1} << 62);
  abi::Atomic(h->ring_head).store(far);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (abi::Atomic(h->ring_tail).load() != far && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(abi::Atomic(h->ring_tail).load(), far);
  EXPECT_EQ(abi::Atomic(h->rejected_requests).load(), 1u);
}

// daemon_closed lies in memory the client can write: a value epd never writes there is
// the client's own memory overwritten, reported as such (DATA_LOSS naming the field and
// value) on that endpoint alone, never taken for a shutdown or a removal; epd goes on
// serving the group once the word is back to open.
TEST_F(HostDataPlaneTest, ScribbledCloseFlagIsAClearErrorNotADrainingDaemon) {
  const int R = 2, E = 2, H = 128, K = 1, M = 4;
  absl::StatusOr<ShmRegion> evil =
      OpenWithRank1MappedTwice(Spec("scribbled-close", R, E, H, K, M, 0, false));
  ASSERT_TRUE(evil.ok()) << evil.status();
  auto* h = reinterpret_cast<abi::EndpointShmHeader*>(evil->data());
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(3, H, K, E, r);
  auto expect_scribbled = [](const absl::Status& st, uint32_t value) {
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_THAT(std::string(st.message()),
                ::testing::HasSubstr(absl::StrCat("daemon_closed holds ", value)))
        << st;
  };

  for (uint32_t value : {3u, 0xffffffffu, 0x80000001u}) {
    // Read by a wait: rank 1's op waits for rank 0 while the word is overwritten.
    auto op = endpoints_[1]->GetDispatchLayout(in[1].idx_t);
    ASSERT_TRUE(op.ok()) << op.status();
    abi::Atomic(h->daemon_closed).store(value);
    expect_scribbled(op->Wait(absl::Seconds(10)).status(), value);
    // Read by a submit.
    expect_scribbled(endpoints_[1]->GetDispatchLayout(in[1].idx_t).status(), value);
    // Rank 0 completes the op rank 1 submitted; then, the word put back, the group runs.
    auto op0 = endpoints_[0]->GetDispatchLayout(in[0].idx_t);
    ASSERT_TRUE(op0.ok()) << op0.status();
    EXPECT_TRUE(op0->Wait(absl::Seconds(10)).ok());
    abi::Atomic(h->daemon_closed).store(0);
    OnEveryRank([&](int r) {
      auto next = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
      ASSERT_TRUE(next.ok()) << next.status();
      auto res = next->Wait(absl::Seconds(10));
      EXPECT_TRUE(res.ok()) << res.status();
    });
  }
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

// An endpoint's memory is a sealed memfd with no name: its descriptors are handed out once
// (the fd channel's TakeEndpointFds), the region and the doorbell can be neither shrunk nor
// grown by whoever holds them (the daemon maps them: a shrink would SIGBUS it), and the
// seals cannot be removed.
TEST_F(HostDataPlaneTest, EndpointMemoryIsSealedNamelessAndHandedOutOnce) {
  spec_ = Spec("shm", 1, 1, 128, 1, 2, 0, false);
  auto g = plane_->CreateGroup(spec_);
  ASSERT_TRUE(g.ok());
  group_ = std::move(*g);
  v1::EndpointInfo info;
  ASSERT_TRUE(group_->AttachRank(0, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok());
  absl::StatusOr<EndpointFds> fds = group_->TakeEndpointFds(0);
  ASSERT_TRUE(fds.ok()) << fds.status();
  EXPECT_EQ(fds->endpoint_id, info.endpoint_id());
  absl::StatusOr<EndpointFds> again = group_->TakeEndpointFds(0);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_THAT(std::string(again.status().message()), ::testing::HasSubstr("already handed out"));
  EXPECT_EQ(group_->TakeEndpointFds(5).status().code(), absl::StatusCode::kNotFound);
  for (const auto& [fd, bytes] : {std::pair<int, uint64_t>{fds->region.get(), info.shm_bytes()},
                                  {fds->doorbell.get(), sizeof(abi::DoorbellPage)}}) {
    char link[256] = {};
    ASSERT_GT(::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1), 0);
    EXPECT_TRUE(absl::StartsWith(link, "/memfd:epd-")) << link;  // No file in /dev/shm.
    EXPECT_EQ(::fcntl(fd, F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
    for (const off_t size :
         {off_t{0}, static_cast<off_t>(bytes / 2), static_cast<off_t>(bytes * 2)}) {
      EXPECT_EQ(::ftruncate(fd, size), -1) << size;
      EXPECT_EQ(errno, EPERM) << size;
    }
    EXPECT_NE(::posix_fallocate(fd, 0, static_cast<off_t>(bytes * 2)), 0);
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
    struct stat st {};
    ASSERT_EQ(::fstat(fd, &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
  }
  auto ep = internal::OpenEndpoint(info, spec_, *std::move(fds), [] { return absl::OkStatus(); });
  ASSERT_TRUE(ep.ok()) << ep.status();
  RankData in;
  in.Make(2, 128, 1, 1, 3);
  auto op = (*ep)->GetDispatchLayout(in.idx_t);
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_TRUE(op->Wait(absl::Seconds(10)).ok());
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
    yt[r] = epd::MakeDLTensor(y[r].data(), kBf16, ys);
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

// The shm header is client-writable. A client that sets the ring, completion and data
// offsets, the sizes, capacities and the ring tail in its header to huge or shifted values
// neither crashes the daemon nor moves where it reads and writes: the daemon uses the layout
// it computed at attach, publishes its ring tail and never reads any of them back. The ops
// still complete with exact results, nothing else in the region is written, and another
// group of the plane keeps its exact results.
TEST_F(HostDataPlaneTest, HeaderOffsetsSizesAndTailWrittenByTheClientAreNeverUsed) {
  VictimGroup victim;
  ASSERT_NO_FATAL_FAILURE(victim.Open(*plane_, "victim"));
  ASSERT_TRUE(victim.Round().ok());

  const int E = 4, H = 128, K = 2, M = 8, T = 6;
  v1::EndpointInfo info;
  auto ring = OpenRawRing(Spec("scribbled-header", 1, E, H, K, M, 0, false), &info);
  ASSERT_NE(ring, nullptr);
  const kernels::GroupShape shape{1, E, H, K, M, 0, false};
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(shape);
  uint8_t* data = ring->data();
  std::memset(data, 0x5A, L.total_bytes);  // Canary: what no op of this test writes stays.
  RankData in;
  in.Make(T, H, K, E, 31);
  std::memcpy(data + L.in_x.offset, in.x.data(), in.x.size() * 2);
  std::memcpy(data + L.in_topk_idx.offset, in.idx.data(), in.idx.size() * 8);

  // The reference: kernels/host on the same inputs.
  std::vector<int32_t> per_rank(1), per_expert(E);
  std::vector<uint8_t> in_rank(T);
  kernels::host::LayoutRankArgs la{T, in.idx.data(), per_rank.data(), per_expert.data(),
                                   in_rank.data()};
  ASSERT_TRUE(kernels::host::GetDispatchLayout(shape, la).ok());
  DispatchReference ref;
  ASSERT_NO_FATAL_FAILURE(ref.Run(shape, {in}, /*weights=*/false, 1));
  const std::vector<bf16_bits>& recv_x = ref.recv_x[0];
  const int N = ref.args[0].num_recv_tokens;
  std::vector<bf16_bits> combined(T * H);
  std::vector<kernels::host::CombineRankArgs> ca(1);
  ca[0] = {T, ref.send_pos[0].data(), N, recv_x.data(), nullptr, combined.data(), nullptr};
  ASSERT_TRUE(kernels::host::Combine(shape, ca).ok());

  // Every layout word of the header, scribbled.
  abi::EndpointShmHeader* h = ring->header();
  h->ring_offset = uint64_t{1} << 46;
  h->completion_offset = (uint64_t{1} << 46) + 8;
  h->data_offset = info.data_offset() + 64 * 1024;
  h->data_bytes = std::numeric_limits<uint64_t>::max();
  h->total_bytes = std::numeric_limits<uint64_t>::max();
  h->ring_capacity = 1u << 31;
  h->completion_capacity = 1u << 31;
  h->size = 1;
  h->ring_tail = 0xdeadbeef;
  auto run = [&](abi::OpKind op, uint64_t handle_seq) -> std::optional<abi::Completion> {
    const uint64_t seq = ring->Submit(op, 0, T, handle_seq);
    auto c = ring->Await(seq, std::chrono::seconds(10));
    EXPECT_TRUE(c.has_value()) << abi::OpKindName(op) << " never completed";
    if (c) EXPECT_EQ(c->status_code, 0) << abi::OpKindName(op) << ": " << c->message;
    return c;
  };
  auto at = [&](const kernels::Region& r) { return data + r.offset; };
  ASSERT_TRUE(run(abi::OpKind::kGetDispatchLayout, 0));
  EXPECT_EQ(0, std::memcmp(at(L.layout_tokens_per_rank), per_rank.data(), 4));
  EXPECT_EQ(0, std::memcmp(at(L.layout_tokens_per_expert), per_expert.data(), E * 4));
  EXPECT_EQ(0, std::memcmp(at(L.layout_is_token_in_rank), in_rank.data(), T));
  const uint64_t dispatch_seq = info.first_seq() + 1;
  auto d = run(abi::OpKind::kDispatch, 0);
  ASSERT_TRUE(d);
  ASSERT_EQ(d->num_recv_tokens, N);
  EXPECT_EQ(0, std::memcmp(at(L.recv_x), recv_x.data(), size_t(N) * H * 2));
  EXPECT_EQ(0, std::memcmp(at(L.recv_topk_idx), ref.recv_idx[0].data(), size_t(N) * K * 8));
  EXPECT_EQ(0, std::memcmp(at(L.recv_src_info), ref.src_info[0].data(), size_t(N) * 4));
  EXPECT_EQ(0, std::memcmp(at(L.send_pos), ref.send_pos[0].data(), T * 4));  // Published.
  std::memcpy(at(L.in_combine_x), recv_x.data(), size_t(N) * H * 2);         // Identity experts.
  ASSERT_TRUE(run(abi::OpKind::kCombine, dispatch_seq));
  EXPECT_EQ(0, std::memcmp(at(L.combined_x), combined.data(), combined.size() * 2));
  // The daemon's tail is its own: published, never read back.
  EXPECT_EQ(abi::Atomic(h->ring_tail).load(), dispatch_seq + 1);

  // Nothing but the staged inputs and the regions these ops write was touched.
  const std::set<std::string> written = {"in_x",
                                         "in_topk_idx",
                                         "in_combine_x",
                                         "layout_tokens_per_rank",
                                         "recv_x",
                                         "recv_topk_idx",
                                         "recv_topk_weights",  // zeros: no weights
                                         "layout_is_token_in_rank",
                                         "layout_tokens_per_expert",
                                         "send_pos",
                                         "rank_prefix",
                                         "recv_tokens_per_expert",
                                         "recv_src_info",
                                         "recv_count",
                                         "combined_x"};
  std::vector<uint8_t> owned(L.total_bytes, 0);
  L.ForEachRegion([&](const char* name, const kernels::Region& r) {
    if (written.count(name)) std::fill_n(owned.begin() + r.offset, r.bytes, 1);
  });
  uint64_t changed = 0;
  for (uint64_t i = 0; i < L.total_bytes; ++i) changed += !owned[i] && data[i] != 0x5A;
  EXPECT_EQ(changed, 0u) << "bytes written outside the op's regions";
  EXPECT_TRUE(victim.Round().ok());
}

// The daemon's own validation of kFlagUe8m0, on raw slots (a client that skips the client
// library's check): without use_fp8 or round_scale, or with hidden % 512 != 0, the op fails
// with INVALID_ARGUMENT naming use_ue8m0; with use_fp8 and round_scale it runs and writes the
// packed UE8M0 scales (token index fastest) exactly as kernels/host does.
TEST_F(HostDataPlaneTest, Ue8m0FlagIsValidatedByTheDaemonAndWritesPackedScales) {
  for (const int H : {384, 1024}) {
    SCOPED_TRACE(absl::StrCat("hidden ", H));
    const int E = 4, K = 2, Mll = 8, T = 6;
    v1::EndpointInfo info;
    auto ring = OpenRawRing(Spec(absl::StrCat("ue8m0-raw-", H), 1, E, H, K, Mll, Mll, true), &info);
    ASSERT_NE(ring, nullptr);
    const kernels::GroupShape shape = rules::ShapeOf(spec_);
    const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(shape);
    RankData in;
    in.Make(T, H, K, E, 77);
    std::memcpy(ring->data() + L.in_x.offset, in.x.data(), in.x.size() * 2);
    std::memcpy(ring->data() + L.in_topk_idx.offset, in.idx.data(), in.idx.size() * 8);
    auto run = [&](uint32_t flags) {
      const uint64_t seq = ring->Submit(abi::OpKind::kLowLatencyDispatch, flags, T);
      auto c = ring->Await(seq, std::chrono::seconds(10));
      EXPECT_TRUE(c.has_value()) << "flags 0x" << std::hex << flags << " never completed";
      return c.value_or(abi::Completion{});
    };
    abi::Completion c = run(abi::kFlagFp8 | abi::kFlagUe8m0);
    EXPECT_EQ(c.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(c.message, ::testing::HasSubstr("use_ue8m0 needs round_scale"));
    c = run(abi::kFlagRoundScale | abi::kFlagUe8m0);
    EXPECT_EQ(c.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(c.message, ::testing::HasSubstr("use_ue8m0 needs use_fp8"));
    c = run(abi::kFlagFp8 | abi::kFlagRoundScale | abi::kFlagUe8m0);
    if (H % 512 != 0) {
      EXPECT_EQ(c.status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
      EXPECT_THAT(c.message,
                  ::testing::HasSubstr("use_ue8m0 needs hidden % 512 == 0, hidden = 384"));
      continue;
    }
    ASSERT_EQ(c.status_code, 0) << c.message;
    // The reference: kernels/host with the same options.
    const int64_t El = E, rows = Mll, cols = H / 512;
    std::vector<uint8_t> recv_x(El * rows * H), scales(El * cols * rows * 4);
    std::vector<int32_t> count(El), src(El * rows), pos(Mll * K);
    std::vector<kernels::host::LowLatencyDispatchRankArgs> a(1);
    a[0] = {T,          in.x.data(), in.idx.data(), recv_x.data(), scales.data(), count.data(),
            src.data(), pos.data()};
    ASSERT_TRUE(kernels::host::LowLatencyDispatch(shape, {true, true, true}, a).ok());
    const uint8_t* got = ring->data() + L.ll_recv_scales[c.buffer].offset;
    int compared = 0;
    for (int64_t j = 0; j < El; ++j) {
      ASSERT_EQ(
          reinterpret_cast<const int32_t*>(ring->data() + L.ll_recv_count[c.buffer].offset)[j],
          count[j]);
      for (int64_t col = 0; col < cols; ++col) {
        const int64_t at = (j * cols + col) * rows * 4;
        EXPECT_EQ(0, std::memcmp(got + at, scales.data() + at, size_t(count[j]) * 4))
            << "expert " << j << " column " << col;
        compared += count[j];
      }
    }
    EXPECT_GT(compared, 0);
  }
}

// A client thread rewriting, in a tight loop during thousands of ops, every array of its
// endpoints that the daemon reads as an index or size (the staged topk_idx, the routing
// state send_pos and low-latency handle positions, and the received counts / src info /
// prefixes) cannot make the daemon read or write out of bounds: the daemon reads each once
// into private memory and checks that copy, or keeps the routing state private in the
// first place. The attacker's ops fail or give it garbage; the daemon does not crash, and
// the victim group beside it gets the exact reference result in every round.
TEST_F(HostDataPlaneTest,
       ClientRewritingIndexArraysDuringOpsReachesNeitherTheDaemonNorAnotherGroup) {
  VictimGroup victim;
  ASSERT_NO_FATAL_FAILURE(victim.Open(*plane_, "victim"));
  const int R = 2, E = 4, H = 128, K = 2, M = 8, Mll = 8;
  spec_ = Spec("attacker", R, E, H, K, M, Mll, false);
  auto g = plane_->CreateGroup(spec_);
  ASSERT_TRUE(g.ok()) << g.status();
  group_ = std::move(*g);
  // The attacker's second mapping of every rank's region, beside its client library's.
  std::vector<std::unique_ptr<testing::RawRing>> hostile;
  endpoints_.clear();
  for (int r = 0; r < R; ++r) {
    v1::EndpointInfo info;
    ASSERT_TRUE(group_->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok());
    DataPlaneGroup* gp = group_.get();
    absl::StatusOr<EndpointFds> fds = gp->TakeEndpointFds(r);
    ASSERT_TRUE(fds.ok()) << fds.status();
    hostile.push_back(testing::RawRing::OpenAlso(info, *fds));
    ASSERT_NE(hostile.back(), nullptr);
    auto ep = internal::OpenEndpoint(info, spec_, *std::move(fds), [gp, r] {
      gp->DetachRank(r);
      return absl::OkStatus();
    });
    ASSERT_TRUE(ep.ok()) << ep.status();
    endpoints_.push_back(std::move(*ep));
  }
  const kernels::EndpointLayout L =
      kernels::EndpointLayout::Compute(kernels::GroupShape{R, E, H, K, M, Mll, false});

  // The scribbler: over and over, for every index array, a snapshot of what is there (what
  // the client staged or the daemon published, so checks of it pass) is written back
  // poisoned (every id or row pushed far out of range) and then restored, so that a check
  // may see the plain values and a later read the poisoned ones. Arrays the daemon only
  // writes get plain garbage.
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> scribbles{0};
  std::thread scribbler([&] {
    std::mt19937_64 rng(7);
    std::vector<uint8_t> snapshot;
    auto poison = [&](uint8_t* base, const kernels::Region& r, int elem_bytes) {
      snapshot.assign(base + r.offset, base + r.offset + r.bytes);
      const int64_t far = int64_t{1} << (elem_bytes == 8 ? 40 : 29);
      for (uint64_t i = 0; i + elem_bytes <= r.bytes; i += elem_bytes) {
        if (elem_bytes == 8) {
          int64_t v;
          std::memcpy(&v, snapshot.data() + i, 8);
          v = v >= 0 ? v + far : v - far;
          std::memcpy(base + r.offset + i, &v, 8);
        } else {
          int32_t v;
          std::memcpy(&v, snapshot.data() + i, 4);
          v = v >= 0 ? static_cast<int32_t>(v + far) : static_cast<int32_t>(v - far);
          std::memcpy(base + r.offset + i, &v, 4);
        }
      }
      std::memcpy(base + r.offset, snapshot.data(), r.bytes);
    };
    auto garbage = [&](uint8_t* base, const kernels::Region& r) {
      for (uint64_t i = 0; i + 8 <= r.bytes; i += 8) {
        const uint64_t v = rng();
        std::memcpy(base + r.offset + i, &v, 8);
      }
    };
    while (!stop.load(std::memory_order_relaxed)) {
      for (auto& ring : hostile) {
        uint8_t* base = ring->data();
        poison(base, L.in_topk_idx, 8);
        poison(base, L.send_pos, 4);
        for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
          poison(base, L.ll_handle_pos[b], 4);
          garbage(base, L.ll_recv_count[b]);
          garbage(base, L.ll_recv_src_info[b]);
        }
        garbage(base, L.recv_src_info);
        garbage(base, L.rank_prefix);
        garbage(base, L.recv_count);
        garbage(base, L.recv_tokens_per_expert);
      }
      scribbles.fetch_add(1, std::memory_order_relaxed);
    }
  });

  // The victim runs rounds all along; every one must be OK and exact.
  std::atomic<bool> attack_done{false};
  int victim_rounds = 0;
  absl::Status victim_status;
  std::thread victim_thread([&] {
    while (!attack_done.load() && victim_status.ok()) {
      victim_status = victim.Round();
      ++victim_rounds;
    }
  });

  // The attacker's own ops, the same sequence on both ranks (their outcomes agree: an op
  // that fails fails for every rank).
  constexpr int kIterations = 1000;
  std::vector<int> attacker_ops(R, 0);
  std::vector<RankData> in(R);
  for (int r = 0; r < R; ++r) in[r].Make(Mll - r, H, K, E, 500 + r);
  std::vector<bf16_bits> zeros(size_t(E / R) * R * Mll * H * 2, 0);
  OnEveryRank([&](int r) {
    auto wait = [&](auto op) {
      ++attacker_ops[r];
      EXPECT_TRUE(op.ok()) << op.status();  // Submitting never fails: the inputs are fine.
      if (!op.ok()) return decltype(op->Wait(absl::Seconds(1)))(op.status());
      auto res = op->Wait(absl::Seconds(30));
      EXPECT_NE(res.status().code(), absl::StatusCode::kUnavailable) << res.status();
      return res;
    };
    for (int i = 0; i < kIterations; ++i) {
      wait(endpoints_[r]->GetDispatchLayout(in[r].idx_t));
      DispatchArgs a;
      a.x = &in[r].x_t;
      a.topk_idx = &in[r].idx_t;
      a.topk_weights = &in[r].w_t;
      auto d = wait(endpoints_[r]->Dispatch(a));
      if (d.ok()) {
        DispatchArgs cached = a;
        cached.cached = d->handle;
        wait(endpoints_[r]->Dispatch(cached));
        std::vector<int64_t> xs{d->num_recv_tokens, H};
        DLTensor x = epd::MakeDLTensor(zeros.data(), kBf16, xs);
        CombineArgs c;
        c.x = &x;
        c.handle = &d->handle;
        wait(endpoints_[r]->Combine(c));
      }
      LowLatencyDispatchArgs la;
      la.x = &in[r].x_t;
      la.topk_idx = &in[r].idx_t;
      auto ld = wait(endpoints_[r]->LowLatencyDispatch(la));
      if (ld.ok()) {
        std::vector<int64_t> ys{E / R, R * Mll, H};
        DLTensor y = epd::MakeDLTensor(zeros.data(), kBf16, ys);
        LowLatencyCombineArgs lc;
        lc.x = &y;
        lc.topk_idx = &in[r].idx_t;
        lc.topk_weights = &in[r].w_t;
        lc.handle = &ld->handle;
        wait(endpoints_[r]->LowLatencyCombine(lc));
      }
    }
  });
  attack_done = true;
  victim_thread.join();
  stop = true;
  scribbler.join();
  EXPECT_TRUE(victim_status.ok()) << victim_status << " (round " << victim_rounds << ")";
  EXPECT_GE(victim_rounds, 2);
  EXPECT_GE(attacker_ops[0], 3 * kIterations);
  EXPECT_GT(scribbles.load(), 100u);
  // The scribbler gone, the attacker's group works again, and so does the victim's.
  OnEveryRank([&](int r) {
    auto op = endpoints_[r]->GetDispatchLayout(in[r].idx_t);
    ASSERT_TRUE(op.ok()) << op.status();
    auto res = op->Wait(absl::Seconds(30));
    EXPECT_TRUE(res.ok()) << res.status();
  });
  EXPECT_TRUE(victim.Round().ok());
}

}  // namespace
}  // namespace epd
