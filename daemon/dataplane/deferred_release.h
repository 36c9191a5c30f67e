// DeferredRelease: GPU memory whose release waits for a moment when no engine has work of
// the daemon's on a device. docs/DESIGN.md §8.2 ("Freeing GPU memory").
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

namespace epd {

/// Holds what owns device or pinned host memory (a CudaRank, a group's peer arrays) until
/// it can be dropped without stalling an op.
///
/// Why: cudaFree and cudaFreeHost wait until the device is idle and, while they wait, hold
/// back every other thread's kernel launches and copies (measured on the H200: a launch
/// from a second thread returned only when the free did). Called beside an op whose ranks'
/// kernels are not all launched yet, the free waits for kernels that spin for the launches
/// it holds back, until their bounded waits fail the op (op_timeout). So memory is never
/// freed on a control thread while engines run: it is handed here, and dropped by an engine
/// thread between two rounds of polls, with every engine's polls held off (`PollScope`) and
/// every group quiescent (no work of the daemon's on a device).
///
/// Cost to the engines: a round while nothing waits reads one atomic counter. While items
/// wait, one engine at most per `check_every` try-locks the gate and runs the quiescence
/// test (which walks every engine's groups); the other rounds skip it. An item is dropped
/// that much later than the first quiescent moment at worst.
///
/// Thread-safety: every method is thread-safe.
class DeferredRelease {
 public:
  /// The least time between two of MaybeRelease's checks by default.
  static constexpr std::chrono::microseconds kDefaultCheckEvery{100};

  /// `check_every`: the least time between two checks of MaybeRelease (zero: every call).
  explicit DeferredRelease(std::chrono::nanoseconds check_every = kDefaultCheckEvery)
      : check_every_ns_(check_every.count()) {}
  DeferredRelease(const DeferredRelease&) = delete;
  DeferredRelease& operator=(const DeferredRelease&) = delete;
  /// Drops what is left (the engines are stopped by then).
  ~DeferredRelease() { ReleaseAll(); }

  /// Keeps `item` until a later MaybeRelease or ReleaseAll drops it. Null is ignored.
  void Add(std::shared_ptr<void> item) {
    if (item == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (items_.empty()) pending_since_ = std::chrono::steady_clock::now();
    items_.push_back(std::move(item));
    pending_.store(items_.size(), std::memory_order_relaxed);
  }

  /// Held (shared) by an engine for a round of polls: no release runs during it, and a
  /// round waits for a release in progress to end.
  std::shared_lock<std::shared_mutex> PollScope() {
    return std::shared_lock<std::shared_mutex>(gate_);
  }

  /// Called by an engine thread after a round of polls, holding no PollScope. When items
  /// wait, no check ran in the last `check_every` (nor runs now on another thread), no
  /// engine is inside a round (else it returns at once: a later round retries) and
  /// `all_quiescent()` (called with every round held off) is true, drops every item on this
  /// thread before the engines go on. Returns the number dropped.
  size_t MaybeRelease(const std::function<bool()>& all_quiescent) {
    // Relaxed: a round that misses an item just added sees it on a later round, and the
    // items themselves are taken under mu_.
    if (pending_.load(std::memory_order_relaxed) == 0) return 0;
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch())
                            .count();
    int64_t next = next_check_ns_.load(std::memory_order_relaxed);
    if (now < next) return 0;
    // One engine takes this check; one that loses the race leaves it to the winner.
    if (!next_check_ns_.compare_exchange_strong(next, now + check_every_ns_,
                                                std::memory_order_relaxed)) {
      return 0;
    }
    std::unique_lock<std::shared_mutex> exclusive(gate_, std::try_to_lock);
    if (!exclusive.owns_lock() || !all_quiescent()) return 0;
    std::vector<std::shared_ptr<void>> items;
    {
      std::lock_guard<std::mutex> lock(mu_);
      items.swap(items_);
      pending_.store(0, std::memory_order_relaxed);
    }
    const size_t n = items.size();
    items.clear();  // The frees, with the engines held off.
    return n;
  }

  /// Drops every item now (shutdown: no engine runs), and those their destructors add.
  void ReleaseAll() {
    for (;;) {
      std::vector<std::shared_ptr<void>> items;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (items_.empty()) return;
        items.swap(items_);
        pending_.store(0, std::memory_order_relaxed);
      }
    }
  }

  /// Items waiting.
  size_t pending() const { return pending_.load(std::memory_order_relaxed); }
  /// How long the oldest waiting item has waited (zero when none waits).
  std::chrono::steady_clock::duration pending_for() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (items_.empty()) return std::chrono::steady_clock::duration::zero();
    return std::chrono::steady_clock::now() - pending_since_;
  }

 private:
  mutable std::mutex mu_;  // Guards items_ and pending_since_.
  std::vector<std::shared_ptr<void>> items_;
  std::chrono::steady_clock::time_point pending_since_;  // When items_ last became non-empty.
  std::atomic<size_t> pending_{0};  // items_.size(), read without mu_ by every round.
  const int64_t check_every_ns_;
  std::atomic<int64_t> next_check_ns_{0};  // steady_clock ns before which no check runs.
  std::shared_mutex gate_;
};

}  // namespace epd
