// Config reload (SIGHUP, `epctl reload`; docs/OPERATIONS.md "Reloading the configuration"):
// which DaemonConfig fields a running epd takes without a restart, and the difference
// between the running config and a newly read one, field by field.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "epd/v1/config.pb.h"

namespace epd {

/// The DaemonConfig fields a reload applies to a running epd (their text-format names):
/// log_level, the quotas (max_groups, max_groups_per_uid, max_endpoints_per_uid,
/// max_endpoint_bytes_per_uid, max_sessions_per_uid, max_connections_per_uid) and
/// metrics_listen (the listener is started, stopped or moved). Every other field, including
/// any added to config.proto later, needs a restart.
absl::Span<const char* const> LiveConfigFields();

/// True when `field` (a name as ConfigDiff lists it) is in LiveConfigFields().
bool IsLiveConfigField(absl::string_view field);

/// The fields that differ between two filled configs, by name ("log_level"; a field of a
/// nested message as "rdma.qps_per_peer"), in config.proto's field order.
struct ConfigDiff {
  std::vector<std::string> live;     ///< Differ, and a reload applies them.
  std::vector<std::string> refused;  ///< Differ, and only a restart applies them.
  bool empty() const { return live.empty() && refused.empty(); }
};

/// The names (as ConfigDiff lists them) of the fields that differ between `a` and `b`, live
/// or not, in config.proto's field order; compared as DiffDaemonConfig compares.
std::vector<std::string> DifferingConfigFields(const v1::DaemonConfig& a,
                                               const v1::DaemonConfig& b);

/// Compares `running` with `next` (both filled by ResolveDaemonConfig), field by field
/// through the proto's descriptor: a field present in one and absent in the other differs;
/// repeated fields differ when any element or the count does.
ConfigDiff DiffDaemonConfig(const v1::DaemonConfig& running, const v1::DaemonConfig& next);

/// Field `field` of `config` (a name as ConfigDiff lists it) in text format, for log lines:
/// `log_level: "debug"`, `rdma { qps_per_peer: 4 }`; "<name> unset" when absent.
std::string ConfigFieldText(const v1::DaemonConfig& config, absl::string_view field);

/// `running` with the live fields of `next` copied in (every other field as it runs): the
/// config a reload leaves in effect.
v1::DaemonConfig WithLiveFields(const v1::DaemonConfig& running, const v1::DaemonConfig& next);

}  // namespace epd
