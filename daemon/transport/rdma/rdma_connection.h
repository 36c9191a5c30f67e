// The RDMA transport's connection lifecycle (DESIGN.md §5.4): the descriptor a link publishes
// (proto/abi/rdma_wire.h) and its checks, the attributes and masks of each queue pair
// transition (RESET -> INIT -> RTR -> RTS, and to ERROR / RESET), and the state machine of
// one peer's link. Everything here but ModifyQp is free of devices.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/transport/rdma/rdma_device.h"
#include "daemon/transport/transport.h"
#include "proto/abi/rdma_wire.h"

namespace epd::transport::rdma {

/// One queue pair's number and first packet sequence number.
struct QpEndpoint {
  uint32_t qpn = 0;
  uint32_t psn = 0;
};

/// What a link publishes (EncodeDescriptor) besides its queue pairs.
struct LocalEndpoint {
  int32_t node = 0;
  int32_t num_nodes = 0;
  uint32_t num_qps = 0;
  PortInfo port;
  uint64_t recv_addr = 0;
  uint64_t recv_bytes = 0;
  uint32_t recv_rkey = 0;
};

/// A peer's descriptor, checked: what this node needs of it.
struct RemoteEndpoint {
  int32_t node = 0;
  std::array<uint8_t, abi::kRdmaGidBytes> gid{};
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_1024;
  uint8_t link_layer = 0;
  uint64_t recv_addr = 0;
  uint64_t recv_bytes = 0;
  uint32_t recv_rkey = 0;
  uint32_t num_qps = 0;
  /// The peer's queue pairs towards this node, [0, num_qps).
  std::array<QpEndpoint, abi::kRdmaMaxQps> qps{};
};

/// The descriptor bytes of `local` with `qps` (num_nodes * num_qps entries, node-major; the
/// entries of local.node are written as zero). Allocates the string.
std::string EncodeDescriptor(const LocalEndpoint& local, std::span<const QpEndpoint> qps);

/// Compares the settings every node must share in two descriptors: this node's `ours` and
/// a peer's `theirs` (untrusted): queue pairs per peer (rdma.qps_per_peer) and link layer.
/// OK when they agree or when either is too short or not an RDMA descriptor of this wire
/// version (ParseDescriptor at Connect names that); FAILED_PRECONDITION naming the setting
/// and each node's value otherwise, the nodes by `our_node` and `their_node`.
absl::Status CompareDescriptorSettings(std::string_view ours, std::string_view theirs,
                                       std::string_view our_node, std::string_view their_node);

/// Checks descriptor `bytes` (untrusted: from a peer daemon) published by node `from` for
/// this node `self` of a group of `num_nodes` whose links use `num_qps` queue pairs per peer
/// over a port of link layer `link_layer`: size, magic, version, node, node count, queue
/// pair count, GID/LID for the link layer, MTU, region bounds, reserved bytes, each queue
/// pair number and PSN (and the publisher's own entries zero). INVALID_ARGUMENT naming the
/// field and its value.
absl::StatusOr<RemoteEndpoint> ParseDescriptor(std::string_view bytes, int32_t from, int32_t self,
                                               int32_t num_nodes, uint32_t num_qps,
                                               uint8_t link_layer);

/// One ibv_modify_qp call: the attributes and the mask of those it sets.
struct QpTransition {
  ibv_qp_attr attr{};
  int mask = 0;
};

/// What RTR and RTS need of this node's options and port.
struct PathOptions {
  uint32_t port = 1;
  int32_t gid_index = 0;
  uint8_t link_layer = IBV_LINK_LAYER_ETHERNET;
  ibv_mtu mtu = IBV_MTU_1024;
  uint32_t service_level = 0;
  uint32_t traffic_class = 0;
  uint32_t timeout = 14;
  uint32_t retry_count = 7;
  uint32_t rnr_retry = 7;
};

/// PathOptions of `options` on `port`.
PathOptions MakePathOptions(const RdmaTransportOptions& options, const PortInfo& port);

/// RESET -> INIT: port, P_Key index 0, remote write access.
QpTransition InitTransition(const PathOptions& path);
/// INIT -> RTR towards the peer's queue pair `remote_qp` (its QPN and PSN) at `remote`: the
/// address vector (GRH with the peer's GID, the GID index, traffic class and hop limit when
/// the link layer is Ethernet or the peer has no LID; the LID and service level), the path
/// MTU (the smaller of the two ends'), the peer's PSN, the RNR timer.
QpTransition RtrTransition(const PathOptions& path, const RemoteEndpoint& remote,
                           const QpEndpoint& remote_qp);
/// RTR -> RTS: ACK timeout, retry counts and this queue pair's own PSN.
QpTransition RtsTransition(const PathOptions& path, uint32_t local_psn);
/// Any state -> `state` (RESET or ERROR): the state only.
QpTransition StateTransition(ibv_qp_state state);

/// Applies `t` to `qp`; INTERNAL naming `what`, the target state and errno.
absl::Status ModifyQp(ibv_qp* qp, const QpTransition& t, absl::string_view what);

/// The state of one peer's link as the transport drives it (PeerState plus the probes of each
/// queue pair). Device-free: the transport feeds it what it saw and does what it answers.
///
/// Bringing a queue pair up: both ends move it to RTS at Connect, but the peer's may not be
/// in RTR yet (its daemon has not called Connect), and a write to it then exhausts its
/// retries and breaks the queue pair. So only the initiator (the lower node of the pair)
/// writes first: a probe, a zero-length RDMA WRITE WITH IMM, on each queue pair; while the
/// peer is not up the probe exhausts its retries having reached nobody, and the queue pair
/// is reset and probes again (kReprobe), no sooner than kReprobeInterval after the last. The
/// responder writes nothing until the initiator's probe arrived on that queue pair (so the
/// initiator's is in RTS), then probes back. Each end is kReady once its own probe is acknowledged
/// on every queue pair; the first receive on each queue pair is the peer's probe, not an immediate
/// for the engine. How long the initiator waits after a failed probe before it probes again.
inline constexpr std::chrono::milliseconds kReprobeInterval{50};

class PeerLinkMachine {
 public:
  using Clock = std::chrono::steady_clock;
  /// What the transport does next.
  enum class Action {
    kNone,       ///< Nothing.
    kReady,      ///< Every queue pair's probe was acknowledged: the peer is kReady.
    kReprobe,    ///< (Initiator) the peer's queue pair is not up: reset ours, probe again.
    kSendProbe,  ///< (Responder) the initiator's probe arrived: send this end's probe.
    kFail,       ///< The peer fails.
  };

  explicit PeerLinkMachine(uint32_t num_qps = 1, bool initiator = true)
      : num_qps_(num_qps), initiator_(initiator) {}

  PeerState state() const { return state_; }
  /// Whether this end probes first (the lower node index of the pair).
  bool initiator() const { return initiator_; }
  /// Connect (again): kConnecting until `deadline`, no probe answered or received.
  void OnConnect(Clock::time_point deadline);
  /// The peer's probe arrived on queue pair `qp` (its first receive since Connect): the
  /// responder answers kSendProbe (once per queue pair); otherwise kNone.
  Action OnPeerProbe(uint32_t qp);
  /// Queue pair `qp`'s own probe completed with `status` at `now`. On the initiator, an
  /// error while connecting and before the deadline means the peer's queue pair is not up
  /// (not yet in RTR: retries exceeded; or still bound to its previous incarnation):
  /// kReprobe, the error kept for the deadline's message. Any error on the responder (the
  /// initiator's queue pair was up), or once ready, is kFail.
  Action OnProbe(uint32_t qp, ibv_wc_status status, Clock::time_point now);
  /// A tick while connecting: kFail once the deadline passed.
  Action OnTick(Clock::time_point now);
  /// Any other error completion, FailPeer, Close: kFailed for good (until OnConnect).
  void OnFail() { state_ = PeerState::kFailed; }
  /// Queue pairs whose own probe was acknowledged so far.
  uint32_t probed() const { return probed_; }
  /// Whether the peer's probe arrived on queue pair `qp` since Connect.
  bool peer_probed(uint32_t qp) const { return qp < 32 && (peer_mask_ & (1u << qp)) != 0; }
  uint32_t reprobes() const { return reprobes_; }
  /// The last probe error while connecting (IBV_WC_SUCCESS: none).
  ibv_wc_status last_error() const { return last_error_; }
  Clock::time_point deadline() const { return deadline_; }

 private:
  uint32_t num_qps_;
  bool initiator_;
  PeerState state_ = PeerState::kIdle;
  Clock::time_point deadline_{};
  uint32_t probed_ = 0;
  uint32_t probed_mask_ = 0;
  uint32_t peer_mask_ = 0;
  uint32_t reprobes_ = 0;
  ibv_wc_status last_error_ = IBV_WC_SUCCESS;
};

}  // namespace epd::transport::rdma
