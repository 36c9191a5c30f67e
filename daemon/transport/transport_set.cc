#include "daemon/transport/transport_set.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"

namespace epd::transport {

void TransportSet::Add(std::string name, Transport* transport) {
  transports_.emplace_back(std::move(name), transport);
}

void TransportSet::SetUnavailable(std::string name, std::string reason) {
  unavailable_.emplace_back(std::move(name), std::move(reason));
}

std::vector<std::string> TransportSet::names() const {
  std::vector<std::string> names;
  for (const auto& [name, t] : transports_) names.push_back(name);
  return names;
}

std::string TransportSet::Resolve(absl::string_view requested) const {
  return requested.empty() ? default_name_ : std::string(requested);
}

absl::StatusOr<Transport*> TransportSet::Find(absl::string_view requested,
                                              absl::string_view group_name) const {
  const std::string name = Resolve(requested);
  for (const auto& [n, t] : transports_) {
    if (n == name) return t;
  }
  std::string why;
  for (const auto& [n, reason] : unavailable_) {
    if (n == name) why = reason;
  }
  if (why.empty()) why = absl::StrCat("\"", name, "\" is not started on this daemon");
  const std::string which =
      requested.empty()
          ? absl::StrCat("spec.transport: \"\" (this daemon's default \"", name, "\")")
          : absl::StrCat("spec.transport: \"", name, "\"");
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          which, ": group \"", group_name, "\" needs a transport this daemon cannot run (it runs: ",
          transports_.empty() ? "none" : absl::StrJoin(names(), ", "), "): ", why)),
      errors::Reason::kTransportMismatch);
}

}  // namespace epd::transport
