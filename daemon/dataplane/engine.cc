#include "daemon/dataplane/engine.h"

#include <chrono>

#include "common/os/futex.h"
#include "common/os/shm_region.h"

namespace epd {

Engine::Engine(abi::DoorbellPage* doorbell, uint32_t idle_us, uint32_t max_sleep_us,
               std::function<bool()> poll, std::function<void()> on_start)
    : doorbell_(doorbell),
      idle_us_(idle_us),
      max_sleep_us_(max_sleep_us),
      poll_(std::move(poll)),
      on_start_(std::move(on_start)) {}

Engine::~Engine() { Stop(); }

namespace {
std::atomic<uint64_t> g_engines_started{0};
}  // namespace

void Engine::Start() {
  started_ = std::chrono::steady_clock::now();
  name_ = std::to_string(g_engines_started.fetch_add(1));
  registration_ = metrics::Default().Add(this);
  thread_ = std::thread([this] { Run(); });
}

void Engine::Stop() {
  stop_.store(true);
  Wake();
  if (thread_.joinable()) thread_.join();
  registration_.Reset();
}

void Engine::Collect(metrics::SnapshotBuilder& out) const {
  const metrics::Labels l = {{"engine", name_}};
  const double busy = static_cast<double>(busy_ns()) * 1e-9;
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  out.AddCounter("epd_engine_busy_seconds_total",
                 "Time the engine thread spent in polls that did work (rate() = utilisation).", l,
                 busy);
  out.AddGauge("epd_engine_utilization", "Engine busy time / wall time since it started.", l,
               wall > 0 ? busy / wall : 0);
}

void Engine::Wake() {
  abi::Atomic(doorbell_->futex_word).fetch_add(1, std::memory_order_seq_cst);
  FutexWakeAll(&doorbell_->futex_word);
}

void Engine::Run() {
  using Clock = std::chrono::steady_clock;
  if (on_start_) on_start_();
  auto last_work = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    const auto poll_start = Clock::now();
    if (poll_()) {
      last_work = Clock::now();
      busy_ns_.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(last_work - poll_start).count(),
          std::memory_order_relaxed);
      continue;
    }
    auto idle = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - last_work);
    if (idle.count() < idle_us_) continue;  // Spin: a request comes within µs.
    // Sleep protocol (Dekker-style with the client, all seq_cst): read the futex word,
    // announce sleeping, poll once more, then wait while the word is unchanged. A client
    // publishes its request before reading engine_sleeping, so one of the two sees the
    // other.
    uint32_t word = abi::Atomic(doorbell_->futex_word).load(std::memory_order_seq_cst);
    abi::Atomic(doorbell_->engine_sleeping).store(1, std::memory_order_seq_cst);
    if (!poll_() && !stop_.load()) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      FutexWait(&doorbell_->futex_word, word, max_sleep_us_);
    }
    abi::Atomic(doorbell_->engine_sleeping).store(0, std::memory_order_seq_cst);
    last_work = Clock::now();
  }
}

}  // namespace epd
