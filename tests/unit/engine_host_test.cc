// EngineHost (daemon/dataplane/engine_host.h): the doorbell page set-up and the engine +
// group-list skeleton both data planes use.
#include "daemon/dataplane/engine_host.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

using namespace std::chrono_literals;

struct CountingGroup {
  std::atomic<int> polls{0};
  bool Poll() {
    polls.fetch_add(1);
    return false;
  }
};

/// Waits up to 5 s for `pred`.
template <typename Pred>
bool WaitFor(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(EngineHostTest, DoorbellPageCarriesSizeMagicAndVersion) {
  auto region = CreateDoorbellPage();
  ASSERT_TRUE(region.ok()) << region.status();
  const auto* page = reinterpret_cast<const abi::DoorbellPage*>(region->data());
  EXPECT_EQ(page->size, sizeof(abi::DoorbellPage));
  EXPECT_EQ(page->magic, abi::kDoorbellMagic);
  EXPECT_EQ(page->version, abi::kShmAbiVersion);
  EXPECT_TRUE(region->DupFd().ok());
}

TEST(EngineHostTest, PollsAddedGroupsUntilRemovedAndRunsBeforePollOnTheEngineThread) {
  EngineHost<CountingGroup> host;
  std::atomic<int> before{0};
  std::atomic<bool> started{false};
  ASSERT_TRUE(host.Start(
                      100, [&] { started = true; }, [&] { before.fetch_add(1); })
                  .ok());
  CountingGroup a, b;
  host.Add(&a);
  host.Add(&b);
  host.Wake();
  ASSERT_TRUE(WaitFor([&] { return a.polls.load() > 0 && b.polls.load() > 0; }));
  EXPECT_TRUE(started.load());
  EXPECT_GT(before.load(), 0);
  host.Remove(&a);  // Returns once no poll of `a` is in flight.
  const int polled = a.polls.load();
  const int b_polled = b.polls.load();
  host.Wake();
  ASSERT_TRUE(WaitFor([&] { return b.polls.load() > b_polled; }));
  EXPECT_EQ(a.polls.load(), polled);
  int visited = 0;
  host.ForEach([&](CountingGroup* g) {
    EXPECT_EQ(g, &b);
    ++visited;
  });
  EXPECT_EQ(visited, 1);
  host.Stop();
  host.Stop();  // Idempotent.
}

TEST(EngineHostTest, StopWithoutStartIsANoOp) {
  EngineHost<CountingGroup> host;
  host.Stop();
  host.Wake();
}

}  // namespace
}  // namespace epd
