// An engine with its doorbell page and the list of groups it polls: the skeleton both data
// planes (host/, cuda/) share. docs/DESIGN.md §8.2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/os/shm_region.h"
#include "daemon/dataplane/deferred_release.h"
#include "daemon/dataplane/engine.h"

namespace epd {

/// Creates a doorbell page (abi::DoorbellPage, size/magic/version written) in a new shm
/// region that clients map through the fd LockstepGroup::DoorbellFd hands out. Errors:
/// those of ShmRegion::Create.
absl::StatusOr<ShmRegion> CreateDoorbellPage();

/// One engine thread, its doorbell page and the groups it polls. `Group` has
/// `bool Poll()` and `bool Quiescent()` (LockstepGroup). Thread-safety: Add/Remove/ForEach lock the
/// group list, which the engine thread holds while it polls.
template <typename Group>
class EngineHost {
 public:
  EngineHost() = default;
  EngineHost(const EngineHost&) = delete;
  EngineHost& operator=(const EngineHost&) = delete;
  ~EngineHost() { Stop(); }

  /// Creates the doorbell page and starts the engine thread, which sleeps after `idle_us`
  /// without work and wakes at least every 20 ms to enforce op timeouts. `before_poll`,
  /// when set, runs on the engine thread before each round of polls (e.g. cudaSetDevice);
  /// `on_start` is Engine's test seam. Call once. Errors: CreateDoorbellPage's.
  absl::Status Start(uint32_t idle_us, std::function<void()> on_start,
                     std::function<void()> before_poll = nullptr) {
    auto page = CreateDoorbellPage();
    if (!page.ok()) return page.status();
    doorbell_ = *std::move(page);
    before_poll_ = std::move(before_poll);
    engine_ = std::make_unique<Engine>(
        reinterpret_cast<abi::DoorbellPage*>(doorbell_.data()), idle_us, kMaxSleepUs,
        [this] { return PollAll(); }, std::move(on_start));
    engine_->Start();
    return absl::OkStatus();
  }
  /// Before Start: each round of polls holds `release`'s PollScope, and after the round the
  /// engine thread calls release->MaybeRelease(all_quiescent) (deferred_release.h). Both
  /// outlive the engine.
  void SetDeferredRelease(DeferredRelease* release, std::function<bool()> all_quiescent) {
    release_ = release;
    all_quiescent_ = std::move(all_quiescent);
  }
  /// The first group in the list whose Quiescent() is false (work of it keeps a device
  /// busy), or null when every group is quiescent. `on_busy(Group&)` runs on that group
  /// with the list's lock still held: the returned pointer is for comparison only, since
  /// the group's owner may remove and destroy it once the lock is released. Takes the
  /// list's lock: not from inside a round of polls.
  template <typename OnBusy>
  Group* FirstBusyGroup(OnBusy&& on_busy) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Group* g : groups_) {
      if (!g->Quiescent()) {
        on_busy(*g);
        return g;
      }
    }
    return nullptr;
  }
  Group* FirstBusyGroup() {
    return FirstBusyGroup([](Group&) {});
  }
  /// Joins the engine thread. Idempotent; a host never started stops at once.
  void Stop() {
    if (engine_) engine_->Stop();
  }
  /// Wakes the engine thread if it sleeps.
  void Wake() {
    if (engine_) engine_->Wake();
  }

  void Add(Group* g) {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.push_back(g);
  }
  void Remove(Group* g) {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.erase(std::remove(groups_.begin(), groups_.end(), g), groups_.end());
  }
  /// Calls `f(Group*)` for every group, holding the list's lock.
  template <typename F>
  void ForEach(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    for (Group* g : groups_) f(g);
  }

  /// Calls `f(std::span<Group* const>)` once with every group, holding the list's lock: no
  /// group is removed (so none is destroyed) until `f` returns. Not from the engine thread.
  template <typename F>
  void WithGroups(F&& f) {
    std::lock_guard<std::mutex> lock(mu_);
    f(std::span<Group* const>(groups_.data(), groups_.size()));
  }

  /// The doorbell page's region (its fd is what clients map).
  const ShmRegion& doorbell() const { return doorbell_; }

 private:
  static constexpr uint32_t kMaxSleepUs = 20000;

  bool PollAll() {
    if (before_poll_) before_poll_();
    bool worked = false;
    {
      std::shared_lock<std::shared_mutex> scope;
      if (release_ != nullptr) scope = release_->PollScope();
      std::lock_guard<std::mutex> lock(mu_);
      for (Group* g : groups_) worked |= g->Poll();
    }
    if (release_ != nullptr) worked |= release_->MaybeRelease(all_quiescent_) > 0;
    return worked;
  }

  ShmRegion doorbell_;
  std::function<void()> before_poll_;
  DeferredRelease* release_ = nullptr;  // Not owned; null: nothing deferred.
  std::function<bool()> all_quiescent_;
  std::mutex mu_;  // Guards groups_.
  std::vector<Group*> groups_;
  std::unique_ptr<Engine> engine_;  // Last: stopped (destroyed) before the rest.
};

}  // namespace epd
