// Shared futex wait/wake and the doorbell ring (futex.h).
#include "common/os/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <ctime>

namespace epd {

void FutexWait(uint32_t* word, uint32_t expected, int64_t timeout_us) {
  struct timespec ts;
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = (timeout_us % 1000000) * 1000;
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool RingDoorbell(abi::DoorbellPage* doorbell) {
  if (abi::Atomic(doorbell->engine_sleeping).load(std::memory_order_seq_cst) == 0) return false;
  abi::Atomic(doorbell->futex_word).fetch_add(1, std::memory_order_seq_cst);
  FutexWakeAll(&doorbell->futex_word);
  return true;
}

}  // namespace epd
