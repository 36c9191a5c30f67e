// The completion record the daemon writes for each op (completion.h).
#include "daemon/dataplane/completion.h"

#include <algorithm>
#include <cstring>

#include "common/os/futex.h"
#include "proto/abi/shm_abi.h"

namespace epd {

void WriteCompletion(LockstepEndpoint& ep, uint64_t seq, const RankOutcome& outcome) {
  abi::Completion& c = ep.completions()[seq % abi::kCompletionCapacity];
  c.status_code = static_cast<int32_t>(outcome.status.code());
  c.num_recv_tokens = outcome.num_recv_tokens;
  c.buffer = outcome.buffer;
  c.reason = 0;
  c.mask_epoch = outcome.mask_epoch;
  c.num_masked = outcome.num_masked;
  c.dropped_pairs = outcome.dropped_pairs;
  c.reserved = 0;
  const absl::string_view msg = outcome.status.message();  // No copy: this is the hot path.
  size_t n = std::min(msg.size(), static_cast<size_t>(abi::kCompletionMessageBytes - 1));
  if (n > 0) std::memcpy(c.message, msg.data(), n);  // An OK status's message has no data.
  c.message[n] = '\0';
  abi::Atomic(c.seq).store(seq, std::memory_order_release);
  abi::Atomic(ep.header->completion_futex).fetch_add(1, std::memory_order_seq_cst);
  if (abi::Atomic(ep.header->client_waiting).load(std::memory_order_seq_cst) != 0) {
    FutexWakeAll(&ep.header->completion_futex);
  }
  if (outcome.status.ok()) ++ep.ops_completed;
}

}  // namespace epd
