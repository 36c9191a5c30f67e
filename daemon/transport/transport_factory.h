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

/// The NIC inventory and the preflight, before anything is started.
struct TransportPlan {
  NicPlan nics;               ///< The ports, the GPU -> NIC map and the RDMA options.
  PreflightResult preflight;  ///< Lines with their severity; whether RDMA can run.
};

/// Runs the NIC inventory and the preflight; logs the lines and the NICs. Binds and opens
/// nothing, so a daemon calls it before any listener: FAILED_PRECONDITION when
/// config.transport is "rdma" and the preflight refuses it, listing the preflight's lines.
absl::StatusOr<TransportPlan> PlanTransports(const v1::DaemonConfig& config,
                                             const TransportStartOptions& options);

/// Starts the transports of `plan` (from PlanTransports on the same config and options):
/// with `options.start`, "rdma" first when the preflight found it usable, then "tcp" (its
/// data listener), so that a daemon configured for "rdma" whose transport fails to start
/// is refused before anything is bound. FAILED_PRECONDITION when config.transport is
/// "rdma" and it cannot run; the errors of MakeTcpTransport; INVALID_ARGUMENT for a bad
/// fault plan.
absl::StatusOr<std::unique_ptr<Transports>> StartTransports(const v1::DaemonConfig& config,
                                                            TransportPlan plan,
                                                            const TransportStartOptions& options);

}  // namespace epd::transport
