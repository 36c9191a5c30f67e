// epd_metrics_bench: what the metrics registry adds to an op on the engine thread
// (daemon/metrics/metrics.h), in nanoseconds per call, measured in this process:
//   epd_metrics_bench [--iters=N] [--ranks=R]
// Rows: a steady_clock read (the engine reads one per popped request and one per finished
// op), Counter::Add, Histogram::ObserveNs, GroupMetrics::RecordOp, RecordStraggler, the
// whole per-op addition for an op of R local ranks, and Counter::Add from 2 threads on one
// counter (no lock: contention costs a cache line, not a wait). DESIGN.md §10 quotes it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "daemon/metrics/metrics.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double NsPerCall(int iters, F&& f) {
  // Best of 5 runs: the least disturbed by other work on the machine.
  double best = 1e30;
  for (int run = 0; run < 5; ++run) {
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) f(i);
    const auto t1 = Clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / iters);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2'000'000, ranks = 8;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--iters=", 8) == 0) {
      iters = std::atoi(argv[i] + 8);
    } else if (std::strncmp(argv[i], "--ranks=", 8) == 0) {
      ranks = std::atoi(argv[i] + 8);
    } else {
      std::fprintf(stderr, "usage: epd_metrics_bench [--iters=N] [--ranks=R]\n");
      return 2;
    }
  }
  if (iters <= 0 || ranks <= 0 || ranks > 1024) {
    std::fprintf(stderr, "epd_metrics_bench: --iters must be > 0, --ranks in 1..1024\n");
    return 2;
  }
  using namespace epd::metrics;
  Counter counter;
  Histogram histogram;
  GroupMetrics group("bench", ranks, 256);
  std::vector<Clock::time_point> arrived(ranks);
  volatile int64_t sink = 0;
  const uint32_t dispatch = 2;

  struct Row {
    const char* what;
    double ns;
  };
  std::vector<Row> rows;
  rows.push_back({"steady_clock::now()", NsPerCall(iters, [&](int) {
                    sink = sink + Clock::now().time_since_epoch().count();
                  })});
  rows.push_back({"Counter::Add", NsPerCall(iters, [&](int) { counter.Add(); })});
  rows.push_back({"Histogram::ObserveNs (1 us .. 1 s spread)",
                  NsPerCall(iters, [&](int i) { histogram.ObserveNs(1000ull << (i % 20)); })});
  rows.push_back({"GroupMetrics::RecordOp (OK)", NsPerCall(iters, [&](int i) {
                    group.RecordOp(dispatch, absl::StatusCode::kOk, 20'000 + (i & 1023), 4096);
                  })});
  rows.push_back({"GroupMetrics::RecordStraggler", NsPerCall(iters, [&](int i) {
                    group.RecordStraggler(i % ranks, 1000 + (i & 4095));
                  })});
  const std::string per_op = "per op, " + std::to_string(ranks) + " local ranks (all of it)";
  rows.push_back({per_op.c_str(), NsPerCall(std::max(1, iters / ranks), [&](int) {
                    // What LockstepGroup adds to one op at most: a clock read per rank's
                    // request (one per poll that takes requests: at most R), the
                    // straggler, a clock read and RecordOp at completion.
                    for (int r = 0; r < ranks; ++r) arrived[r] = Clock::now();
                    int last = 0;
                    for (int r = 1; r < ranks; ++r) {
                      if (arrived[r] > arrived[last]) last = r;
                    }
                    group.RecordStraggler(
                        last, static_cast<uint64_t>((arrived[last] - arrived[0]).count()));
                    const auto now = Clock::now();
                    group.RecordOp(dispatch, absl::StatusCode::kOk,
                                   static_cast<uint64_t>((now - arrived[0]).count()), 4096);
                  })});
  {
    std::atomic<bool> go{false};
    Counter shared;
    double ns[2] = {0, 0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        while (!go.load()) {
        }
        ns[t] = NsPerCall(iters / 5, [&](int) { shared.Add(); });
      });
    }
    go.store(true);
    for (auto& t : threads) t.join();
    rows.push_back({"Counter::Add, 2 threads on one counter", std::max(ns[0], ns[1])});
  }
  std::printf("%-48s %10s\n", "metrics operation", "ns/call");
  for (const Row& r : rows) std::printf("%-48s %10.1f\n", r.what, r.ns);
  std::printf("(best of 5 runs of %d calls; checksum %lld)\n", iters,
              static_cast<long long>(sink + counter.value() % 2));
  return 0;
}
