// epd's version, one definition for the daemon (GetStats, --version) and its tools, and
// the rule for which client versions a daemon serves (checked at Session open).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epd {

/// epd's version string ("MAJOR.MINOR.PATCH"), reported by GetStats and by the --version
/// of epd and epctl, and sent by libepdclient at Session open.
inline constexpr char kEpdVersion[] = "0.1.0";

/// How many minor versions an older client may lag behind the daemon (same major): a
/// daemon x.M.* serves clients x.(M-kClientMinorsBehind).* through x.M.*, so a node's epd is
/// upgraded first and its clients follow within that many releases.
inline constexpr int kClientMinorsBehind = 2;

/// Most bytes of a version string that an error message, a log line or the audit log
/// echoes (escaped: EscapeClientText, common/client_text.h).
inline constexpr size_t kMaxEchoedVersionBytes = 64;

/// A parsed "MAJOR.MINOR.PATCH" (a pre-release or build suffix after '-' or '+' ignored).
struct Version {
  int major = 0;
  int minor = 0;
  int patch = 0;
};

/// Parses "1.2.3" (also "1.2.3-rc1", "1.2.3+abc"). INVALID_ARGUMENT naming `text` (its
/// first 64 bytes, escaped) when it is not three non-negative decimal numbers separated
/// by dots.
absl::StatusOr<Version> ParseVersion(absl::string_view text);

/// The client versions a daemon of `daemon` serves, as text: "0.0.x to 0.1.x".
std::string CompatibleClientVersions(const Version& daemon);

/// Whether a client of `client` may use a daemon of `daemon`: the same major, and the
/// client's minor between the daemon's minus kClientMinorsBehind and the daemon's (a
/// client newer than its daemon may send what the daemon does not know). Patch levels
/// never matter.
bool ClientVersionCompatible(const Version& client, const Version& daemon);

/// CheckClientVersion at Session open: OK for a compatible `client_version`, and for ""
/// (a client from before versions were exchanged). FAILED_PRECONDITION naming both
/// versions and the compatible range otherwise, or INVALID_ARGUMENT when
/// `client_version` does not parse. Either names `client_version` by at most its first 64
/// bytes, escaped (EscapeClientText): the message is safe to log and to send back.
absl::Status CheckClientVersion(absl::string_view client_version,
                                absl::string_view daemon_version = kEpdVersion);

}  // namespace epd
