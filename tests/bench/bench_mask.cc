// epd_bench --backend=host, rank masking: through a real `epd --backend=host`, a group with
// on_rank_failure = MASK whose last rank is a separate process (this binary re-run with
// --mask_victim) and whose other ranks are threads here, each running low-latency rounds
// (LowLatencyDispatch, identity experts, LowLatencyCombine) back to back. Per trial: the
// time from kill -9 of the last rank's process to the first round of rank 0 that completes
// without it (OpMask.num_masked = 1), and from a new process's Join returning into that slot
// to the first round of rank 0 that includes it (num_masked = 0). Goal: < 100 ms each.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/bench/bench.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/subprocess.h"

ABSL_FLAG(int, mask_trials, 5, "host bench, rank masking: kill/rejoin trials (0 = skip)");
ABSL_FLAG(std::string, mask_victim, "",
          "internal: run as the masked rank's process of the rank-masking bench: "
          "SOCKET,GROUP,RANK,NUM_RANKS");

namespace epd::bench {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

constexpr int kRanks = 4, kExperts = 16, kHidden = 1024, kTopk = 4, kTokens = 32;
constexpr double kGoalMs = 100;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

v1::GroupSpec MaskSpec(const std::string& name, int num_ranks) {
  v1::GroupSpec spec;
  spec.set_name(name);
  spec.set_num_ranks(num_ranks);
  spec.set_num_experts(kExperts);
  spec.set_hidden(kHidden);
  spec.set_num_topk(kTopk);
  spec.set_max_tokens_per_rank(kTokens);
  spec.set_ll_max_tokens_per_rank(kTokens);
  spec.set_on_rank_failure(v1::RANK_FAILURE_POLICY_MASK);
  return spec;
}

/// One rank's round inputs and its loop of low-latency rounds.
class Roundtrip {
 public:
  Roundtrip(Endpoint* ep, int rank) : ep_(ep) {
    std::mt19937 rng(11 + rank);
    x_.resize(size_t(kTokens) * kHidden);
    for (auto& v : x_) v = kernels::FloatToBf16(float(rng() % 200) / 100.f - 1.f);
    for (int t = 0; t < kTokens; ++t) {
      std::vector<int64_t> e(kExperts);
      for (int i = 0; i < kExperts; ++i) e[i] = i;
      std::shuffle(e.begin(), e.end(), rng);
      idx_.insert(idx_.end(), e.begin(), e.begin() + kTopk);
    }
    w_.assign(idx_.size(), 0.25f);
    x_t_ = MakeDLTensor(x_.data(), kBf16, xs_);
    idx_t_ = MakeDLTensor(idx_.data(), kI64, ks_);
    w_t_ = MakeDLTensor(w_.data(), kF32, ks_);
  }
  /// One round; its combine's mask.
  absl::StatusOr<OpMask> Round() {
    LowLatencyDispatchArgs d;
    d.x = &x_t_;
    d.topk_idx = &idx_t_;
    auto dop = ep_->LowLatencyDispatch(d);
    if (!dop.ok()) return dop.status();
    auto dres = dop->Wait(absl::Seconds(30));
    if (!dres.ok()) return dres.status();
    TensorView input = ep_->LowLatencyCombineInput();
    std::memcpy(input.data(), dres->recv_x.data(), dres->recv_x.nbytes());
    LowLatencyCombineArgs c;
    c.x = &input.dl();
    c.topk_idx = &idx_t_;
    c.topk_weights = &w_t_;
    c.handle = &dres->handle;
    auto cop = ep_->LowLatencyCombine(c);
    if (!cop.ok()) return cop.status();
    auto cres = cop->Wait(absl::Seconds(30));
    if (!cres.ok()) return cres.status();
    return cres->mask;
  }

 private:
  Endpoint* ep_;
  std::vector<uint16_t> x_;
  std::vector<int64_t> idx_;
  std::vector<float> w_;
  std::vector<int64_t> xs_{kTokens, kHidden}, ks_{kTokens, kTopk};
  DLTensor x_t_{}, idx_t_{}, w_t_{};
};

/// Rank 0's finished rounds: (completion time, ranks masked; -1 for a failed round).
class RoundLog {
 public:
  void Add(int64_t at_ns, int32_t masked) {
    std::lock_guard<std::mutex> lock(mu_);
    rounds_.emplace_back(at_ns, masked);
  }
  /// The completion time of the first round after `after_ns` with `masked` ranks masked,
  /// waiting up to `timeout`; 0 when none came.
  int64_t WaitFirst(int64_t after_ns, int32_t masked, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    do {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& [at, m] : rounds_) {
          if (at > after_ns && m == masked) return at;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } while (absl::Now() < end);
    return 0;
  }
  /// Rounds finished after `after_ns` with `masked` ranks masked.
  int Count(int64_t after_ns, int32_t masked) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const auto& [at, m] : rounds_) n += at > after_ns && m == masked;
    return n;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<int64_t, int32_t>> rounds_;
};

/// This binary (the victim is this binary re-run with --mask_victim).
std::string SelfPath() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("epd_bench") : self.string();
}

/// The victim's "joined NS" time, waiting up to 30 s; 0 when it did not join.
int64_t JoinedAt(testing::Subprocess& victim) {
  if (!victim.WaitForOutput("joined ", absl::Seconds(30)).ok()) return 0;
  for (absl::string_view line : absl::StrSplit(victim.Stdout(), '\n')) {
    int64_t ns = 0;
    if (absl::ConsumePrefix(&line, "joined ") && absl::SimpleAtoi(line, &ns)) return ns;
  }
  return 0;
}

}  // namespace

int MaybeRunMaskVictim() {
  if (absl::GetFlag(FLAGS_mask_victim).empty()) return -1;
  std::vector<std::string> f = absl::StrSplit(absl::GetFlag(FLAGS_mask_victim), ',');
  int rank = 0, num_ranks = 0;
  if (f.size() != 4 || !absl::SimpleAtoi(f[2], &rank) || !absl::SimpleAtoi(f[3], &num_ranks)) {
    std::fprintf(stderr, "--mask_victim: want SOCKET,GROUP,RANK,NUM_RANKS\n");
    return 2;
  }
  ClientOptions o;
  o.socket_path = f[0];
  o.client_name = "epd_bench mask victim";
  auto client = Client::Connect(o);
  if (!client.ok()) return 1;
  JoinOptions j;
  j.spec = MaskSpec(f[1], num_ranks);
  j.rank = rank;
  auto ep = (*client)->Join(j);
  if (!ep.ok()) {
    std::fprintf(stderr, "join: %s\n", ep.status().ToString().c_str());
    return 1;
  }
  std::printf("joined %lld\n", static_cast<long long>(NowNs()));
  std::fflush(stdout);
  Roundtrip rounds(ep->get(), rank);
  for (;;) (void)rounds.Round();  // Until killed.
}

int RunMaskBench(bool json) {
  const int trials = absl::GetFlag(FLAGS_mask_trials);
  if (trials <= 0) return 0;
  const std::string epd = SiblingEpdPath();
  setenv("EPD_BINARY", epd.c_str(), 1);
  testing::DaemonProcessOptions dopt;
  dopt.tcp = false;
  dopt.log_level = "warn";
  dopt.extra_args = {"--op_timeout=5s"};
  auto daemon = testing::DaemonProcess::Start(dopt);
  if (!daemon.ok()) {
    std::fprintf(stderr, "mask bench: starting %s: %s\n", epd.c_str(),
                 daemon.status().ToString().c_str());
    return 1;
  }
  const std::string socket = (*daemon)->socket_path();
  ClientOptions copt;
  copt.socket_path = socket;
  copt.client_name = "epd_bench mask";
  auto client = Client::Connect(copt);
  if (!client.ok()) return 1;
  const int victim_rank = kRanks - 1;
  auto spawn_victim = [&](int n) {
    testing::SubprocessOptions o;
    o.stdout_path = absl::StrCat((*daemon)->dir(), "/victim", n, ".out");
    o.stderr_path = absl::StrCat((*daemon)->dir(), "/victim", n, ".err");
    return testing::Subprocess::Spawn(
        {SelfPath(),
         absl::StrCat("--mask_victim=", socket, ",maskbench,", victim_rank, ",", kRanks)},
        o);
  };
  auto victim = spawn_victim(0);
  if (!victim.ok()) return 1;
  std::vector<std::unique_ptr<Endpoint>> eps(victim_rank);
  std::vector<std::thread> joins;
  std::vector<absl::Status> joined(victim_rank);
  for (int r = 0; r < victim_rank; ++r) {
    joins.emplace_back([&, r] {
      JoinOptions j;
      j.spec = MaskSpec("maskbench", kRanks);
      j.rank = r;
      auto ep = (*client)->Join(j);
      joined[r] = ep.status();
      if (ep.ok()) eps[r] = std::move(*ep);
    });
  }
  for (auto& t : joins) t.join();
  for (const absl::Status& st : joined) {
    if (!st.ok()) {
      std::fprintf(stderr, "mask bench: join: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  if (JoinedAt(**victim) == 0) return 1;
  RoundLog log;
  std::atomic<bool> stop{false};
  std::vector<std::thread> survivors;
  for (int r = 0; r < victim_rank; ++r) {
    survivors.emplace_back([&, r] {
      Roundtrip rounds(eps[r].get(), r);
      while (!stop.load()) {
        absl::StatusOr<OpMask> m = rounds.Round();
        if (r == 0) log.Add(NowNs(), m.ok() ? m->num_masked : -1);
      }
    });
  }
  std::vector<double> death_ms, rejoin_ms;
  int64_t included_since = 0;
  bool ok = true;
  for (int trial = 0; trial < trials && ok; ++trial) {
    // The victim takes part in 20 rounds first.
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (log.Count(included_since, 0) < 20 && absl::Now() < until)
      absl::SleepFor(absl::Milliseconds(1));
    const int64_t killed = NowNs();
    (*victim)->Signal(SIGKILL);
    const int64_t without = log.WaitFirst(killed, 1, absl::Seconds(10));
    (void)(*victim)->Wait(absl::Seconds(5));
    victim = spawn_victim(trial + 1);
    const int64_t rejoined = victim.ok() ? JoinedAt(**victim) : 0;
    const int64_t with = rejoined ? log.WaitFirst(rejoined, 0, absl::Seconds(10)) : 0;
    if (without == 0 || with == 0) {
      std::fprintf(stderr, "mask bench: trial %d: no round %s\n", trial,
                   without == 0 ? "without the killed rank" : "with the rejoined rank");
      ok = false;
      break;
    }
    death_ms.push_back((without - killed) / 1e6);
    rejoin_ms.push_back((with - rejoined) / 1e6);
    included_since = with;
  }
  stop.store(true);
  if (victim.ok()) (*victim)->Signal(SIGKILL);  // Survivors waiting for it are released.
  for (auto& t : survivors) t.join();
  if (!ok) return 1;
  const Percentiles death = ComputePercentiles(death_ms), rejoin = ComputePercentiles(rejoin_ms);
  const double death_max = *std::max_element(death_ms.begin(), death_ms.end());
  const double rejoin_max = *std::max_element(rejoin_ms.begin(), rejoin_ms.end());
  auto verdict = [](double ms) { return ms < kGoalMs ? "meets the goal" : "MISSES the goal"; };
  if (json) {
    std::printf(
        "{\"backend\":\"host\",\"figure\":\"rank_masking\",\"ranks\":%d,\"trials\":%d,"
        "\"death_to_first_op_without_ms\":{\"p50\":%.2f,\"max\":%.2f},"
        "\"rejoin_to_first_op_with_ms\":{\"p50\":%.2f,\"max\":%.2f},\"goal_ms\":%.0f}\n",
        kRanks, trials, death.p50, death_max, rejoin.p50, rejoin_max, kGoalMs);
  } else {
    std::printf(
        "\nrank masking (real epd, on_rank_failure MASK, R=%d: rank %d a process, the others "
        "threads; low-latency rounds T=%d H=%d K=%d back to back; %d trials)\n",
        kRanks, victim_rank, kTokens, kHidden, kTopk, trials);
    std::printf("%-44s %10s %10s %10s  %s\n", "", "p50 (ms)", "max (ms)", "goal (ms)", "verdict");
    std::printf("%-44s %10.2f %10.2f %10s  %s\n", "kill -9 -> first round without it", death.p50,
                death_max, "< 100", verdict(death_max));
    std::printf("%-44s %10.2f %10.2f %10s  %s\n", "rejoin (Join returned) -> first round with it",
                rejoin.p50, rejoin_max, "< 100", verdict(rejoin_max));
  }
  return death_max < kGoalMs && rejoin_max < kGoalMs ? 0 : 1;
}

}  // namespace epd::bench
