// Nodes of one group inside one test process for the transport tests
// (tcp_transport_test.cc, fault_transport_test.cc): each node has its own receive region and
// group link (on its own transport, or on a shared one), a wake counter, and helpers to
// connect every pair and to wait with a bound.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "daemon/transport/transport.h"

namespace epd::transport::testing {

/// Polls `pred` every 200 us until it is true or `timeout` passed; returns its last value.
inline bool WaitFor(const std::function<bool()>& pred,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

/// One node of the test group.
struct TestNode {
  std::vector<uint8_t> recv;  ///< The receive region.
  std::unique_ptr<GroupLink> link;
  std::shared_ptr<std::atomic<int>> wakes = std::make_shared<std::atomic<int>>(0);
};

/// Creates `num_nodes` links of group `group` on `transports[i % transports.size()]`, each
/// with a receive region of `recv_bytes` (zeroed).
inline std::vector<TestNode> MakeNodes(const std::vector<Transport*>& transports, int num_nodes,
                                       uint64_t recv_bytes, const std::string& group = "g",
                                       const std::vector<std::string>& node_labels = {}) {
  std::vector<TestNode> nodes(static_cast<size_t>(num_nodes));
  for (int i = 0; i < num_nodes; ++i) {
    TestNode& n = nodes[static_cast<size_t>(i)];
    n.recv.assign(recv_bytes, 0);
    GroupLinkOptions o;
    o.group = group;
    o.num_nodes = num_nodes;
    o.self_node = i;
    o.recv_base = n.recv.data();
    o.recv_bytes = recv_bytes;
    o.node_labels = node_labels;
    o.wake = [w = n.wakes] { w->fetch_add(1); };
    auto link = transports[static_cast<size_t>(i) % transports.size()]->CreateGroupLink(o);
    EXPECT_TRUE(link.ok()) << link.status();
    if (link.ok()) n.link = std::move(*link);
  }
  return nodes;
}

/// Connects every node to every other one and waits (bounded) until all are kReady.
inline void ConnectAll(std::vector<TestNode>& nodes) {
  const int n = static_cast<int>(nodes.size());
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      ASSERT_TRUE(nodes[static_cast<size_t>(i)]
                      .link->Connect(j, nodes[static_cast<size_t>(j)].link->LocalDescriptorFor(i))
                      .ok());
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      GroupLink& link = *nodes[static_cast<size_t>(i)].link;
      ASSERT_TRUE(WaitFor([&] { return link.State(j) == PeerState::kReady; }))
          << "node " << i << " -> " << j << ": state " << static_cast<int>(link.State(j)) << " "
          << link.PeerStatus(j);
    }
  }
}

/// Posts a write, retrying (bounded) while the link answers RESOURCE_EXHAUSTED.
inline absl::Status PostWriteRetrying(GroupLink& link, int32_t node,
                                      std::span<const WritePiece> pieces, uint32_t imm) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    absl::Status s = link.PostWrite(node, pieces, imm);
    if (!absl::IsResourceExhausted(s) || std::chrono::steady_clock::now() >= deadline) return s;
    std::this_thread::yield();
  }
}

/// Pops one immediate from `node`, waiting up to `timeout`.
inline bool PollImmWaiting(GroupLink& link, int32_t node, uint32_t* imm,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  return WaitFor([&] { return link.PollImm(node, imm); }, timeout);
}

}  // namespace epd::transport::testing
