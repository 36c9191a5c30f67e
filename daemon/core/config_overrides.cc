// Flag-override detection (config_overrides.h).
#include "daemon/core/config_overrides.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "daemon/core/config_reload.h"

namespace epd {

absl::StatusOr<ResolvedDaemonConfig> ResolveDaemonConfigWithOverrides(const ConfigFlags& flags) {
  v1::DaemonConfig file;
  if (flags.config_path && !flags.config_path->empty()) {
    EPD_ASSIGN_OR_RETURN(file, LoadDaemonConfigFile(*flags.config_path));
  }
  ResolvedDaemonConfig resolved;
  EPD_ASSIGN_OR_RETURN(resolved.config, ResolveDaemonConfigFrom(file, flags));
  // The fields the file sets whose value the flags replaced. Both sides filled, so that
  // equal values spelt differently ("off" and "", "TCP" and "tcp") are not an override.
  const std::vector<std::string> set_by_file = DifferingConfigFields(v1::DaemonConfig(), file);
  v1::DaemonConfig file_filled = file;
  FillDaemonConfigDefaults(&file_filled);
  for (std::string& field : DifferingConfigFields(file_filled, resolved.config)) {
    if (std::find(set_by_file.begin(), set_by_file.end(), field) == set_by_file.end()) continue;
    ConfigFlagOverride override_;
    override_.flag = FlagOfConfigField(field);
    override_.file_value = ConfigFieldText(file_filled, field);
    override_.value = ConfigFieldText(resolved.config, field);
    override_.field = std::move(field);
    resolved.overridden.push_back(std::move(override_));
  }
  return resolved;
}

std::string FlagOfConfigField(absl::string_view field) {
  if (field == "socket_path") return "--socket";
  if (field == "op_timeout_ms") return "--op_timeout";
  absl::string_view rdma = field;
  if (absl::ConsumePrefix(&rdma, "rdma.")) return absl::StrCat("--rdma_", rdma);
  return absl::StrCat("--", field);
}

std::string ConfigFlagOverrideText(const ConfigFlagOverride& override_) {
  return absl::StrCat(override_.field, ": set by ", override_.flag, " on the command line (",
                      override_.value, "); the config file's value (", override_.file_value,
                      ") is not applied");
}

}  // namespace epd
