// The text form of a GPU UUID, shared by the daemon's inventory and the client's GPU
// lookup so both spell it the same way.
#pragma once

#include <cstdio>
#include <string>

namespace epd {

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (as nvidia-smi prints it) from the 16 raw
/// bytes of a cudaUUID_t (`cudaDeviceProp::uuid.bytes`).
inline std::string FormatGpuUuid(const void* bytes16) {
  const auto* b = static_cast<const unsigned char*>(bytes16);
  char out[64];
  std::snprintf(out, sizeof(out),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

}  // namespace epd
