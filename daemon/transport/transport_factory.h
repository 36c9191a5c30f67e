// Starts the transports a daemon runs for groups that span nodes (DaemonConfig.transport,
// tcp_*, rdma): TCP whenever the Peer listener is on, RDMA when the preflight finds it
// usable (daemon/transport/rdma/preflight.h), each wrapped in the fault plan of
// testing_transport_faults when that is set. A daemon configured for "rdma" that cannot
// run it does not start.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/transport/rdma/preflight.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/transport_set.h"
#include "epd/v1/config.pb.h"
#include "epd/v1/control.pb.h"

namespace epd::transport {

/// What StartTransports needs besides the config.
struct TransportStartOptions {
  /// Start transports (the Peer listener is on); false = only the NIC inventory and the
  /// preflight, for GetStats.
  bool start = true;
  /// The daemon's GPUs (GPU -> NIC mapping, GPUDirect).
  std::vector<v1::GpuInfo> gpus;
  /// Root of sysfs ("/sys"); tests point it at a fake tree.
  std::string sysfs_root = "/sys";
  /// Preflight facts; nullopt = GatherPreflightFacts(sysfs_root, gpus).
  std::optional<PreflightFacts> facts;
};

/// The started transports, by name, and what GetStats shows of them.
struct Transports {
  std::vector<std::unique_ptr<Transport>> owned;  ///< Started transports.
  TransportSet set;                               ///< Borrowing `owned`.
  std::vector<v1::NicInfo> nics;                  ///< GetStatsResponse.nics.
  std::vector<std::string> preflight;             ///< GetStatsResponse.preflight.
  std::string tcp_listen_address;                 ///< The TCP data listener; "" if none.

  /// Shuts down every transport (links closed, threads joined), in reverse order.
  void Shutdown();
};

/// Runs the NIC inventory and the preflight, and (with `options.start`) starts "tcp"
/// and, when usable, "rdma". `config` is filled and valid. FAILED_PRECONDITION when
/// config.transport is "rdma" and RDMA cannot run here, listing the preflight's lines;
/// the errors of MakeTcpTransport; INVALID_ARGUMENT for a bad fault plan.
absl::StatusOr<std::unique_ptr<Transports>> StartTransports(const v1::DaemonConfig& config,
                                                            const TransportStartOptions& options);

}  // namespace epd::transport
