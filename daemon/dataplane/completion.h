// The completion record the daemon writes for each op of an endpoint (shm_abi.h).
#pragma once

#include <cstdint>

#include "daemon/dataplane/lockstep_group.h"

namespace epd {

/// Writes `outcome` as the completion of op `seq` into `ep`'s completion ring (status code,
/// N, buffer, the mask fields, message truncated to abi::kCompletionMessageBytes - 1), publishes it
/// and wakes a waiting client. Engine thread only; allocates nothing.
void WriteCompletion(LockstepEndpoint& ep, uint64_t seq, const RankOutcome& outcome);

}  // namespace epd
