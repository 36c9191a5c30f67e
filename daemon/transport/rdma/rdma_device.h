// The RDMA transport's device lifecycle (DESIGN.md §5.4): opening an ibv device by name,
// querying its port and GID, the protection domain and completion channel every link of the
// device shares; and the device-free checks of RdmaTransportOptions against ranges and
// against the device's capabilities.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/transport/rdma/rdma_transport.h"

namespace epd::transport::rdma {

/// Frees one verbs object (unique_ptr deleter): device context, protection domain,
/// completion channel, completion queue, queue pair, memory region.
struct IbvDeleter {
  void operator()(ibv_context* p) const { ibv_close_device(p); }
  void operator()(ibv_pd* p) const { ibv_dealloc_pd(p); }
  void operator()(ibv_comp_channel* p) const { ibv_destroy_comp_channel(p); }
  void operator()(ibv_cq* p) const { ibv_destroy_cq(p); }
  void operator()(ibv_qp* p) const { ibv_destroy_qp(p); }
  void operator()(ibv_mr* p) const { ibv_dereg_mr(p); }
};
template <typename T>
using IbvPtr = std::unique_ptr<T, IbvDeleter>;

/// What the transport needs of a device's limits (ibv_query_device).
struct DeviceCaps {
  uint32_t max_qp_wr = 0;  ///< Work requests per queue (send or receive) of a queue pair.
  uint32_t max_cqe = 0;    ///< Entries of a completion queue.
  uint32_t max_qp = 0;     ///< Queue pairs of the device.
  uint32_t max_cq = 0;     ///< Completion queues of the device.
};

/// One port as the transport uses it (ibv_query_port / ibv_query_gid).
struct PortInfo {
  uint32_t port = 1;
  int32_t gid_index = 0;
  uint8_t link_layer = 0;  ///< IBV_LINK_LAYER_INFINIBAND or IBV_LINK_LAYER_ETHERNET.
  uint16_t lid = 0;
  ibv_mtu active_mtu = IBV_MTU_1024;
  ibv_mtu mtu = IBV_MTU_1024;  ///< What this transport uses (options.mtu, capped; or active).
  uint32_t max_msg_sz = 0;
  std::array<uint8_t, 16> gid{};
};

/// Queue sizes of every link, from the options and the device's limits (PlanQueues).
struct QueuePlan {
  uint32_t send_wr = 0;       ///< Send work requests per queue pair.
  uint32_t recv_wr = 0;       ///< Receive work requests per queue pair (immediates in flight).
  uint32_t cq_depth = 0;      ///< Entries of each peer's completion queue.
  uint32_t signal_every = 1;  ///< A send work request of every this many is signalled.
};

/// Checks every field of `options` against its range. INVALID_ARGUMENT naming the option
/// ("rdma qps_per_peer 17 not in [1, 16]") and its value.
absl::Status ValidateRdmaOptions(const RdmaTransportOptions& options);

/// Queue sizes for links with `options` on a device with `caps`: max_send_wr capped at
/// max_qp_wr; cq_depth capped at max_cqe; then, as one completion queue per peer takes the
/// completions of qps_per_peer queue pairs (send and receive), the queues shrink until
/// qps_per_peer * (send_wr + recv_wr) <= cq_depth. FAILED_PRECONDITION when fewer than 2
/// work requests per queue remain (naming the limits).
absl::StatusOr<QueuePlan> PlanQueues(const RdmaTransportOptions& options, const DeviceCaps& caps);

/// The ibv_mtu of `bytes` (256, 512, 1024, 2048, 4096); INVALID_ARGUMENT otherwise.
absl::StatusOr<ibv_mtu> MtuFromBytes(uint32_t bytes);
/// Bytes of an ibv_mtu value (0 for an unknown one).
uint32_t MtuBytes(int mtu);
/// The MTU a port uses: `option_bytes` (0 = the port's active MTU), which must not exceed
/// the active MTU (INVALID_ARGUMENT naming both).
absl::StatusOr<ibv_mtu> ChooseMtu(uint32_t option_bytes, ibv_mtu active, const std::string& where);

/// An open device: its context, protection domain and completion channel (non-blocking fd).
/// Destroyed in reverse order of creation; safe after a half-finished open.
class RdmaDevice {
 public:
  const std::string& name() const { return name_; }
  ibv_context* context() const { return context_.get(); }
  ibv_pd* pd() const { return pd_.get(); }
  ibv_comp_channel* channel() const { return channel_.get(); }
  const DeviceCaps& caps() const { return caps_; }

 private:
  friend absl::StatusOr<std::unique_ptr<RdmaDevice>> OpenRdmaDevice(const std::string& name);
  std::string name_;
  IbvPtr<ibv_context> context_;
  IbvPtr<ibv_pd> pd_;
  IbvPtr<ibv_comp_channel> channel_;
  DeviceCaps caps_;
};

/// Opens device `name` ("mlx5_0"). UNAVAILABLE when there is no RDMA device ("no RDMA
/// device: ibv_get_device_list returned 0 devices") or none of that name (listing those
/// found); INTERNAL naming the verbs call that failed.
absl::StatusOr<std::unique_ptr<RdmaDevice>> OpenRdmaDevice(const std::string& name);

/// Queries `port` of `device` and its GID at `gid_index`, choosing the MTU with
/// `mtu_bytes` (ChooseMtu). UNAVAILABLE when the port is missing or not ACTIVE, the GID
/// index is outside the table or its GID is zero (RoCE); each names device, port and index.
absl::StatusOr<PortInfo> QueryPort(const RdmaDevice& device, uint32_t port, int32_t gid_index,
                                   uint32_t mtu_bytes);

}  // namespace epd::transport::rdma
