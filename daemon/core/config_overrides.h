// Which DaemonConfig fields a command-line flag overrides the --config file for (DESIGN.md
// §3.1): the flag wins, at start-up and at every reload, and the daemon logs each such field
// (Daemon::Start, the reload path in daemon_ops.cc). The resolution itself is config.h's.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/core/config.h"
#include "epd/v1/config.pb.h"

namespace epd {

/// A field the --config file sets to another value than a command-line flag gives it: the
/// flag wins (at start-up and at every reload), the file's value is not applied.
struct ConfigFlagOverride {
  std::string field;       ///< As ConfigDiff names it: "log_level", "rdma.qps_per_peer".
  std::string flag;        ///< The flag that sets it: "--log_level".
  std::string file_value;  ///< The file's, ConfigFieldText: `log_level: "debug"`.
  std::string value;       ///< The one in effect (the flag's), the same way.
};

/// ResolveDaemonConfig's config, and the fields whose flag overrides the file's value (in
/// config.proto's field order; none without a --config file). Values are compared after
/// FillDaemonConfigDefaults, so a flag giving the file's own value (or "off" for "") is no
/// override.
struct ResolvedDaemonConfig {
  v1::DaemonConfig config;
  std::vector<ConfigFlagOverride> overridden;
};

/// ResolveDaemonConfig, with the fields a flag overrides the file for. Errors as
/// ResolveDaemonConfig.
absl::StatusOr<ResolvedDaemonConfig> ResolveDaemonConfigWithOverrides(const ConfigFlags& flags);

/// The command-line flag that sets DaemonConfig field `field` (a ConfigDiff name):
/// "--socket" for socket_path, "--op_timeout" for op_timeout_ms, "--rdma_devices" for
/// rdma.devices, else "--" and the field's name ("--log_level").
std::string FlagOfConfigField(absl::string_view field);

/// "log_level: set by --log_level on the command line (log_level: \"info\"); the config
/// file's value (log_level: \"debug\") is not applied": for log lines.
std::string ConfigFlagOverrideText(const ConfigFlagOverride& override_);

}  // namespace epd
