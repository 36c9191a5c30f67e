// Client-supplied text made safe to echo: the one way a log line or an error message
// names a string a client sent that is not yet validated (a group name, a client_name, a
// session id, a gpu_uuid, a client_version).
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace epd {

/// Most bytes of one client-supplied string that a log line or an error message echoes
/// (EscapeClientText): a group name is at most 64 bytes when valid, and a client may send
/// up to max_request_bytes (4 MiB by default).
inline constexpr size_t kMaxEchoedClientBytes = 128;

/// A client-supplied string (group name, client_name, session id, gpu_uuid) made safe to
/// write into a log line or echo in an error message: the first `max_bytes` bytes with
/// every control, non-ASCII, quote and backslash byte escaped C-style ("\n", "\x1b",
/// "\\", "\""), so no raw newline, escape sequence or quote-closing byte gets through;
/// a longer string is cut there and gets "...(N bytes)" with its full length. The result
/// is printable ASCII, at most 4 * max_bytes + 32 bytes long. Every log line and error
/// message that names a client string not yet validated goes through this.
std::string EscapeClientText(absl::string_view text, size_t max_bytes = kMaxEchoedClientBytes);

/// The length of the well-formed UTF-8 sequence at the start of `text` (non-empty), or 0
/// when it starts with a byte that does not begin one (no overlong forms, surrogates or
/// code points past U+10FFFF).
size_t Utf8SequenceLength(absl::string_view text);

/// The length of the longest prefix of `text` that is well-formed UTF-8 (as
/// Utf8SequenceLength): text.size() when all of it is.
size_t ValidUtf8Prefix(absl::string_view text);

}  // namespace epd
