// epd's version, one definition for the daemon (GetStats, --version) and its tools.
#pragma once

namespace epd {

/// epd's version string ("MAJOR.MINOR.PATCH"), reported by GetStats and by the --version
/// of epd and epctl.
inline constexpr char kEpdVersion[] = "0.1.0";

}  // namespace epd
