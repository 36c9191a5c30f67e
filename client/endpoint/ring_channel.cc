// RingChannel (ring_channel.h).
#include "client/endpoint/ring_channel.h"

#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/endpoint/deadline.h"
#include "common/errors/reason.h"
#include "common/os/futex.h"

namespace epd::internal {
namespace {

/// How long a wait spins on a completion before it sleeps on the completion futex (µs).
constexpr int64_t kSpinBeforeSleepUs = 200;

}  // namespace

RingChannel::RingChannel(ShmRegion region, ShmRegion doorbell, std::string group, int32_t rank,
                         uint32_t op_timeout_ms, std::shared_ptr<SessionWatch> session)
    : region_(std::move(region)),
      doorbell_region_(std::move(doorbell)),
      header_(reinterpret_cast<abi::EndpointShmHeader*>(region_.data())),
      doorbell_(reinterpret_cast<abi::DoorbellPage*>(doorbell_region_.data())),
      group_(std::move(group)),
      rank_(rank),
      op_timeout_ms_(op_timeout_ms),
      session_(std::move(session)) {}

absl::Status RingChannel::WaitForSpace() const {
  const uint64_t head = abi::Atomic(header_->ring_head).load(std::memory_order_relaxed);
  // Bounded wait for ring space (only when many ops are in flight).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(op_timeout_ms_) +
                  std::chrono::seconds(1);  // (In int64: op_timeout_ms + 1000 overflows a uint32.)
  while (head - abi::Atomic(header_->ring_tail).load(std::memory_order_acquire) >=
         abi::kRingCapacity) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::UnavailableError("epd did not drain the request ring; is the daemon alive?");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return absl::OkStatus();
}

void RingChannel::Publish(const abi::RequestSlot& slot) {
  const uint64_t head = abi::Atomic(header_->ring_head).load(std::memory_order_relaxed);
  auto* ring = reinterpret_cast<abi::RequestSlot*>(region_.data() + header_->ring_offset);
  std::memcpy(&ring[(head + 1) % abi::kRingCapacity], &slot, sizeof(slot));
  abi::Atomic(header_->ring_head).store(head + 1, std::memory_order_seq_cst);
  // When the engine was asleep, do not spin on this CPU afterwards: the scheduler may
  // place the woken engine here, behind our spin (docs/BENCHMARKS.md "Host backend").
  woke_engine_ = RingDoorbell(doorbell_);
}

abi::Completion& RingChannel::CompletionOf(uint64_t seq) const {
  return reinterpret_cast<abi::Completion*>(
      region_.data() + header_->completion_offset)[seq % abi::kCompletionCapacity];
}

bool RingChannel::Completed(uint64_t seq) const {
  return abi::Atomic(CompletionOf(seq).seq).load(std::memory_order_acquire) == seq;
}

absl::Status RingChannel::ClosedStatus(absl::string_view prefix) const {
  // The word lies in memory this process can write too: read it once, then judge the copy.
  return ClosedStatusOf(abi::Atomic(header_->daemon_closed).load(std::memory_order_acquire),
                        prefix);
}

absl::Status RingChannel::ClosedStatusOf(uint32_t closed, absl::string_view prefix) const {
  // Only the values the daemon writes are states of epd. Anything else is this endpoint's
  // memory overwritten (a bug or a hostile thread in this process): an error of this
  // endpoint alone, never read as a shutdown or a removal.
  switch (closed) {
    case 0:
      return absl::OkStatus();
    case abi::kClosedRankRemoved:
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              prefix, "rank ", rank_, " of group ", group_,
              " was removed from its group by epd (a LeaveGroup in this session's name, or "
              "the session ended); Join again")),
          errors::Reason::kEndpointClosed);
    case abi::kClosedShutdown:
      return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                    prefix, "epd is shutting down: it closed this endpoint")),
                                errors::Reason::kDaemonDraining);
    default:
      return absl::DataLossError(absl::StrCat(
          prefix, "rank ", rank_, " of group ", group_,
          ": the endpoint's shared-memory field daemon_closed holds ", closed, ", not 0 (open), ",
          abi::kClosedShutdown, " (shutdown) or ", abi::kClosedRankRemoved,
          " (rank removed): something in this process overwrote epd's shared memory; this "
          "endpoint is unusable (Leave and Join again)"));
  }
}

absl::Status RingChannel::WaitCompletion(uint64_t seq, absl::Duration timeout,
                                         abi::Completion* out) {
  abi::EndpointShmHeader* header = header_;
  abi::Completion& c = CompletionOf(seq);
  const auto start = std::chrono::steady_clock::now();
  const auto limit = DeadlineAfter(start, timeout);
  // The daemon bounds every op by op_timeout; far past it, the daemon is gone.
  const auto daemon_gone =
      start + std::chrono::milliseconds(op_timeout_ms_) + std::chrono::seconds(5);
  // Spin this long before sleeping on the futex: an op's own completion usually comes
  // within it, and a futex wake-up costs a scheduler round trip (docs/BENCHMARKS.md
  // "Host backend").
  const auto spin_until = start + std::chrono::microseconds(
                                      std::exchange(woke_engine_, false) ? 0 : kSpinBeforeSleepUs);
  for (uint64_t got; (got = abi::Atomic(c.seq).load(std::memory_order_acquire)) != seq;) {
    if (got > seq) {
      // The record was reused by a later op (record seq % kCompletionCapacity).
      return absl::FailedPreconditionError(absl::StrCat(
          "op ", seq, ": its completion record already holds op ", got, "'s; only the latest ",
          abi::kCompletionCapacity, " ops of an endpoint can be waited for (Wait sooner)"));
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= limit) {
      return errors::WithReason(
          absl::DeadlineExceededError(
              absl::StrCat("op ", seq, " not complete after ", absl::FormatDuration(timeout))),
          errors::Reason::kOpTimeout);
    }
    if (session_ != nullptr && session_->lost() &&
        abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat(
              "op ", seq, ": the Session with epd ended (the daemon died or restarted)")),
          errors::Reason::kDaemonUnavailable);
    }
    if (const uint32_t closed = abi::Atomic(header->daemon_closed).load(std::memory_order_acquire);
        closed != 0 && abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
      return ClosedStatusOf(closed, absl::StrCat("op ", seq, ": "));
    }
    if (now >= daemon_gone) {
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat(
              "op ", seq,
              ": no completion from epd within op_timeout + 5 s; the daemon is gone or stuck")),
          errors::Reason::kDaemonUnavailable);
    }
    if (now < spin_until) continue;
    uint32_t word = abi::Atomic(header->completion_futex).load(std::memory_order_seq_cst);
    abi::Atomic(header->client_waiting).store(1, std::memory_order_seq_cst);
    if (abi::Atomic(c.seq).load(std::memory_order_seq_cst) != seq) {
      FutexWait(&header->completion_futex, word, 2000);
    }
    abi::Atomic(header->client_waiting).store(0, std::memory_order_relaxed);
  }
  std::memcpy(out, &c, sizeof(c));
  if (out->status_code != 0) {
    out->message[abi::kCompletionMessageBytes - 1] = '\0';
    // The daemon's catalog reason (0 from none: the generic reason of the code).
    return errors::WithReason(
        absl::Status(static_cast<absl::StatusCode>(out->status_code), out->message),
        static_cast<errors::Reason>(out->reason));
  }
  return absl::OkStatus();
}

}  // namespace epd::internal
