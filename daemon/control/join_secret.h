// JoinSecret: a group's join secret (JoinGroupRequest.join_secret) as the registry keeps it:
// in a fixed array inside the group (no heap copies left behind by reallocation), compared
// in time independent of its contents and length, and wiped when the group is destroyed.
// docs/SECURITY.md "Groups, owners, secrets, quotas" says what it protects.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <string_view>

namespace epd {

/// Most bytes a join secret may have (JoinGroupRequest.join_secret).
inline constexpr size_t kMaxJoinSecretBytes = 256;

class JoinSecret {
 public:
  /// No secret (the group admits its owner's uid only).
  JoinSecret() = default;
  ~JoinSecret() { Wipe(); }
  JoinSecret(const JoinSecret&) = delete;
  JoinSecret& operator=(const JoinSecret&) = delete;

  /// Replaces the secret with `bytes` (empty = none). Bytes past kMaxJoinSecretBytes are
  /// not kept; the registry refuses such a secret before it gets here.
  void Set(std::string_view bytes) {
    Wipe();
    size_ = std::min(bytes.size(), kMaxJoinSecretBytes);
    std::memcpy(bytes_.data(), bytes.data(), size_);
  }

  /// Whether a (non-empty) secret is set.
  bool set() const { return size_ != 0; }

  /// Whether `presented` is exactly this secret (both empty counts as equal). Reads all
  /// kMaxJoinSecretBytes of both whatever they hold, so the time taken tells nothing about
  /// where they differ or how long the secret is. `presented` longer than
  /// kMaxJoinSecretBytes never matches.
  bool Matches(std::string_view presented) const {
    if (presented.size() > kMaxJoinSecretBytes) return false;
    unsigned char diff = size_ == presented.size() ? 0 : 1;
    for (size_t i = 0; i < kMaxJoinSecretBytes; ++i) {
      const unsigned char p = i < presented.size() ? static_cast<unsigned char>(presented[i]) : 0;
      diff |= static_cast<unsigned char>(bytes_[i] ^ p);
    }
    return diff == 0;
  }

 private:
  void Wipe() {
    // Through a volatile pointer, so the stores are not dropped as dead before destruction.
    volatile unsigned char* p = bytes_.data();
    for (size_t i = 0; i < bytes_.size(); ++i) p[i] = 0;
    size_ = 0;
  }

  std::array<unsigned char, kMaxJoinSecretBytes> bytes_{};  ///< Zero past size_.
  size_t size_ = 0;
};

}  // namespace epd
