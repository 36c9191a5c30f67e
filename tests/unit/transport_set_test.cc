// TransportSet: a group's spec.transport ("" = the default) picks a transport by name; a
// name the daemon cannot run is FAILED_PRECONDITION naming spec.transport, the group, what
// the daemon runs and why.
#include "daemon/transport/transport_set.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd::transport {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(TransportSetTest, PicksByNameAndDefault) {
  // Only the pointers are compared; nothing is called on them.
  Transport* tcp = reinterpret_cast<Transport*>(0x1000);
  Transport* rdma = reinterpret_cast<Transport*>(0x2000);
  TransportSet set;
  set.Add("tcp", tcp);
  set.Add("rdma", rdma);
  EXPECT_THAT(set.names(), ElementsAre("tcp", "rdma"));
  EXPECT_EQ(*set.Find("", "g"), tcp);
  set.set_default_name("rdma");
  EXPECT_EQ(*set.Find("", "g"), rdma);
  EXPECT_EQ(*set.Find("tcp", "g"), tcp);
  EXPECT_EQ(set.Resolve(""), "rdma");
  EXPECT_EQ(set.Resolve("tcp"), "tcp");
}

TEST(TransportSetTest, AMissingTransportIsRefusedWithItsReason) {
  TransportSet set;
  set.Add("tcp", reinterpret_cast<Transport*>(0x1000));
  set.SetUnavailable("rdma", "RDMA: port mlx5_0:1 is DOWN, not ACTIVE; bring its link up");
  absl::StatusOr<Transport*> named = set.Find("rdma", "moe");
  EXPECT_EQ(named.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(named.status().message(),
              AllOf(HasSubstr("spec.transport: \"rdma\""), HasSubstr("group \"moe\""),
                    HasSubstr("(it runs: tcp)"), HasSubstr("mlx5_0:1 is DOWN")));
  set.set_default_name("rdma");
  EXPECT_THAT(set.Find("", "moe").status().message(),
              HasSubstr("spec.transport: \"\" (this daemon's default \"rdma\")"));
  TransportSet none;
  EXPECT_THAT(none.Find("tcp", "g").status().message(),
              AllOf(HasSubstr("(it runs: none)"), HasSubstr("\"tcp\" is not started")));
}

}  // namespace
}  // namespace epd::transport
