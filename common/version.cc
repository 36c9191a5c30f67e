#include "common/version.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/client_text.h"
#include "common/errors/reason.h"

namespace epd {

absl::StatusOr<Version> ParseVersion(absl::string_view text) {
  absl::string_view core = text.substr(0, text.find_first_of("-+"));
  std::vector<absl::string_view> parts = absl::StrSplit(core, '.');
  Version version;
  int* fields[] = {&version.major, &version.minor, &version.patch};
  bool ok = parts.size() == 3;
  for (size_t i = 0; ok && i < 3; ++i) {
    ok = !parts[i].empty() && parts[i].find_first_not_of("0123456789") == absl::string_view::npos &&
         absl::SimpleAtoi(parts[i], fields[i]);
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("version \"",
                                                   EscapeClientText(text, kMaxEchoedVersionBytes),
                                                   "\" is not MAJOR.MINOR.PATCH (e.g. 0.1.0)"));
  }
  return version;
}

std::string CompatibleClientVersions(const Version& daemon) {
  const int oldest = std::max(0, daemon.minor - kClientMinorsBehind);
  return absl::StrCat(daemon.major, ".", oldest, ".x to ", daemon.major, ".", daemon.minor, ".x");
}

bool ClientVersionCompatible(const Version& client, const Version& daemon) {
  return client.major == daemon.major && client.minor <= daemon.minor &&
         client.minor >= daemon.minor - kClientMinorsBehind;
}

absl::Status CheckClientVersion(absl::string_view client_version,
                                absl::string_view daemon_version) {
  if (client_version.empty()) return absl::OkStatus();
  absl::StatusOr<Version> daemon = ParseVersion(daemon_version);
  if (!daemon.ok()) return daemon.status();
  absl::StatusOr<Version> client = ParseVersion(client_version);
  if (!client.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SessionRequest.client_version: ", client.status().message()));
  }
  if (ClientVersionCompatible(*client, *daemon)) return absl::OkStatus();
  return errors::WithReason(
      absl::FailedPreconditionError(
          absl::StrCat("client version ", EscapeClientText(client_version, kMaxEchoedVersionBytes),
                       " is not served by epd ", daemon_version, ", which serves clients ",
                       CompatibleClientVersions(*daemon), "; ",
                       client->major != daemon->major || client->minor > daemon->minor
                           ? "upgrade epd on this node or run the client release that matches it"
                           : "upgrade the client (libepdclient / the epd Python package)",
                       " (docs/DEPLOYMENT.md \"Versions and upgrades\")")),
      errors::Reason::kVersionIncompatible);
}

}  // namespace epd
