// `epctl doctor` (doctor_command.cc): its flags (--standalone, --peers, --peer_timeout,
// --daemon_config, --sysfs_root) and its run.
#pragma once

#include <set>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace epd::epctl {

/// Checks the doctor's flags for `command` (the epctl command given) before anything runs:
/// for another command, a doctor flag given (--standalone, --peers, --peer_timeout,
/// --daemon_config, --sysfs_root) is refused; for doctor, --daemon_config without
/// --standalone, a --peer_timeout outside (0, 1m], an empty --peers or an entry that is not
/// host:port, and a --sysfs_root that is not a directory. Prints why on stderr and returns
/// 2 (a usage error), or -1 when the arguments are good. `given`: the names of the flags the
/// command line gave (without "--"; "standalone" for --nostandalone too).
int CheckDoctorArguments(absl::string_view command, const std::set<std::string>& given);

/// Runs the doctor against the epd at `target` (a ChannelTarget), or with --standalone
/// without one, prints the table (or JSON) on stdout and returns the exit code: 0 when no
/// check failed, 1 when one did (also when the daemon does not answer), 2 for a bad
/// --daemon_config.
int RunDoctor(const std::string& target, bool json, absl::Duration timeout);

}  // namespace epd::epctl
