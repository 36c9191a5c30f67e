// Shared (cross-process) futex waits and wakes on words of the shm ABI, and the client side
// of the engine doorbell (proto/abi/shm_abi.h DoorbellPage) built on them.
#pragma once

#include <cstdint>

#include "proto/abi/shm_abi.h"

namespace epd {

/// FUTEX_WAIT on a shared (non-private) futex word while it equals `expected`, for at
/// most `timeout_us` microseconds. Returns on wake, timeout, or value change.
void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_us);
/// FUTEX_WAKE every waiter of a shared futex word.
void FutexWakeAll(uint32_t* word);

/// Client side of the engine doorbell (shm_abi.h DoorbellPage): call after publishing a
/// request; wakes the engine when it sleeps (one futex syscall only in that case).
/// Returns true when it had to wake the engine.
bool RingDoorbell(abi::DoorbellPage* doorbell);

}  // namespace epd
