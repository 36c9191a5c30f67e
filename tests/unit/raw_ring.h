// RawRing: a test's raw client of one endpoint's shm ring (proto/abi/shm_abi.h), without the
// client library: publishes request slots and reads completions. Used where a test must
// write exactly the slot a client would (flags the client library sets on its own, e.g.
// kFlagStreamOrdered) or drive a LockstepGroup by hand. The ring, completions and data area
// are found from the ABI's layout (abi::ComputeEndpointShmLayout) and EndpointInfo, as the
// daemon finds them, not from the header's offsets: a test may scribble over the header.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

#include "common/os/shm_region.h"
#include "daemon/dataplane/data_plane.h"
#include "epd/v1/control.pb.h"
#include "proto/abi/shm_abi.h"

namespace epd::testing {

/// A fresh doorbell page's descriptor, for test LockstepGroups (DoorbellFd) that run no
/// engine: nobody sleeps on it.
inline absl::StatusOr<ScopedFd> TestDoorbellFd() {
  absl::StatusOr<ShmRegion> page =
      ShmRegion::Create("epd-test-doorbell", sizeof(abi::DoorbellPage));
  if (!page.ok()) return page.status();
  return page->TakeFd();
}

/// Writes request slots into an endpoint's ring and reads its completions, as a client
/// would (proto/abi/shm_abi.h), without the client library.
class RawRing {
 public:
  /// Maps the region of `info`'s endpoint, taken from `group` (TakeEndpointFds: once).
  static std::unique_ptr<RawRing> Open(const v1::EndpointInfo& info, DataPlaneGroup& group) {
    absl::StatusOr<EndpointFds> fds = group.TakeEndpointFds(info.rank());
    EXPECT_TRUE(fds.ok()) << fds.status();
    if (!fds.ok()) return nullptr;
    return Map(info, std::move(fds->region));
  }

  /// A second mapping of the region whose descriptors `fds` holds (a hostile client's view
  /// beside its own client library's): maps a duplicate, `fds` stays usable.
  static std::unique_ptr<RawRing> OpenAlso(const v1::EndpointInfo& info, const EndpointFds& fds) {
    ScopedFd dup(::fcntl(fds.region.get(), F_DUPFD_CLOEXEC, 0));
    EXPECT_TRUE(dup.valid()) << "dup of the region descriptor: " << std::strerror(errno);
    if (!dup.valid()) return nullptr;
    return Map(info, std::move(dup));
  }

 private:
  static std::unique_ptr<RawRing> Map(const v1::EndpointInfo& info, ScopedFd region_fd) {
    auto region = ShmRegion::Map(std::move(region_fd), info.shm_bytes(), "raw ring");
    EXPECT_TRUE(region.ok()) << region.status();
    if (!region.ok()) return nullptr;
    auto ring = std::make_unique<RawRing>();
    ring->region_ = std::move(*region);
    ring->next_seq_ = info.first_seq();
    ring->layout_ = abi::ComputeEndpointShmLayout(info.data_bytes());
    ring->data_offset_ = info.data_offset();
    return ring;
  }

 public:
  abi::EndpointShmHeader* header() const {
    return reinterpret_cast<abi::EndpointShmHeader*>(region_.data());
  }

  /// The host backend's data area in the region (EndpointInfo.data_offset).
  uint8_t* data() const { return region_.data() + data_offset_; }
  /// The whole region (shm_bytes).
  uint8_t* region_data() const { return region_.data(); }
  uint64_t region_bytes() const { return region_.size(); }

  /// Publishes the next request (op, flags, T; `handle_seq` for ops that use a handle)
  /// and returns its seq.
  uint64_t Submit(abi::OpKind op, uint32_t flags, int32_t num_tokens, uint64_t handle_seq = 0) {
    abi::RequestSlot slot{};
    slot.magic = abi::kRequestMagic;
    slot.op = static_cast<uint32_t>(op);
    slot.seq = next_seq_++;
    slot.flags = flags;
    slot.num_tokens = num_tokens;
    slot.expert_alignment = 1;
    slot.handle_seq = handle_seq;
    SubmitRaw(slot);
    return slot.seq;
  }

  /// Publishes `slot` as it is (any bytes) in the next ring slot.
  void SubmitRaw(const abi::RequestSlot& slot) {
    abi::EndpointShmHeader* h = header();
    auto* ring = reinterpret_cast<abi::RequestSlot*>(region_.data() + layout_.ring_offset);
    const uint64_t head = abi::Atomic(h->ring_head).load();
    std::memcpy(&ring[(head + 1) % abi::kRingCapacity], &slot, sizeof(slot));
    abi::Atomic(h->ring_head).store(head + 1, std::memory_order_release);
  }

  /// The completion of `seq` once written, else nullopt.
  std::optional<abi::Completion> Completion(uint64_t seq) const {
    auto* c = reinterpret_cast<abi::Completion*>(region_.data() + layout_.completion_offset) +
              seq % abi::kCompletionCapacity;
    if (abi::Atomic(c->seq).load(std::memory_order_acquire) != seq) return std::nullopt;
    return *c;
  }

  /// Waits (bounded by `timeout`) for the completion of `seq`, calling `poll` meanwhile.
  std::optional<abi::Completion> Await(uint64_t seq, std::chrono::milliseconds timeout,
                                       const std::function<void()>& poll = {}) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      if (poll) poll();
      if (auto c = Completion(seq)) return c;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return std::nullopt;
  }

 private:
  ShmRegion region_;
  uint64_t next_seq_ = 0;
  abi::EndpointShmLayout layout_{};
  uint64_t data_offset_ = 0;
};

}  // namespace epd::testing
