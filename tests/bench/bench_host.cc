// epd_bench --backend=host: per-op latency and bandwidth of the host backend through the
// real data path (libepdclient endpoints → shm rings → the host engine → kernels/host),
// with one thread per rank in this process (the control plane is not on the hot path, so
// it is left out). Each figure is printed beside a memcpy of the same bytes measured in
// the same run. Host figures are for reference, not a goal.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "client/endpoint/endpoint_internal.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/bench/bench.h"
#include "tests/common/dtypes.h"

ABSL_FLAG(int, host_ranks, 4, "host bench: ranks (threads)");
ABSL_FLAG(int, host_tokens, 128, "host bench: tokens per rank");
ABSL_FLAG(int, host_hidden, 2048, "host bench: hidden");
ABSL_FLAG(int, host_experts, 32, "host bench: experts");
ABSL_FLAG(int, host_topk, 4, "host bench: top-k");
ABSL_FLAG(int, host_engine_idle_us, 100,
          "host bench: engine spins this long before sleeping (the daemon's --engine_idle_us)");
ABSL_FLAG(int, host_iters, 200, "host bench: timed iterations per op (after 10 warm-up)");

namespace epd::bench {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

using Clock = std::chrono::steady_clock;

struct Stat {
  std::string op;
  double p50_us = 0, p99_us = 0;
  double bytes = 0;      // Payload bytes per rank per op.
  double memcpy_us = 0;  // memcpy of the same bytes.
};

double MemcpyMicros(size_t bytes) {
  std::vector<char> a(bytes + 64, 1), b(bytes + 64);
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    auto s = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
  }
  return ComputePercentiles(t).p50;
}

}  // namespace

int RunHostBench() {
  const int R = absl::GetFlag(FLAGS_host_ranks), T = absl::GetFlag(FLAGS_host_tokens),
            H = absl::GetFlag(FLAGS_host_hidden), E = absl::GetFlag(FLAGS_host_experts),
            K = absl::GetFlag(FLAGS_host_topk), iters = absl::GetFlag(FLAGS_host_iters);
  const bool json = absl::GetFlag(FLAGS_json);
  if (R < 1 || E % R != 0 || K > E || H % 128 != 0) {
    std::fprintf(stderr, "host bench: need E %% R == 0, K <= E, H %% 128 == 0\n");
    return 2;
  }
  epd::HostDataPlaneOptions o;
  o.engine_idle_us = static_cast<uint32_t>(absl::GetFlag(FLAGS_host_engine_idle_us));
  auto plane = epd::MakeHostDataPlane(o);
  if (!plane.ok()) {
    std::fprintf(stderr, "host bench: %s\n", plane.status().ToString().c_str());
    return 1;
  }
  epd::v1::GroupSpec spec;
  spec.set_name("bench");
  spec.set_num_ranks(R);
  spec.set_num_experts(E);
  spec.set_hidden(H);
  spec.set_num_topk(K);
  spec.set_max_tokens_per_rank(T);
  spec.set_ll_max_tokens_per_rank(T);
  spec.set_use_fp8(true);
  auto group = (*plane)->CreateGroup(spec);
  if (!group.ok()) return 1;
  std::vector<std::unique_ptr<epd::Endpoint>> eps;
  for (int r = 0; r < R; ++r) {
    epd::v1::EndpointInfo info;
    if (!(*group)->AttachRank(r, "", epd::v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok()) return 1;
    auto fds = (*group)->TakeEndpointFds(r);
    if (!fds.ok()) return 1;
    auto ep =
        epd::internal::OpenEndpoint(info, spec, *std::move(fds), [] { return absl::OkStatus(); });
    if (!ep.ok()) return 1;
    eps.push_back(std::move(*ep));
  }
  if (!json) {
    std::printf("host bench: R=%d T=%d H=%d E=%d K=%d, %d iterations (+10 warm-up) per op\n", R, T,
                H, E, K, iters);
    std::fflush(stdout);
  }
  // Inputs: uniform random routing, distinct experts per token.
  std::vector<std::vector<uint16_t>> x(R);
  std::vector<std::vector<int64_t>> idx(R);
  std::vector<std::vector<float>> w(R);
  std::vector<int64_t> xs{T, H}, ks{T, K};
  std::vector<DLTensor> xt(R), it(R), wt(R);
  std::mt19937 rng(7);
  for (int r = 0; r < R; ++r) {
    x[r].resize(size_t(T) * H);
    for (auto& v : x[r]) v = epd::kernels::FloatToBf16(float(rng() % 200) / 100.f - 1.f);
    idx[r].resize(size_t(T) * K);
    w[r].assign(size_t(T) * K, 0.25f);
    std::vector<int> ex(E);
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < E; ++e) ex[e] = e;
      std::shuffle(ex.begin(), ex.end(), rng);
      for (int k = 0; k < K; ++k) idx[r][t * K + k] = ex[k];
    }
    xt[r] = epd::MakeDLTensor(x[r].data(), kBf16, xs);
    it[r] = epd::MakeDLTensor(idx[r].data(), kI64, ks);
    wt[r] = epd::MakeDLTensor(w[r].data(), kF32, ks);
  }
  // Per-rank timing of one op kind: every rank runs `op` iters times in lockstep.
  auto measure = [&](const std::function<absl::Status(int)>& op) {
    std::vector<std::vector<double>> lat(R);
    std::vector<std::thread> threads;
    absl::Status first_error;
    std::mutex mu;
    for (int r = 0; r < R; ++r) {
      threads.emplace_back([&, r] {
        for (int i = 0; i < iters + 10; ++i) {
          auto s = Clock::now();
          absl::Status st = op(r);
          double us = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
          if (!st.ok()) {
            std::lock_guard<std::mutex> l(mu);
            first_error = st;
            return;
          }
          if (i >= 10) lat[r].push_back(us);
        }
      });
    }
    for (auto& t : threads) t.join();
    std::vector<double> all;
    for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
    return std::make_pair(first_error, all);
  };
  std::vector<epd::DispatchResult> last(R);
  std::vector<epd::LowLatencyDispatchResult> last_ll(R);
  std::vector<std::vector<uint16_t>> expert_out(R);
  std::vector<std::vector<int64_t>> eshape(R);
  std::vector<DLTensor> et(R);
  std::vector<Stat> stats;
  const double token_bytes = double(H) * 2;
  auto run = [&](const std::string& name, double bytes_per_rank,
                 const std::function<absl::Status(int)>& op) -> bool {
    auto [st, lat] = measure(op);
    if (!st.ok()) {
      std::fprintf(stderr, "host bench: %s: %s\n", name.c_str(), st.ToString().c_str());
      return false;
    }
    Stat s;
    s.op = name;
    Percentiles p = ComputePercentiles(lat);
    s.p50_us = p.p50;
    s.p99_us = p.p99;
    s.bytes = bytes_per_rank;
    s.memcpy_us = MemcpyMicros(static_cast<size_t>(bytes_per_rank) * R);
    stats.push_back(s);
    return true;
  };
  bool ok = run("Dispatch (bf16)", T * token_bytes * std::min(K, R), [&](int r) -> absl::Status {
    epd::DispatchArgs a;
    a.x = &xt[r];
    a.topk_idx = &it[r];
    a.topk_weights = &wt[r];
    auto op = eps[r]->Dispatch(a);
    if (!op.ok()) return op.status();
    auto res = op->Wait();
    if (!res.ok()) return res.status();
    last[r] = *res;
    return absl::OkStatus();
  });
  for (int r = 0; ok && r < R; ++r) {
    expert_out[r].assign(size_t(last[r].num_recv_tokens) * H, 0x3f80);
    eshape[r] = {last[r].num_recv_tokens, H};
    et[r] = epd::MakeDLTensor(expert_out[r].data(), kBf16, eshape[r]);
  }
  ok = ok && run("Combine (bf16)", T * token_bytes * std::min(K, R), [&](int r) -> absl::Status {
         epd::CombineArgs a;
         a.x = &et[r];
         a.handle = &last[r].handle;
         auto op = eps[r]->Combine(a);
         if (!op.ok()) return op.status();
         return op->Wait().status();
       });
  ok = ok &&
       run("LowLatencyDispatch (fp8)", T * (H + H / 128 * 4.0) * K, [&](int r) -> absl::Status {
         epd::LowLatencyDispatchArgs a;
         a.x = &xt[r];
         a.topk_idx = &it[r];
         a.use_fp8 = true;
         auto op = eps[r]->LowLatencyDispatch(a);
         if (!op.ok()) return op.status();
         auto res = op->Wait();
         if (!res.ok()) return res.status();
         last_ll[r] = *res;
         return absl::OkStatus();
       });
  std::vector<std::vector<uint16_t>> ll_out(R);
  std::vector<std::vector<int64_t>> ll_shape(R);
  std::vector<DLTensor> llt(R);
  for (int r = 0; ok && r < R; ++r) {
    ll_out[r].assign(size_t(E / R) * R * T * H, 0x3f80);
    ll_shape[r] = {E / R, int64_t(R) * T, H};
    llt[r] = epd::MakeDLTensor(ll_out[r].data(), kBf16, ll_shape[r]);
  }
  // LL combine reuses the last LL dispatch's handle each time (valid: no new dispatch).
  ok = ok && run("LowLatencyCombine (bf16)", T * token_bytes * K, [&](int r) -> absl::Status {
         epd::LowLatencyCombineArgs a;
         a.x = &llt[r];
         a.topk_idx = &it[r];
         a.topk_weights = &wt[r];
         a.handle = &last_ll[r].handle;
         auto op = eps[r]->LowLatencyCombine(a);
         if (!op.ok()) return op.status();
         return op->Wait().status();
       });
  if (!ok) return 1;

  // Hand-off latency: one rank-0 GetDispatchLayout round trip with T = 0 on a one-rank
  // group, back to back (engine spinning) and after 2 ms of idleness (engine asleep on its
  // futex: the wake-up path). The difference is the cost of waking the engine.
  epd::v1::GroupSpec solo = spec;
  solo.set_name("bench-solo");
  solo.set_num_ranks(1);
  auto solo_group = (*plane)->CreateGroup(solo);
  if (!solo_group.ok()) return 1;
  epd::v1::EndpointInfo solo_info;
  if (!(*solo_group)->AttachRank(0, "", epd::v1::LAUNCH_MODE_UNSPECIFIED, {}, &solo_info).ok()) {
    return 1;
  }
  auto solo_fds = (*solo_group)->TakeEndpointFds(0);
  if (!solo_fds.ok()) return 1;
  auto solo_ep = epd::internal::OpenEndpoint(solo_info, solo, *std::move(solo_fds),
                                             [] { return absl::OkStatus(); });
  if (!solo_ep.ok()) return 1;
  std::vector<int64_t> empty_shape{0, K};
  DLTensor empty = epd::MakeDLTensor(idx[0].data(), kI64, empty_shape);
  auto round_trip = [&](std::chrono::microseconds idle, std::vector<double>& out) -> bool {
    for (int i = 0; i < iters + 10; ++i) {
      if (idle.count() > 0) std::this_thread::sleep_for(idle);
      auto s = Clock::now();
      auto op = (*solo_ep)->GetDispatchLayout(empty);
      if (!op.ok() || !op->Wait().ok()) return false;
      if (i >= 10)
        out.push_back(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
    }
    return true;
  };
  std::vector<double> awake, asleep;
  if (!round_trip(std::chrono::microseconds(0), awake) ||
      !round_trip(std::chrono::microseconds(2000), asleep)) {
    std::fprintf(stderr, "host bench: hand-off round trip failed\n");
    return 1;
  }
  Percentiles awake_p = ComputePercentiles(awake), asleep_p = ComputePercentiles(asleep);
  if (json) {
    std::printf(
        "{\"backend\":\"host\",\"ranks\":%d,\"tokens\":%d,\"hidden\":%d,\"experts\":%d,"
        "\"topk\":%d,\"ops\":[",
        R, T, H, E, K);
    for (size_t i = 0; i < stats.size(); ++i) {
      const Stat& s = stats[i];
      std::printf(
          "%s{\"op\":\"%s\",\"p50_us\":%.1f,\"p99_us\":%.1f,\"bytes_per_rank\":%.0f,"
          "\"gbps_per_rank\":%.3f,\"memcpy_all_ranks_us\":%.1f}",
          i ? "," : "", s.op.c_str(), s.p50_us, s.p99_us, s.bytes, s.bytes / s.p50_us / 1e3,
          s.memcpy_us);
    }
    std::printf(
        "],\"handoff\":{\"awake_p50_us\":%.1f,\"awake_p99_us\":%.1f,"
        "\"asleep_p50_us\":%.1f,\"asleep_p99_us\":%.1f}}\n",
        awake_p.p50, awake_p.p99, asleep_p.p50, asleep_p.p99);
  } else {
    std::printf("%-26s %10s %10s %14s %12s %22s\n", "op", "p50 (us)", "p99 (us)", "bytes/rank",
                "GB/s/rank", "memcpy all ranks (us)");
    for (const Stat& s : stats) {
      std::printf("%-26s %10.1f %10.1f %14.0f %12.3f %22.1f\n", s.op.c_str(), s.p50_us, s.p99_us,
                  s.bytes, s.bytes / s.p50_us / 1e3, s.memcpy_us);
    }
    std::printf(
        "(bytes/rank: token bytes a rank sends, one copy per destination; the memcpy "
        "column copies R times that, single-threaded, in this process)\n");
    std::printf("\nhand-off round trip (1 rank, T = 0, submit -> engine -> completion)\n");
    std::printf("%-34s %10s %10s\n", "", "p50 (us)", "p99 (us)");
    std::printf("%-34s %10.1f %10.1f\n", "engine awake (back to back)", awake_p.p50, awake_p.p99);
    std::printf("%-34s %10.1f %10.1f\n", "engine asleep (2 ms idle first)", asleep_p.p50,
                asleep_p.p99);
    std::printf("(wake-up cost = asleep - awake; the engine sleeps after %u us idle)\n",
                o.engine_idle_us);
  }
  std::fflush(stdout);
  return RunMaskBench(json);
}

}  // namespace epd::bench
