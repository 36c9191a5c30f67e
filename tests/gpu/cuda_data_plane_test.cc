// The CUDA data plane in-process (daemon/dataplane/cuda/cuda_data_plane.h), daemon-launched,
// 8 virtual ranks on one GPU, endpoints opened by the real client code, one thread per
// rank. Oracle: the same op sequence through the host data plane (kernels/host), compared
// byte for byte. Also: a rank that never arrives, an out-of-range expert id, routing words a
// client rewrote, and the launch modes seen from the daemon side through raw ring slots
// (tests/unit/raw_ring.h): ready_seq/done_seq of stream-ordered requests, client-launched
// endpoints. The cases in full: docs/CUDA_BACKEND.md "How the GPU tests are built".
#include "daemon/dataplane/cuda/cuda_data_plane.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cuda/cuda_ipc.h"
#include "client/endpoint/endpoint_internal.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/gpu/gpu_inventory.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics.h"
#include "epd/client.h"
#include "epd/kernels/cuda_ops.h"
#include "proto/abi/launch_flags.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

using kernels::bf16_bits;
using testing::DeviceBuffer;

v1::GroupSpec Spec(const std::string& name, int R, int E, int H, int K, int M, int Mll) {
  return testing::MakeSpec(name, {.num_ranks = R,
                                  .num_experts = E,
                                  .hidden = H,
                                  .num_topk = K,
                                  .max_tokens_per_rank = M,
                                  .ll_max_tokens_per_rank = Mll,
                                  .use_fp8 = H % 128 == 0});
}

/// A DLTensor over `data` (host or device) with `shape` (kept alive by the caller).
DLTensor Tensor(const void* data, DLDataType dtype, std::vector<int64_t>& shape, bool cuda) {
  DLTensor t{};
  t.data = const_cast<void*>(data);
  t.device = {cuda ? kDLCUDA : kDLCPU, 0};
  t.ndim = static_cast<int>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

/// `bytes` bytes at byte `offset` of a result view, copied to the host.
std::vector<uint8_t> Fetch(const TensorView& v, size_t offset, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes == 0) return out;
  const uint8_t* src = static_cast<const uint8_t*>(v.data()) + offset;
  if (v.dl().device.device_type == kDLCUDA) {
    EXPECT_EQ(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::memcpy(out.data(), src, bytes);
  }
  return out;
}
std::vector<uint8_t> FetchAll(const TensorView& v) { return Fetch(v, 0, v.nbytes()); }

/// One rank's inputs, on the host and (for the CUDA plane) on the GPU.
struct RankInputs {
  int T = 0;
  std::vector<bf16_bits> x;  // [T, H]
  std::vector<int64_t> idx;  // [T, K]
  std::vector<float> w;      // [T, K]
  std::vector<bf16_bits> y;  // [El, R*Mll, H]: low-latency expert outputs
  DeviceBuffer dx, dy;       // Device copies of x and y.
};

/// Every rank's inputs of one group.
struct Inputs {
  std::vector<RankInputs> ranks;
  void Make(const v1::GroupSpec& s, const std::vector<int>& tokens,
            const testing::RoutingOptions& routing, uint64_t seed) {
    std::mt19937_64 rng(seed);
    const int R = s.num_ranks(), H = s.hidden(), K = s.num_topk(), E = s.num_experts();
    ranks.resize(R);
    for (int r = 0; r < R; ++r) {
      RankInputs& in = ranks[r];
      in.T = tokens[r];
      in.x = testing::RandomBf16(static_cast<size_t>(in.T) * H, rng);
      in.idx = testing::RandomTopk(in.T, K, E, routing, rng);
      in.w = testing::RandomFloats(in.idx.size(), rng, 0.f, 1.f);
      const size_t ysize = s.ll_max_tokens_per_rank() > 0
                               ? static_cast<size_t>(E / R) * R * s.ll_max_tokens_per_rank() * H
                               : 0;
      in.y = testing::RandomBf16(ysize, rng);
      auto dx = DeviceBuffer::Allocate(std::max<size_t>(in.x.size() * 2, 16));
      auto dy = DeviceBuffer::Allocate(std::max<size_t>(in.y.size() * 2, 16));
      ASSERT_TRUE(dx.ok() && dy.ok());
      in.dx = std::move(*dx);
      in.dy = std::move(*dy);
      ASSERT_EQ(cudaMemcpy(in.dx.get(), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(in.dy.get(), in.y.data(), in.y.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
};

/// One group on one data plane, every rank's endpoint opened.
struct PlaneGroup {
  v1::GroupSpec spec;
  bool cuda = false;
  std::unique_ptr<DataPlaneGroup> group;
  std::vector<std::unique_ptr<Endpoint>> eps;

  /// `gpu_uuids[r]`: rank r's GPU on the CUDA plane (empty: every rank on the first GPU).
  /// `mode`: every rank's launch mode (unspecified: the plane's default).
  void Open(DataPlane* plane, const v1::GroupSpec& s,
            const std::vector<std::string>& gpu_uuids = {},
            v1::LaunchMode mode = v1::LAUNCH_MODE_UNSPECIFIED) {
    spec = s;
    cuda = plane->backend_name() == "cuda";
    auto g = plane->CreateGroup(s);
    ASSERT_TRUE(g.ok()) << g.status();
    group = std::move(*g);
    eps.resize(s.num_ranks());
    for (int r = 0; r < s.num_ranks(); ++r) {
      ASSERT_NO_FATAL_FAILURE(OpenRank(r, cuda && !gpu_uuids.empty() ? gpu_uuids[r] : "", mode));
    }
  }

  /// Attaches rank r and opens its endpoint into eps[r] (also: a new process joining the
  /// slot of a rank that left), in launch mode `mode` (unspecified: the plane's default).
  void OpenRank(int r, const std::string& uuid = "",
                v1::LaunchMode mode = v1::LAUNCH_MODE_UNSPECIFIED) {
    v1::EndpointInfo info;
    absl::Status st = group->AttachRank(r, uuid, mode, {}, &info);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(info.backend(), cuda ? "cuda" : "host");
    if (cuda) {
      EXPECT_EQ(info.data_offset(), 0u);
      EXPECT_EQ(info.cuda_ipc_handle().size(), sizeof(cudaIpcMemHandle_t));
    }
    DataPlaneGroup* gp = group.get();
    absl::StatusOr<EndpointFds> fds = gp->TakeEndpointFds(r);
    ASSERT_TRUE(fds.ok()) << fds.status();
    auto ep = internal::OpenEndpoint(info, spec, *std::move(fds), [gp, r] {
      gp->DetachRank(r);
      return absl::OkStatus();
    });
    ASSERT_TRUE(ep.ok()) << ep.status();
    eps[r] = std::move(*ep);
  }

  /// Joins every rank of `s` through a real daemon (one client process holding all R
  /// endpoints; the data areas are mapped with cudaIpcOpenMemHandle).
  void Join(Client* client, const v1::GroupSpec& s, const std::string& gpu_uuid) {
    spec = s;
    for (int r = 0; r < s.num_ranks(); ++r) {
      JoinOptions o;
      o.spec = s;
      o.rank = r;
      o.gpu_uuid = gpu_uuid;
      o.launch_mode = v1::LAUNCH_MODE_DAEMON;  // This file tests the daemon's engine.
      auto ep = client->Join(o);
      ASSERT_TRUE(ep.ok()) << "rank " << r << ": " << ep.status();
      cuda = (*ep)->info().backend() == "cuda";
      eps.push_back(std::move(*ep));
    }
  }

  /// Runs fn(rank) on one thread per rank (except `skip`) and joins.
  void OnEveryRank(const std::function<void(int)>& fn, int skip = -1) const {
    std::vector<std::thread> threads;
    for (int r = 0; r < spec.num_ranks(); ++r) {
      if (r != skip) threads.emplace_back(fn, r);
    }
    for (auto& t : threads) t.join();
  }
};

/// Outputs of one op at one rank: named byte blobs, the op's status, and each op's OpMask
/// (rank masking: epoch, num_masked, this rank's dropped pairs).
struct RankResult {
  absl::Status status;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;
  std::vector<OpMask> masks;
};
using GroupResult = std::vector<RankResult>;

void ExpectSame(const GroupResult& want, const GroupResult& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t r = 0; r < want.size(); ++r) {
    ASSERT_EQ(want[r].status.code(), got[r].status.code())
        << what << " rank " << r << ": host " << want[r].status << " vs cuda " << got[r].status;
    ASSERT_EQ(want[r].blobs.size(), got[r].blobs.size()) << what << " rank " << r;
    for (size_t i = 0; i < want[r].blobs.size(); ++i) {
      const auto& [name, bytes] = want[r].blobs[i];
      ASSERT_EQ(bytes.size(), got[r].blobs[i].second.size())
          << what << " rank " << r << " " << name;
      absl::Status cmp =
          testing::CompareBytes(bytes.data(), got[r].blobs[i].second.data(), bytes.size(),
                                absl::StrCat(what, " rank ", r, " ", name));
      EXPECT_TRUE(cmp.ok()) << cmp;
    }
    ASSERT_EQ(want[r].masks.size(), got[r].masks.size()) << what << " rank " << r;
    for (size_t i = 0; i < want[r].masks.size(); ++i) {
      const OpMask& w = want[r].masks[i];
      const OpMask& g = got[r].masks[i];
      EXPECT_EQ(w.epoch, g.epoch) << what << " rank " << r << " op " << i;
      EXPECT_EQ(w.num_masked, g.num_masked) << what << " rank " << r << " op " << i;
      EXPECT_EQ(w.dropped_pairs, g.dropped_pairs) << what << " rank " << r << " op " << i;
    }
  }
}

/// Normal mode: GetDispatchLayout, Dispatch (weights, alignment 4), Combine of the received
/// rows (identity experts, with weights), then a cached re-dispatch; on every rank but
/// `skip`.
GroupResult RunNormal(PlaneGroup& g, Inputs& in, int skip = -1) {
  const int R = g.spec.num_ranks(), H = g.spec.hidden(), K = g.spec.num_topk();
  GroupResult out(R);
  g.OnEveryRank(
      [&](int r) {
        RankInputs& ri = in.ranks[r];
        RankResult& res = out[r];
        std::vector<int64_t> xs{ri.T, H}, ks{ri.T, K};
        // x from the GPU on the CUDA plane (device-to-device staging); idx/weights from the host.
        DLTensor x =
            Tensor(g.cuda ? static_cast<const void*>(ri.dx.get()) : ri.x.data(), kBf16, xs, g.cuda);
        DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
        DLTensor w = Tensor(ri.w.data(), kF32, ks, false);

        auto lop = g.eps[r]->GetDispatchLayout(idx);
        ASSERT_TRUE(lop.ok()) << lop.status();
        auto layout = lop->Wait(absl::Seconds(20));
        ASSERT_TRUE(layout.ok()) << "rank " << r << ": " << layout.status();
        res.blobs.push_back({"num_tokens_per_rank", FetchAll(layout->num_tokens_per_rank)});
        res.blobs.push_back({"num_tokens_per_expert", FetchAll(layout->num_tokens_per_expert)});
        res.blobs.push_back({"is_token_in_rank", FetchAll(layout->is_token_in_rank)});

        DispatchArgs da;
        da.x = &x;
        da.topk_idx = &idx;
        da.topk_weights = &w;
        da.expert_alignment = 4;
        auto dop = g.eps[r]->Dispatch(da);
        ASSERT_TRUE(dop.ok()) << dop.status();
        auto d = dop->Wait(absl::Seconds(20));
        ASSERT_TRUE(d.ok()) << "rank " << r << ": " << d.status();
        res.masks.push_back(d->mask);
        res.blobs.push_back(
            {"N", std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&d->num_recv_tokens),
                                       reinterpret_cast<uint8_t*>(&d->num_recv_tokens) + 4)});
        res.blobs.push_back({"recv_x", FetchAll(d->recv_x)});
        res.blobs.push_back({"recv_topk_idx", FetchAll(d->recv_topk_idx)});
        res.blobs.push_back({"recv_topk_weights", FetchAll(d->recv_topk_weights)});
        res.blobs.push_back(
            {"num_recv_tokens_per_expert", FetchAll(d->num_recv_tokens_per_expert)});
        res.blobs.push_back({"recv_src_info", FetchAll(d->recv_src_info)});

        CombineArgs ca;
        ca.x = &d->recv_x.dl();  // Identity experts: the received rows.
        ca.topk_weights = &d->recv_topk_weights.dl();
        ca.handle = &d->handle;
        auto cop = g.eps[r]->Combine(ca);
        ASSERT_TRUE(cop.ok()) << cop.status();
        auto c = cop->Wait(absl::Seconds(20));
        ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
        res.masks.push_back(c->mask);
        res.blobs.push_back({"combined_x", FetchAll(c->combined_x)});
        res.blobs.push_back({"combined_topk_weights", FetchAll(c->combined_topk_weights)});

        DispatchArgs again;
        again.x = &x;
        again.cached = d->handle;
        auto aop = g.eps[r]->Dispatch(again);
        ASSERT_TRUE(aop.ok()) << aop.status();
        auto a = aop->Wait(absl::Seconds(20));
        ASSERT_TRUE(a.ok()) << "rank " << r << ": " << a.status();
        res.masks.push_back(a->mask);
        res.blobs.push_back({"cached recv_x", FetchAll(a->recv_x)});
      },
      skip);
  return out;
}

/// One low-latency round: dispatch (bf16 or FP8; `ue8m0`: UE8M0-packed scales), then
/// combine of the fixed expert outputs y. Only the packed rows [0, recv_count[j]) of each
/// expert are compared.
GroupResult RunLowLatency(PlaneGroup& g, Inputs& in, bool fp8, bool round_scale, int skip = -1,
                          bool ue8m0 = false) {
  const int R = g.spec.num_ranks(), H = g.spec.hidden(), K = g.spec.num_topk();
  const int El = g.spec.num_experts() / R;
  const int64_t rows = static_cast<int64_t>(R) * g.spec.ll_max_tokens_per_rank();
  const int S = ue8m0 ? (H + 511) / 512 : (H + 127) / 128;  // 4-byte scale columns
  GroupResult out(R);
  g.OnEveryRank(
      [&](int r) {
        RankInputs& ri = in.ranks[r];
        RankResult& res = out[r];
        std::vector<int64_t> xs{ri.T, H}, ks{ri.T, K}, ys{El, rows, H};
        DLTensor x =
            Tensor(g.cuda ? static_cast<const void*>(ri.dx.get()) : ri.x.data(), kBf16, xs, g.cuda);
        DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
        DLTensor w = Tensor(ri.w.data(), kF32, ks, false);
        DLTensor y =
            Tensor(g.cuda ? static_cast<const void*>(ri.dy.get()) : ri.y.data(), kBf16, ys, g.cuda);
        LowLatencyDispatchArgs da;
        da.x = &x;
        da.topk_idx = &idx;
        da.use_fp8 = fp8;
        da.round_scale = round_scale;
        da.use_ue8m0 = ue8m0;
        auto dop = g.eps[r]->LowLatencyDispatch(da);
        ASSERT_TRUE(dop.ok()) << dop.status();
        auto d = dop->Wait(absl::Seconds(20));
        res.status = d.status();
        if (!d.ok()) return;
        res.masks.push_back(d->mask);
        std::vector<uint8_t> count_bytes = FetchAll(d->recv_count);
        res.blobs.push_back({"recv_count", count_bytes});
        const auto* count = reinterpret_cast<const int32_t*>(count_bytes.data());
        const size_t row_bytes = static_cast<size_t>(H) * (fp8 ? 1 : 2);
        for (int j = 0; j < El; ++j) {
          const size_t n = static_cast<size_t>(std::max(0, count[j]));
          const size_t row0 = static_cast<size_t>(j) * rows;
          res.blobs.push_back(
              {absl::StrCat("recv_x[", j, "]"), Fetch(d->recv_x, row0 * row_bytes, n * row_bytes)});
          res.blobs.push_back(
              {absl::StrCat("recv_src_info[", j, "]"), Fetch(d->recv_src_info, row0 * 4, n * 4)});
          // Scales are stored [El, S, rows] of 4-byte words (token index fastest): rows
          // [0, n) per column.
          for (size_t c = 0; fp8 && c < static_cast<size_t>(S); ++c) {
            const size_t at = (static_cast<size_t>(j) * S + c) * rows * 4;
            res.blobs.push_back(
                {absl::StrCat("recv_scales[", j, "][", c, "]"), Fetch(d->recv_scales, at, n * 4)});
          }
        }
        LowLatencyCombineArgs ca;
        ca.x = &y;
        ca.topk_idx = &idx;
        ca.topk_weights = &w;
        ca.handle = &d->handle;
        auto cop = g.eps[r]->LowLatencyCombine(ca);
        ASSERT_TRUE(cop.ok()) << cop.status();
        auto c = cop->Wait(absl::Seconds(20));
        ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
        res.masks.push_back(c->mask);
        res.blobs.push_back({"combined_x", FetchAll(c->combined_x)});
      },
      skip);
  return out;
}

class CudaDataPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override { SetUpPlanes(std::nullopt); }
  /// `kernel_ready_wait`: CudaDataPlaneOptions::kernel_ready_wait (unset = the daemon's
  /// default: a WaitFlagAsync kernel under MPS, cuStreamWaitValue64 otherwise).
  /// `op_graphs`, `fused_launch`: CudaDataPlaneOptions::op_graphs / fused_launch.
  void SetUpPlanes(std::optional<bool> kernel_ready_wait, bool op_graphs = false,
                   bool fused_launch = true) {
    std::string why;
    if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
    CudaDataPlaneOptions o;
    o.op_timeout_ms = 1000;
    o.kernel_ready_wait = kernel_ready_wait;
    o.op_graphs = op_graphs;
    o.fused_launch = fused_launch;
    auto cuda = MakeCudaDataPlane(o);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
    HostDataPlaneOptions h;
    h.op_timeout_ms = 1000;
    h.host_threads = 4;
    auto host = MakeHostDataPlane(h);
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = std::move(*host);
    internal::SetInProcessAreaResolver(FindInProcessCudaArea);
  }
  void TearDown() override { internal::SetInProcessAreaResolver({}); }

  std::unique_ptr<DataPlane> cuda_;
  std::unique_ptr<DataPlane> host_;
};

TEST_F(CudaDataPlaneTest, NormalOpsMatchHostWithEightVirtualRanks) {
  const v1::GroupSpec spec = Spec("normal8", 8, 64, 2048, 8, 128, 0);
  Inputs in;
  in.Make(spec, {128, 0, 1, 77, 128, 5, 100, 64}, {.masked_fraction = 0.25}, 1);
  PlaneGroup host, cuda;
  host.Open(host_.get(), spec);
  cuda.Open(cuda_.get(), spec);
  GroupResult want = RunNormal(host, in);
  GroupResult got = RunNormal(cuda, in);
  ExpectSame(want, got, "normal");
}

TEST_F(CudaDataPlaneTest, LowLatencyMatchesHostWithEightVirtualRanks) {
  const v1::GroupSpec spec = Spec("ll8", 8, 32, 2048, 8, 16, 128);
  PlaneGroup host, cuda;
  host.Open(host_.get(), spec);
  cuda.Open(cuda_.get(), spec);
  struct Round {
    testing::RoutingOptions routing;
    bool fp8, round_scale, ue8m0;
  };
  const Round rounds[] = {{{}, false, false, false},
                          {{.masked_fraction = 0.5}, true, false, false},
                          {{.one_expert = 3}, true, true, false},  // Every token to one expert.
                          {{.duplicate_fraction = 0.3}, false, false, false},
                          {{.masked_fraction = 0.2}, true, true, true}};  // UE8M0 scales
  int i = 0;
  for (const Round& round : rounds) {
    Inputs in;
    in.Make(spec, {128, 0, 1, 77, 128, 64, 3, 100}, round.routing, 100 + i);
    GroupResult want = RunLowLatency(host, in, round.fp8, round.round_scale, -1, round.ue8m0);
    GroupResult got = RunLowLatency(cuda, in, round.fp8, round.round_scale, -1, round.ue8m0);
    ExpectSame(want, got,
               absl::StrCat("low-latency round ", i, round.fp8 ? " fp8" : " bf16",
                            round.ue8m0 ? " ue8m0" : ""));
    ++i;
  }
}

/// Tokens each global expert receives from `in`'s routing: a token once per distinct
/// expert >= 0 of its row (epd_expert_received_tokens_total's reference), added to `want`.
void AddReferenceExpertTokens(const v1::GroupSpec& s, const Inputs& in,
                              std::vector<uint64_t>& want) {
  const int K = s.num_topk();
  for (const RankInputs& ri : in.ranks) {
    for (int t = 0; t < ri.T; ++t) {
      const int64_t* row = ri.idx.data() + static_cast<size_t>(t) * K;
      for (int k = 0; k < K; ++k) {
        if (row[k] < 0 || std::find(row, row + k, row[k]) != row + k) continue;
        ++want[static_cast<size_t>(row[k])];
      }
    }
  }
}

// epd_op_gpu_seconds and epd_expert_received_tokens_total on the CUDA backend, daemon-
// launched: every OK op of every kind gets one GPU time (count == ops), and each expert's
// total equals the count from topk_idx and the host backend's for the same ops (normal
// dispatch, its cached repeat, low-latency dispatch; duplicates in a row count once).
TEST_F(CudaDataPlaneTest, OpGpuTimeAndExpertTokensAreRecordedPerOp) {
  const v1::GroupSpec spec = Spec("gpumet8", 8, 32, 1024, 4, 64, 64);
  v1::GroupSpec host_spec = spec;
  host_spec.set_name("gpumet8-host");
  PlaneGroup host, cuda;
  host.Open(host_.get(), host_spec);
  cuda.Open(cuda_.get(), spec, {}, v1::LAUNCH_MODE_DAEMON);  // Client-launched: not measured.
  std::shared_ptr<metrics::GroupMetrics> gm = metrics::Default().FindGroup("gpumet8");
  std::shared_ptr<metrics::GroupMetrics> hm = metrics::Default().FindGroup("gpumet8-host");
  ASSERT_TRUE(gm && hm);
  std::vector<uint64_t> want(static_cast<size_t>(spec.num_experts()), 0);
  constexpr int kRounds = 3;
  for (int i = 0; i < kRounds; ++i) {
    Inputs in;
    in.Make(spec, {64, 0, 1, 33, 64, 17, 64, 5},
            {.masked_fraction = 0.2, .duplicate_fraction = i == 1 ? 0.3 : 0.0}, 900 + i);
    ExpectSame(RunNormal(host, in), RunNormal(cuda, in), absl::StrCat("normal round ", i));
    // Dispatch and its cached repeat: the same tokens twice.
    AddReferenceExpertTokens(spec, in, want);
    AddReferenceExpertTokens(spec, in, want);
    ExpectSame(RunLowLatency(host, in, i == 2, false), RunLowLatency(cuda, in, i == 2, false),
               absl::StrCat("low-latency round ", i));
    AddReferenceExpertTokens(spec, in, want);
  }
  for (int e = 0; e < spec.num_experts(); ++e) {
    EXPECT_EQ(gm->expert_tokens(e), want[static_cast<size_t>(e)]) << "expert " << e;
    EXPECT_EQ(hm->expert_tokens(e), want[static_cast<size_t>(e)]) << "host, expert " << e;
  }
  const std::pair<abi::OpKind, uint64_t> kinds[] = {{abi::OpKind::kGetDispatchLayout, kRounds},
                                                    {abi::OpKind::kDispatch, 2 * kRounds},
                                                    {abi::OpKind::kCombine, kRounds},
                                                    {abi::OpKind::kLowLatencyDispatch, kRounds},
                                                    {abi::OpKind::kLowLatencyCombine, kRounds}};
  const std::string text = metrics::RenderPrometheus(metrics::Default().Collect());
  for (const auto& [kind, n] : kinds) {
    const uint32_t op = static_cast<uint32_t>(kind);
    EXPECT_EQ(gm->ops(op), n) << abi::OpKindName(op);
    EXPECT_EQ(gm->gpu_timed_ops(op), n) << abi::OpKindName(op);
    EXPECT_EQ(hm->gpu_timed_ops(op), 0u) << "the host backend has no GPU time";
    EXPECT_NE(text.find(absl::StrCat("epd_op_gpu_seconds_count{group=\"gpumet8\",op=\"",
                                     abi::OpKindName(op), "\"} ", n, "\n")),
              std::string::npos)
        << abi::OpKindName(op);
  }
  std::cout << "GPU time sum (s) by op:\n";
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StartsWith(line, "epd_op_gpu_seconds_sum{group=\"gpumet8\"")) {
      std::cout << "  " << line << "\n";
    }
  }
}

TEST_F(CudaDataPlaneTest, MissingRankTimesOutWhileAnotherGroupOnTheGpuWorks) {
  const v1::GroupSpec spec_a = Spec("late", 4, 16, 1024, 4, 16, 32);
  const v1::GroupSpec spec_b = Spec("busy", 4, 16, 1024, 4, 16, 32);
  PlaneGroup a, b, b_host, a_host;
  a.Open(cuda_.get(), spec_a);
  b.Open(cuda_.get(), spec_b);
  b_host.Open(host_.get(), spec_b);
  a_host.Open(host_.get(), spec_a);
  Inputs in_a, in_b;
  in_a.Make(spec_a, {32, 7, 0, 20}, {}, 7);
  in_b.Make(spec_b, {3, 32, 16, 1}, {}, 8);

  // Group a: rank 3 never arrives. Meanwhile group b runs rounds on the same GPU.
  const auto start = std::chrono::steady_clock::now();
  GroupResult a_result;
  std::thread late([&] { a_result = RunLowLatency(a, in_a, false, false, /*skip=*/3); });
  for (int round = 0; round < 3; ++round) {
    GroupResult want = RunLowLatency(b_host, in_b, round == 1, false);
    GroupResult got = RunLowLatency(b, in_b, round == 1, false);
    ExpectSame(want, got, absl::StrCat("busy group round ", round));
  }
  late.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(a_result[r].status.code(), absl::StatusCode::kDeadlineExceeded) << a_result[r].status;
    EXPECT_NE(a_result[r].status.message().find("rank(s) 3"), std::string::npos)
        << a_result[r].status;
  }
  EXPECT_LT(secs, 1.0 + 1.0 + 2.0) << "the busy group's rounds ran beside the timeout";

  // The late rank's request for the failed op fails at once.
  {
    RankInputs& ri = in_a.ranks[3];
    std::vector<int64_t> xs{ri.T, spec_a.hidden()}, ks{ri.T, spec_a.num_topk()};
    DLTensor x = Tensor(ri.x.data(), kBf16, xs, false);
    DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
    LowLatencyDispatchArgs da;
    da.x = &x;
    da.topk_idx = &idx;
    auto op = a.eps[3]->LowLatencyDispatch(da);
    ASSERT_TRUE(op.ok());
    auto res = op->Wait(absl::Seconds(5));
    EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded) << res.status();
  }
  // Then group a works, with correct results.
  GroupResult want = RunLowLatency(a_host, in_a, true, false);
  GroupResult got = RunLowLatency(a, in_a, true, false);
  ExpectSame(want, got, "late group after the timeout");
}

TEST_F(CudaDataPlaneTest, OutOfRangeExpertIdFailsEveryRankThenNextOpIsCorrect) {
  const v1::GroupSpec spec = Spec("badid", 8, 16, 1024, 4, 32, 32);
  PlaneGroup host, cuda;
  host.Open(host_.get(), spec);
  cuda.Open(cuda_.get(), spec);
  Inputs in;
  in.Make(spec, {32, 8, 0, 1, 32, 16, 2, 30}, {}, 11);
  const int64_t saved = in.ranks[4].idx[5];
  in.ranks[4].idx[5] = spec.num_experts();  // Out of range.
  GroupResult bad = RunLowLatency(cuda, in, false, false);
  for (int r = 0; r < spec.num_ranks(); ++r) {
    EXPECT_EQ(bad[r].status.code(), absl::StatusCode::kInvalidArgument) << bad[r].status;
  }
  in.ranks[4].idx[5] = saved;
  GroupResult want = RunLowLatency(host, in, false, false);
  GroupResult got = RunLowLatency(cuda, in, false, false);
  ExpectSame(want, got, "low-latency after a bad id");
  // Normal mode on the same endpoints, after the low-latency ops.
  GroupResult nwant = RunNormal(host, in);
  GroupResult ngot = RunNormal(cuda, in);
  ExpectSame(nwant, ngot, "normal after low-latency");
}

// A client rewriting its endpoint's routing words through its mapping of the data area
// (here the in-process mapping the client library resolved; a real client has its CUDA IPC
// mapping) between a dispatch and the combine that reads them as rows: send_pos before a
// normal combine, the low-latency handle positions before a low-latency combine. The
// kernels bound-check every row they read, so the op fails for the group with an error
// naming the out-of-range routing values, a neighbour group on the same GPU keeps matching
// the host oracle, and the attacked group's next ops are exact again.
TEST_F(CudaDataPlaneTest, RoutingRewrittenByAClientFailsItsGroupWhileANeighbourStaysExact) {
  const v1::GroupSpec spec = Spec("attacked", 2, 8, 1024, 4, 16, 16);
  const v1::GroupSpec nspec = Spec("neighbour", 2, 8, 1024, 4, 16, 16);
  PlaneGroup attacked, attacked_host, neighbour, neighbour_host;
  attacked.Open(cuda_.get(), spec);
  attacked_host.Open(host_.get(), spec);
  neighbour.Open(cuda_.get(), nspec);
  neighbour_host.Open(host_.get(), nspec);
  Inputs in, nin;
  in.Make(spec, {16, 9}, {}, 5);
  nin.Make(nspec, {7, 16}, {}, 6);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  const int R = spec.num_ranks(), H = spec.hidden(), K = spec.num_topk();
  const int El = spec.num_experts() / R;
  const int64_t rows = static_cast<int64_t>(R) * spec.ll_max_tokens_per_rank();
  auto expect_routing_error = [](const absl::Status& st, const char* what) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what << ": " << st;
    EXPECT_NE(st.message().find("routing value(s)"), std::string::npos) << what << ": " << st;
  };
  attacked.OnEveryRank([&](int r) {
    RankInputs& ri = in.ranks[r];
    std::vector<int64_t> xs{ri.T, H}, ks{ri.T, K}, ys{El, rows, H};
    DLTensor x = Tensor(ri.dx.get(), kBf16, xs, true);
    DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
    DLTensor w = Tensor(ri.w.data(), kF32, ks, false);
    DLTensor y = Tensor(ri.dy.get(), kBf16, ys, true);
    DispatchArgs da;
    da.x = &x;
    da.topk_idx = &idx;
    auto dop = attacked.eps[r]->Dispatch(da);
    ASSERT_TRUE(dop.ok()) << dop.status();
    auto d = dop->Wait(absl::Seconds(20));
    ASSERT_TRUE(d.ok()) << "rank " << r << ": " << d.status();
    // The data area, as the client maps it: its views point into it.
    uint8_t* area = static_cast<uint8_t*>(d->recv_x.data()) - L.recv_x.offset;
    if (r == 0) {
      const std::vector<int32_t> bad(static_cast<size_t>(ri.T) * R, 1 << 30);
      ASSERT_EQ(
          cudaMemcpy(area + L.send_pos.offset, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice),
          cudaSuccess);
    }
    CombineArgs ca;
    ca.x = &d->recv_x.dl();
    ca.handle = &d->handle;
    auto cop = attacked.eps[r]->Combine(ca);
    ASSERT_TRUE(cop.ok()) << cop.status();
    expect_routing_error(cop->Wait(absl::Seconds(20)).status(), "Combine");

    LowLatencyDispatchArgs la;
    la.x = &x;
    la.topk_idx = &idx;
    auto lop = attacked.eps[r]->LowLatencyDispatch(la);
    ASSERT_TRUE(lop.ok()) << lop.status();
    auto ld = lop->Wait(absl::Seconds(20));
    ASSERT_TRUE(ld.ok()) << "rank " << r << ": " << ld.status();
    if (r == 1) {
      const std::vector<int32_t> bad(static_cast<size_t>(ri.T) * K, 1 << 30);
      ASSERT_EQ(cudaMemcpy(area + L.ll_handle_pos[ld->handle.buffer].offset, bad.data(),
                           bad.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    LowLatencyCombineArgs lc;
    lc.x = &y;
    lc.topk_idx = &idx;
    lc.topk_weights = &w;
    lc.handle = &ld->handle;
    auto lcop = attacked.eps[r]->LowLatencyCombine(lc);
    ASSERT_TRUE(lcop.ok()) << lcop.status();
    expect_routing_error(lcop->Wait(absl::Seconds(20)).status(), "LowLatencyCombine");
  });
  ExpectSame(RunNormal(neighbour_host, nin), RunNormal(neighbour, nin), "neighbour normal");
  ExpectSame(RunLowLatency(neighbour_host, nin, false, false),
             RunLowLatency(neighbour, nin, false, false), "neighbour low-latency");
  ExpectSame(RunNormal(attacked_host, in), RunNormal(attacked, in), "attacked group after");
  ExpectSame(RunLowLatency(attacked_host, in, false, false),
             RunLowLatency(attacked, in, false, false), "attacked group low-latency after");
}

// One group across GPUs (peer access enabled by the plane): ranks alternate between the
// first two GPUs, two virtual ranks on each.
TEST_F(CudaDataPlaneTest, GroupAcrossTwoGpusMatchesHost) {
  auto inventory = GpuInventory::Discover({});
  ASSERT_TRUE(inventory.ok()) << inventory.status();
  if (inventory->gpus().size() < 2) {
    GTEST_SKIP() << "needs 2 GPUs, this machine has " << inventory->gpus().size();
  }
  const std::string g0 = inventory->gpus()[0].uuid(), g1 = inventory->gpus()[1].uuid();
  const v1::GroupSpec spec = Spec("two-gpus", 4, 16, 1024, 4, 32, 32);
  PlaneGroup host, cuda;
  host.Open(host_.get(), spec);
  cuda.Open(cuda_.get(), spec, {g0, g1, g0, g1});
  Inputs in;
  in.Make(spec, {32, 5, 0, 31}, {.masked_fraction = 0.2}, 31);
  ExpectSame(RunLowLatency(host, in, true, false), RunLowLatency(cuda, in, true, false),
             "two GPUs low-latency");
  ExpectSame(RunNormal(host, in), RunNormal(cuda, in), "two GPUs normal");
}

TEST_F(CudaDataPlaneTest, ReportsGpuMemory) {
  const v1::GroupSpec spec = Spec("mem", 2, 2, 128, 1, 4, 0);
  auto free_bytes = cuda_->FreeBytes("");
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  EXPECT_GT(*free_bytes, cuda_->BytesPerRank(spec));
  EXPECT_EQ(cuda_->BytesPerRank(spec) % (2u << 20), 0u);
  EXPECT_EQ(cuda_->FreeBytes("GPU-not-a-gpu").status().code(), absl::StatusCode::kNotFound);
}

// The CUDA backend's endpoint regions and its engine's doorbell page are sealed memfds: each
// rank's descriptors are handed out once, every group on a GPU gets that GPU's one doorbell
// page, and nobody holding them can resize either (epd maps both: a shrink would SIGBUS
// it). docs/SECURITY.md "Shared memory the client cannot resize", "The doorbell page".
TEST_F(CudaDataPlaneTest, EndpointRegionsAndTheGpusDoorbellAreSealedAndHandedOutOnce) {
  std::vector<std::unique_ptr<DataPlaneGroup>> groups;
  std::vector<EndpointFds> fds;
  std::vector<v1::EndpointInfo> infos(2);
  for (int g = 0; g < 2; ++g) {
    auto group = cuda_->CreateGroup(Spec(absl::StrCat("sealed", g), 1, 2, 128, 1, 4, 0));
    ASSERT_TRUE(group.ok()) << group.status();
    groups.push_back(std::move(*group));
    ASSERT_TRUE(groups[g]->AttachRank(0, "", v1::LAUNCH_MODE_DAEMON, {}, &infos[g]).ok());
    absl::StatusOr<EndpointFds> taken = groups[g]->TakeEndpointFds(0);
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_EQ(taken->endpoint_id, infos[g].endpoint_id());
    EXPECT_TRUE(groups[g]->RankMapped(0));
    EXPECT_EQ(groups[g]->TakeEndpointFds(0).status().code(), absl::StatusCode::kFailedPrecondition);
    fds.push_back(*std::move(taken));
  }
  struct stat a {
  }, b{};
  ASSERT_EQ(::fstat(fds[0].doorbell.get(), &a), 0);
  ASSERT_EQ(::fstat(fds[1].doorbell.get(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "one doorbell page per GPU engine";
  for (int g = 0; g < 2; ++g) {
    for (const auto& [fd, bytes] :
         {std::pair<int, uint64_t>{fds[g].region.get(), infos[g].shm_bytes()},
          {fds[g].doorbell.get(), sizeof(abi::DoorbellPage)}}) {
      EXPECT_EQ(::fcntl(fd, F_GET_SEALS) & kRequiredSeals, kRequiredSeals);
      EXPECT_EQ(::ftruncate(fd, 0), -1);
      EXPECT_EQ(errno, EPERM);
      EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes * 2)), -1);
      EXPECT_EQ(errno, EPERM);
      struct stat st {};
      ASSERT_EQ(::fstat(fd, &st), 0);
      EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes);
    }
  }
}

// The default launch mode (DataPlane::DefaultLaunchMode): client-launched when every rank
// can have a GPU of its own or MPS is active, daemon-launched otherwise.
TEST_F(CudaDataPlaneTest, DefaultLaunchModeIsClientWithAGpuPerRankOrMps) {
  int gpus = 0;
  ASSERT_EQ(cudaGetDeviceCount(&gpus), cudaSuccess);
  EXPECT_EQ(cuda_->DefaultLaunchMode(Spec("one", 1, 2, 128, 1, 4, 0)), v1::LAUNCH_MODE_CLIENT);
  EXPECT_EQ(cuda_->DefaultLaunchMode(Spec("per-gpu", gpus, 2 * gpus, 128, 1, 4, 0)),
            v1::LAUNCH_MODE_CLIENT);
  const v1::LaunchMode crowded =
      cuda_->DefaultLaunchMode(Spec("crowded", gpus + 1, 2 * (gpus + 1), 128, 1, 4, 0));
  EXPECT_EQ(crowded, DetectMps().active ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON)
      << DetectMps().detail;
  EXPECT_EQ(host_->DefaultLaunchMode(Spec("host", 1, 2, 128, 1, 4, 0)), v1::LAUNCH_MODE_DAEMON);
}

/// One rank attached to a data-plane group through raw ring slots: its EndpointInfo, its
/// ring, and its device area (mapped in-process).
struct RawRank {
  v1::EndpointInfo info;
  std::unique_ptr<testing::RawRing> ring;
  uint8_t* area = nullptr;
};

/// Attaches every rank of `group` with `mode` and maps its ring and area.
std::vector<RawRank> AttachRaw(DataPlaneGroup& group, int ranks, v1::LaunchMode mode) {
  std::vector<RawRank> out(ranks);
  for (int r = 0; r < ranks; ++r) {
    absl::Status st = group.AttachRank(r, "", mode, {}, &out[r].info);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return {};
    out[r].ring = testing::RawRing::Open(out[r].info, group);
    auto area = FindInProcessCudaArea(out[r].info.cuda_ipc_handle());
    EXPECT_TRUE(area.ok()) << area.status();
    if (!area.ok() || out[r].ring == nullptr) return {};
    out[r].area = static_cast<uint8_t*>(*area);
  }
  return out;
}

uint64_t ReadU64(const uint8_t* device) {
  uint64_t v = ~0ull;
  EXPECT_EQ(cudaMemcpy(&v, device, sizeof(v), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}
void WriteU64(uint8_t* device, uint64_t v) {
  EXPECT_EQ(cudaMemcpy(device, &v, sizeof(v), cudaMemcpyHostToDevice), cudaSuccess);
}
template <typename T>
void Upload(uint8_t* device, const std::vector<T>& v) {
  EXPECT_EQ(cudaMemcpy(device, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}
template <typename T>
std::vector<T> Download(const uint8_t* device, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

/// The launch_flags words of a rank (layout.h).
struct Flags {
  uint8_t* ready;
  uint8_t* done;
};
Flags FlagsOf(const RawRank& rank, const kernels::EndpointLayout& layout) {
  uint8_t* base = rank.area + layout.launch_flags.offset;
  return {base + abi::kReadyFlagOffset, base + abi::kDoneFlagOffset};
}

/// Polls done_seq until it reaches `seq` (the engine's write lands on the GPU shortly after
/// the CPU completion) or `timeout` passes; returns the last value read.
uint64_t AwaitDone(const Flags& f, uint64_t seq, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  uint64_t v = ReadU64(f.done);
  while (v < seq && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    v = ReadU64(f.done);
  }
  return v;
}

constexpr int32_t kCode(absl::StatusCode c) { return static_cast<int32_t>(c); }

/// Every rank submits a stream-ordered LowLatencyDispatch of T tokens routed by `idx`
/// ([T, 2] int64, distinct ids per token, already staged in every rank's in_topk_idx)
/// and writes its ready_seq; then each rank must complete OK with done_seq == seq and
/// recv_count[j] = R * (tokens of idx with expert r*El + j).
/// Uploads to every rank's area x = `x_value` [max_t, H] bf16 and, with K = 2, token t routed
/// to experts (step * t) % E and (step * t + offset) % E; returns that topk_idx [max_t, 2].
std::vector<int64_t> UploadTwoExpertRouting(std::vector<RawRank>& ranks,
                                            const kernels::EndpointLayout& L, int H, int E,
                                            int max_t, float x_value, int step, int offset) {
  constexpr int K = 2;
  std::vector<bf16_bits> x(max_t * H, kernels::FloatToBf16(x_value));
  std::vector<int64_t> idx(max_t * K);
  for (int t = 0; t < max_t; ++t) {
    idx[t * K] = (step * t) % E;
    idx[t * K + 1] = (step * t + offset) % E;
  }
  for (RawRank& rank : ranks) {
    Upload(rank.area + L.in_x.offset, x);
    Upload(rank.area + L.in_topk_idx.offset, idx);
  }
  return idx;
}

void RunOrderedDispatchAndCheckCounts(std::vector<RawRank>& ranks, const kernels::EndpointLayout& L,
                                      const v1::GroupSpec& spec, const std::vector<int64_t>& idx,
                                      int T, const std::string& what) {
  const int R = spec.num_ranks(), K = spec.num_topk(), El = spec.num_experts() / R;
  uint64_t seq = 0;
  for (int r = 0; r < R; ++r) {
    seq = ranks[r].ring->Submit(abi::OpKind::kLowLatencyDispatch, abi::kFlagStreamOrdered, T);
    WriteU64(FlagsOf(ranks[r], L).ready, seq);
  }
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(seq, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << what << ": rank " << r;
    EXPECT_EQ(c->status_code, 0) << what << ": " << c->message;
    EXPECT_EQ(AwaitDone(FlagsOf(ranks[r], L), seq, std::chrono::milliseconds(2000)), seq) << what;
    const auto count = Download<int32_t>(ranks[r].area + L.ll_recv_count[c->buffer].offset, El);
    for (int j = 0; j < El; ++j) {
      const int e = r * El + j;
      int want = 0;
      for (int t = 0; t < T; ++t) {
        bool hit = false;
        for (int k = 0; k < K; ++k) hit |= idx[t * K + k] == e;
        want += hit ? 1 : 0;
      }
      EXPECT_EQ(count[j], R * want) << what << ": rank " << r << " expert " << e;
    }
  }
}

/// How the ordered tests' daemon launches a low-latency op.
enum class OrderedLaunch {
  kStreamWait,  ///< cuStreamWaitValue64 for ready (no MPS), per rank.
  kInAKernel,   ///< A WaitFlagAsync kernel, the op's kernel programmatic behind it (MPS).
  kOpGraphs,    ///< As kInAKernel, captured in per-GPU op graphs (CudaDataPlaneOptions::op_graphs).
  kFused,       ///< One WaitFlagsAsync and one fused kernel per GPU (fused_launch).
};

/// The stream-ordered tests, with each way a daemon-launched low-latency op can wait for its
/// client's ready flag (CudaDataPlaneOptions::kernel_ready_wait): cuStreamWaitValue64 (no
/// MPS) and a WaitFlagAsync kernel with the op's kernel launched programmatically (MPS),
/// the latter also through per-GPU op graphs (one launch per GPU per op).
class CudaDataPlaneOrderedTest : public CudaDataPlaneTest,
                                 public ::testing::WithParamInterface<OrderedLaunch> {
 protected:
  void SetUp() override {
    SetUpPlanes(KernelWait(), GetParam() == OrderedLaunch::kOpGraphs,
                GetParam() == OrderedLaunch::kFused);
  }
  bool KernelWait() const { return GetParam() != OrderedLaunch::kStreamWait; }
};

INSTANTIATE_TEST_SUITE_P(ReadyWait, CudaDataPlaneOrderedTest,
                         ::testing::Values(OrderedLaunch::kStreamWait, OrderedLaunch::kInAKernel,
                                           OrderedLaunch::kOpGraphs, OrderedLaunch::kFused),
                         [](const ::testing::TestParamInfo<OrderedLaunch>& info) {
                           switch (info.param) {
                             case OrderedLaunch::kStreamWait:
                               return std::string("StreamWait");
                             case OrderedLaunch::kInAKernel:
                               return std::string("InAKernel");
                             case OrderedLaunch::kOpGraphs:
                               return std::string("OpGraphs");
                             case OrderedLaunch::kFused:
                               return std::string("Fused");
                           }
                           return std::string("Unknown");
                         });

TEST_P(CudaDataPlaneOrderedTest, StreamOrderedOpRunsOnlyOnceReadyIsWrittenThenWritesDone) {
  const int R = 2, E = 8, K = 2, T = 6;
  const v1::GroupSpec spec = Spec("ordered", R, E, 256, K, 16, 16);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_UNSPECIFIED);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  for (const RawRank& rk : ranks) {
    EXPECT_EQ(rk.info.launch_mode(), v1::LAUNCH_MODE_DAEMON);
    // The client's staging kernel may wait for done only where the daemon's ready wait is a
    // kernel (MPS): that is when its low-latency grids leave it an SM.
    EXPECT_EQ(rk.info.kernel_done_wait(), KernelWait());
    // So may a graph-mode program step's (its instances' grids leave the SM too).
    EXPECT_EQ(rk.info.program_kernel_done_wait(), KernelWait());
    EXPECT_EQ(ReadU64(FlagsOf(rk, L).ready), 0u);
    EXPECT_EQ(ReadU64(FlagsOf(rk, L).done), 0u);
  }
  // Stale inputs (every token to expert 0) are staged first; the right ones only after
  // the requests are published, right before ready_seq is written, as a client's stream
  // that is still busy would.
  std::vector<int64_t> stale(T * K, 0);
  std::vector<std::vector<int64_t>> idx(R, std::vector<int64_t>(T * K));
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      idx[r][t * K] = (t + r) % E;
      idx[r][t * K + 1] = t % 3 == 0 ? -1 : (t + r + 3) % E;
    }
    Upload(ranks[r].area + L.in_topk_idx.offset, stale);
  }
  uint64_t seq = 0;
  for (int r = 0; r < R; ++r) {
    seq = ranks[r].ring->Submit(abi::OpKind::kGetDispatchLayout, abi::kFlagStreamOrdered, T);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (int r = 0; r < R; ++r) {
    EXPECT_FALSE(ranks[r].ring->Completion(seq).has_value()) << "rank " << r << " done early";
    EXPECT_LT(ReadU64(FlagsOf(ranks[r], L).done), seq) << "rank " << r;
    const auto per_expert = Download<int32_t>(ranks[r].area + L.layout_tokens_per_expert.offset, E);
    EXPECT_EQ(std::count(per_expert.begin(), per_expert.end(), 0), E)
        << "rank " << r << ": the kernels ran before ready_seq was written";
  }
  for (int r = 0; r < R; ++r) {
    Upload(ranks[r].area + L.in_topk_idx.offset, idx[r]);
    WriteU64(FlagsOf(ranks[r], L).ready, seq);
  }
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(seq, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "rank " << r << " got no completion";
    EXPECT_EQ(c->status_code, 0) << c->message;
    EXPECT_EQ(AwaitDone(FlagsOf(ranks[r], L), seq, std::chrono::milliseconds(2000)), seq);
    std::vector<int32_t> want_expert(E, 0), want_rank(R, 0);
    for (int t = 0; t < T; ++t) {
      std::vector<bool> to_rank(R, false);
      for (int k = 0; k < K; ++k) {
        const int64_t e = idx[r][t * K + k];
        if (e < 0) continue;
        ++want_expert[e];
        to_rank[e / (E / R)] = true;
      }
      for (int q = 0; q < R; ++q) want_rank[q] += to_rank[q] ? 1 : 0;
    }
    EXPECT_EQ(Download<int32_t>(ranks[r].area + L.layout_tokens_per_expert.offset, E), want_expert)
        << "rank " << r;
    EXPECT_EQ(Download<int32_t>(ranks[r].area + L.layout_tokens_per_rank.offset, R), want_rank)
        << "rank " << r;
  }
  // A request without the flag leaves the flags alone.
  uint64_t plain = 0;
  for (int r = 0; r < R; ++r) plain = ranks[r].ring->Submit(abi::OpKind::kGetDispatchLayout, 0, T);
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(plain, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, 0) << c->message;
    EXPECT_EQ(ReadU64(FlagsOf(ranks[r], L).done), seq);
  }
}

TEST_P(CudaDataPlaneOrderedTest, StreamOrderedFailuresStillWriteDone) {
  const int R = 2, E = 8, K = 2, H = 256, T = 4;
  const v1::GroupSpec spec = Spec("ordered-fail", R, E, H, K, 16, 16);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_DAEMON);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  std::vector<bf16_bits> x(T * H, kernels::FloatToBf16(1.f));
  std::vector<int64_t> good(T * K), bad(T * K);
  for (int t = 0; t < T; ++t) {
    good[t * K] = t % E;
    good[t * K + 1] = (t + 5) % E;
  }
  bad = good;
  bad[3] = E;  // Out of range.
  for (int r = 0; r < R; ++r) Upload(ranks[r].area + L.in_x.offset, x);
  const auto ll = abi::OpKind::kLowLatencyDispatch;
  const uint32_t ordered = abi::kFlagStreamOrdered;

  // 1. An out-of-range expert id: the kernels run (after ready) and report it.
  Upload(ranks[0].area + L.in_topk_idx.offset, good);
  Upload(ranks[1].area + L.in_topk_idx.offset, bad);
  uint64_t seq = 0;
  for (int r = 0; r < R; ++r) {
    seq = ranks[r].ring->Submit(ll, ordered, T);
    WriteU64(FlagsOf(ranks[r], L).ready, seq);
  }
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(seq, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "bad id: rank " << r;
    EXPECT_EQ(c->status_code, kCode(absl::StatusCode::kInvalidArgument)) << c->message;
    EXPECT_EQ(AwaitDone(FlagsOf(ranks[r], L), seq, std::chrono::milliseconds(2000)), seq)
        << "bad id: rank " << r;
  }

  // 2. A client error on rank 0: no kernel runs, no ready_seq is ever written, and both
  //    ranks' streams still get done_seq.
  Upload(ranks[1].area + L.in_topk_idx.offset, good);
  seq = ranks[0].ring->Submit(ll, ordered | abi::kFlagClientError, T);
  ranks[1].ring->Submit(ll, ordered, T);
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(seq, std::chrono::milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "client error: rank " << r;
    EXPECT_EQ(c->status_code, kCode(absl::StatusCode::kInvalidArgument)) << c->message;
    EXPECT_EQ(AwaitDone(FlagsOf(ranks[r], L), seq, std::chrono::milliseconds(2000)), seq)
        << "client error: rank " << r;
  }

  // 3. Rank 1 never arrives: rank 0 gets DEADLINE_EXCEEDED after op_timeout (1 s), and
  //    done_seq; rank 1's late request then fails at once, with done_seq too.
  const auto start = std::chrono::steady_clock::now();
  seq = ranks[0].ring->Submit(ll, ordered, T);
  auto c0 = ranks[0].ring->Await(seq, std::chrono::milliseconds(5000));
  ASSERT_TRUE(c0.has_value());
  EXPECT_EQ(c0->status_code, kCode(absl::StatusCode::kDeadlineExceeded)) << c0->message;
  EXPECT_NE(std::string(c0->message).find("rank(s) 1"), std::string::npos) << c0->message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2000));
  EXPECT_EQ(AwaitDone(FlagsOf(ranks[0], L), seq, std::chrono::milliseconds(2000)), seq);
  EXPECT_LT(ReadU64(FlagsOf(ranks[1], L).done), seq);
  ranks[1].ring->Submit(ll, ordered, T);
  auto c1 = ranks[1].ring->Await(seq, std::chrono::milliseconds(1000));
  ASSERT_TRUE(c1.has_value());
  EXPECT_EQ(c1->status_code, kCode(absl::StatusCode::kDeadlineExceeded)) << c1->message;
  EXPECT_EQ(AwaitDone(FlagsOf(ranks[1], L), seq, std::chrono::milliseconds(2000)), seq);

  // 4. The group then works, stream-ordered: every token reaches its experts.
  RunOrderedDispatchAndCheckCounts(ranks, L, spec, good, T, "after failures");
}

// A client that publishes a stream-ordered request but never writes ready_seq (e.g. it
// died between the two): the engine gives the op up after op_timeout + 5 s, releases the
// rank's stream from the host (ready_seq = seq), the late kernels end at their own timeout
// and write done_seq, and the group's next op is correct.
TEST_P(CudaDataPlaneOrderedTest, ReadyNeverWrittenIsGivenUpThenTheGroupRecovers) {
  const int R = 2, E = 8, K = 2, H = 256, T = 3;
  const v1::GroupSpec spec = Spec("no-ready", R, E, H, K, 16, 16);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_DAEMON);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  std::vector<bf16_bits> x(T * H, kernels::FloatToBf16(0.5f));
  std::vector<int64_t> idx(T * K);
  for (int t = 0; t < T; ++t) {
    idx[t * K] = (2 * t) % E;
    idx[t * K + 1] = (2 * t + 5) % E;
  }
  for (int r = 0; r < R; ++r) {
    Upload(ranks[r].area + L.in_x.offset, x);
    Upload(ranks[r].area + L.in_topk_idx.offset, idx);
  }
  const auto ll = abi::OpKind::kLowLatencyDispatch;
  const uint32_t ordered = abi::kFlagStreamOrdered;
  const uint64_t seq = ranks[0].ring->Submit(ll, ordered, T);
  ranks[1].ring->Submit(ll, ordered, T);
  WriteU64(FlagsOf(ranks[0], L).ready, seq);  // Rank 1's client never does.
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < R; ++r) {
    auto c = ranks[r].ring->Await(seq, std::chrono::milliseconds(10000));
    ASSERT_TRUE(c.has_value()) << "rank " << r;
    EXPECT_EQ(c->status_code, kCode(absl::StatusCode::kDeadlineExceeded)) << c->message;
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(secs, 5.5) << "given up before op_timeout (1 s) + 5 s";
  EXPECT_LT(secs, 8.0);
  // Both streams end: rank 0's after its kernel timed out, rank 1's after the release.
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(AwaitDone(FlagsOf(ranks[r], L), seq, std::chrono::milliseconds(5000)), seq)
        << "rank " << r;
  }
  // The next op waits for the abandoned one to leave the GPU, then runs correctly.
  RunOrderedDispatchAndCheckCounts(ranks, L, spec, idx, T, "after the give-up");
}

// Ops through op graphs take each op's seq and T from the engine's words, not the values
// of the op they were captured at: a run of stream-ordered dispatches with changing T and
// both buffer sets (two variants), each routed right. Only the op-graph launch counts them
// as graph launches; the per-rank paths never do. Eight ranks on one GPU, one graph each op.
TEST_P(CudaDataPlaneOrderedTest, OpGraphsReplayEachOpsSeqAndTokenCount) {
  const int R = 8, E = 16, K = 2, H = 256, kMaxT = 8;
  const v1::GroupSpec spec = Spec("op-graphs", R, E, H, K, 16, kMaxT);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_DAEMON);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  const std::vector<int64_t> idx = UploadTwoExpertRouting(ranks, L, H, E, kMaxT, 0.25f, 3, 7);
  const uint64_t before = CudaOpGraphLaunchesForTesting();
  const uint64_t fused_before = CudaFusedLaunchesForTesting();
  const int token_counts[] = {3, 8, 1, 8, 0, 5};
  for (int T : token_counts) {
    const std::vector<int64_t> prefix(idx.begin(), idx.begin() + T * K);
    RunOrderedDispatchAndCheckCounts(ranks, L, spec, prefix, T, absl::StrCat("T = ", T));
  }
  const uint64_t launched = CudaOpGraphLaunchesForTesting() - before;
  if (GetParam() == OrderedLaunch::kOpGraphs) {
    EXPECT_EQ(launched, std::size(token_counts)) << "not every op went through the op graphs";
  } else {
    EXPECT_EQ(launched, 0u) << "op graphs used though CudaDataPlaneOptions::op_graphs is off";
  }
  // One GPU: one fused launch per op, and none on any other path.
  const uint64_t fused = CudaFusedLaunchesForTesting() - fused_before;
  if (GetParam() == OrderedLaunch::kFused) {
    EXPECT_EQ(fused, std::size(token_counts)) << "not every op went through a fused launch";
  } else {
    EXPECT_EQ(fused, 0u) << "a fused launch on a path that must not use one";
  }
}

// A fused launch holds at most kMaxFusedRanks ranks of a GPU: a group with one more on the
// GPU takes the per-rank path on every launch setting, and its ops are right.
TEST_P(CudaDataPlaneOrderedTest, MoreRanksOnAGpuThanAFusedLaunchHoldsTakeThePerRankPath) {
  const int R = kernels::cuda::kMaxFusedRanks + 1, E = 2 * R, K = 2, H = 256, kMaxT = 8;
  const v1::GroupSpec spec = Spec("fused-overflow", R, E, H, K, 16, kMaxT);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_DAEMON);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  const std::vector<int64_t> idx = UploadTwoExpertRouting(ranks, L, H, E, kMaxT, 0.5f, 5, 3);
  const uint64_t fused_before = CudaFusedLaunchesForTesting();
  for (int T : {kMaxT, 3}) {
    const std::vector<int64_t> prefix(idx.begin(), idx.begin() + T * K);
    RunOrderedDispatchAndCheckCounts(ranks, L, spec, prefix, T, absl::StrCat("T = ", T));
  }
  EXPECT_EQ(CudaFusedLaunchesForTesting() - fused_before, 0u)
      << R << " ranks on one GPU went through a fused launch of at most "
      << kernels::cuda::kMaxFusedRanks;
}

// The memory of a rank that left, or of a group that ended, is freed only when no group has
// work on the GPU: cudaFree and cudaFreeHost wait for the whole device and hold back the
// engine's launches meanwhile, so a free beside another op whose ranks are not all launched
// would stall it until its kernels' bounds (DeferredRelease). Here a FAIL-policy group's op
// is held on the GPU (rank 1's client never writes ready_seq) while rank 1 leaves, and a
// second group is created and ends: neither's memory is freed until that op has ended; then
// both are, by the engine, with no further call. Seen through this process's registry of
// exported areas, which a rank leaves as its resources are destroyed (FindInProcessCudaArea).
TEST_F(CudaDataPlaneTest, MemoryOfRanksThatLeftIsFreedOnlyWhenNoGroupHasWorkOnTheGpu) {
  const int R = 2, E = 8, K = 2, T = 4;
  v1::GroupSpec spec = Spec("left-in-op", R, E, 256, K, 16, 16);
  spec.set_on_rank_failure(v1::RANK_FAILURE_POLICY_FAIL);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_DAEMON);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  const std::string left_handle = ranks[1].info.cuda_ipc_handle();
  std::vector<int64_t> idx(T * K);
  for (int t = 0; t < T; ++t) {
    idx[t * K] = t % E;
    idx[t * K + 1] = (t + 3) % E;
  }
  for (int r = 0; r < R; ++r) Upload(ranks[r].area + L.in_topk_idx.offset, idx);
  // Both ranks submit a stream-ordered op; only rank 0's client writes ready_seq, so the op
  // stays on the GPU, holding rank 1, while rank 1 leaves.
  uint64_t seq = 0;
  for (int r = 0; r < R; ++r) {
    seq = ranks[r].ring->Submit(abi::OpKind::kGetDispatchLayout, abi::kFlagStreamOrdered, T);
  }
  WriteU64(FlagsOf(ranks[0], L).ready, seq);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_FALSE(ranks[0].ring->Completion(seq).has_value()) << "the op did not wait for rank 1";
  (*group)->DetachRank(1);
  // A second group on the same GPU, created and ended while that op is on the GPU.
  std::string other_handle;
  {
    auto other = cuda_->CreateGroup(Spec("ends-beside-op", R, E, 256, K, 16, 16));
    ASSERT_TRUE(other.ok()) << other.status();
    std::vector<RawRank> other_ranks = AttachRaw(**other, R, v1::LAUNCH_MODE_DAEMON);
    ASSERT_EQ(other_ranks.size(), static_cast<size_t>(R));
    other_handle = other_ranks[0].info.cuda_ipc_handle();
    for (int r = 0; r < R; ++r) (*other)->DetachRank(r);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // Many engine rounds.
  EXPECT_TRUE(FindInProcessCudaArea(left_handle).ok()) << "freed while an op held the GPU";
  EXPECT_TRUE(FindInProcessCudaArea(other_handle).ok())
      << "an ended group's memory was freed while another group's op was on the GPU";
  // The op now ends (its stream released as a client's would).
  WriteU64(ranks[1].area + L.launch_flags.offset + abi::kReadyFlagOffset, seq);
  auto c = ranks[0].ring->Await(seq, std::chrono::milliseconds(5000));
  ASSERT_TRUE(c.has_value()) << "rank 0 got no completion";
  EXPECT_EQ(AwaitDone(FlagsOf(ranks[0], L), seq, std::chrono::milliseconds(2000)), seq);
  // No group has work on the GPU now: the engine frees both between two rounds.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while ((FindInProcessCudaArea(left_handle).ok() || FindInProcessCudaArea(other_handle).ok()) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_FALSE(FindInProcessCudaArea(left_handle).ok()) << "rank 1's memory was never freed";
  EXPECT_FALSE(FindInProcessCudaArea(other_handle).ok()) << "the ended group's memory stayed";
  (*group)->DetachRank(0);
}

// EPD_KERNEL_DONE_WAIT takes "0" or "1" (or nothing); any other value fails the opening of
// a daemon-launched endpoint naming the variable and the value, and "0" opens it.
TEST_F(CudaDataPlaneTest, BadKernelDoneWaitSwitchFailsTheEndpointNamingIt) {
  const v1::GroupSpec spec = Spec("done-wait-env", 1, 8, 256, 2, 16, 16);
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  DataPlaneGroup* gp = group->get();
  for (const char* value : {"maybe", "0"}) {
    SCOPED_TRACE(value);
    ASSERT_EQ(setenv("EPD_KERNEL_DONE_WAIT", value, 1), 0);
    v1::EndpointInfo info;
    ASSERT_TRUE(gp->AttachRank(0, "", v1::LAUNCH_MODE_DAEMON, {}, &info).ok());
    absl::StatusOr<EndpointFds> fds = gp->TakeEndpointFds(0);
    ASSERT_TRUE(fds.ok()) << fds.status();
    auto ep = internal::OpenEndpoint(info, spec, *std::move(fds), [gp] {
      gp->DetachRank(0);
      return absl::OkStatus();
    });
    unsetenv("EPD_KERNEL_DONE_WAIT");
    if (std::string(value) == "0") {
      EXPECT_TRUE(ep.ok()) << ep.status();
    } else {
      EXPECT_EQ(ep.status().code(), absl::StatusCode::kInvalidArgument) << ep.status();
      EXPECT_NE(ep.status().message().find("EPD_KERNEL_DONE_WAIT"), std::string::npos);
      EXPECT_NE(ep.status().message().find("maybe"), std::string::npos);
      gp->DetachRank(0);
    }
  }
}

TEST_F(CudaDataPlaneTest, ClientLaunchedEndpointGetsAZeroedAreaAndItsRingIsRefused) {
  const int R = 2;
  const v1::GroupSpec spec = Spec("client-mode", R, 8, 256, 2, 16, 16);
  const kernels::EndpointLayout L = kernels::EndpointLayout::Compute(ShapeOf(spec));
  auto group = cuda_->CreateGroup(spec);
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<RawRank> ranks = AttachRaw(**group, R, v1::LAUNCH_MODE_CLIENT);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(R));
  for (const RawRank& rk : ranks) {
    EXPECT_EQ(rk.info.launch_mode(), v1::LAUNCH_MODE_CLIENT);
    EXPECT_FALSE(rk.info.kernel_done_wait()) << "a client-launched endpoint has no done wait";
    EXPECT_FALSE(rk.info.program_kernel_done_wait());
    EXPECT_EQ(rk.info.backend(), "cuda");
    EXPECT_EQ(rk.info.cuda_ipc_handle().size(), sizeof(cudaIpcMemHandle_t));
    EXPECT_EQ(rk.info.data_bytes(), L.total_bytes);
    const auto bytes = Download<uint8_t>(rk.area, L.total_bytes);
    EXPECT_EQ(static_cast<uint64_t>(std::count(bytes.begin(), bytes.end(), 0)), L.total_bytes)
        << "the area (launch_flags included) must be zeroed";
  }
  // Every slot is refused at once (no op collection, no op_timeout wait), done_seq
  // included for a stream-ordered one.
  const auto start = std::chrono::steady_clock::now();
  const uint64_t a =
      ranks[0].ring->Submit(abi::OpKind::kLowLatencyDispatch, abi::kFlagStreamOrdered, 1);
  const uint64_t b = ranks[0].ring->Submit(abi::OpKind::kGetDispatchLayout, 0, 1);
  for (uint64_t seq : {a, b}) {
    auto c = ranks[0].ring->Await(seq, std::chrono::milliseconds(2000));
    ASSERT_TRUE(c.has_value()) << "seq " << seq;
    EXPECT_EQ(c->status_code, kCode(absl::StatusCode::kFailedPrecondition)) << c->message;
    EXPECT_NE(std::string(c->message).find("client-launched"), std::string::npos) << c->message;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(AwaitDone(FlagsOf(ranks[0], L), a, std::chrono::milliseconds(2000)), a);
  EXPECT_EQ(abi::Atomic(ranks[0].ring->header()->rejected_requests).load(), 2u);
  // Nothing ran on rank 1's area either.
  EXPECT_EQ(ReadU64(FlagsOf(ranks[1], L).done), 0u);
}

// ---- rank masking (GroupSpec.on_rank_failure = MASK, docs/RELIABILITY.md) ----------------
//
// The same ops, masks and departures on the host data plane (kernels/host: the masked
// reference) and the CUDA data plane (8 virtual ranks on one GPU, daemon-launched): every
// rank that takes part gets the host's bytes and the host's OpMask (epoch, num_masked,
// dropped pairs).

/// A MASK group of 8 ranks on both planes, with inputs that route pairs to every rank.
class CudaMaskTest : public CudaDataPlaneTest {
 protected:
  void SetUp() override {
    CudaDataPlaneTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    spec_ = Spec("masked8", 8, 32, 1024, 4, 64, 64);
    spec_.set_on_rank_failure(v1::RANK_FAILURE_POLICY_MASK);
    ASSERT_NO_FATAL_FAILURE(host_group_.Open(host_.get(), spec_));
    ASSERT_NO_FATAL_FAILURE(cuda_group_.Open(cuda_.get(), spec_));
    in_.Make(spec_, {64, 0, 1, 33, 64, 17, 5, 40}, {.masked_fraction = 0.1}, 77);
  }
  void TearDown() override {
    // Endpoints before their groups, both before the base clears the in-process resolver.
    for (PlaneGroup* g : {&host_group_, &cuda_group_}) {
      g->eps.clear();
      g->group.reset();
    }
    CudaDataPlaneTest::TearDown();
  }

  /// The same UpdateRankMask on both planes; their answers agree.
  void Mask(std::vector<int32_t> mask, bool clean = false) {
    auto h = host_group_.group->UpdateRankMask(mask, {}, clean);
    auto c = cuda_group_.group->UpdateRankMask(mask, {}, clean);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(h->epoch(), c->epoch());
    EXPECT_EQ(h->masked_ranks_size(), c->masked_ranks_size());
  }

  /// `round` on both planes while masked rank `masked` (alive) keeps its place in each
  /// group's sequence by submitting `ops` GetDispatchLayout requests, each failing at once
  /// as masked; the survivors' results compared.
  void CompareWhileMasked(const std::function<GroupResult(PlaneGroup&)>& round, int masked, int ops,
                          const std::string& what) {
    for (PlaneGroup* g : {&host_group_, &cuda_group_}) {
      std::thread in_step([&] {
        RankInputs& ri = in_.ranks[masked];
        std::vector<int64_t> ks{ri.T, spec_.num_topk()};
        DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
        for (int i = 0; i < ops; ++i) {
          auto op = g->eps[masked]->GetDispatchLayout(idx);
          ASSERT_TRUE(op.ok()) << op.status();
          absl::Status st = op->Wait(absl::Seconds(20)).status();
          EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
        }
      });
      (g == &host_group_ ? want_ : got_) = round(*g);
      in_step.join();
    }
    ExpectSame(want_, got_, what);
  }

  /// `round` on both planes, compared.
  void Compare(const std::function<GroupResult(PlaneGroup&)>& round, const std::string& what) {
    want_ = round(host_group_);
    got_ = round(cuda_group_);
    ExpectSame(want_, got_, what);
  }

  /// Sum over the CUDA plane's ranks of op `op`'s dropped pairs; every rank but `skip`
  /// reports `epoch` and `num_masked` there.
  int DroppedAt(size_t op, uint32_t epoch, int32_t num_masked, int skip = -1) const {
    int dropped = 0;
    for (int r = 0; r < spec_.num_ranks(); ++r) {
      if (r == skip) continue;
      EXPECT_GT(got_[r].masks.size(), op) << "rank " << r;
      if (got_[r].masks.size() <= op) continue;
      EXPECT_EQ(got_[r].masks[op].epoch, epoch) << "rank " << r << " op " << op;
      EXPECT_EQ(got_[r].masks[op].num_masked, num_masked) << "rank " << r << " op " << op;
      dropped += got_[r].masks[op].dropped_pairs;
    }
    return dropped;
  }

  v1::GroupSpec spec_;
  PlaneGroup host_group_, cuda_group_;
  Inputs in_;
  GroupResult want_, got_;
};

// A client masks rank 3; low-latency rounds (BF16, FP8, FP8 with round_scale) run without it
// and equal the host's with rank 3's experts dropped; clean brings it back, exact again.
TEST_F(CudaMaskTest, LowLatencyUnderAClientsMaskMatchesHostThenCleanIsExact) {
  auto ll = [&](bool fp8, bool round_scale, int skip) {
    return [&, fp8, round_scale, skip](PlaneGroup& g) {
      return RunLowLatency(g, in_, fp8, round_scale, skip);
    };
  };
  Compare(ll(false, false, -1), "ll before the mask");
  EXPECT_EQ(DroppedAt(1, 0, 0), 0);
  ASSERT_NO_FATAL_FAILURE(Mask({3}));
  const struct { bool fp8, round_scale; } options[] = {{false, false}, {true, false}, {true, true}};
  for (const auto& o : options) {
    const std::string what =
        absl::StrCat("ll masked", o.fp8 ? " fp8" : " bf16", o.round_scale ? " round_scale" : "");
    CompareWhileMasked(ll(o.fp8, o.round_scale, 3), 3, 2, what);
    EXPECT_GT(DroppedAt(0, 1, 1, 3), 0) << what << ": the dispatch routes pairs to rank 3";
    EXPECT_GT(DroppedAt(1, 1, 1, 3), 0) << what << ": the combine drops them too";
  }
  ASSERT_NO_FATAL_FAILURE(Mask({}, /*clean=*/true));
  Compare(ll(true, true, -1), "ll after clean");
  EXPECT_EQ(DroppedAt(1, 2, 0), 0);
}

// A rank masked after its dispatch keeps that dispatch's results: the ops that run without
// it play its part on an area of their own, never on the area its client reads them from.
TEST_F(CudaMaskTest, MaskedRanksLastResultsSurviveTheOpsThatRunWithoutIt) {
  PlaneGroup& g = cuda_group_;
  const int R = spec_.num_ranks(), H = spec_.hidden();
  std::vector<absl::StatusOr<LowLatencyDispatchResult>> d(R, absl::UnknownError("not run"));
  g.OnEveryRank([&](int r) {
    RankInputs& ri = in_.ranks[r];
    std::vector<int64_t> xs{ri.T, H}, ks{ri.T, spec_.num_topk()};
    DLTensor x = Tensor(ri.dx.get(), kBf16, xs, true);
    DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
    LowLatencyDispatchArgs da;
    da.x = &x;
    da.topk_idx = &idx;
    auto op = g.eps[r]->LowLatencyDispatch(da);
    if (!op.ok()) {
      d[r] = op.status();
      return;
    }
    d[r] = op->Wait(absl::Seconds(20));
  });
  for (int r = 0; r < R; ++r) ASSERT_TRUE(d[r].ok()) << "rank " << r << ": " << d[r].status();
  const std::vector<uint8_t> count = FetchAll(d[3]->recv_count);
  const std::vector<uint8_t> rows = FetchAll(d[3]->recv_x);
  bool received = false;
  for (size_t i = 0; i < count.size(); i += 4) {
    int32_t c;
    std::memcpy(&c, count.data() + i, 4);
    received |= c > 0;
  }
  ASSERT_TRUE(received) << "rank 3's experts received no token: the test shows nothing";
  // Rank 3's client has not yet read its results when it is masked; two rounds of each
  // option run without it, in both low-latency buffers.
  auto masked = g.group->UpdateRankMask(std::vector<int32_t>{3}, {}, false);
  ASSERT_TRUE(masked.ok()) << masked.status();
  for (int i = 0; i < 2; ++i) {
    for (bool fp8 : {false, true}) {
      GroupResult res = RunLowLatency(g, in_, fp8, false, /*skip=*/3);
      for (int r = 0; r < R; ++r) {
        if (r != 3) ASSERT_TRUE(res[r].status.ok()) << "rank " << r << ": " << res[r].status;
      }
    }
  }
  EXPECT_TRUE(FetchAll(d[3]->recv_count) == count)
      << "rank 3's recv_count was overwritten by ops it took no part in";
  EXPECT_TRUE(FetchAll(d[3]->recv_x) == rows)
      << "rank 3's recv_x was overwritten by ops it took no part in";
}

// Normal ops (layout, dispatch with weights, combine, cached re-dispatch) under a client's
// mask of rank 6, then clean.
TEST_F(CudaMaskTest, NormalOpsUnderAClientsMaskMatchHostThenCleanIsExact) {
  ASSERT_NO_FATAL_FAILURE(Mask({6}));
  CompareWhileMasked([&](PlaneGroup& g) { return RunNormal(g, in_, 6); }, 6, 4, "normal masked");
  EXPECT_GT(DroppedAt(0, 1, 1, 6), 0) << "the dispatch routes pairs to rank 6";
  EXPECT_EQ(DroppedAt(1, 1, 1, 6), 0) << "the combine's routes are the masked dispatch's";
  ASSERT_NO_FATAL_FAILURE(Mask({}, /*clean=*/true));
  Compare([&](PlaneGroup& g) { return RunNormal(g, in_); }, "normal after clean");
}

// A rank whose client is gone (its endpoint closed: DetachRank, as when its Session ends)
// is masked: low-latency and normal rounds run without it (its part played on the area it
// left); a new process joins its slot and the next rounds include it, exact.
//
// The area rank 5 left plays its masked part until the rejoin; the first op after the rejoin
// hands it to the plane's DeferredRelease, which frees it at the first moment no group has
// work on the GPU: right after that op. Here the clients share the daemon's CUDA context (the
// daemon is in this process), and a client that has already submitted the next op holds a
// stream wait for that op's done_seq, which the free (it waits for the whole context) would
// wait for while the engine that must launch the op is inside it: every client that had
// submitted then fails at op_timeout + 5 s (its stream release ends the stall). A daemon in
// its own process waits for nothing of its clients'. So the first op after the rejoin runs
// alone, and the next round starts once that area is gone.
TEST_F(CudaMaskTest, DepartedRankIsMaskedThenARejoinIsExact) {
  Compare([&](PlaneGroup& g) { return RunLowLatency(g, in_, false, false); }, "ll whole");
  const std::string left_handle = cuda_group_.eps[5]->info().cuda_ipc_handle();
  host_group_.eps[5].reset();
  cuda_group_.eps[5].reset();
  auto mask = cuda_group_.group->GetRankMask();
  ASSERT_TRUE(mask.ok()) << mask.status();
  EXPECT_EQ(mask->epoch(), 1u);
  const auto start = std::chrono::steady_clock::now();
  Compare([&](PlaneGroup& g) { return RunLowLatency(g, in_, true, false, 5); }, "ll departed");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1000))
      << "the survivors waited for the departed rank";
  EXPECT_GT(DroppedAt(0, 1, 1, 5), 0);
  Compare([&](PlaneGroup& g) { return RunNormal(g, in_, 5); }, "normal departed");
  EXPECT_GT(DroppedAt(0, 1, 1, 5), 0);
  ASSERT_NO_FATAL_FAILURE(host_group_.OpenRank(5));
  ASSERT_NO_FATAL_FAILURE(cuda_group_.OpenRank(5));
  EXPECT_TRUE(FindInProcessCudaArea(left_handle).ok()) << "the stand-in went before the rejoin";
  for (PlaneGroup* g : {&host_group_, &cuda_group_}) {
    g->OnEveryRank([&](int r) {
      RankInputs& ri = in_.ranks[r];
      std::vector<int64_t> ks{ri.T, spec_.num_topk()};
      DLTensor idx = Tensor(ri.idx.data(), kI64, ks, false);
      auto op = g->eps[r]->GetDispatchLayout(idx);
      ASSERT_TRUE(op.ok()) << op.status();
      auto layout = op->Wait(absl::Seconds(20));
      ASSERT_TRUE(layout.ok()) << "rank " << r << ": " << layout.status();
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (FindInProcessCudaArea(left_handle).ok() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(FindInProcessCudaArea(left_handle).ok()) << "the stand-in's area was never freed";
  // Its registry entry goes first; its frees follow on the engine thread, on an idle GPU.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Compare([&](PlaneGroup& g) { return RunLowLatency(g, in_, false, false); }, "ll rejoined");
  EXPECT_EQ(DroppedAt(1, 2, 0), 0);
  Compare([&](PlaneGroup& g) { return RunNormal(g, in_); }, "normal rejoined");
  EXPECT_EQ(DroppedAt(1, 2, 0), 0);
}

// Every rank dispatches; rank 2 leaves before the combine. The others' combines (normal:
// its rows left out of the sum; low-latency: its experts' terms left out) equal the host's
// and report the routes / pairs dropped.
TEST_F(CudaMaskTest, DepartureBetweenDispatchAndCombineDropsItsRows) {
  const int R = spec_.num_ranks(), H = spec_.hidden(), K = spec_.num_topk();
  for (PlaneGroup* g : {&host_group_, &cuda_group_}) {
    GroupResult& out = g == &host_group_ ? want_ : got_;
    out.assign(R, RankResult{});
    std::vector<absl::StatusOr<DispatchResult>> normal(R, absl::UnknownError(""));
    std::vector<absl::StatusOr<LowLatencyDispatchResult>> ll(R, absl::UnknownError(""));
    std::vector<std::vector<int64_t>> xs(R), ks(R);
    std::vector<DLTensor> x(R), idx(R), w(R);
    for (int r = 0; r < R; ++r) {
      RankInputs& ri = in_.ranks[r];
      xs[r] = {ri.T, H};
      ks[r] = {ri.T, K};
      x[r] = Tensor(g->cuda ? static_cast<const void*>(ri.dx.get()) : ri.x.data(), kBf16, xs[r],
                    g->cuda);
      idx[r] = Tensor(ri.idx.data(), kI64, ks[r], false);
      w[r] = Tensor(ri.w.data(), kF32, ks[r], false);
    }
    g->OnEveryRank([&](int r) {
      DispatchArgs da;
      da.x = &x[r];
      da.topk_idx = &idx[r];
      da.topk_weights = &w[r];
      auto op = g->eps[r]->Dispatch(da);
      ASSERT_TRUE(op.ok()) << op.status();
      normal[r] = op->Wait(absl::Seconds(20));
      ASSERT_TRUE(normal[r].ok()) << normal[r].status();
      LowLatencyDispatchArgs la;
      la.x = &x[r];
      la.topk_idx = &idx[r];
      auto lop = g->eps[r]->LowLatencyDispatch(la);
      ASSERT_TRUE(lop.ok()) << lop.status();
      ll[r] = lop->Wait(absl::Seconds(20));
      ASSERT_TRUE(ll[r].ok()) << ll[r].status();
    });
    g->eps[2].reset();
    g->OnEveryRank(
        [&](int r) {
          CombineArgs ca;
          ca.x = &normal[r]->recv_x.dl();
          ca.topk_weights = &normal[r]->recv_topk_weights.dl();
          ca.handle = &normal[r]->handle;
          auto op = g->eps[r]->Combine(ca);
          ASSERT_TRUE(op.ok()) << op.status();
          auto c = op->Wait(absl::Seconds(20));
          ASSERT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
          out[r].masks.push_back(c->mask);
          out[r].blobs.push_back({"combined_x", FetchAll(c->combined_x)});
          out[r].blobs.push_back({"combined_topk_weights", FetchAll(c->combined_topk_weights)});
          LowLatencyCombineArgs lc;
          lc.x = &ll[r]->recv_x.dl();  // Identity experts: the received rows.
          lc.topk_idx = &idx[r];
          lc.topk_weights = &w[r];
          lc.handle = &ll[r]->handle;
          auto lop = g->eps[r]->LowLatencyCombine(lc);
          ASSERT_TRUE(lop.ok()) << lop.status();
          auto l = lop->Wait(absl::Seconds(20));
          ASSERT_TRUE(l.ok()) << "rank " << r << ": " << l.status();
          out[r].masks.push_back(l->mask);
          out[r].blobs.push_back({"ll combined_x", FetchAll(l->combined_x)});
        },
        /*skip=*/2);
  }
  ExpectSame(want_, got_, "departure between dispatch and combine");
  EXPECT_GT(DroppedAt(0, 1, 1, 2), 0) << "normal combine: routes to rank 2 dropped";
  EXPECT_GT(DroppedAt(1, 1, 1, 2), 0) << "low-latency combine: pairs to rank 2 dropped";
}

// Client-launched endpoints cannot mask (no one would launch a dead client's kernels):
// refused at attach, naming the fields.
TEST_F(CudaMaskTest, ClientLaunchedRankOfAMaskingGroupIsRefused) {
  v1::GroupSpec spec = spec_;
  spec.set_name("masked_client");
  auto g = cuda_->CreateGroup(spec);
  ASSERT_TRUE(g.ok()) << g.status();
  v1::EndpointInfo info;
  absl::Status st = (*g)->AttachRank(0, "", v1::LAUNCH_MODE_CLIENT, {}, &info);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("launch_mode"), std::string::npos) << st;
  EXPECT_NE(st.message().find("on_rank_failure"), std::string::npos) << st;
  EXPECT_EQ(cuda_->DefaultLaunchMode(spec), v1::LAUNCH_MODE_DAEMON);
}

// The whole path through a real epd process (started by the caller with --backend=auto
// or cuda on a GPU machine): Session, JoinGroup, cudaIpcOpenMemHandle in this (another)
// process, the shm ring and doorbell, the daemon's engine and kernels; compared with the
// host data plane in this process.
TEST(CudaDaemonProcessTest, EightRanksThroughARealEpd) {
  const char* socket = std::getenv("EPD_TEST_SOCKET");
  if (socket == nullptr || *socket == '\0') {
    GTEST_SKIP() << "set EPD_TEST_SOCKET to the socket of an epd running the CUDA backend";
  }
  std::string why;
  if (!testing::HaveGpu(&why)) GTEST_SKIP() << why;
  ClientOptions co;
  co.socket_path = socket;
  co.client_name = "cuda_data_plane_test";
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  auto stats = (*client)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_EQ(stats->backend(), "cuda") << stats->backend_reason();
  ASSERT_GT(stats->gpus_size(), 0);
  HostDataPlaneOptions h;
  h.host_threads = 4;
  auto host_plane = MakeHostDataPlane(h);
  ASSERT_TRUE(host_plane.ok()) << host_plane.status();

  const v1::GroupSpec spec = Spec("external", 8, 32, 1024, 4, 32, 32);
  PlaneGroup remote, host;
  remote.Join(client->get(), spec, stats->gpus(0).uuid());
  ASSERT_TRUE(remote.cuda);
  host.Open(host_plane->get(), spec);
  Inputs in;
  in.Make(spec, {32, 0, 1, 17, 32, 8, 3, 30}, {.masked_fraction = 0.2}, 21);
  for (int round = 0; round < 2; ++round) {
    GroupResult want = RunLowLatency(host, in, round == 1, false);
    GroupResult got = RunLowLatency(remote, in, round == 1, false);
    ExpectSame(want, got, absl::StrCat("external low-latency round ", round));
  }
  ExpectSame(RunNormal(host, in), RunNormal(remote, in), "external normal");
}

}  // namespace
}  // namespace epd
