// Fork-join parallelism for the host ops (see internal.h).
#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

#include "internal.h"

namespace epd::kernels::host::internal {

int ResolveThreads(const HostExecution& exec) {
  if (exec.num_threads > 0) return exec.num_threads;
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void ParallelFor(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int64_t threads = std::min<int64_t>(std::max(num_threads, 1), n);
  if (threads == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int64_t i = 0; i + 1 < threads; ++i) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // Out of threads: the ones already running (and the caller) finish the work.
    }
  }
  worker();
  for (std::thread& t : pool) t.join();
}

std::vector<TokenChunk> SplitTokens(std::span<const int32_t> num_tokens, int32_t grain) {
  grain = std::max<int32_t>(grain, 1);
  std::vector<TokenChunk> chunks;
  for (size_t r = 0; r < num_tokens.size(); ++r) {
    for (int32_t b = 0; b < num_tokens[r]; b += grain) {
      chunks.push_back({static_cast<int32_t>(r), b, std::min(num_tokens[r], b + grain)});
    }
  }
  return chunks;
}

int32_t GrainForRowBytes(int64_t row_bytes) {
  constexpr int64_t kChunkBytes = 64 * 1024;
  return static_cast<int32_t>(
      std::clamp<int64_t>(kChunkBytes / std::max<int64_t>(row_bytes, 1), 1, 1024));
}

}  // namespace epd::kernels::host::internal
