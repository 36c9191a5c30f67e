// The Shutdown sequence TCP's and RDMA's cores share (daemon/transport/link_common.h
// ShutdownCore): once however often and from however many threads it is called, the
// progress thread woken and joined before any link is detached, every link detached with
// the transport's name and woken, the list cleared, and the core's own release run once.
#include "daemon/transport/link_common.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace epd::transport {
namespace {

struct FakeLink {
  std::vector<std::string> detached;  ///< Each Detach's message.
  bool woken = false;
  const std::atomic<bool>* thread_running = nullptr;
  bool thread_ran_when_detached = false;
  void Detach(const absl::Status& cause, bool wake) {
    detached.push_back(std::string(cause.message()));
    woken = wake;
    thread_ran_when_detached = thread_running->load();
  }
};

TEST(ShutdownCoreTest, StopsTheThreadThenDetachesEveryLinkOnce) {
  std::atomic<bool> stop{false};
  std::atomic<bool> running{true};
  std::atomic<int> wakes{0};
  std::thread progress([&] {
    while (!stop.load()) std::this_thread::yield();
    running = false;
  });
  std::mutex mu;
  FakeLink a, b;
  a.thread_running = b.thread_running = &running;
  std::vector<FakeLink*> links = {&a, &b};
  ShutdownOnce once;
  int released = 0;
  auto shutdown = [&] {
    ShutdownCore(
        once, stop, progress, [&] { ++wakes; }, mu, links, "TCP", [&] { ++released; });
  };
  std::thread other(shutdown);
  shutdown();
  other.join();
  shutdown();  // Again: nothing more.
  EXPECT_FALSE(progress.joinable());
  EXPECT_EQ(wakes.load(), 1);
  EXPECT_EQ(released, 1);
  EXPECT_TRUE(links.empty());
  for (const FakeLink* l : {&a, &b}) {
    ASSERT_EQ(l->detached.size(), 1u);
    EXPECT_EQ(l->detached[0], "the TCP transport was shut down");
    EXPECT_TRUE(l->woken);
    EXPECT_FALSE(l->thread_ran_when_detached);
  }
}

TEST(ShutdownCoreTest, WithoutAThreadTheLinksAreStillDetached) {
  std::atomic<bool> stop{false};
  std::thread none;
  std::mutex mu;
  std::atomic<bool> running{false};
  FakeLink a;
  a.thread_running = &running;
  std::vector<FakeLink*> links = {&a};
  ShutdownOnce once;
  bool woke = false;
  ShutdownCore(
      once, stop, none, [&] { woke = true; }, mu, links, "RDMA");
  EXPECT_TRUE(stop.load());
  EXPECT_FALSE(woke);  // No thread to wake.
  ASSERT_EQ(a.detached.size(), 1u);
  EXPECT_EQ(a.detached[0], "the RDMA transport was shut down");
}

}  // namespace
}  // namespace epd::transport
