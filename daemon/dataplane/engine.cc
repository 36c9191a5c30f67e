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

void Engine::Start() {
  thread_ = std::thread([this] { Run(); });
}

void Engine::Stop() {
  stop_.store(true);
  Wake();
  if (thread_.joinable()) thread_.join();
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
    if (poll_()) {
      last_work = Clock::now();
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
