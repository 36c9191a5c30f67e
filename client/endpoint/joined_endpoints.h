// JoinedEndpoints: the endpoints a Client made and the JoinOptions that made each, so that
// Client::Reconnect can rejoin them after a daemon restart. Internal to libepdclient.
#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "absl/synchronization/mutex.h"
#include "epd/client.h"

namespace epd::internal {

/// Shared by a Client and its endpoints (an Endpoint may outlive its Client). An endpoint
/// is added by Client::Join and removed by its Leave (or destructor). Thread-safe; ForEach
/// holds the lock while it runs, so an Add or Remove on another thread waits for it.
class JoinedEndpoints {
 public:
  /// Records `endpoint` (not owned), joined with `options` during Session `generation`.
  void Add(Endpoint* endpoint, const JoinOptions& options, uint64_t generation) {
    absl::MutexLock lock(&mu_);
    entries_[endpoint] = Entry{options, generation};
  }
  /// Forgets `endpoint` (no-op when absent).
  void Remove(Endpoint* endpoint) {
    absl::MutexLock lock(&mu_);
    entries_.erase(endpoint);
  }
  /// Calls `fn(endpoint, options)` for each endpoint recorded with a generation other than
  /// `generation`, in no particular order; when it returns true the endpoint is recorded as
  /// bound to `generation`.
  void ForEachStale(uint64_t generation,
                    const std::function<bool(Endpoint&, const JoinOptions&)>& fn) {
    absl::MutexLock lock(&mu_);
    for (auto& [endpoint, entry] : entries_) {
      if (entry.generation == generation) continue;
      if (fn(*endpoint, entry.options)) entry.generation = generation;
    }
  }
  size_t size() {
    absl::MutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  struct Entry {
    JoinOptions options;
    uint64_t generation = 0;
  };
  absl::Mutex mu_;
  std::map<Endpoint*, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace epd::internal
