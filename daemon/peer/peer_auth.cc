#include "daemon/peer/peer_auth.h"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "daemon/control/spec_validation.h"
#include "daemon/core/keyed_mac.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace epd::peer {
namespace {

constexpr char kHelloLabel[] = "epd-peer-hello-v1";
constexpr char kSessionLabel[] = "epd-peer-session-v1";
constexpr char kJoinSecretLabel[] = "epd-join-secret-v1";

std::string Mac(absl::string_view key, absl::string_view label,
                std::initializer_list<absl::string_view> parts) {
  return LabelledHmacSha256(key, label, parts);
}

/// The host part of a daemon id ("host:port", "[v6]:port"), without brackets.
std::string DaemonIdHost(absl::string_view daemon_id) {
  absl::string_view host = daemon_id.substr(0, std::min(daemon_id.rfind(':'), daemon_id.size()));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::string(host);
}

/// Whether a certificate name (a DNS name, "*.example.com" matching one leftmost label, or
/// an IP address in any textual form) names `host`.
bool CertNameMatches(absl::string_view name, absl::string_view host) {
  in6_addr a{}, b{};
  const std::string n(name), h(host);
  for (int family : {AF_INET, AF_INET6}) {
    if (::inet_pton(family, n.c_str(), &a) == 1) {
      return ::inet_pton(family, h.c_str(), &b) == 1 &&
             std::memcmp(&a, &b, family == AF_INET ? 4 : 16) == 0;
    }
  }
  if (absl::EqualsIgnoreCase(name, host)) return true;
  if (!absl::StartsWith(name, "*.")) return false;
  const size_t dot = host.find('.');
  return dot != absl::string_view::npos && dot > 0 &&
         absl::EqualsIgnoreCase(name.substr(1), host.substr(dot));
}

}  // namespace

absl::Status CheckPeerCertificateNames(absl::string_view daemon_id,
                                       const std::vector<std::string>& sans,
                                       const std::vector<std::string>& common_names) {
  const std::string host = DaemonIdHost(daemon_id);
  const std::vector<std::string>& names = sans.empty() ? common_names : sans;
  for (const std::string& name : names) {
    if (CertNameMatches(name, host)) return absl::OkStatus();
  }
  std::vector<std::string> shown;
  for (const std::string& name : names) shown.push_back(EscapeClientText(name));
  return errors::WithReason(
      absl::PermissionDeniedError(absl::StrCat(
          "daemon id \"", EscapeClientText(daemon_id), "\" names host \"", EscapeClientText(host),
          "\", but the caller's TLS certificate is for ",
          names.empty() ? std::string("no name")
                        : absl::StrCat(sans.empty() ? "common name " : "subject alternative names ",
                                       absl::StrJoin(shown, ", ")),
          " (a daemon must advertise a host its certificate names)")),
      errors::Reason::kPeerAuthFailed);
}

std::string HelloProof(absl::string_view secret, absl::string_view server_nonce,
                       absl::string_view client_nonce, absl::string_view daemon_id) {
  return Mac(secret, kHelloLabel, {server_nonce, client_nonce, daemon_id});
}

std::string SessionKey(absl::string_view secret, absl::string_view server_nonce,
                       absl::string_view client_nonce, absl::string_view daemon_id) {
  return Mac(secret, kSessionLabel, {server_nonce, client_nonce, daemon_id});
}

std::string JoinSecretDigest(absl::string_view secret, absl::string_view group,
                             absl::string_view join_secret) {
  return Mac(secret, kJoinSecretLabel, {group, join_secret});
}

std::string PeerRequestMac(absl::string_view session_key, absl::string_view method,
                           uint64_t counter,
                           const google::protobuf::Message& request_without_auth) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    request_without_auth.SerializeToCodedStream(&coded);
  }
  char counter_bytes[sizeof counter];
  std::memcpy(counter_bytes, &counter, sizeof counter);  // Little-endian hosts only.
  return Mac(session_key, method, {absl::string_view(counter_bytes, sizeof counter), bytes});
}

}  // namespace epd::peer
