// TransportSet: the transports a daemon can run for groups that span nodes, by name
// ("tcp", "rdma"), its default (DaemonConfig.transport), and why each transport it cannot
// run is missing (the preflight's line or the start error). A group's spec.transport ("" =
// the default) picks one at join; a transport this daemon cannot run is refused there.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epd::transport {

class Transport;

class TransportSet {
 public:
  /// Adds `transport` under `name`; not owned, must outlive the set's users.
  void Add(std::string name, Transport* transport);
  /// Records why `name` cannot run on this daemon (one line saying what to change).
  void SetUnavailable(std::string name, std::string reason);
  /// The transport of a spec that names none (DaemonConfig.transport).
  void set_default_name(std::string name) { default_name_ = std::move(name); }
  const std::string& default_name() const { return default_name_; }

  /// Names of the transports this daemon can run, in the order added.
  std::vector<std::string> names() const;
  /// `requested` with "" replaced by the default name.
  std::string Resolve(absl::string_view requested) const;
  /// The transport for a group of `group_name` whose spec.transport is `requested`.
  /// FAILED_PRECONDITION naming spec.transport, the group and why this daemon cannot run it.
  absl::StatusOr<Transport*> Find(absl::string_view requested, absl::string_view group_name) const;

 private:
  std::vector<std::pair<std::string, Transport*>> transports_;
  std::vector<std::pair<std::string, std::string>> unavailable_;
  std::string default_name_ = "tcp";
};

}  // namespace epd::transport
