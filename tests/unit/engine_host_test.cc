// EngineHost (daemon/dataplane/engine_host.h): the doorbell page set-up and the engine +
// group-list skeleton both data planes use.
#include "daemon/dataplane/engine_host.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

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
  bool Quiescent() { return true; }
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

/// A group whose quiescence the test sets, and which records whether a release ran while
/// one of its polls was in progress.
struct BusyGroup {
  std::atomic<bool> quiescent{false};
  std::atomic<bool> in_poll{false};
  std::atomic<int> polls{0};
  bool Poll() {
    in_poll = true;
    polls.fetch_add(1);
    std::this_thread::sleep_for(100us);
    in_poll = false;
    return false;
  }
  bool Quiescent() { return quiescent.load(); }
};

/// Records the thread that drops it and whether a group's poll was running then.
struct ReleaseProbe {
  ReleaseProbe(std::atomic<bool>* released, std::atomic<bool>* during_poll, const BusyGroup* group,
               std::thread::id* thread)
      : released(released), during_poll(during_poll), group(group), thread(thread) {}
  std::atomic<bool>* released;
  std::atomic<bool>* during_poll;
  const BusyGroup* group;
  std::thread::id* thread;
  ~ReleaseProbe() {
    *during_poll = group->in_poll.load();
    *thread = std::this_thread::get_id();
    *released = true;
  }
};

TEST(EngineHostTest, DeferredMemoryIsDroppedOnTheEngineThreadOnlyOnceEveryGroupIsQuiescent) {
  DeferredRelease release;
  EngineHost<BusyGroup> host;
  host.SetDeferredRelease(&release, [&host] { return host.FirstBusyGroup() == nullptr; });
  std::thread::id engine_thread;
  ASSERT_TRUE(host.Start(100, [&] { engine_thread = std::this_thread::get_id(); }).ok());
  BusyGroup g;
  host.Add(&g);
  std::atomic<bool> released{false}, during_poll{false};
  std::thread::id dropped_on;
  release.Add(std::make_shared<ReleaseProbe>(&released, &during_poll, &g, &dropped_on));
  EXPECT_EQ(release.pending(), 1u);
  // While the group has work on the device, nothing is dropped, however many rounds run.
  const int polls = g.polls.load();
  host.Wake();
  ASSERT_TRUE(WaitFor([&] { return g.polls.load() > polls + 20; }));
  EXPECT_FALSE(released.load());
  EXPECT_EQ(release.pending(), 1u);
  g.quiescent = true;
  host.Wake();
  ASSERT_TRUE(WaitFor([&] { return released.load(); }));
  EXPECT_EQ(release.pending(), 0u);
  EXPECT_EQ(dropped_on, engine_thread);
  EXPECT_FALSE(during_poll.load());
  host.Stop();
}

TEST(EngineHostTest, FirstBusyGroupIsTheFirstGroupWithWorkAndSeesItUnderTheListLock) {
  EngineHost<BusyGroup> host;  // Not started: only the list.
  EXPECT_EQ(host.FirstBusyGroup(), nullptr);
  BusyGroup a, b, c;
  a.quiescent = true;
  host.Add(&a);
  host.Add(&b);
  host.Add(&c);
  EXPECT_EQ(host.FirstBusyGroup(), &b);
  b.quiescent = true;
  int visited = 0;
  BusyGroup* seen = nullptr;
  EXPECT_EQ(host.FirstBusyGroup([&](BusyGroup& g) {
    ++visited;
    seen = &g;
  }),
            &c);
  EXPECT_EQ(visited, 1);
  EXPECT_EQ(seen, &c);
  c.quiescent = true;
  EXPECT_EQ(host.FirstBusyGroup([&](BusyGroup&) { ++visited; }), nullptr);
  EXPECT_EQ(visited, 1);  // Not called when every group is quiescent.
  a.quiescent = false;
  host.Remove(&a);
  EXPECT_EQ(host.FirstBusyGroup(), nullptr);  // A removed group no longer counts.
}

TEST(EngineHostTest, DeferredReleaseWaitsForEveryEngineToLeaveItsRound) {
  DeferredRelease release(0ns);  // Every call checks.
  // Another engine inside a round of polls (its PollScope held): no release.
  auto scope = release.PollScope();
  std::atomic<bool> released{false}, during_poll{false};
  std::thread::id dropped_on;
  BusyGroup g;
  release.Add(std::make_shared<ReleaseProbe>(&released, &during_poll, &g, &dropped_on));
  size_t dropped = 0;
  std::thread other([&] { dropped = release.MaybeRelease([] { return true; }); });
  other.join();
  EXPECT_EQ(dropped, 0u);
  EXPECT_FALSE(released.load());
  scope.unlock();
  std::this_thread::sleep_for(2ms);
  EXPECT_GE(release.pending_for(), 2ms);                      // What a long wait is reported from.
  EXPECT_EQ(release.MaybeRelease([] { return false; }), 0u);  // Not quiescent: kept.
  EXPECT_EQ(release.MaybeRelease([] { return true; }), 1u);
  EXPECT_TRUE(released.load());
  release.Add(nullptr);  // Ignored.
  EXPECT_EQ(release.pending(), 0u);
  EXPECT_EQ(release.pending_for(), std::chrono::steady_clock::duration::zero());
}

TEST(EngineHostTest, DeferredReleaseChecksNothingWhileNothingWaits) {
  DeferredRelease release(0ns);
  int checks = 0;
  auto count = [&] {
    ++checks;
    return true;
  };
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(release.MaybeRelease(count), 0u);
  EXPECT_EQ(checks, 0);
  // Nor once what waited is dropped.
  release.Add(std::make_shared<int>(1));
  EXPECT_EQ(release.MaybeRelease(count), 1u);
  EXPECT_EQ(checks, 1);
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(release.MaybeRelease(count), 0u);
  EXPECT_EQ(checks, 1);
  EXPECT_EQ(release.pending(), 0u);
}

TEST(EngineHostTest, DeferredReleaseChecksAtMostOncePerIntervalWhileItemsWait) {
  // A long interval: of many rounds on several engines, one checks.
  {
    DeferredRelease release(std::chrono::hours(1));
    release.Add(std::make_shared<int>(1));
    std::atomic<int> checks{0};
    auto busy = [&] {
      checks.fetch_add(1);
      return false;
    };
    std::vector<std::thread> engines;
    for (int t = 0; t < 4; ++t) {
      engines.emplace_back([&] {
        for (int i = 0; i < 1000; ++i) release.MaybeRelease(busy);
      });
    }
    for (std::thread& t : engines) t.join();
    EXPECT_EQ(checks.load(), 1);
    EXPECT_EQ(release.pending(), 1u);
    // Quiescent now, but the next check is an hour away: kept.
    EXPECT_EQ(release.MaybeRelease([] { return true; }), 0u);
    EXPECT_EQ(release.pending(), 1u);
  }
  // A short one: once it has passed, the next round checks again and drops.
  DeferredRelease release(1ms);
  release.Add(std::make_shared<int>(1));
  int checks = 0;
  EXPECT_EQ(release.MaybeRelease([&] {
    ++checks;
    return false;
  }),
            0u);
  std::this_thread::sleep_for(2ms);
  EXPECT_EQ(release.MaybeRelease([&] {
    ++checks;
    return true;
  }),
            1u);
  EXPECT_EQ(checks, 2);
}

TEST(EngineHostTest, StopWithoutStartIsANoOp) {
  EngineHost<CountingGroup> host;
  host.Stop();
  host.Wake();
}

}  // namespace
}  // namespace epd
