// libepdclient's two launch modes on the CUDA backend (client/include/epd/client.h), end to
// end through an epd Daemon running in this process and a real Client on its socket, R = 2
// and 8 virtual ranks on one GPU, one thread issuing every rank's ops. Every output is
// compared byte for byte with kernels/host (host_ops.h) and between the two modes: both
// modes' ops, a client-launched CUDA graph replayed with a new T, stream-ordered ops without
// Wait, bad expert ids, a rejected rank taking part with T = 0, large capacities and top-k,
// and the rules of tests/common/contract_rules.h. The cases in full: docs/CUDA_BACKEND.md
// "How the GPU tests are built".
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cuda/cuda_ipc.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/config.h"
#include "daemon/core/daemon.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "tests/common/contract_rules.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/gpu/client_launch_kernels.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/in_process_epd.h"
#include "tests/gpu/test_bytes.h"

namespace epd {
namespace {

using kernels::bf16_bits;
using kernels::GroupShape;
using testing::Bytes;
using testing::DeviceBuffer;
using testing::Fetch;
namespace host = kernels::host;

constexpr uint32_t kOpTimeoutMs = 3000;
constexpr auto kWait = absl::Seconds(20);
using testing::kBf16;
using testing::kF32;
using testing::kI32;
using testing::kI64;

const char* ModeName(v1::LaunchMode mode) {
  return mode == v1::LAUNCH_MODE_CLIENT ? "client-launched" : "daemon-launched";
}

v1::GroupSpec Spec(const std::string& name, int R, int E, int H, int K, int Mll) {
  return testing::MakeSpec(name, {.num_ranks = R,
                                  .num_experts = E,
                                  .hidden = H,
                                  .num_topk = K,
                                  .max_tokens_per_rank = 48,
                                  .ll_max_tokens_per_rank = Mll,
                                  .use_fp8 = H % 128 == 0});
}

v1::GroupSpec Spec(const std::string& name, int R, int H, int Mll) {
  return Spec(name, R, 4 * R, H, 4, Mll);
}

/// This process's CUDA ordinal of the GPU the groups live on (current for every test).
int g_device = 0;

/// A DLTensor over `data` (on g_device when `cuda`, else host) with `shape` (kept alive by
/// the caller).
DLTensor Tensor(const void* data, DLDataType dtype, std::vector<int64_t>& shape, bool cuda) {
  return MakeDLTensor(const_cast<void*>(data), dtype, shape,
                      cuda ? DLDevice{kDLCUDA, g_device} : DLDevice{kDLCPU, 0});
}

std::vector<uint8_t> FetchAll(const TensorView& v) { return Fetch(v.data(), 0, v.nbytes()); }

/// Device copy of a host vector (at least 16 bytes allocated).
template <typename T>
DeviceBuffer Upload(const std::vector<T>& v) {
  auto buf = DeviceBuffer::Allocate(std::max<size_t>(v.size() * sizeof(T), 16));
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!buf.ok()) return DeviceBuffer();
  if (!v.empty()) {
    EXPECT_EQ(cudaMemcpy(buf->get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return std::move(*buf);
}

/// Outputs of one op at one rank: named byte blobs, and the op's status.
struct RankResult {
  absl::Status status;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> blobs;
};
using GroupResult = std::vector<RankResult>;

void ExpectSame(const GroupResult& want, const GroupResult& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t r = 0; r < want.size(); ++r) {
    ASSERT_EQ(want[r].status.code(), got[r].status.code())
        << what << " rank " << r << ": " << want[r].status << " vs " << got[r].status;
    ASSERT_EQ(want[r].blobs.size(), got[r].blobs.size()) << what << " rank " << r;
    for (size_t i = 0; i < want[r].blobs.size(); ++i) {
      const auto& [name, bytes] = want[r].blobs[i];
      ASSERT_EQ(name, got[r].blobs[i].first) << what << " rank " << r;
      ASSERT_EQ(bytes.size(), got[r].blobs[i].second.size())
          << what << " rank " << r << " " << name;
      absl::Status cmp =
          testing::CompareBytes(bytes.data(), got[r].blobs[i].second.data(), bytes.size(),
                                absl::StrCat(what, " rank ", r, " ", name));
      EXPECT_TRUE(cmp.ok()) << cmp;
    }
  }
}

// ---- inputs ---------------------------------------------------------------------------------

/// One rank's inputs: host vectors and device copies.
struct RankInputs {
  int T = 0;
  std::vector<bf16_bits> x;  // [T, H]
  std::vector<int64_t> idx;  // [T, K]
  std::vector<float> w;      // [T, K]
  std::vector<bf16_bits> y;  // [El, R*Mll, H]: low-latency expert outputs
  DeviceBuffer dx, didx, dw, dy;
};

std::vector<RankInputs> MakeInputs(const v1::GroupSpec& s, const std::vector<int>& tokens,
                                   const testing::RoutingOptions& routing, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int R = s.num_ranks(), H = s.hidden(), K = s.num_topk(), E = s.num_experts();
  std::vector<RankInputs> in(R);
  for (int r = 0; r < R; ++r) {
    RankInputs& ri = in[r];
    ri.T = tokens[r];
    ri.x = testing::RandomBf16(static_cast<size_t>(ri.T) * H, rng);
    ri.idx = testing::RandomTopk(ri.T, K, E, routing, rng);
    ri.w = testing::RandomFloats(ri.idx.size(), rng, 0.f, 1.f);
    ri.y =
        testing::RandomBf16(static_cast<size_t>(E / R) * R * s.ll_max_tokens_per_rank() * H, rng);
    ri.dx = Upload(ri.x);
    ri.didx = Upload(ri.idx);
    ri.dw = Upload(ri.w);
    ri.dy = Upload(ri.y);
  }
  return in;
}

// ---- host oracle ------------------------------------------------------------------------------

/// Blobs of one rank's low-latency dispatch: recv_count, then per local expert the valid
/// rows of recv_x, recv_src_info and (FP8) recv_scales (per scale block: the storage is
/// token index fastest). `at(name, offset, bytes)` reads.
template <typename Reader>
void LowLatencyDispatchBlobs(const GroupShape& g, bool fp8, const int32_t* count, Reader at,
                             RankResult& res, bool ue8m0 = false) {
  const int64_t El = g.num_local_experts(), rows = g.ll_rows_per_expert();
  const size_t row_bytes = static_cast<size_t>(g.hidden) * (fp8 ? 1 : 2);
  // 4-byte scale columns: f32 per 128 channels, or (UE8M0) one int32 per 512.
  const size_t S = static_cast<size_t>(ue8m0 ? g.num_scales() / 4 : g.num_scales());
  res.blobs.push_back({"recv_count", Bytes(count, El)});
  for (int64_t j = 0; j < El; ++j) {
    const size_t n = static_cast<size_t>(std::max(0, count[j]));
    const size_t row0 = static_cast<size_t>(j * rows);
    res.blobs.push_back({absl::StrCat("recv_x[", j, "]"), at(0, row0 * row_bytes, n * row_bytes)});
    res.blobs.push_back({absl::StrCat("recv_src_info[", j, "]"), at(1, row0 * 4, n * 4)});
    // Scales are stored [El, S, rows] (token index fastest): rows [0, n) of each column.
    for (size_t c = 0; fp8 && c < S; ++c) {
      const size_t at_col = (static_cast<size_t>(j) * S + c) * static_cast<size_t>(rows) * 4;
      res.blobs.push_back({absl::StrCat("recv_scales[", j, "][", c, "]"), at(2, at_col, n * 4)});
    }
  }
}

/// The host's low-latency dispatch then combine (expert outputs y, or scaled recv_x when
/// `scale_experts`), as blobs per rank: dispatch blobs then "combined_x".
/// `zero_experts_of`: a rank whose expert outputs are zeros (-1 = none).
GroupResult HostLowLatency(const GroupShape& g, const std::vector<RankInputs>& in, bool fp8,
                           bool round_scale, bool scale_experts = false, int zero_experts_of = -1,
                           bool ue8m0 = false) {
  const int R = g.num_ranks, H = g.hidden, K = g.num_topk;
  const int64_t El = g.num_local_experts(), rows = g.ll_rows_per_expert();
  const size_t S = static_cast<size_t>(g.num_scales());
  const size_t cells = static_cast<size_t>(El * rows);
  std::vector<std::vector<uint8_t>> recv_x(R, std::vector<uint8_t>(cells * H * 2));
  std::vector<std::vector<float>> recv_scales(R, std::vector<float>(cells * S));
  std::vector<std::vector<int32_t>> count(R, std::vector<int32_t>(El)),
      src(R, std::vector<int32_t>(cells));
  std::vector<std::vector<int32_t>> handle(R, std::vector<int32_t>(g.ll_max_tokens_per_rank * K));
  std::vector<host::LowLatencyDispatchRankArgs> da(R);
  for (int r = 0; r < R; ++r) {
    da[r] = {in[r].T,          in[r].x.data(),        in[r].idx.data(),
             recv_x[r].data(), recv_scales[r].data(), count[r].data(),
             src[r].data(),    handle[r].data()};
  }
  absl::Status st = host::LowLatencyDispatch(g, {fp8, round_scale, ue8m0}, std::span(da));
  EXPECT_TRUE(st.ok()) << st;
  GroupResult out(R);
  std::vector<std::vector<bf16_bits>> y(R), combined(R);
  for (int r = 0; r < R; ++r) {
    LowLatencyDispatchBlobs(
        g, fp8, count[r].data(),
        [&](int which, size_t off, size_t n) {
          const uint8_t* base = which == 0 ? recv_x[r].data()
                                : which == 1
                                    ? reinterpret_cast<const uint8_t*>(src[r].data())
                                    : reinterpret_cast<const uint8_t*>(recv_scales[r].data());
          return std::vector<uint8_t>(base + off, base + off + n);
        },
        out[r], ue8m0);
    if (scale_experts) {
      y[r].assign(cells * H, 0);
      const auto* rx = reinterpret_cast<const bf16_bits*>(recv_x[r].data());
      for (size_t i = 0; i < cells * H; ++i) {
        const int64_t j = static_cast<int64_t>(i / (rows * H));
        y[r][i] = kernels::FloatToBf16(kernels::Bf16ToFloat(rx[i]) * testing::ExpertScale(j));
      }
    } else {
      y[r] = in[r].y;
    }
    if (r == zero_experts_of) std::fill(y[r].begin(), y[r].end(), 0);
    combined[r].assign(static_cast<size_t>(in[r].T) * H, 0);
  }
  std::vector<host::LowLatencyCombineRankArgs> ca(R);
  for (int r = 0; r < R; ++r) {
    ca[r] = {in[r].T,          in[r].idx.data(), in[r].w.data(),
             handle[r].data(), y[r].data(),      combined[r].data()};
  }
  st = host::LowLatencyCombine(g, std::span(ca));
  EXPECT_TRUE(st.ok()) << st;
  for (int r = 0; r < R; ++r)
    out[r].blobs.push_back({"combined_x", Bytes(combined[r].data(), combined[r].size())});
  return out;
}

/// The host's GetDispatchLayout, Dispatch (weights, alignment 4) and Combine of the
/// received rows (identity experts, with weights), as blobs per rank.
GroupResult HostNormal(const GroupShape& g, const std::vector<RankInputs>& in) {
  const int R = g.num_ranks, H = g.hidden, K = g.num_topk, E = g.num_experts;
  const int64_t cap = static_cast<int64_t>(R) * g.max_tokens_per_rank;
  const int El = E / R;
  GroupResult out(R);
  for (int r = 0; r < R; ++r) {
    std::vector<int32_t> per_rank(R), per_expert(E);
    std::vector<uint8_t> in_rank(static_cast<size_t>(in[r].T) * R);
    host::LayoutRankArgs la{in[r].T, in[r].idx.data(), per_rank.data(), per_expert.data(),
                            in_rank.data()};
    absl::Status st = host::GetDispatchLayout(g, la);
    EXPECT_TRUE(st.ok()) << st;
    out[r].blobs.push_back({"num_tokens_per_rank", Bytes(per_rank.data(), R)});
    out[r].blobs.push_back({"num_tokens_per_expert", Bytes(per_expert.data(), E)});
    out[r].blobs.push_back({"is_token_in_rank", in_rank});
  }
  std::vector<std::vector<bf16_bits>> rx(R, std::vector<bf16_bits>(cap * H));
  std::vector<std::vector<int64_t>> ridx(R, std::vector<int64_t>(cap * K));
  std::vector<std::vector<float>> rw(R, std::vector<float>(cap * K));
  std::vector<std::vector<int32_t>> per_expert(R, std::vector<int32_t>(El)),
      src(R, std::vector<int32_t>(cap)), prefix(R, std::vector<int32_t>(R));
  std::vector<std::vector<int32_t>> send_pos(R);
  std::vector<host::DispatchRankArgs> da(R);
  for (int r = 0; r < R; ++r) {
    send_pos[r].resize(static_cast<size_t>(std::max(1, in[r].T)) * R);
    host::DispatchRankArgs& a = da[r];
    a.num_tokens = in[r].T;
    a.x = in[r].x.data();
    a.topk_idx = in[r].idx.data();
    a.topk_weights = in[r].w.data();
    a.recv_capacity = cap;
    a.recv_x = rx[r].data();
    a.recv_topk_idx = ridx[r].data();
    a.recv_topk_weights = rw[r].data();
    a.recv_tokens_per_expert = per_expert[r].data();
    a.recv_src_info = src[r].data();
    a.send_pos = send_pos[r].data();
    a.rank_prefix = prefix[r].data();
  }
  absl::Status st = host::Dispatch(g, {false, 4}, std::span(da));
  EXPECT_TRUE(st.ok()) << st;
  std::vector<std::vector<bf16_bits>> combined(R);
  std::vector<std::vector<float>> combined_w(R);
  std::vector<host::CombineRankArgs> ca(R);
  for (int r = 0; r < R; ++r) {
    const int32_t N = da[r].num_recv_tokens;
    out[r].blobs.push_back({"N", Bytes(&N, 1)});
    out[r].blobs.push_back({"recv_x", Bytes(rx[r].data(), static_cast<size_t>(N) * H)});
    out[r].blobs.push_back({"recv_topk_idx", Bytes(ridx[r].data(), static_cast<size_t>(N) * K)});
    out[r].blobs.push_back({"recv_topk_weights", Bytes(rw[r].data(), static_cast<size_t>(N) * K)});
    out[r].blobs.push_back({"num_recv_tokens_per_expert", Bytes(per_expert[r].data(), El)});
    out[r].blobs.push_back({"recv_src_info", Bytes(src[r].data(), N)});
    combined[r].assign(static_cast<size_t>(in[r].T) * H, 0);
    combined_w[r].assign(static_cast<size_t>(in[r].T) * K, 0.f);
    ca[r] = {in[r].T,
             send_pos[r].data(),
             N,
             rx[r].data(),
             rw[r].data(),
             combined[r].data(),
             combined_w[r].data()};
  }
  st = host::Combine(g, std::span(ca));
  EXPECT_TRUE(st.ok()) << st;
  for (int r = 0; r < R; ++r) {
    out[r].blobs.push_back({"combined_x", Bytes(combined[r].data(), combined[r].size())});
    out[r].blobs.push_back(
        {"combined_topk_weights", Bytes(combined_w[r].data(), combined_w[r].size())});
  }
  return out;
}

// ---- the daemon, the client, the groups --------------------------------------------------------

/// Every rank of one group, joined through the client in one launch mode, with a stream
/// per rank.
struct Group {
  v1::GroupSpec spec;
  GroupShape shape;
  v1::LaunchMode mode = v1::LAUNCH_MODE_DAEMON;
  std::vector<testing::CudaStream> streams;
  std::vector<std::unique_ptr<Endpoint>> eps;
  int R() const { return spec.num_ranks(); }
  void* stream(int r) const { return streams[r].get(); }
};

class ClientLaunchTest : public testing::InProcessEpdTest<ClientLaunchTest> {
 public:
  static constexpr const char* kSuiteName = "client_launch";
  static constexpr uint32_t kSuiteOpTimeoutMs = kOpTimeoutMs;

 protected:
  void SetUp() override {
    InProcessEpdTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    g_device = Epd()->device();
    // Streams, inputs and kernels of the test on the groups' GPU.
    ASSERT_EQ(cudaSetDevice(g_device), cudaSuccess);
  }

 public:
  /// Joins every rank of `spec` in `mode`, then runs one op per rank that needs no peer
  /// (GetDispatchLayout, T = 0): in client-launched mode this maps the group's areas
  /// (GetGroupEndpoints) before any rank's kernel spins waiting for its peers.
  static Group Join(const v1::GroupSpec& spec, v1::LaunchMode mode) {
    Group g;
    g.spec = spec;
    g.shape = ShapeOf(spec);
    g.mode = mode;
    for (int r = 0; r < spec.num_ranks(); ++r) {
      auto s = testing::CudaStream::Create();
      EXPECT_TRUE(s.ok()) << s.status();
      g.streams.push_back(std::move(*s));
      JoinOptions o;
      o.spec = spec;
      o.rank = r;
      o.gpu_uuid = Epd()->gpu_uuid();
      o.launch_mode = mode;
      auto ep = Epd()->client().Join(o);
      EXPECT_TRUE(ep.ok()) << ModeName(mode) << " rank " << r << ": " << ep.status();
      if (!ep.ok()) return g;
      EXPECT_EQ((*ep)->info().launch_mode(), mode);
      g.eps.push_back(std::move(*ep));
    }
    std::vector<int64_t> shape{0, spec.num_topk()};
    DLTensor empty = Tensor(nullptr, kI64, shape, false);
    std::vector<PendingOp<LayoutResult>> ops;
    for (int r = 0; r < spec.num_ranks(); ++r) {
      auto op = g.eps[r]->GetDispatchLayout(empty, g.stream(r));
      EXPECT_TRUE(op.ok()) << op.status();
      if (op.ok()) ops.push_back(*op);
    }
    for (auto& op : ops) {
      auto res = op.Wait(kWait);
      EXPECT_TRUE(res.ok()) << res.status();
    }
    return g;
  }
};

// ---- op rounds through the client --------------------------------------------------------------

/// A low-latency dispatch on every rank (x and topk_idx from the GPU, or topk_idx from the
/// host with `host_idx`), then a combine of the expert outputs y; on each rank's stream,
/// or with `no_stream` on none (the endpoints' own streams, results valid after Wait). Ranks in
/// `reject` pass a topk_idx of the wrong dtype (their op call must fail at once). Returns the blobs
/// of the ranks that succeeded, the statuses of the others.
GroupResult RunLowLatency(Group& g, std::vector<RankInputs>& in, bool fp8, bool round_scale,
                          bool host_idx = false, int reject = -1, bool no_stream = false,
                          bool in_place = false, bool ue8m0 = false) {
  const int R = g.R(), H = g.spec.hidden(), K = g.spec.num_topk();
  const int64_t El = g.shape.num_local_experts(), rows = g.shape.ll_rows_per_expert();
  GroupResult out(R);
  std::vector<std::vector<int64_t>> xs(R), ks(R), ys(R);
  std::vector<DLTensor> x(R), idx(R), w(R), y(R);
  for (int r = 0; r < R; ++r) {
    xs[r] = {in[r].T, H};
    ks[r] = {in[r].T, K};
    ys[r] = {El, rows, H};
    x[r] = Tensor(in[r].dx.get(), kBf16, xs[r], true);
    idx[r] = host_idx ? Tensor(in[r].idx.data(), kI64, ks[r], false)
                      : Tensor(in[r].didx.get(), kI64, ks[r], true);
    if (r == reject) idx[r].dtype = kF32;
    w[r] = Tensor(in[r].dw.get(), kF32, ks[r], true);
    y[r] = Tensor(in[r].dy.get(), kBf16, ys[r], true);
    if (in_place) {
      // x and the expert outputs produced in the endpoint's own staging regions
      // (LowLatencyDispatchInput / LowLatencyCombineInput): nothing is copied for them.
      const TensorView xin = g.eps[r]->LowLatencyDispatchInput();
      const TensorView yin = g.eps[r]->LowLatencyCombineInput();
      EXPECT_EQ(xin.shape()[0], g.spec.ll_max_tokens_per_rank());
      EXPECT_EQ(yin.nbytes(), static_cast<size_t>(El * rows * H * 2));
      EXPECT_EQ(cudaMemcpy(xin.data(), in[r].dx.get(), static_cast<size_t>(in[r].T) * H * 2,
                           cudaMemcpyDefault),
                cudaSuccess);
      EXPECT_EQ(cudaMemcpy(yin.data(), in[r].dy.get(), yin.nbytes(), cudaMemcpyDefault),
                cudaSuccess);
      x[r] = Tensor(xin.data(), kBf16, xs[r], true);
      y[r] = Tensor(yin.data(), kBf16, ys[r], true);
    }
  }
  std::vector<std::optional<PendingOp<LowLatencyDispatchResult>>> dops(R);
  for (int r = 0; r < R; ++r) {
    LowLatencyDispatchArgs a;
    a.x = &x[r];
    a.topk_idx = &idx[r];
    a.use_fp8 = fp8;
    a.round_scale = round_scale;
    a.use_ue8m0 = ue8m0;
    a.stream = no_stream ? nullptr : g.stream(r);
    auto op = g.eps[r]->LowLatencyDispatch(a);
    if (r == reject) {
      EXPECT_EQ(op.status().code(), absl::StatusCode::kInvalidArgument) << op.status();
      out[r].status = op.ok() ? absl::InternalError("not rejected") : op.status();
      continue;
    }
    EXPECT_TRUE(op.ok()) << "rank " << r << ": " << op.status();
    if (op.ok()) dops[r] = *op;
  }
  std::vector<std::optional<LowLatencyDispatchResult>> d(R);
  bool all_ok = true;
  for (int r = 0; r < R; ++r) {
    if (!dops[r]) continue;
    auto res = dops[r]->Wait(kWait);
    out[r].status = res.status();
    if (!res.ok()) {
      all_ok = false;
      continue;
    }
    d[r] = *res;
    std::vector<uint8_t> count = FetchAll(res->recv_count);
    const TensorView* views[] = {&res->recv_x, &res->recv_src_info, &res->recv_scales};
    LowLatencyDispatchBlobs(
        g.shape, fp8, reinterpret_cast<const int32_t*>(count.data()),
        [&](int which, size_t off, size_t n) { return Fetch(views[which]->data(), off, n); },
        out[r], ue8m0);
  }
  if (!all_ok) return out;  // A failed dispatch: no rank combines.
  std::vector<std::optional<PendingOp<LowLatencyCombineResult>>> cops(R);
  for (int r = 0; r < R; ++r) {
    LowLatencyCombineArgs a;
    a.x = &y[r];
    a.topk_idx = &idx[r];
    a.topk_weights = &w[r];
    a.handle = d[r] ? &d[r]->handle : nullptr;
    a.stream = no_stream ? nullptr : g.stream(r);
    auto op = g.eps[r]->LowLatencyCombine(a);
    if (r == reject) {
      EXPECT_FALSE(op.ok());
      continue;
    }
    EXPECT_TRUE(op.ok()) << "rank " << r << ": " << op.status();
    if (op.ok()) cops[r] = *op;
  }
  for (int r = 0; r < R; ++r) {
    if (!cops[r]) continue;
    auto c = cops[r]->Wait(kWait);
    EXPECT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    if (c.ok()) out[r].blobs.push_back({"combined_x", FetchAll(c->combined_x)});
  }
  return out;
}

/// GetDispatchLayout, Dispatch (weights, alignment 4) and Combine of the received rows
/// (identity experts: recv_x and recv_topk_weights passed back), on every rank.
GroupResult RunNormal(Group& g, std::vector<RankInputs>& in) {
  const int R = g.R(), H = g.spec.hidden(), K = g.spec.num_topk();
  GroupResult out(R);
  std::vector<std::vector<int64_t>> xs(R), ks(R);
  std::vector<DLTensor> x(R), idx(R), w(R);
  for (int r = 0; r < R; ++r) {
    xs[r] = {in[r].T, H};
    ks[r] = {in[r].T, K};
    x[r] = Tensor(in[r].dx.get(), kBf16, xs[r], true);
    idx[r] = Tensor(in[r].didx.get(), kI64, ks[r], true);
    w[r] = Tensor(in[r].w.data(), kF32, ks[r], false);  // From the host: staged.
  }
  std::vector<PendingOp<LayoutResult>> lops;
  for (int r = 0; r < R; ++r) {
    auto op = g.eps[r]->GetDispatchLayout(idx[r], g.stream(r));
    EXPECT_TRUE(op.ok()) << op.status();
    if (!op.ok()) return out;
    lops.push_back(*op);
  }
  for (int r = 0; r < R; ++r) {
    auto l = lops[r].Wait(kWait);
    EXPECT_TRUE(l.ok()) << "rank " << r << ": " << l.status();
    if (!l.ok()) return out;
    out[r].blobs.push_back({"num_tokens_per_rank", FetchAll(l->num_tokens_per_rank)});
    out[r].blobs.push_back({"num_tokens_per_expert", FetchAll(l->num_tokens_per_expert)});
    out[r].blobs.push_back({"is_token_in_rank", FetchAll(l->is_token_in_rank)});
  }
  std::vector<PendingOp<DispatchResult>> dops;
  std::vector<DispatchResult> enqueued;
  for (int r = 0; r < R; ++r) {
    DispatchArgs a;
    a.x = &x[r];
    a.topk_idx = &idx[r];
    a.topk_weights = &w[r];
    a.expert_alignment = 4;
    a.stream = g.stream(r);
    auto op = g.eps[r]->Dispatch(a);
    EXPECT_TRUE(op.ok()) << op.status();
    if (!op.ok()) return out;
    // Stream-ordered view before any CPU synchronisation: capacity rows, N on the device.
    auto early = op->Enqueued();
    EXPECT_TRUE(early.ok()) << early.status();
    if (!early.ok()) return out;
    EXPECT_EQ(early->num_recv_tokens, -1);
    EXPECT_EQ(early->recv_x.shape()[0], int64_t{R} * g.spec.max_tokens_per_rank());
    EXPECT_EQ(early->recv_count.numel(), 1);
    enqueued.push_back(*early);
    dops.push_back(*op);
  }
  std::vector<DispatchResult> d;
  for (int r = 0; r < R; ++r) {
    auto res = dops[r].Wait(kWait);
    EXPECT_TRUE(res.ok()) << "rank " << r << ": " << res.status();
    if (!res.ok()) return out;
    const int32_t N = res->num_recv_tokens;
    // The device count of the Enqueued() result is the N Wait returns, and its capacity
    // views are the same memory.
    const std::vector<uint8_t> device_n = FetchAll(enqueued[r].recv_count);
    int32_t n_on_device = -1;
    std::memcpy(&n_on_device, device_n.data(), sizeof(n_on_device));
    EXPECT_EQ(n_on_device, N) << "rank " << r;
    EXPECT_EQ(enqueued[r].recv_x.data(), res->recv_x.data()) << "rank " << r;
    out[r].blobs.push_back({"N", Bytes(&N, 1)});
    out[r].blobs.push_back({"recv_x", FetchAll(res->recv_x)});
    out[r].blobs.push_back({"recv_topk_idx", FetchAll(res->recv_topk_idx)});
    out[r].blobs.push_back({"recv_topk_weights", FetchAll(res->recv_topk_weights)});
    out[r].blobs.push_back(
        {"num_recv_tokens_per_expert", FetchAll(res->num_recv_tokens_per_expert)});
    out[r].blobs.push_back({"recv_src_info", FetchAll(res->recv_src_info)});
    d.push_back(*res);
  }
  std::vector<PendingOp<CombineResult>> cops;
  for (int r = 0; r < R; ++r) {
    CombineArgs a;
    a.x = &d[r].recv_x.dl();
    a.topk_weights = &d[r].recv_topk_weights.dl();
    a.handle = &d[r].handle;
    a.stream = g.stream(r);
    auto op = g.eps[r]->Combine(a);
    EXPECT_TRUE(op.ok()) << op.status();
    if (!op.ok()) return out;
    cops.push_back(*op);
  }
  for (int r = 0; r < R; ++r) {
    auto c = cops[r].Wait(kWait);
    EXPECT_TRUE(c.ok()) << "rank " << r << ": " << c.status();
    if (!c.ok()) return out;
    out[r].blobs.push_back({"combined_x", FetchAll(c->combined_x)});
    out[r].blobs.push_back({"combined_topk_weights", FetchAll(c->combined_topk_weights)});
  }
  return out;
}

constexpr v1::LaunchMode kModes[] = {v1::LAUNCH_MODE_DAEMON, v1::LAUNCH_MODE_CLIENT};

std::vector<int> Tokens(int R, int Mll, int salt) {
  std::vector<int> t(R);
  for (int r = 0; r < R; ++r) t[r] = (r * 37 + salt * 11) % (Mll + 1);
  t[0] = Mll;
  if (R > 1) t[1] = 0;
  return t;
}

// ---- tests -----------------------------------------------------------------------------------

TEST_F(ClientLaunchTest, LowLatencyBothModesMatchHost) {
  for (int R : {2, 8}) {
    const int Mll = 32;
    GroupResult by_mode[2][5];
    for (int m = 0; m < 2; ++m) {
      const v1::GroupSpec spec = Spec(absl::StrCat("ll-", R, "-", m), R, /*H=*/1024, Mll);
      Group g = Join(spec, kModes[m]);
      ASSERT_EQ(static_cast<int>(g.eps.size()), R);
      struct Round {
        testing::RoutingOptions routing;
        bool fp8, round_scale, host_idx, no_stream, in_place, ue8m0;
      };
      const Round rounds[] = {{{}, false, false, false, false, false, false},
                              {{.masked_fraction = 0.5}, true, false, true, true, false, false},
                              {{.one_expert = 1}, true, true, false, false, false, false},
                              {{}, true, false, false, false, true, false},
                              {{.masked_fraction = 0.2}, true, true, false, false, false, true}};
      for (int i = 0; i < 5; ++i) {
        const Round& round = rounds[i];
        std::vector<RankInputs> in = MakeInputs(spec, Tokens(R, Mll, i), round.routing, 100 + i);
        GroupResult want =
            HostLowLatency(g.shape, in, round.fp8, round.round_scale, false, -1, round.ue8m0);
        by_mode[m][i] = RunLowLatency(g, in, round.fp8, round.round_scale, round.host_idx, -1,
                                      round.no_stream, round.in_place, round.ue8m0);
        ExpectSame(
            want, by_mode[m][i],
            absl::StrCat(ModeName(kModes[m]), " R=", R, " round ", i, round.fp8 ? " fp8" : " bf16",
                         round.in_place ? " in place" : "", round.ue8m0 ? " ue8m0" : ""));
      }
    }
    for (int i = 0; i < 5; ++i) {
      ExpectSame(by_mode[0][i], by_mode[1][i],
                 absl::StrCat("daemon vs client R=", R, " round ", i));
    }
  }
}

// Low-latency capacities (Mll) of 1, 128, 1024, 1100, 3000 and 4096 and top-k of 1, 2, 4, 8,
// 32, 48 and 64, small and DeepSeek-V3 hidden sizes, FP8 and BF16, in both modes: the CUDA
// backend runs every spec Join accepts (cuda_limits.h), through the large path of the
// dispatch where its routing does not fit shared memory or K > 32.
TEST_F(ClientLaunchTest, LowLatencyLargeCapacityAndTopkBothModesMatchHost) {
  struct Case {
    int R, E, H, K, Mll;
  };
  const Case cases[] = {
      {2, 16, 128, 8, 3000},   // The conformance check's failing specs (first three).
      {4, 16, 1024, 4, 1024},  //
      {4, 32, 256, 2, 1100},   //
      {2, 64, 128, 64, 4096},  //
      {2, 48, 7168, 48, 128},  // DeepSeek-V3's hidden size.
      {8, 8, 7168, 1, 1},
      {2, 32, 7168, 32, 1024},  // The largest top-k of the small path, at 7168.
      {2, 32, 256, 32, 4096},
  };
  for (const Case& c : cases) {
    GroupResult by_mode[2][2];
    for (int m = 0; m < 2; ++m) {
      const v1::GroupSpec spec = Spec(absl::StrCat("ll-large-", c.E, "-", c.K, "-", c.Mll, "-", m),
                                      c.R, c.E, c.H, c.K, c.Mll);
      const std::string what = absl::StrCat(ModeName(kModes[m]), " ", SpecSummary(spec));
      Group g = Join(spec, kModes[m]);
      ASSERT_EQ(static_cast<int>(g.eps.size()), c.R) << what;
      for (int i = 0; i < 2; ++i) {
        const bool fp8 = i == 0;
        std::vector<RankInputs> in =
            MakeInputs(spec, Tokens(c.R, c.Mll, i), {.masked_fraction = 0.1 * i}, 300 + i);
        GroupResult want = HostLowLatency(g.shape, in, fp8, /*round_scale=*/false);
        by_mode[m][i] = RunLowLatency(g, in, fp8, /*round_scale=*/false);
        ExpectSame(want, by_mode[m][i], absl::StrCat(what, fp8 ? " fp8" : " bf16"));
      }
    }
    for (int i = 0; i < 2; ++i) {
      ExpectSame(by_mode[0][i], by_mode[1][i],
                 absl::StrCat("daemon vs client E=", c.E, " K=", c.K, " Mll=", c.Mll, " op ", i));
    }
  }
}

// The rules client.h and DESIGN.md §3.3 state (tests/common/contract_rules.h): duplicate
// experts, is_token_in_rank's dtype, recv_topk_weights without topk_weights, a cached
// re-dispatch's outputs, empty sums, the FP8 scale floor; in both modes.
TEST_F(ClientLaunchTest, ContractRulesOfClientHHoldInBothModes) {
  for (int m = 0; m < 2; ++m) {
    SCOPED_TRACE(ModeName(kModes[m]));
    Group g = Join(testing::contract::Spec(absl::StrCat("contract-", m)), kModes[m]);
    ASSERT_EQ(static_cast<int>(g.eps.size()), testing::contract::kR);
    std::vector<Endpoint*> eps;
    for (const auto& ep : g.eps) eps.push_back(ep.get());
    testing::contract::CheckContractRules(eps, [](const TensorView& v) { return FetchAll(v); });
  }
}

TEST_F(ClientLaunchTest, NormalBothModesMatchHost) {
  for (int R : {2, 8}) {
    GroupResult by_mode[2];
    for (int m = 0; m < 2; ++m) {
      const v1::GroupSpec spec = Spec(absl::StrCat("normal-", R, "-", m), R, /*H=*/512, 16);
      Group g = Join(spec, kModes[m]);
      ASSERT_EQ(static_cast<int>(g.eps.size()), R);
      std::vector<int> tokens(R);
      for (int r = 0; r < R; ++r) tokens[r] = (r * 29 + 5) % 49;
      tokens[R - 1] = 0;
      std::vector<RankInputs> in = MakeInputs(spec, tokens, {.masked_fraction = 0.25}, 7);
      GroupResult want = HostNormal(g.shape, in);
      by_mode[m] = RunNormal(g, in);
      ExpectSame(want, by_mode[m], absl::StrCat(ModeName(kModes[m]), " normal R=", R));
    }
    ExpectSame(by_mode[0], by_mode[1], absl::StrCat("daemon vs client normal R=", R));
  }
}

/// Client-launched: dispatch (T read from the device) → toy expert → combine of a group of
/// `spec`, captured into one CUDA graph per rank, replayed `replays` times with new inputs
/// and a new T written into the device before each replay (not captured). Rows of
/// x/topk_idx past T hold ids that are out of range: a kernel reading past T would report
/// INVALID_ARGUMENT.
void RunClientLaunchedGraph(const v1::GroupSpec& spec, int replays) {
  const int R = spec.num_ranks(), Mll = spec.ll_max_tokens_per_rank(), H = spec.hidden();
  Group g = ClientLaunchTest::Join(spec, v1::LAUNCH_MODE_CLIENT);
  ASSERT_EQ(static_cast<int>(g.eps.size()), R);
  const int K = spec.num_topk(), E = spec.num_experts();
  const int64_t El = g.shape.num_local_experts(), rows = g.shape.ll_rows_per_expert();
  struct RankGraph {
    DeviceBuffer dx, didx, dw, dT;
    std::vector<int64_t> xs, ks, ns;
    DLTensor x, idx, w, T;
    std::optional<PendingOp<LowLatencyDispatchResult>> dop;
    std::optional<PendingOp<LowLatencyCombineResult>> cop;
    TensorView combined;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
  };
  std::vector<RankGraph> rg(R);
  for (int r = 0; r < R; ++r) {
    RankGraph& q = rg[r];
    q.dx = Upload(std::vector<bf16_bits>(static_cast<size_t>(Mll) * H));
    q.didx = Upload(std::vector<int64_t>(static_cast<size_t>(Mll) * K, -1));
    q.dw = Upload(std::vector<float>(static_cast<size_t>(Mll) * K));
    q.dT = Upload(std::vector<int32_t>(1, 0));
    q.xs = {Mll, H};
    q.ks = {Mll, K};
    q.ns = {1};
    q.x = Tensor(q.dx.get(), kBf16, q.xs, true);
    q.idx = Tensor(q.didx.get(), kI64, q.ks, true);
    q.w = Tensor(q.dw.get(), kF32, q.ks, true);
    q.T = Tensor(q.dT.get(), kI32, q.ns, true);
    cudaStream_t s = static_cast<cudaStream_t>(g.stream(r));
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    // A failed assertion below leaves the capture: end it, so later tests see no error.
    testing::EndCaptureOnExit end_capture(s);
    LowLatencyDispatchArgs da;
    da.x = &q.x;
    da.topk_idx = &q.idx;
    da.num_tokens = &q.T;
    da.stream = s;
    auto dop = g.eps[r]->LowLatencyDispatch(da);
    ASSERT_TRUE(dop.ok()) << dop.status();
    q.dop = *dop;
    auto d = dop->Enqueued();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->handle.num_tokens, Mll);  // The capacity.
    const TensorView expert_out = g.eps[r]->LowLatencyCombineInput();
    ASSERT_TRUE(testing::LaunchScaleExperts(d->recv_x.as<bf16_bits>(), expert_out.as<bf16_bits>(),
                                            El, rows, H, s)
                    .ok());
    LowLatencyCombineArgs ca;
    ca.x = &expert_out.dl();
    ca.topk_idx = &q.idx;
    ca.topk_weights = &q.w;
    ca.handle = &d->handle;
    ca.stream = s;
    auto cop = g.eps[r]->LowLatencyCombine(ca);
    ASSERT_TRUE(cop.ok()) << cop.status();
    q.cop = *cop;
    auto c = cop->Enqueued();
    ASSERT_TRUE(c.ok()) << c.status();
    q.combined = c->combined_x;
    ASSERT_EQ(cudaStreamEndCapture(s, &q.graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&q.exec, q.graph, 0), cudaSuccess);
  }
  std::mt19937_64 rng(4242 + R + Mll);
  int checked = 0;
  for (int replay = 0; replay < replays; ++replay) {
    std::vector<RankInputs> in(R);
    for (int r = 0; r < R; ++r) {
      RankInputs& ri = in[r];
      ri.T = replay == 0 ? Mll : (r + replay) % 7 == 0 ? 0 : static_cast<int>(rng() % (Mll + 1));
      testing::RoutingOptions routing;
      routing.masked_fraction = (replay % 3) * 0.25;
      ri.x = testing::RandomBf16(static_cast<size_t>(ri.T) * H, rng);
      ri.idx = testing::RandomTopk(ri.T, K, E, routing, rng);
      ri.w = testing::RandomFloats(ri.idx.size(), rng, 0.f, 1.f);
      // Capacity rows past T: garbage tokens with out-of-range ids.
      std::vector<bf16_bits> x_cap = ri.x;
      x_cap.resize(static_cast<size_t>(Mll) * H, 0x7fc0);
      std::vector<int64_t> idx_cap = ri.idx;
      idx_cap.resize(static_cast<size_t>(Mll) * K, E + 5);
      std::vector<float> w_cap = ri.w;
      w_cap.resize(static_cast<size_t>(Mll) * K, 1.f);
      cudaStream_t s = static_cast<cudaStream_t>(g.stream(r));
      ASSERT_EQ(cudaMemcpyAsync(rg[r].dx.get(), x_cap.data(), x_cap.size() * 2,
                                cudaMemcpyHostToDevice, s),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(rg[r].didx.get(), idx_cap.data(), idx_cap.size() * 8,
                                cudaMemcpyHostToDevice, s),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(rg[r].dw.get(), w_cap.data(), w_cap.size() * 4,
                                cudaMemcpyHostToDevice, s),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(rg[r].dT.get(), &ri.T, 4, cudaMemcpyHostToDevice, s), cudaSuccess);
    }
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(cudaGraphLaunch(rg[r].exec, static_cast<cudaStream_t>(g.stream(r))), cudaSuccess);
    }
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(g.stream(r))), cudaSuccess);
    }
    GroupResult want = HostLowLatency(g.shape, in, false, false, /*scale_experts=*/true);
    GroupResult got(R);
    for (int r = 0; r < R; ++r) {
      auto d = rg[r].dop->Wait(kWait);  // Captured: reads and clears the device status.
      ASSERT_TRUE(d.ok()) << "replay " << replay << " rank " << r << ": " << d.status();
      auto c = rg[r].cop->Wait(kWait);
      ASSERT_TRUE(c.ok()) << "replay " << replay << " rank " << r << ": " << c.status();
      got[r].blobs.push_back({"recv_count", FetchAll(d->recv_count)});
      got[r].blobs.push_back(
          {"combined_x", Fetch(rg[r].combined.data(), 0, static_cast<size_t>(in[r].T) * H * 2)});
      // Only recv_count and combined_x of the host's blobs.
      RankResult keep;
      keep.blobs.push_back(want[r].blobs.front());
      keep.blobs.push_back(want[r].blobs.back());
      want[r] = std::move(keep);
    }
    ExpectSame(want, got, absl::StrCat("graph ", SpecSummary(spec), " replay ", replay));
    if (::testing::Test::HasFailure()) break;
    ++checked;
  }
  EXPECT_EQ(checked, replays);
  for (auto& q : rg) {
    cudaGraphExecDestroy(q.exec);
    cudaGraphDestroy(q.graph);
  }
}

TEST_F(ClientLaunchTest, ClientLaunchedGraphReplaysWithChangingTokens) {
  for (int R : {2, 8}) RunClientLaunchedGraph(Spec(absl::StrCat("graph-", R), R, 256, 32), 100);
}

// The same at low-latency capacities and top-k that take the dispatch's large path.
TEST_F(ClientLaunchTest, ClientLaunchedGraphAtLargeCapacityAndTopk) {
  RunClientLaunchedGraph(Spec("graph-large-k48", 2, 64, 128, 48, 1024), 10);
  RunClientLaunchedGraph(Spec("graph-large-m4096", 2, 16, 256, 8, 4096), 10);
}

// Four ops per rank enqueued back to back with no Wait between them (dispatch A, combine A,
// dispatch B, combine B), combine A's handle and every read taken from Enqueued() views;
// A's outputs are copied on the stream right after A's ops (stream-ordered reads). One
// synchronisation at the end; then every op's Wait must be OK and every output match.
TEST_F(ClientLaunchTest, StreamOrderedOpsBackToBackWithoutWait) {
  for (int R : {2, 8}) {
    for (v1::LaunchMode mode : kModes) {
      const int Mll = 32, H = 1024;
      const v1::GroupSpec spec = Spec(absl::StrCat("ordered-", R, "-", mode), R, H, Mll);
      Group g = Join(spec, mode);
      ASSERT_EQ(static_cast<int>(g.eps.size()), R);
      const int K = spec.num_topk();
      const int64_t El = g.shape.num_local_experts(), rows = g.shape.ll_rows_per_expert();
      std::vector<RankInputs> in[2] = {
          MakeInputs(spec, Tokens(R, Mll, 3), {}, 21),
          MakeInputs(spec, Tokens(R, Mll, 4), {.masked_fraction = 0.5}, 22)};
      GroupResult want[2] = {HostLowLatency(g.shape, in[0], true, false),
                             HostLowLatency(g.shape, in[1], false, false)};
      struct Snap {
        DeviceBuffer count, combined;
      };
      std::vector<Snap> snap(R);
      // Round 1's combines run on other streams than its dispatches (no Wait between):
      // the library must order them after the dispatch on the GPU (daemon-launched: the
      // ops share the staging regions, ready_seq and the staging kernel's ticket word).
      std::vector<testing::CudaStream> other(R);
      for (int r = 0; r < R; ++r) {
        auto os = testing::CudaStream::Create();
        ASSERT_TRUE(os.ok()) << os.status();
        other[r] = std::move(*os);
      }
      std::vector<std::vector<std::optional<PendingOp<LowLatencyDispatchResult>>>> dops(
          2, std::vector<std::optional<PendingOp<LowLatencyDispatchResult>>>(R));
      std::vector<std::vector<std::optional<PendingOp<LowLatencyCombineResult>>>> cops(
          2, std::vector<std::optional<PendingOp<LowLatencyCombineResult>>>(R));
      std::vector<std::vector<std::vector<int64_t>>> xs(2), ks(2), ys(2);
      std::vector<std::vector<DLTensor>> x(2), idx(2), w(2), y(2);
      std::vector<std::vector<LowLatencyDispatchResult>> d(2);
      for (int round = 0; round < 2; ++round) {
        xs[round].resize(R);
        ks[round].resize(R);
        ys[round].resize(R);
        x[round].resize(R);
        idx[round].resize(R);
        w[round].resize(R);
        y[round].resize(R);
        d[round].resize(R);
        for (int r = 0; r < R; ++r) {
          RankInputs& ri = in[round][r];
          xs[round][r] = {ri.T, H};
          ks[round][r] = {ri.T, K};
          ys[round][r] = {El, rows, H};
          x[round][r] = Tensor(ri.dx.get(), kBf16, xs[round][r], true);
          idx[round][r] = Tensor(ri.didx.get(), kI64, ks[round][r], true);
          w[round][r] = Tensor(ri.dw.get(), kF32, ks[round][r], true);
          y[round][r] = Tensor(ri.dy.get(), kBf16, ys[round][r], true);
        }
      }
      for (int r = 0; r < R; ++r) {
        auto c = DeviceBuffer::Allocate(El * 4);
        auto cx = DeviceBuffer::Allocate(static_cast<size_t>(Mll) * H * 2);
        ASSERT_TRUE(c.ok() && cx.ok());
        snap[r].count = std::move(*c);
        snap[r].combined = std::move(*cx);
      }
      // Enqueue every op of both rounds; each rank's ops in order on its stream.
      for (int round = 0; round < 2; ++round) {
        for (int r = 0; r < R; ++r) {
          cudaStream_t s = static_cast<cudaStream_t>(g.stream(r));
          LowLatencyDispatchArgs da;
          da.x = &x[round][r];
          da.topk_idx = &idx[round][r];
          da.use_fp8 = round == 0;
          da.stream = s;
          auto dop = g.eps[r]->LowLatencyDispatch(da);
          ASSERT_TRUE(dop.ok()) << dop.status();
          dops[round][r] = *dop;
          auto view = dop->Enqueued();
          ASSERT_TRUE(view.ok()) << view.status();
          d[round][r] = *view;
          if (round == 0) {
            ASSERT_EQ(cudaMemcpyAsync(snap[r].count.get(), view->recv_count.data(), El * 4,
                                      cudaMemcpyDeviceToDevice, s),
                      cudaSuccess);
          }
        }
        for (int r = 0; r < R; ++r) {
          cudaStream_t s = round == 1 ? other[r].get() : static_cast<cudaStream_t>(g.stream(r));
          LowLatencyCombineArgs ca;
          ca.x = &y[round][r];
          ca.topk_idx = &idx[round][r];
          ca.topk_weights = &w[round][r];
          ca.handle = &d[round][r].handle;
          ca.stream = s;
          auto cop = g.eps[r]->LowLatencyCombine(ca);
          ASSERT_TRUE(cop.ok()) << cop.status();
          cops[round][r] = *cop;
          auto view = cop->Enqueued();
          ASSERT_TRUE(view.ok()) << view.status();
          if (round == 0) {
            ASSERT_EQ(cudaMemcpyAsync(snap[r].combined.get(), view->combined_x.data(),
                                      view->combined_x.nbytes(), cudaMemcpyDeviceToDevice, s),
                      cudaSuccess);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(g.stream(r))), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(other[r].get()), cudaSuccess);
      }
      GroupResult got[2];
      for (int round = 0; round < 2; ++round) {
        got[round].resize(R);
        for (int r = 0; r < R; ++r) {
          auto dr = dops[round][r]->Wait(kWait);
          ASSERT_TRUE(dr.ok()) << ModeName(mode) << " round " << round << " rank " << r << ": "
                               << dr.status();
          EXPECT_EQ(dr->handle.buffer, d[round][r].handle.buffer) << "Enqueued's buffer";
          auto cr = cops[round][r]->Wait(kWait);
          ASSERT_TRUE(cr.ok()) << cr.status();
          const int T = in[round][r].T;
          std::vector<uint8_t> count =
              round == 0 ? Fetch(snap[r].count.get(), 0, El * 4) : FetchAll(dr->recv_count);
          const TensorView* views[] = {&dr->recv_x, &dr->recv_src_info, &dr->recv_scales};
          LowLatencyDispatchBlobs(
              g.shape, round == 0, reinterpret_cast<const int32_t*>(count.data()),
              [&](int which, size_t off, size_t n) { return Fetch(views[which]->data(), off, n); },
              got[round][r]);
          got[round][r].blobs.push_back(
              {"combined_x", round == 0
                                 ? Fetch(snap[r].combined.get(), 0, static_cast<size_t>(T) * H * 2)
                                 : FetchAll(cr->combined_x)});
        }
        ExpectSame(want[round], got[round],
                   absl::StrCat(ModeName(mode), " R=", R, " back-to-back round ", round));
      }
    }
  }
}

TEST_F(ClientLaunchTest, BadExpertIdThenNextOpCorrect) {
  for (int R : {2, 8}) {
    for (v1::LaunchMode mode : kModes) {
      const int Mll = 16;
      const v1::GroupSpec spec = Spec(absl::StrCat("badid-", R, "-", mode), R, 512, Mll);
      Group g = Join(spec, mode);
      ASSERT_EQ(static_cast<int>(g.eps.size()), R);
      std::vector<RankInputs> in = MakeInputs(spec, Tokens(R, Mll, 5), {}, 31);
      const int bad_rank = R - 1 == 1 ? 0 : R - 1;
      ASSERT_GT(in[bad_rank].T, 0);
      std::vector<int64_t> bad_idx = in[bad_rank].idx;
      bad_idx[1] = spec.num_experts() + 3;
      ASSERT_EQ(cudaMemcpy(in[bad_rank].didx.get(), bad_idx.data(), bad_idx.size() * 8,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      GroupResult bad = RunLowLatency(g, in, false, false);
      for (int r = 0; r < R; ++r) {
        // Daemon-launched: every rank gets the error. Client-launched: the rank whose input
        // had the bad id (client.h: GPU-found errors are reported by that rank only).
        if (mode == v1::LAUNCH_MODE_DAEMON || r == bad_rank) {
          EXPECT_EQ(bad[r].status.code(), absl::StatusCode::kInvalidArgument)
              << ModeName(mode) << " rank " << r << ": " << bad[r].status;
        }
      }
      EXPECT_NE(bad[bad_rank].status.message().find("outside [-1"), std::string::npos)
          << bad[bad_rank].status;
      ASSERT_EQ(cudaMemcpy(in[bad_rank].didx.get(), in[bad_rank].idx.data(),
                           in[bad_rank].idx.size() * 8, cudaMemcpyHostToDevice),
                cudaSuccess);
      for (int round = 0; round < 2; ++round) {  // Both buffers, after the failed op.
        ExpectSame(HostLowLatency(g.shape, in, round == 1, false),
                   RunLowLatency(g, in, round == 1, false),
                   absl::StrCat(ModeName(mode), " R=", R, " after a bad id, round ", round));
      }
      ExpectSame(HostNormal(g.shape, in), RunNormal(g, in),
                 absl::StrCat(ModeName(mode), " R=", R, " normal after a bad id"));
    }
  }
}

// Client-launched: rank 0's topk_idx has the wrong dtype, so its op calls fail at once; it
// still takes part (T = 0 in the dispatch; zero expert outputs and no pulls in the
// combine), so the other ranks complete without waiting op_timeout, with the results of
// rank 0 having no tokens and experts that output zeros.
TEST_F(ClientLaunchTest, ClientLaunchedRejectedRankStillTakesPart) {
  for (int R : {2, 8}) {
    const int Mll = 16;
    const v1::GroupSpec spec = Spec(absl::StrCat("reject-", R), R, 512, Mll);
    Group g = Join(spec, v1::LAUNCH_MODE_CLIENT);
    ASSERT_EQ(static_cast<int>(g.eps.size()), R);
    // A first good round, so rank 0 has a latest dispatch buffer to take part with.
    std::vector<RankInputs> in = MakeInputs(spec, Tokens(R, Mll, 6), {}, 41);
    ExpectSame(HostLowLatency(g.shape, in, false, false), RunLowLatency(g, in, false, false),
               absl::StrCat("R=", R, " before the rejection"));
    const auto start = std::chrono::steady_clock::now();
    GroupResult got = RunLowLatency(g, in, false, false, false, /*reject=*/0);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(secs, kOpTimeoutMs / 1000.0) << "the peers waited for the op timeout";
    std::vector<RankInputs> as_seen = MakeInputs(spec, Tokens(R, Mll, 6), {}, 41);
    as_seen[0].T = 0;
    as_seen[0].x.clear();
    as_seen[0].idx.clear();
    as_seen[0].w.clear();
    GroupResult want = HostLowLatency(g.shape, as_seen, false, false, false, /*zero_experts_of=*/0);
    want[0] = RankResult{absl::InvalidArgumentError(""), {}};
    got[0].blobs.clear();
    ExpectSame(want, got, absl::StrCat("R=", R, " with rank 0 rejected"));
    // And the group goes on.
    ExpectSame(HostLowLatency(g.shape, in, true, false), RunLowLatency(g, in, true, false),
               absl::StrCat("R=", R, " after the rejection"));
  }
}

}  // namespace
}  // namespace epd
