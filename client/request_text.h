// Checks of the text a client puts in a request's proto string fields: protobuf refuses to
// serialize a string field that is not UTF-8 (and the daemon would end the stream), so the
// client names the field itself, before anything is sent.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/client_text.h"

namespace epd::internal {

/// Longest ClientOptions::client_name sent, in bytes.
inline constexpr size_t kMaxClientNameBytes = 256;
/// Longest JoinOptions::gpu_uuid, in bytes (a UUID "GPU-..." or a PCI bus id is shorter).
inline constexpr size_t kMaxGpuUuidBytes = 63;
/// Longest NodeSpec.peer_address, in bytes (a "host:port" with a DNS name fits).
inline constexpr size_t kMaxPeerAddressBytes = 255;
/// Longest join secret, in bytes (docs/SECURITY.md "Groups, owners, secrets, quotas").
inline constexpr size_t kMaxJoinSecretBytes = 256;

/// The length of the longest prefix of `text` that is well-formed UTF-8 (common/client_text.h,
/// shared with the daemon's checks).
using ::epd::ValidUtf8Prefix;

/// INVALID_ARGUMENT naming `field` (and the text, escaped) unless `text` is UTF-8 with no NUL
/// byte and at most `max_bytes` bytes long.
absl::Status CheckRequestText(absl::string_view field, absl::string_view text, size_t max_bytes);

/// `text` with each byte that does not belong to well-formed UTF-8 replaced by '?'.
std::string SanitizeUtf8(absl::string_view text);

}  // namespace epd::internal
