// The RDMA transport's data path, device-free parts (DESIGN.md §5.4): how a write's pieces
// become work requests on the queue pairs of a peer (striped by remote address, so a byte
// always travels on the same queue pair and later writes land after earlier ones), which
// work requests are signalled, and what an error completion means as an absl::Status.
#pragma once

#include <infiniband/verbs.h>

#include <algorithm>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "daemon/transport/transport.h"

namespace epd::transport::rdma {

/// Remote bytes [k * stripe, (k + 1) * stripe) of a peer's receive region travel on queue
/// pair k % num_qps: pieces are cut at stripe boundaries.
inline constexpr uint64_t kStripeBytes = uint64_t{1} << 20;
/// The stripe with one queue pair: pieces are cut only to bound one work request.
inline constexpr uint64_t kMaxWrBytes = uint64_t{1} << 30;
/// PlannedWr::piece of the zero-length work request that only carries the immediate.
inline constexpr uint32_t kNoPiece = UINT32_MAX;

/// The stripe for `num_qps` queue pairs.
inline uint64_t StripeBytes(uint32_t num_qps) { return num_qps <= 1 ? kMaxWrBytes : kStripeBytes; }

/// The queue pair that carries remote byte `remote_offset`.
inline uint32_t StripeQp(uint64_t remote_offset, uint64_t stripe, uint32_t num_qps) {
  return static_cast<uint32_t>((remote_offset / stripe) % num_qps);
}

/// Counts the data work requests of a write on each queue pair: counts[q] for q in
/// [0, num_qps) (counts.size() >= num_qps). Empty pieces count nothing.
inline void CountWrs(std::span<const WritePiece> pieces, uint64_t stripe, uint32_t num_qps,
                     std::span<uint32_t> counts) {
  std::fill(counts.begin(), counts.begin() + num_qps, 0u);
  for (const WritePiece& p : pieces) {
    uint64_t at = p.remote_offset;
    const uint64_t end = p.remote_offset + p.bytes;
    while (at < end) {
      const uint64_t seg_end = std::min(end, (at / stripe + 1) * stripe);
      ++counts[StripeQp(at, stripe, num_qps)];
      at = seg_end;
    }
  }
}

/// One work request of a write on one queue pair.
struct PlannedWr {
  uint32_t piece = kNoPiece;  ///< Index of the piece, or kNoPiece (immediate only).
  uint64_t offset = 0;        ///< Byte offset within the piece.
  uint64_t bytes = 0;
  bool with_imm = false;  ///< RDMA WRITE WITH IMM (the write's last on its queue pair).
};

/// Calls `emit(const PlannedWr&)` for each work request of a write of `pieces` on queue pair
/// `qp`, in posting order: its data work requests (`count` of them, CountWrs' counts[qp]),
/// the last carrying the immediate; with none, one zero-length write with the immediate.
/// Every queue pair carries the immediate of every write, so the receiver delivers it once
/// all have (each after that queue pair's bytes of the write). Allocates nothing.
template <typename Emit>
void PlanQpWrs(std::span<const WritePiece> pieces, uint64_t stripe, uint32_t num_qps, uint32_t qp,
               uint32_t count, Emit&& emit) {
  if (count == 0) {
    emit(PlannedWr{kNoPiece, 0, 0, true});
    return;
  }
  uint32_t emitted = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const WritePiece& p = pieces[i];
    uint64_t at = p.remote_offset;
    const uint64_t end = p.remote_offset + p.bytes;
    while (at < end) {
      const uint64_t seg_end = std::min(end, (at / stripe + 1) * stripe);
      if (StripeQp(at, stripe, num_qps) == qp) {
        ++emitted;
        emit(PlannedWr{static_cast<uint32_t>(i), at - p.remote_offset, seg_end - at,
                       emitted == count});
      }
      at = seg_end;
    }
  }
}

/// Whether the send work request with per-queue-pair ordinal `ordinal` (0, 1, ...) is
/// signalled: the last of a write on its queue pair always (WritesCompleted counts those),
/// else one of every `signal_every`, so the send queue frees its slots in time.
inline bool Signalled(uint64_t ordinal, uint32_t signal_every, bool with_imm) {
  return with_imm || (ordinal + 1) % signal_every == 0;
}

/// Whether a completion on a connected peer's queue pair counts in
/// LinkCounters::error_completions: every error status except IBV_WC_WR_FLUSH_ERR (the
/// flushes that follow the error which moved the queue pair to ERROR).
inline bool CountsAsErrorCompletion(ibv_wc_status status) {
  return status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR;
}

/// What error completion `status` (with the NIC's `vendor_err`) on queue pair `qp` of the
/// peer named `peer` ("group 'g': node 1 (...)") means: UNAVAILABLE when the peer is gone or
/// unreachable (retry or RNR retry exceeded, flushed after an earlier error, remote abort),
/// DATA_LOSS when the peer refused the request (remote access or invalid request: its region
/// differs from its descriptor), INTERNAL for a local error (protection, length, operation).
/// Each names the peer, the queue pair, the direction, ibv_wc_status_str and what to check.
/// OK for IBV_WC_SUCCESS.
absl::Status WcStatusToStatus(ibv_wc_status status, uint32_t vendor_err, absl::string_view peer,
                              uint32_t qp, bool receive);

}  // namespace epd::transport::rdma
