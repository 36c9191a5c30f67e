// GroupSpec.nodes: the rules of a group that spans nodes (ValidateGroupSpec), the diff of
// the repeated field, the node of a rank, and the cuda backend's kernel limits on spanning specs.
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/control/spec_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/specs.h"

namespace epd {
namespace {

using ::epd::testing::MakeSpec;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::GroupSpec Spanning(std::initializer_list<std::pair<const char*, int>> nodes) {
  int total = 0;
  for (const auto& n : nodes) total += n.second;
  v1::GroupSpec spec = MakeSpec("g", {.num_ranks = total, .num_experts = 4 * total});
  for (const auto& [address, ranks] : nodes) {
    v1::NodeSpec* node = spec.add_nodes();
    node->set_peer_address(address);
    node->set_num_ranks(ranks);
  }
  return spec;
}

TEST(SpecNodesTest, GoodSpecs) {
  EXPECT_TRUE(ValidateGroupSpec(MakeSpec("g")).ok());  // No nodes: one node.
  EXPECT_TRUE(ValidateGroupSpec(Spanning({{"10.0.0.1:7100", 2}, {"10.0.0.2:7100", 3}})).ok());
  EXPECT_TRUE(ValidateGroupSpec(Spanning({{"node-a.cluster:1", 1}, {"[fe80::1]:65535", 1}})).ok());
  // One entry is allowed: a one-node group.
  v1::GroupSpec one = Spanning({{"10.0.0.1:7100", 2}});
  EXPECT_TRUE(ValidateGroupSpec(one).ok());
  EXPECT_FALSE(SpansNodes(one));
  EXPECT_TRUE(SpansNodes(Spanning({{"a:1", 1}, {"b:1", 1}})));
}

TEST(SpecNodesTest, BadNodesAreNamed) {
  struct Case {
    v1::GroupSpec spec;
    std::string field;
    std::string value;
  };
  v1::GroupSpec sum = Spanning({{"a:1", 1}, {"b:1", 1}});
  sum.set_num_ranks(4);
  sum.set_num_experts(16);
  v1::GroupSpec too_many = MakeSpec("g", {.num_ranks = 4097, .num_experts = 4097});
  for (int i = 0; i < 4097; ++i) {
    v1::NodeSpec* n = too_many.add_nodes();
    n->set_peer_address(absl::StrCat("h", i, ":1"));
    n->set_num_ranks(1);
  }
  too_many.set_num_ranks(4096);  // Stays in range so that the nodes rule is the one hit.
  too_many.set_num_experts(4096);
  for (const Case& c : std::vector<Case>{
           {Spanning({{"a:1", 1}, {"", 1}}), "nodes[1].peer_address", "not host:port"},
           {Spanning({{"a:1", 1}, {"b", 1}}), "nodes[1].peer_address", "\"b\""},
           {Spanning({{"a:1", 1}, {"b:0", 1}}), "nodes[1].peer_address", "b:0"},
           {Spanning({{"a:1", 1}, {"b:65536", 1}}), "nodes[1].peer_address", "b:65536"},
           {Spanning({{"a:1", 1}, {"b c:1", 1}}), "nodes[1].peer_address", "b c:1"},
           {Spanning({{"a:1", 1}, {"-b:1", 1}}), "nodes[1].peer_address", "-b:1"},
           {Spanning({{"a:1", 1}, {"[zz]:1", 1}}), "nodes[1].peer_address", "[zz]:1"},
           {Spanning({{"a:1", 1}, {"a:1", 1}}), "nodes[1].peer_address", "listed twice"},
           {Spanning({{"a:1", 2}, {"b:1", 0}}), "nodes[1].num_ranks", "0"},
           {sum, "spec.nodes", "num_ranks 4"},
           {too_many, "spec.nodes", "4097"},
       }) {
    absl::Status status = ValidateGroupSpec(c.spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field << " " << c.value;
    EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr(c.field), HasSubstr(c.value)));
  }
  v1::GroupSpec long_address = Spanning({{"a:1", 1}, {"b:1", 1}});
  long_address.mutable_nodes(1)->set_peer_address(std::string(300, 'h') + ":1");
  EXPECT_THAT(ValidateGroupSpec(long_address).message(), HasSubstr("...(302 bytes)"));
}

TEST(SpecNodesTest, NodeOfRank) {
  v1::GroupSpec spec = Spanning({{"a:1", 2}, {"b:1", 3}, {"c:1", 1}});
  int32_t first = -1;
  EXPECT_EQ(NodeOfRank(spec, 0, &first), 0);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(NodeOfRank(spec, 4, &first), 1);
  EXPECT_EQ(first, 2);
  EXPECT_EQ(NodeOfRank(spec, 5, &first), 2);
  EXPECT_EQ(first, 5);
  EXPECT_EQ(NodeOfRank(spec, 6), -1);
  EXPECT_EQ(NodeOfRank(spec, -1), -1);
}

TEST(SpecNodesTest, DiffNamesTheNodes) {
  v1::GroupSpec a = Spanning({{"a:1", 2}, {"b:1", 2}});
  v1::GroupSpec b = a;
  b.mutable_nodes(1)->set_peer_address("c:1");
  std::vector<std::string> diffs = DiffGroupSpecs(a, b);
  ASSERT_EQ(diffs.size(), 1u);
  EXPECT_THAT(diffs[0], AllOf(HasSubstr("nodes: live=[#1 {"), HasSubstr("b:1"),
                              HasSubstr("requested=[#1 {"), HasSubstr("c:1")));
  v1::GroupSpec c = a;
  c.clear_nodes();
  EXPECT_THAT(CheckSameSpec(a, c).message(),
              HasSubstr("nodes: live=[2 entries] requested=[0 entries]"));
  EXPECT_TRUE(CheckSameSpec(a, a).ok());
  EXPECT_THAT(SpecSummary(a), HasSubstr("nodes=2"));
  EXPECT_THAT(SpecSummary(MakeSpec("g")), ::testing::Not(HasSubstr("nodes")));
}

TEST(SpecNodesTest, TransportIsNamedAndOnlyForSpanningGroups) {
  v1::GroupSpec spec = Spanning({{"a:1", 2}, {"b:1", 2}});
  for (const char* t : {"", "tcp", "rdma"}) {
    spec.set_transport(t);
    EXPECT_TRUE(ValidateGroupSpec(spec).ok()) << t;
  }
  spec.set_transport("udp");
  absl::Status bad = ValidateGroupSpec(spec);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), AllOf(HasSubstr("spec.transport"), HasSubstr("\"udp\"")));
  v1::GroupSpec one = MakeSpec("g");
  one.set_transport("tcp");
  EXPECT_THAT(ValidateGroupSpec(one).message(), HasSubstr("without nodes"));
  v1::GroupSpec a = Spanning({{"a:1", 2}, {"b:1", 2}});
  v1::GroupSpec b = a;
  b.set_transport("rdma");
  EXPECT_THAT(CheckSameSpec(a, b).message(), HasSubstr("transport"));
}

TEST(SpecNodesTest, CudaTakesSpanningSpecsWithinItsKernelLimits) {
  v1::GroupSpec spec = Spanning({{"a:1", 2}, {"b:1", 2}});
  EXPECT_TRUE(ValidateGroupSpecForBackend(spec, "host").ok());
  EXPECT_TRUE(ValidateGroupSpecForBackend(spec, "cuda").ok());
  EXPECT_TRUE(ValidateGroupSpecForBackend(Spanning({{"a:1", 4}}), "cuda").ok());
  // The kernels' limits hold across nodes as on one node: 65 ranks are too many for cuda.
  v1::GroupSpec big = Spanning({{"a:1", 33}, {"b:1", 32}});
  absl::Status cuda = ValidateGroupSpecForBackend(big, "cuda");
  EXPECT_EQ(cuda.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cuda.message(), HasSubstr("num_ranks"));
  EXPECT_TRUE(ValidateGroupSpecForBackend(big, "host").ok());
}

}  // namespace
}  // namespace epd
