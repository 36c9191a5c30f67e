// SessionWatch (session_watch.h).
#include "client/session_watch.h"

#include <utility>

namespace epd::internal {

void SessionWatch::MarkLost() {
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_.exchange(true, std::memory_order_acq_rel)) return;
  for (auto& [id, hook] : hooks_) hook();
  hooks_.clear();
}

uint64_t SessionWatch::AddHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  if (lost_.load(std::memory_order_acquire)) {
    hook();
  } else {
    hooks_.emplace(id, std::move(hook));
  }
  return id;
}

void SessionWatch::RemoveHook(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.erase(id);
}

}  // namespace epd::internal
