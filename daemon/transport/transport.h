// The transport interface: how one daemon moves a group's bytes into another daemon's
// memory. Shaped after NCCL's split: the caller's side (the engine thread: Post*, Poll*,
// never blocking) and the proxy's side (the transport's own progress thread, or the NIC,
// which moves the bytes). Implementations: TCP (daemon/transport/tcp/), a fault-injecting
// wrapper for tests (daemon/transport/fault/), RDMA (daemon/transport/rdma/).
// docs/DESIGN.md §5.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace epd::transport {

/// One piece of a one-sided write: `bytes` bytes from local memory `src` to byte offset
/// `remote_offset` of the peer's receive region. The source must stay unchanged until
/// the write completes (GroupLink::WritesCompleted).
struct WritePiece {
  const void* src = nullptr;
  uint64_t bytes = 0;
  uint64_t remote_offset = 0;
};

/// Where a region of local memory lives.
enum class MemoryKind {
  kHost,        ///< Host memory (pageable or pinned).
  kCudaDevice,  ///< CUDA device memory of `cuda_device` (RDMA: registered through dmabuf).
};

/// A region of local memory a link writes from or receives into (RDMA: one memory region
/// each): given at link creation, registered for the link's life, or added and withdrawn
/// while it lives (GroupLink::AddSendRegion). Owned by the caller; must stay mapped while
/// the link holds it.
struct MemoryRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int cuda_device = -1;  ///< For kCudaDevice: the daemon's CUDA ordinal.
};

/// What a GroupLink is created with.
struct GroupLinkOptions {
  std::string group;      ///< The group's name (log lines, errors).
  int32_t num_nodes = 0;  ///< Nodes of the group, >= 2.
  int32_t self_node = 0;  ///< This daemon's node index, [0, num_nodes).
  /// This node's receive region: peers' writes land here. Registered once for the
  /// group's life (RDMA: one memory region). Owned by the caller; must outlive the link.
  void* recv_base = nullptr;
  uint64_t recv_bytes = 0;
  /// Where the receive region lives (Transport::Supports says which kinds a transport
  /// takes; CreateGroupLink refuses another with INVALID_ARGUMENT).
  MemoryKind recv_kind = MemoryKind::kHost;
  int recv_cuda_device = -1;
  /// Regions PostWrite sources may lie in, besides the receive region (and those added
  /// later with GroupLink::AddSendRegion). A transport that needs sources registered (RDMA)
  /// refuses a piece outside them with INVALID_ARGUMENT; TCP takes host sources anywhere.
  /// Empty: host sources anywhere where the transport allows it (TCP), none elsewhere.
  std::vector<MemoryRegion> send_regions;
  /// Called from the transport's progress thread when something the engine waits for
  /// happened (an immediate arrived, a write completed, a peer failed): wakes the engine.
  /// Must be cheap and must not call back into the link. It is called with the
  /// transport's internal locks held and never from inside a call into the link: it must
  /// not block on anything the engine may hold while calling the link (write an eventfd,
  /// wake a futex, notify a condition variable).
  std::function<void()> wake;
  /// How errors and log lines name each node: entry i for node i (for the data plane, its
  /// Peer address and ranks: "10.0.0.2:7100, ranks 4-7"), so that a broken link names the
  /// node as the Peer mesh does. Empty (or "" for a node): by its data address only.
  std::vector<std::string> node_labels;
};

/// What a transport counts about the link to one peer node, for the metrics scrape
/// (epd_transport_retransmits_total, epd_transport_error_completions_total). -1: the
/// transport does not know it.
struct LinkCounters {
  /// Segments this node re-sent to the peer (TCP: tcpi_total_retrans of the link's
  /// outbound connections since the link began, closed ones included).
  int64_t retransmits = -1;
  /// Work completions with an error status, flushes not counted (RDMA).
  int64_t error_completions = -1;
};

/// State of the link to one peer node.
enum class PeerState {
  kIdle,        ///< Connect not called yet.
  kConnecting,  ///< Connecting / handshaking.
  kReady,       ///< Writes flow.
  kFailed,      ///< Broken for good (PeerStatus says why); the group's ops fail.
};

/// One group's links to the other nodes of the group. Thread-safety: the caller's side
/// (every method) is called by one thread at a time (the engine thread of the group);
/// the progress happens on the transport's threads. A write either lands whole, in order
/// with the writes posted before it to the same peer, or the peer goes kFailed.
class GroupLink {
 public:
  virtual ~GroupLink() = default;

  /// What a peer needs to connect to this node for this group, as opaque bytes carried
  /// by the Peer service (TCP: address and port, but no token: see LocalDescriptorFor;
  /// RDMA: queue pair numbers, GIDs and the region's key).
  virtual std::string LocalDescriptor() const = 0;
  /// What node `node` (a peer of this node) needs to connect to this node: the descriptor
  /// the Peer service hands that node alone. A transport may put in it what only that node
  /// may know (TCP: a token that lets it, and no other node, connect as itself); then
  /// LocalDescriptor() lacks it and admits no one. Default: LocalDescriptor().
  virtual std::string LocalDescriptorFor(int32_t node) const { return LocalDescriptor(); }

  /// Starts connecting to node `node` (!= self) with the descriptor it published.
  /// Non-blocking. Called again for a node (its daemon registered the group anew: a new
  /// incarnation), it drops the old connection and its undelivered immediates and
  /// connects to the new descriptor. Errors: INVALID_ARGUMENT (node, descriptor).
  virtual absl::Status Connect(int32_t node, std::string_view descriptor) = 0;

  virtual PeerState State(int32_t node) const = 0;
  /// OK while the peer is not kFailed; else why, naming the node and its address.
  virtual absl::Status PeerStatus(int32_t node) const = 0;

  /// Posts a one-sided write of `pieces` into node `node`'s receive region, then delivers
  /// `imm` to that node (PollImm) once every byte of the write is in its memory. Its bytes
  /// land after those of the writes posted before it to that node (a byte written twice ends
  /// with the later write's value); pieces of one write should not overlap (which of them
  /// lands last is unspecified).
  /// Non-blocking; allocates nothing in steady state. Errors: UNAVAILABLE (peer not
  /// ready or failed, naming it), INVALID_ARGUMENT (a piece outside the peer's region),
  /// RESOURCE_EXHAUSTED (too many writes in flight: retry after WritesCompleted grows).
  virtual absl::Status PostWrite(int32_t node, std::span<const WritePiece> pieces,
                                 uint32_t imm) = 0;

  /// Writes posted to `node` whose sources may be reused (a count since the link began).
  /// Once the peer is kFailed every posted write counts (the transport reads no source of
  /// it any more), whether it landed or not.
  virtual uint64_t WritesCompleted(int32_t node) const = 0;

  /// Pops the next immediate received from node `node`, in the order it was posted.
  /// False when none is waiting.
  virtual bool PollImm(int32_t node, uint32_t* imm) = 0;

  /// Fails the link to node `node` now: closes its connections (the peer sees a failure)
  /// and makes it kFailed with `cause` in PeerStatus. For the data plane giving up on a
  /// peer and for fault injection. Default: nothing.
  virtual void FailPeer(int32_t node, const absl::Status& cause) {
    (void)node;
    (void)cause;
  }

  /// Declares `region` a place PostWrite sources may lie in from now on, besides the
  /// receive region and GroupLinkOptions.send_regions: for memory that comes and goes
  /// while the link lives (a rank's data area, attached after the link was made). RDMA
  /// registers it (one memory region, pinned until RemoveSendRegion); a transport that
  /// takes host sources anywhere (TCP, the default) records nothing. Returns a handle for
  /// RemoveSendRegion (>= 0). The memory must stay mapped until RemoveSendRegion or the
  /// link's end. Allocates; not for the hot path (once per attach). Errors: INVALID_ARGUMENT
  /// (empty or null region, a kind the transport does not Support), FAILED_PRECONDITION
  /// (the locked-memory limit), those of the registration.
  virtual absl::StatusOr<int> AddSendRegion(const MemoryRegion& region) {
    (void)region;
    return 0;
  }
  /// Withdraws a region AddSendRegion declared (`handle` its answer). No write posted
  /// from it may still be in flight (WritesCompleted has counted every one). An unknown
  /// handle is ignored. Default: nothing.
  virtual void RemoveSendRegion(int handle) { (void)handle; }

  /// The link's counters for node `node`. Unlike the caller's side above, any thread may
  /// call it (the metrics scrape) while the link lives; it takes the transport's lock
  /// briefly and allocates nothing. Default: nothing known.
  virtual LinkCounters Counters(int32_t node) const {
    (void)node;
    return {};
  }

  /// Closes every connection of the link (peers see it as a failure). Idempotent; the
  /// destructor calls it.
  virtual void Close() = 0;
};

/// A transport: a factory of group links plus the resources shared by every group
/// (the progress thread, a listener). Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  /// "tcp", "rdma", "fault(tcp)".
  virtual std::string name() const = 0;
  /// Whether links can receive into and write from memory of `kind` (TCP: host only, so
  /// the CUDA backend stages device memory through pinned host buffers; RDMA: host, and
  /// device memory where GPUDirect RDMA works).
  virtual bool Supports(MemoryKind kind) const { return kind == MemoryKind::kHost; }
  virtual absl::StatusOr<std::unique_ptr<GroupLink>> CreateGroupLink(
      const GroupLinkOptions& options) = 0;
  /// Compares the settings every node of a group must share (RDMA: queue pairs per peer,
  /// link layer) in this node's descriptor `ours` and a peer's `theirs` (untrusted bytes:
  /// only what the comparison needs is read; anything malformed is left to Connect).
  /// The Peer service calls it at rendezvous, so that a group whose nodes differ is
  /// refused there. FAILED_PRECONDITION naming the setting and each node's value, the
  /// nodes by `our_node` and `their_node` ("node 0 (10.0.0.1:7300)"). Default: OK.
  virtual absl::Status CompareDescriptorSettings(std::string_view ours, std::string_view theirs,
                                                 std::string_view our_node,
                                                 std::string_view their_node) const {
    (void)ours;
    (void)theirs;
    (void)our_node;
    (void)their_node;
    return absl::OkStatus();
  }
  /// Stops the progress thread and closes every link. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace epd::transport
