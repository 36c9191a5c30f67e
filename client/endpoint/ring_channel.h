// RingChannel: the client's side of one endpoint's shared-memory ring (proto/abi/shm_abi.h):
// requests published at the ring's head with a doorbell ring, completions waited for (spin,
// then the completion futex), and the daemon's "endpoint closed" word.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/session_watch.h"
#include "common/os/futex.h"
#include "common/os/shm_region.h"
#include "proto/abi/shm_abi.h"

namespace epd::internal {

class RingChannel {
 public:
  RingChannel() = default;
  /// Adopts the endpoint's mapped region (its header already checked by OpenEndpoint) and
  /// doorbell page. `group`/`rank` name the endpoint in errors; `op_timeout_ms` bounds
  /// the waits; `session` (may be null) says when the daemon is gone.
  RingChannel(ShmRegion region, ShmRegion doorbell, std::string group, int32_t rank,
              uint32_t op_timeout_ms, std::shared_ptr<SessionWatch> session);

  /// The endpoint region's header; valid while this channel lives.
  abi::EndpointShmHeader& header() const { return *header_; }
  /// The endpoint region's first byte.
  uint8_t* region_data() const { return region_.data(); }

  /// Waits (bounded by op_timeout + 1 s) for a free ring slot. UNAVAILABLE when the
  /// daemon does not drain the ring.
  absl::Status WaitForSpace() const;
  /// Publishes `slot` (its seq assigned in order by the caller) at the ring's head and
  /// rings the engine's doorbell. Call after WaitForSpace.
  void Publish(const abi::RequestSlot& slot);
  /// Rings the engine's doorbell without a slot (a command it polls elsewhere is coming).
  void Wake() { RingDoorbell(doorbell_); }

  /// Waits for the completion of `seq` and copies it into `*out`. Returns the op's status;
  /// DEADLINE_EXCEEDED after `timeout`; UNAVAILABLE when the daemon is gone (session
  /// lost, or no completion within op_timeout + 5 s) or closed the endpoint for shutdown;
  /// FAILED_PRECONDITION when its record was reused or the rank was removed; DATA_LOSS
  /// when daemon_closed holds a value epd never writes (ClosedStatus).
  absl::Status WaitCompletion(uint64_t seq, absl::Duration timeout, abi::Completion* out);
  /// Whether the completion record of `seq` holds that op's completion.
  bool Completed(uint64_t seq) const;

  /// The error for a closed endpoint (EndpointShmHeader::daemon_closed, read once), OK when
  /// open: UNAVAILABLE (kClosedShutdown), FAILED_PRECONDITION (kClosedRankRemoved), or
  /// DATA_LOSS naming the field and its value when it holds anything else (this process
  /// overwrote the endpoint's shared memory). `prefix` starts the message.
  absl::Status ClosedStatus(absl::string_view prefix) const;

 private:
  /// ClosedStatus of the value `closed` already copied out of the header.
  absl::Status ClosedStatusOf(uint32_t closed, absl::string_view prefix) const;

  abi::Completion& CompletionOf(uint64_t seq) const;

  ShmRegion region_;
  ShmRegion doorbell_region_;
  abi::EndpointShmHeader* header_ = nullptr;
  abi::DoorbellPage* doorbell_ = nullptr;
  std::string group_;
  int32_t rank_ = 0;
  uint32_t op_timeout_ms_ = 0;
  std::shared_ptr<SessionWatch> session_;
  bool woke_engine_ = false;  ///< The last Publish had to wake the engine.
};

}  // namespace epd::internal
