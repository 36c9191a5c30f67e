// Engine: the thread that polls request rings, spinning while there is work and sleeping
// on the doorbell futex (proto/abi/shm_abi.h DoorbellPage) once idle. docs/DESIGN.md §8.2.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "daemon/metrics/metrics.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// Reports its busy time to metrics::Default() while it runs (epd_engine_busy_seconds_total
/// and epd_engine_utilization, label engine = the engines' start order in the process).
class Engine : private metrics::Source {
 public:
  /// `poll` is called in a loop on the engine thread; it returns true when it did work.
  /// `doorbell` points to a DoorbellPage shared with clients; it must outlive the engine.
  /// `on_start`, when set, is called once on the engine thread before its first poll (a
  /// test seam: e.g. to mark the thread for an allocation counter).
  Engine(abi::DoorbellPage* doorbell, uint32_t idle_us, uint32_t max_sleep_us,
         std::function<bool()> poll, std::function<void()> on_start = nullptr);
  /// Stops and joins the thread.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Starts the thread. Call once.
  void Start();
  /// Asks the thread to exit and joins it. Idempotent.
  void Stop();
  /// Wakes the thread if it sleeps (for daemon-side events: a rank left, shutdown).
  void Wake();

  /// Number of times the engine went to sleep (diagnostics and tests).
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }
  /// Nanoseconds spent in polls that did work.
  uint64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

 private:
  void Run();
  void Collect(metrics::SnapshotBuilder& out) const override;
  abi::DoorbellPage* doorbell_;
  uint32_t idle_us_;
  uint32_t max_sleep_us_;
  std::function<bool()> poll_;
  std::function<void()> on_start_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> sleeps_{0};
  std::atomic<uint64_t> busy_ns_{0};
  std::chrono::steady_clock::time_point started_;
  std::string name_;
  metrics::Registration registration_;  ///< While the thread runs.
  std::thread thread_;
};

}  // namespace epd
