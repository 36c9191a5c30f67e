// A fault-injecting transport wrapping any other (DESIGN.md §5): per peer node it drops
// writes, delays them, resets the link, or partitions nodes from each other, so that the
// data plane's failure handling is tested without broken hardware. Controlled from tests
// through FaultTransport, and from a real epd process through a text spec (ParseFaultPlan).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/transport/transport.h"

namespace epd::transport {

/// Faults toward one peer node; an unset field means "none" (or, in FaultPlan::per_node,
/// "as FaultPlan::all").
struct PeerFaults {
  /// Every write waits this long before it is posted to the wrapped link (order kept).
  std::optional<int64_t> delay_ms;
  /// The first N writes pass; every later one vanishes (PostWrite answers OK, the peer never
  /// sees its bytes nor its immediate; WritesCompleted counts it once the passed ones did).
  std::optional<int64_t> drop_after_writes;
  /// The first N writes pass; the next PostWrite fails the link to the peer instead (the
  /// wrapped link's FailPeer: its connections close, so the peer sees a failure too).
  /// 0: the first PostWrite does.
  std::optional<int64_t> reset_after_writes;
};

/// What FaultTransport injects.
struct FaultPlan {
  PeerFaults all;                          ///< Toward every peer.
  std::map<int32_t, PeerFaults> per_node;  ///< Overrides of `all` per peer node.
  /// Sides of a partition: a node of one side cannot reach a node of another, either way
  /// (PostWrite answers UNAVAILABLE, no immediate arrives; after `partition_fail_after`
  /// the link to it fails for good). Nodes on no side reach everyone.
  std::vector<std::vector<int32_t>> partition;
  std::chrono::milliseconds partition_fail_after{200};

  /// The faults toward `node`: per_node's fields over `all`'s.
  PeerFaults For(int32_t node) const;
  /// True when `a` and `b` are on different sides of `partition`.
  bool Partitioned(int32_t a, int32_t b) const;
  /// The plan as a spec ParseFaultPlan reads back.
  std::string ToString() const;
};

/// Parses a fault spec: items separated by ';', each KEY=VALUE, optionally followed by
/// ":node=N" to apply to peer node N only. Keys: delay_ms, drop_after_writes,
/// reset_after_writes (integers >= 0; per node or all), partition (sides separated by '|',
/// nodes of a side by ','; e.g. "0,1|2,3"), partition_fail_ms (> 0). E.g.
/// "delay_ms=5;drop_after_writes=3:node=1;reset_after_writes=10;partition=0|1". "" = no
/// faults. INVALID_ARGUMENT naming the item and what is wrong.
absl::StatusOr<FaultPlan> ParseFaultPlan(std::string_view spec);

/// The wrapper. Thread-safe. Its links serialize their calls into the wrapped link (the
/// engine thread and the wrapper's timer thread, which posts delayed writes and fails
/// partitioned peers, calling the link's wake).
class FaultTransport : public Transport {
 public:
  ~FaultTransport() override = default;
  /// Replaces the plan of every link, existing and future (counts of writes so far are
  /// kept; a partition's bound starts when the plan puts a node behind it).
  virtual void SetPlan(FaultPlan plan) = 0;
  virtual FaultPlan plan() const = 0;
  /// Fails the link of group `group` to `node` now (as reset_after_writes would).
  /// NOT_FOUND when no live link of that group exists here.
  virtual absl::Status ResetPeer(std::string_view group, int32_t node) = 0;
};

/// Wraps `inner` (not null). The plan applies from the first link.
std::unique_ptr<FaultTransport> MakeFaultTransport(std::unique_ptr<Transport> inner,
                                                   FaultPlan plan);

}  // namespace epd::transport
