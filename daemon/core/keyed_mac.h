// Keyed MACs shared by the daemon's authenticated protocols (the Peer service's handshake
// and call MACs, the TCP transport's link tokens): one labelled HMAC-SHA256 and one
// constant-time comparison, on libcrypto.
#pragma once

#include <initializer_list>
#include <string>

#include "absl/strings/string_view.h"

namespace epd {

/// HMAC-SHA256 under `key` of `label`, a 0 byte, then each of `parts` as its 4-byte
/// little-endian length and its bytes (so that no two inputs collide). 32 bytes.
std::string LabelledHmacSha256(absl::string_view key, absl::string_view label,
                               std::initializer_list<absl::string_view> parts);

/// Whether `a` and `b` are the same bytes, in a time that depends only on their sizes.
bool ConstantTimeEqual(absl::string_view a, absl::string_view b);

}  // namespace epd
