// The client side of groups across nodes: SetNodes and NodesFromRankAddresses (C++), the C
// ABI's node list in epd_join_options_t (validated before anything is sent; a caller built
// before the field passes the smaller struct_size and joins a one-node group) and
// epd_client_peer_address, against an in-process daemon on the host backend.
#include <cstddef>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "daemon/core/config.h"
#include "daemon/core/daemon.h"
#include "epd/client.h"
#include "epd/epd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/specs.h"

namespace epd {
namespace {

using ::testing::HasSubstr;

TEST(SetNodesTest, FillsNodesInOrderAndSetsNumRanksToTheirSum) {
  v1::GroupSpec spec = testing::MakeSpec("g", {.num_ranks = 1});
  SetNodes(&spec, {{"10.0.0.1:7300", 2}, {"10.0.0.2:7300", 3}});
  ASSERT_EQ(spec.nodes_size(), 2);
  EXPECT_EQ(spec.nodes(0).peer_address(), "10.0.0.1:7300");
  EXPECT_EQ(spec.nodes(0).num_ranks(), 2);
  EXPECT_EQ(spec.nodes(1).peer_address(), "10.0.0.2:7300");
  EXPECT_EQ(spec.nodes(1).num_ranks(), 3);
  EXPECT_EQ(spec.num_ranks(), 5);
  // An empty list makes a one-node group again and keeps num_ranks.
  SetNodes(&spec, {});
  EXPECT_EQ(spec.nodes_size(), 0);
  EXPECT_EQ(spec.num_ranks(), 5);
}

TEST(NodesFromRankAddressesTest, ContiguousRanksOfOneAddressFormANode) {
  auto nodes = NodesFromRankAddresses({"a:1", "a:1", "b:2", "b:2", "b:2", "c:3"});
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  ASSERT_EQ(nodes->size(), 3u);
  EXPECT_EQ((*nodes)[0].peer_address, "a:1");
  EXPECT_EQ((*nodes)[0].num_ranks, 2);
  EXPECT_EQ((*nodes)[1].peer_address, "b:2");
  EXPECT_EQ((*nodes)[1].num_ranks, 3);
  EXPECT_EQ((*nodes)[2].peer_address, "c:3");
  EXPECT_EQ((*nodes)[2].num_ranks, 1);
}

TEST(NodesFromRankAddressesTest, OneAddressOrNoneIsAOneNodeGroup) {
  for (const std::vector<std::string>& addresses :
       std::vector<std::vector<std::string>>{{}, {"a:1"}, {"a:1", "a:1", "a:1"}, {"", ""}}) {
    auto nodes = NodesFromRankAddresses(addresses);
    ASSERT_TRUE(nodes.ok()) << nodes.status();
    EXPECT_TRUE(nodes->empty());
  }
}

TEST(NodesFromRankAddressesTest, InterleavedRanksAndMissingAddressesAreRefused) {
  auto interleaved = NodesFromRankAddresses({"a:1", "b:2", "a:1"});
  EXPECT_EQ(interleaved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(interleaved.status().message(), HasSubstr("rank 2"));
  EXPECT_THAT(interleaved.status().message(), HasSubstr("a:1"));
  EXPECT_THAT(interleaved.status().message(), HasSubstr("contiguous"));
  auto missing = NodesFromRankAddresses({"a:1", "a:1", "", ""});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.status().message(), HasSubstr("ranks 2..3"));
  EXPECT_THAT(missing.status().message(), HasSubstr("peer_listen"));
}

/// An in-process daemon on the host backend (Peer listener off) and a C client of it.
class CApiNodesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_client_nodes_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/epd.sock";
    v1::DaemonConfig config;
    config.set_socket_path(socket_);
    config.set_socket_mode("0600");
    config.set_log_level("warn");
    config.set_backend(v1::BACKEND_HOST);
    FillDaemonConfigDefaults(&config);
    DaemonOptions options;
    options.inventory = GpuInventory::FromList({}, "no GPU (test)");
    options.drain_grace = absl::Milliseconds(10);
    auto daemon = Daemon::Start(config, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    epd_client_options_t o{};
    o.struct_size = sizeof(o);
    o.socket_path = socket_.c_str();
    ASSERT_EQ(epd_client_connect(&o, &client_), EPD_OK) << epd_last_error();
  }
  void TearDown() override {
    epd_client_destroy(client_);
    daemon_.reset();
    std::filesystem::remove_all(dir_);
  }

  static epd_join_options_t Join(const char* name) {
    epd_join_options_t j{};
    j.struct_size = sizeof(j);
    j.name = name;
    j.num_ranks = 1;
    j.num_experts = 4;
    j.hidden = 128;
    j.num_topk = 2;
    j.max_tokens_per_rank = 4;
    return j;
  }

  /// Joins with `j`; expects INVALID_ARGUMENT whose message has `fragment`.
  void ExpectRefused(const epd_join_options_t& j, const std::string& fragment) {
    epd_endpoint_t* ep = nullptr;
    EXPECT_EQ(epd_client_join(client_, &j, &ep), EPD_INVALID_ARGUMENT) << fragment;
    EXPECT_THAT(epd_last_error(), HasSubstr(fragment));
    EXPECT_EQ(ep, nullptr);
  }

  std::string dir_, socket_;
  std::unique_ptr<Daemon> daemon_;
  epd_client_t* client_ = nullptr;
};

TEST_F(CApiNodesTest, BadNodeListsAreRefusedNamingTheField) {
  epd_join_options_t j = Join("nodes");
  j.num_nodes = -1;
  ExpectRefused(j, "options.num_nodes=-1");
  j.num_nodes = 4097;
  ExpectRefused(j, "options.num_nodes=4097");
  j.num_nodes = 1;
  ExpectRefused(j, "options.nodes is NULL");
  epd_node_t nodes[2] = {{"127.0.0.1:1", 1}, {nullptr, 1}};
  j.nodes = nodes;
  j.num_nodes = 2;
  ExpectRefused(j, "options.nodes[1].peer_address is NULL");
  nodes[1].peer_address = "host\xff:1";
  ExpectRefused(j, "options.nodes[1].peer_address");
  ExpectRefused(j, "not valid UTF-8");
  const std::string long_address(300, 'h');
  nodes[1].peer_address = long_address.c_str();
  ExpectRefused(j, "at most 255");
}

TEST_F(CApiNodesTest, ACallerBuiltBeforeNodesJoinsAOneNodeGroup) {
  epd_join_options_t j = Join("old-caller");
  // Garbage past the old struct_size is not read.
  j.nodes = reinterpret_cast<const epd_node_t*>(0x1);
  j.num_nodes = -7;
  j.struct_size = offsetof(epd_join_options_t, nodes);
  epd_endpoint_t* ep = nullptr;
  ASSERT_EQ(epd_client_join(client_, &j, &ep), EPD_OK) << epd_last_error();
  epd_endpoint_destroy(ep);
  j.struct_size = offsetof(epd_join_options_t, nodes) - 1;
  ExpectRefused(j, "epd_join_options_t.struct_size=");
}

// epd_join_options_t.transport is the spec's transport: the daemon sees it (and refuses it
// on a group without nodes, or a name that is no transport); a caller built before the
// field joins with each daemon's default.
TEST_F(CApiNodesTest, TransportReachesTheSpec) {
  epd_join_options_t j = Join("transport");
  j.transport = "rdma";
  ExpectRefused(j, "spec.transport: \"rdma\" is set for a group without nodes");
  epd_node_t nodes[2] = {{"127.0.0.1:1", 1}, {"127.0.0.1:2", 1}};
  j.num_ranks = 2;
  j.nodes = nodes;
  j.num_nodes = 2;
  j.transport = "udp";
  ExpectRefused(j, "spec.transport: \"udp\" is not a transport");
  const std::string long_name(40, 't');
  j.transport = long_name.c_str();
  ExpectRefused(j, "options.transport");
  j.transport = "tc\xffp";
  ExpectRefused(j, "not valid UTF-8");
  // Before the field: garbage past the older struct_size is not read; "" = the default.
  epd_join_options_t old = Join("transport-old");
  old.transport = reinterpret_cast<const char*>(0x1);
  old.struct_size = offsetof(epd_join_options_t, transport);
  epd_endpoint_t* ep = nullptr;
  ASSERT_EQ(epd_client_join(client_, &old, &ep), EPD_OK) << epd_last_error();
  epd_endpoint_destroy(ep);
  epd_join_options_t empty = Join("transport-empty");
  empty.transport = "";
  ep = nullptr;
  ASSERT_EQ(epd_client_join(client_, &empty, &ep), EPD_OK) << epd_last_error();
  epd_endpoint_destroy(ep);
}

TEST_F(CApiNodesTest, AnEmptyNodeListIsAOneNodeGroup) {
  epd_join_options_t j = Join("no-nodes");
  epd_endpoint_t* ep = nullptr;
  ASSERT_EQ(epd_client_join(client_, &j, &ep), EPD_OK) << epd_last_error();
  epd_endpoint_destroy(ep);
}

TEST_F(CApiNodesTest, PeerAddressIsEmptyWithoutAPeerListener) {
  char buf[64] = "garbage";
  size_t length = 99;
  ASSERT_EQ(epd_client_peer_address(client_, buf, sizeof(buf), &length), EPD_OK)
      << epd_last_error();
  EXPECT_STREQ(buf, "");
  EXPECT_EQ(length, 0u);
  EXPECT_EQ(epd_client_peer_address(client_, nullptr, 0, &length), EPD_OUT_OF_RANGE);
  EXPECT_THAT(epd_last_error(), HasSubstr("1 bytes are needed"));
  EXPECT_EQ(epd_client_peer_address(nullptr, buf, sizeof(buf), nullptr), EPD_INVALID_ARGUMENT);
  EXPECT_THAT(epd_last_error(), HasSubstr("client is NULL"));
}

}  // namespace
}  // namespace epd

namespace epd {
namespace {

TEST_F(CApiNodesTest, CppJoinChecksEveryPeerAddressBeforeSending) {
  ClientOptions options;
  options.socket_path = socket_;
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  JoinOptions join;
  join.spec = testing::MakeSpec("cpp-nodes", {.num_ranks = 2});
  SetNodes(&join.spec, {{"127.0.0.1:1", 1}, {"bad\xc3(:2", 1}});
  absl::Status status = (*client)->Join(join).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("JoinOptions::spec.nodes[1].peer_address"));
  EXPECT_THAT(status.message(), HasSubstr("not valid UTF-8"));
  join.spec.mutable_nodes(1)->set_peer_address(std::string("a\0b", 3));
  EXPECT_THAT((*client)->Join(join).status().message(), HasSubstr("NUL byte"));
  join.spec.mutable_nodes(1)->set_peer_address(std::string(256, 'h'));
  EXPECT_THAT((*client)->Join(join).status().message(), HasSubstr("at most 255"));
}

}  // namespace
}  // namespace epd
