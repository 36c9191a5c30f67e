// OnEveryRank: runs one call per rank on its own thread, for calls that block until every
// rank of a group has made them (RegisterProgram, UnregisterProgram). Shared by the GPU
// tests (tests/gpu/in_process_epd.h) and the launch bench (tests/bench/bench_launch.cc).
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace epd::testing {

/// Runs `fn(r)` for r in [0, R), each on its own thread, joins them and returns the R
/// statuses, indexed by rank. Allocates (threads, the statuses): not for counted windows.
inline std::vector<absl::Status> OnEveryRank(int R, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> st(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) threads.emplace_back([&, r] { st[r] = fn(r); });
  for (auto& t : threads) t.join();
  return st;
}

}  // namespace epd::testing
