// SessionWatch: whether a Client's Session with the daemon has ended, shared by the Client
// and its endpoints (waits then fail at once; CUDA streams left waiting are released).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

namespace epd::internal {

/// Shared by a Client and its endpoints: whether the client's Session with the daemon has
/// ended (e.g. epd was killed), and what to do when it does. Thread-safe.
class SessionWatch {
 public:
  /// True once MarkLost was called.
  bool lost() const { return lost_.load(std::memory_order_acquire); }
  /// Marks the Session ended and runs every registered hook once (on the caller's thread,
  /// under the watch's lock: a hook being removed waits for it).
  void MarkLost();
  /// Registers `hook` (run by MarkLost; at once when the Session is already lost).
  /// Returns an id for RemoveHook.
  uint64_t AddHook(std::function<void()> hook);
  /// Removes a hook; after it returns, the hook is not running and never runs again.
  void RemoveHook(uint64_t id);

 private:
  std::atomic<bool> lost_{false};
  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::function<void()>> hooks_;
};

}  // namespace epd::internal
