// For client programs a test stops by closing their stdin (SubprocessOptions::pipe_stdin,
// Subprocess::CloseStdin): tests/security/epd_victim.cc, tests/multinode/clients/mn_client.cc.
#pragma once

#include <unistd.h>

#include <atomic>
#include <thread>

namespace epd::testing {

/// Sets `*stop` once stdin reaches EOF (or fails), from a thread of its own that lives as
/// long as the process (a blocking read cannot be interrupted portably; the process exits
/// with it). `stop` must have static storage duration.
inline void StopAtStdinEof(std::atomic<bool>* stop) {
  std::thread([stop] {
    char buffer[64];
    while (::read(0, buffer, sizeof(buffer)) > 0) {
    }
    stop->store(true);
  }).detach();
}

}  // namespace epd::testing
