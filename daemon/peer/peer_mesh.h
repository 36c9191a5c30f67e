// PeerMesh: the daemon's side of the Peer service (proto/epd/v1/peer.proto) as the data
// plane sees it. A group that spans nodes registers here on this daemon; the mesh finds
// the same group on every other node's daemon (rendezvous over gRPC, authenticated and
// version-checked), hands over each side's transport descriptor, watches the peers'
// liveness, and tells them when the group is torn down here. docs/DESIGN.md §5.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/v1/control.pb.h"

namespace epd::peer {

/// One group at this daemon, as registered with the mesh.
struct GroupMembership {
  v1::GroupSpec spec;     ///< Validated; spec.nodes().size() >= 2.
  int32_t self_node = 0;  ///< The node this daemon is for the group.
  /// This node's GroupLink::LocalDescriptor (opaque to the mesh), for every peer node when
  /// `transport_descriptors` is empty.
  std::string transport_descriptor;
  /// Empty, or one entry per node of the spec: entry i (GroupLink::LocalDescriptorFor(i))
  /// is handed to node i alone (the own node's entry is unused).
  std::vector<std::string> transport_descriptors;
  /// PeerMesh::JoinSecretDigest of the group's join secret at this node. A peer node that
  /// registered the group with a different one is a mismatch (FAILED_PRECONDITION naming
  /// "join_secret"): ranks on two nodes form a group only if they presented the same secret.
  std::string join_secret_digest;
  /// Compares this node's transport descriptor with a peer node's at rendezvous
  /// (Transport::CompareDescriptorSettings, the nodes named "node 0 (10.0.0.1:7300)"); an
  /// error is a mismatch (the group is refused at that peer, FAILED_PRECONDITION). Called
  /// with the mesh's lock held: cheap, no call back in. Empty = no comparison.
  std::function<absl::Status(std::string_view ours, std::string_view theirs,
                             std::string_view our_node, std::string_view their_node)>
      compare_descriptors;
  /// Called (from a mesh thread) when something changed that the group's engine waits
  /// for: a peer's descriptor arrived, a peer was lost or left. Cheap; no call back in.
  std::function<void()> wake;
};

/// A peer node's registration of the group.
struct PeerDescriptor {
  uint64_t incarnation = 0;  ///< Changes each time that daemon registers the group anew.
  std::string transport;     ///< Its GroupLink::LocalDescriptor (opaque bytes).
};

/// The group's view of its peer nodes. Thread-safe. Destroying it tears the group down
/// at this node: the peers are told (their ops of the group fail at once, naming this
/// node) and the mesh forgets the group.
class GroupPeers {
 public:
  virtual ~GroupPeers() = default;
  /// Node `node`'s transport descriptor, once its daemon registered the same group with
  /// the same spec; nullopt before that. A daemon that restarts (or tears the group down
  /// and registers it again) comes back with a new incarnation: the data plane then
  /// rebuilds its link to that node between ops (the group re-forms).
  virtual std::optional<PeerDescriptor> Descriptor(int32_t node) const = 0;
  /// OK while every peer node is registered (or still expected) and alive. Once a peer
  /// is lost (its daemon died, stopped answering for the liveness bound, tore the group
  /// down, or presented a different spec), UNAVAILABLE (FAILED_PRECONDITION for a spec
  /// mismatch) naming the node, its address and its ranks; OK again once that node
  /// registers the group anew (a new incarnation).
  virtual absl::Status Health() const = 0;
  /// Nodes whose daemon has not registered the group yet, with their ranks, for an op's
  /// DEADLINE_EXCEEDED message ("node 1 (10.0.0.2:7100, ranks 4-7) has not joined");
  /// empty when all did.
  virtual std::string DescribeMissing() const = 0;
  /// This node's joined local ranks (a bit per local rank), published to the peers so
  /// that their errors can name the ranks missing here.
  virtual void SetLocalRanksJoined(const std::vector<bool>& joined) = 0;
};

/// "ranks 4-7" / "rank 4": the ranks of a node, for messages.
std::string RankRangeText(int32_t first_rank, int32_t num_ranks);

/// The daemon-wide mesh. Thread-safe.
class PeerMesh {
 public:
  virtual ~PeerMesh() = default;
  /// Registers `membership`'s group. Errors: ALREADY_EXISTS (registered here already),
  /// INVALID_ARGUMENT (self_node out of range), UNAVAILABLE (the mesh is shutting down).
  virtual absl::StatusOr<std::unique_ptr<GroupPeers>> RegisterGroup(GroupMembership membership) = 0;
  /// This daemon's advertised Peer address ("host:port"), as a client puts it in a
  /// spec's NodeSpec.peer_address; "" when the Peer listener is off.
  virtual std::string advertised_address() const = 0;
  /// The digest of group `group`'s join secret (empty = none) that peers compare at
  /// rendezvous (GroupMembership.join_secret_digest): keyed with the cluster's secret, so
  /// it tells nothing about the join secret to one who does not know both.
  virtual std::string JoinSecretDigest(std::string_view group, std::string_view join_secret) const {
    (void)group;
    (void)join_secret;
    return {};
  }
  /// Every node of the registered group `group` as this daemon sees it (ListGroups);
  /// empty when the group is not registered here.
  virtual std::vector<v1::GroupNodeInfo> NodeStatuses(const std::string& group) const {
    (void)group;
    return {};
  }
};

}  // namespace epd::peer
