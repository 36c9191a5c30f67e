#include "daemon/core/keyed_mac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdint>

namespace epd {

std::string LabelledHmacSha256(absl::string_view key, absl::string_view label,
                               std::initializer_list<absl::string_view> parts) {
  std::string message(label);
  message.push_back('\0');
  for (absl::string_view p : parts) {
    const auto n = static_cast<uint32_t>(p.size());
    message.append(reinterpret_cast<const char*>(&n), sizeof n);
    message.append(p.data(), p.size());
  }
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int out_len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &out_len);
  return std::string(reinterpret_cast<const char*>(out), out_len);
}

bool ConstantTimeEqual(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace epd
