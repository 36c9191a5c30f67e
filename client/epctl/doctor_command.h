// `epctl doctor` (doctor_command.cc): its flags (--standalone, --peers, --peer_timeout,
// --daemon_config, --sysfs_root) and its run.
#pragma once

#include <string>

#include "absl/time/time.h"

namespace epd::epctl {

/// Runs the doctor against the epd at `target` (a ChannelTarget), or with --standalone
/// without one, prints the table (or JSON) on stdout and returns the exit code: 0 when no
/// check failed, 1 when one did (also when the daemon does not answer), 2 for a bad
/// --daemon_config.
int RunDoctor(const std::string& target, bool json, absl::Duration timeout);

}  // namespace epd::epctl
