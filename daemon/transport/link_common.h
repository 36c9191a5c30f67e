// What every GroupLink implementation shares (TCP, RDMA): checks of the link's options, which
// nodes are peers, how a peer is named in errors, what State/PeerStatus answer for a node that
// is not a peer, whether a write's pieces fit the peer's receive region, and the per-peer
// counters of the caller's side (writes completed, immediates delivered and consumed), and
// the Shutdown sequence of a transport's core.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/errors/reason.h"
#include "daemon/transport/transport.h"

namespace epd::transport {

/// Whether `node` is a peer of this node: in [0, num_nodes) and not self_node.
inline bool IsPeerNode(const GroupLinkOptions& o, int32_t node) {
  return node >= 0 && node < o.num_nodes && node != o.self_node;
}

/// Checks num_nodes in [2, max_nodes], self_node in [0, num_nodes) and a non-null recv_base
/// when recv_bytes > 0. INVALID_ARGUMENT naming the group, the field and its value.
absl::Status CheckGroupLinkOptions(const GroupLinkOptions& o, int32_t max_nodes);

/// "group 'g': node 1 (LABEL; PREFIX WHERE)" when node 1 has a label in o.node_labels, else
/// "group 'g': node 1 (WHERE)". `where` says where the node is for this transport (its data
/// address, its GID); `labeled_prefix` precedes it after a label ("data ").
std::string PeerNodeName(const GroupLinkOptions& o, int32_t node, absl::string_view where,
                         absl::string_view labeled_prefix);

/// GroupLink::State for a node that is not a peer: kReady for this node, kIdle otherwise.
PeerState NonPeerState(const GroupLinkOptions& o, int32_t node);

/// GroupLink::PeerStatus for a node that is not a peer: OK for this node, INVALID_ARGUMENT
/// naming it otherwise.
absl::Status NonPeerStatus(const GroupLinkOptions& o, int32_t node);

/// INVALID_ARGUMENT: `call` ("Connect", "PostWrite") named `node`, which is not a peer.
absl::Status NotAPeerError(const GroupLinkOptions& o, int32_t node, absl::string_view call);

/// Index of the first piece that does not lie within a peer receive region of
/// `region_bytes` or has no source (and is not empty), or -1 when every piece fits.
/// Allocates nothing (PostWrite's steady state).
ptrdiff_t FirstPieceOutside(std::span<const WritePiece> pieces, uint64_t region_bytes);

/// INVALID_ARGUMENT naming `peer`, piece `index` of `pieces`, its offset and size.
absl::Status PieceOutsideError(std::span<const WritePiece> pieces, ptrdiff_t index,
                               uint64_t region_bytes, absl::string_view peer);

/// Whether [src, src + bytes) lies whole within [begin, end).
inline bool RangeHolds(uint64_t begin, uint64_t end, const void* src, uint64_t bytes) {
  const auto at = reinterpret_cast<uint64_t>(src);
  return at >= begin && at <= end && bytes <= end - at;
}

/// Index of the first non-empty piece whose source lies whole in none of `regions` (each
/// with uint64_t `begin` and `end`: the link's registered regions), or -1 when every
/// piece's does. What a transport that needs sources registered (RDMA) checks before
/// posting. Linear in pieces x regions; allocates nothing.
template <typename Region>
ptrdiff_t FirstSourceOutside(std::span<const WritePiece> pieces, std::span<const Region> regions) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    const WritePiece& w = pieces[i];
    if (w.bytes == 0) continue;
    bool inside = false;
    for (const Region& r : regions) {
      if (RangeHolds(r.begin, r.end, w.src, w.bytes)) {
        inside = true;
        break;
      }
    }
    if (!inside) return static_cast<ptrdiff_t>(i);
  }
  return -1;
}

/// INVALID_ARGUMENT naming `peer` and piece `index` of `pieces`, whose source lies outside
/// every registered region of the link.
absl::Status SourceOutsideError(std::span<const WritePiece> pieces, ptrdiff_t index,
                                absl::string_view peer);

/// The caller's side of one peer of a link: its state, writes posted (engine thread) and
/// completed (progress thread), and the ring of immediates delivered (progress thread,
/// written into imm_slots at their sequence number before `delivered` moves past it) and
/// consumed (engine thread). Transports keep their own state beside it.
struct PeerCounters {
  std::atomic<PeerState> state{PeerState::kIdle};
  std::atomic<uint64_t> writes_posted{0};
  std::atomic<uint64_t> writes_done{0};
  std::vector<uint32_t> imm_slots;  ///< Sized once when the link is created.
  std::atomic<uint64_t> delivered{0};
  std::atomic<uint64_t> consumed{0};

  /// GroupLink::WritesCompleted: once kFailed (stored after the transport stopped reading
  /// the peer's sources) every posted write, else those completed.
  uint64_t WritesCompleted() const {
    if (state.load(std::memory_order_acquire) == PeerState::kFailed) {
      return writes_posted.load(std::memory_order_relaxed);
    }
    return writes_done.load(std::memory_order_acquire);
  }
  /// GroupLink::PollImm's pop: the next delivered immediate into `*imm`, false when none
  /// waits. Engine thread; allocates nothing.
  bool PopImm(uint32_t* imm) {
    const uint64_t c = consumed.load(std::memory_order_relaxed);
    if (c >= delivered.load(std::memory_order_acquire)) return false;
    *imm = imm_slots[c % imm_slots.size()];
    consumed.store(c + 1, std::memory_order_release);
    return true;
  }
};

/// What makes a transport core's Shutdown run once (ShutdownCore).
struct ShutdownOnce {
  std::mutex mu;
  bool done = false;
};

/// The Shutdown of a transport's core (TCP, RDMA). Once: a later call returns when the first
/// has finished. Sets `stop`, calls `wake` and joins `thread` (the progress thread); then,
/// under `links_mu`, detaches every link of `links` with UNAVAILABLE "the `transport`
/// transport was shut down" (waking their engines: Link::Detach(status, /*wake=*/true)),
/// clears the list, and calls `release` for what else the core drops under that lock.
template <typename Link>
void ShutdownCore(
    ShutdownOnce& once, std::atomic<bool>& stop, std::thread& thread,
    absl::FunctionRef<void()> wake, std::mutex& links_mu, std::vector<Link*>& links,
    absl::string_view transport, absl::FunctionRef<void()> release = [] {}) {
  std::lock_guard<std::mutex> once_lock(once.mu);
  if (once.done) return;
  once.done = true;
  stop = true;
  if (thread.joinable()) {
    wake();
    thread.join();
  }
  std::lock_guard<std::mutex> l(links_mu);
  const absl::Status cause = errors::WithReason(
      absl::UnavailableError(absl::StrCat("the ", transport, " transport was shut down")),
      errors::Reason::kTransportFailed);
  for (Link* link : links) link->Detach(cause, /*wake=*/true);
  links.clear();
  release();
}

}  // namespace epd::transport
