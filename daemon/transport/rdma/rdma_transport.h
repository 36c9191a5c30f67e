// The RDMA transport (DESIGN.md §5.4): reliable-connected queue pairs to every peer node of
// a group, RDMA WRITE WITH IMM of each write's pieces into the peer's registered receive
// region, completion queues polled by one progress thread. Built on libibverbs (librdmacm is
// not used: descriptors travel through the Peer service); split by lifecycle: device
// (rdma_device.*), registration (rdma_memory.*), connection (rdma_connection.*), data path
// (rdma_datapath.*, and the link and progress thread in rdma_transport.cc). Wire bytes:
// proto/abi/rdma_wire.h.
// Device discovery from sysfs, GPU-to-NIC choice and preflight: nic_inventory.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/transport/transport.h"

namespace epd::transport {

/// Whether GPU memory is registered with the NIC (GPUDirect RDMA through dmabuf).
enum class GpuDirectMode {
  kAuto,  ///< When the device and driver support it; else pinned host staging.
  kOn,    ///< Required: a link that cannot register GPU memory is refused.
  kOff,   ///< Never: the CUDA backend stages through pinned host memory.
};

/// One device port the transport uses, resolved by the NIC inventory.
struct RdmaPort {
  std::string device;     ///< ibv device name, "mlx5_0".
  uint32_t port = 1;      ///< 1-based.
  int32_t gid_index = 0;  ///< GID table index to use on this port.
  /// Daemon CUDA ordinals that use this port (nearest on the PCIe tree); empty = host
  /// memory only / any.
  std::vector<int> cuda_devices;
};

/// What MakeRdmaTransport is built with (DaemonConfig.rdma, validated and resolved).
struct RdmaTransportOptions {
  std::vector<RdmaPort> ports;  ///< At least one.
  uint32_t service_level = 0;   ///< 0..15.
  uint32_t traffic_class = 0;   ///< 0..255.
  uint32_t timeout = 14;        ///< Local ACK timeout exponent, 1..31.
  uint32_t retry_count = 7;     ///< 0..7.
  uint32_t rnr_retry = 7;       ///< 0..7 (7 = infinite).
  uint32_t qps_per_peer = 2;    ///< 1..16.
  uint32_t max_send_wr = 1024;  ///< Per queue pair; capped at the device's max_qp_wr.
  uint32_t cq_depth = 4096;     ///< Capped at the device's max_cqe.
  uint32_t mtu = 0;             ///< Bytes (256..4096); 0 = the port's active MTU.
  /// Bound on bringing up a peer's queue pairs after Connect (both ends in RTS and a probe
  /// write acknowledged on each), milliseconds, 1..3600000.
  uint32_t connect_timeout_ms = 10000;
  GpuDirectMode gpudirect = GpuDirectMode::kAuto;
};

/// Opens the devices of `options.ports` and starts the progress thread. Errors:
/// INVALID_ARGUMENT naming the option and its value; UNAVAILABLE when a device or port is
/// missing or not active (naming it); FAILED_PRECONDITION when a limit stops it (e.g.
/// RLIMIT_MEMLOCK), saying what to change; UNIMPLEMENTED when epd was built without RDMA.
/// Never crashes on a machine without RDMA.
absl::StatusOr<std::unique_ptr<Transport>> MakeRdmaTransport(const RdmaTransportOptions& options);

}  // namespace epd::transport
