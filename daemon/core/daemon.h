// Daemon: the core of `epd` (main.cc only parses flags, builds a Daemon and waits for a
// signal; a test can run a Daemon inside its own process). Start() brings up the GPU
// inventory, the data plane (host or CUDA), the group registry, epd's own listener on the
// unix socket (Control and grpc.health.v1) and the optional TCP listener (health only);
// Shutdown() drains and releases everything. What health reports and when, and the order
// of start and shutdown: docs/DEPLOYMENT.md §5 "Start, health and shutdown". daemon.cc has
// start-up and shutdown; daemon_ops.cc health, metrics, config reload and drain.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/shm_region.h"
#include "common/version.h"
#include "daemon/core/config.h"
#include "daemon/core/config_overrides.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/gpu/gpu_inventory.h"
#include "daemon/metrics/metrics.h"
#include "daemon/server/peer_credentials.h"
#include "daemon/transport/rdma/preflight.h"
#include "epd/v1/config.pb.h"
#include "epd/v1/control.grpc.pb.h"
#include "epd/v1/control.pb.h"

namespace grpc {
class Server;
}

namespace epd {
namespace peer {
class GrpcPeerMesh;
class PeerMesh;
}  // namespace peer
namespace transport {
class TransportSet;
struct Transports;
struct TransportStartOptions;
}  // namespace transport

class AuditLog;
namespace metrics {
class MetricsServer;
}  // namespace metrics

class ControlService;
class FdChannel;
class GroupRegistry;
class UnixListener;

/// The gRPC service name whose health is reported besides "".
inline constexpr char kControlServiceName[] = "epd.v1.Control";

/// Which data plane runs, and why (logged at start, GetStats.backend/backend_reason).
struct BackendChoice {
  std::string backend;  ///< "host" or "cuda": the data plane actually built.
  std::string reason;
};

/// Decides the backend from the requested one and the GPUs found.
///   host → host. cuda → FAILED_PRECONDITION when no GPU is usable (the inventory's
///   reason is in the message). auto → cuda when a GPU is usable, else host.
/// `cuda_data_plane_built` = false (a build without CUDA): a cuda/auto choice with GPUs runs
/// the host data plane and the reason says so.
absl::StatusOr<BackendChoice> ChooseBackend(v1::Backend requested, const GpuInventory& inventory,
                                            bool cuda_data_plane_built);

/// Builds the data plane for a config and a backend choice.
using DataPlaneFactory = std::function<absl::StatusOr<std::unique_ptr<DataPlane>>(
    const v1::DaemonConfig& config, const BackendChoice& choice)>;

/// The data plane epd runs by default for `choice`: the CUDA data plane
/// (daemon/dataplane/cuda/cuda_data_plane.h; op_timeout_ms, engine_idle_us, gpu_uuids of
/// `config`) when choice.backend is "cuda" in a CUDA build, else the host data plane
/// (daemon/dataplane/host/host_data_plane.h; op_timeout_ms, engine_idle_us, host_threads).
/// UNIMPLEMENTED for a backend this build has no data plane for.
/// `peer_mesh` and `transports` (null when the Peer listener is off) go to the host data
/// plane (HostDataPlaneOptions) for groups that span nodes; both must outlive the plane.
absl::StatusOr<std::unique_ptr<DataPlane>> MakeDefaultDataPlane(
    const v1::DaemonConfig& config, const BackendChoice& choice,
    peer::PeerMesh* peer_mesh = nullptr, const transport::TransportSet* transports = nullptr);

/// How long epd's main lets a stop (Daemon::Shutdown after SIGTERM) take before it exits
/// regardless (exit code 1). The drain (drain_grace, the data plane's GPU drain, the gRPC
/// servers' shutdown) is bounded well inside it.
inline constexpr absl::Duration kShutdownHardLimit = absl::Seconds(4);

struct DaemonOptions {
  /// Data plane factory; null = MakeDefaultDataPlane. Tests inject a fake.
  DataPlaneFactory data_plane_factory;
  /// GPU inventory; nullopt = GpuInventory::Discover(config.gpu_uuids()).
  std::optional<GpuInventory> inventory;
  /// After health turns NOT_SERVING at shutdown, the server keeps answering this long so
  /// health probes and watchers see NOT_SERVING before the socket goes away.
  absl::Duration drain_grace = absl::Milliseconds(500);
  /// How often the GPUs are re-read (free memory; a failure = GPU lost → NOT_SERVING).
  absl::Duration gpu_poll_interval = absl::Seconds(2);
  /// How often the health updater looks at the listener and expires unmapped endpoints.
  absl::Duration health_interval = absl::Milliseconds(250);
  /// The listener is stuck (health NOT_SERVING) when its accept loop has not gone round,
  /// or accept has kept failing, for this long.
  absl::Duration listener_stall_limit = absl::Seconds(3);
  /// Called at the top of every round of the listener's accept loop (tests stall it).
  std::function<void()> listener_loop_hook_for_testing;
  /// How often the health updater probes the Peer listener (GrpcPeerMesh::ProbeListener),
  /// and how long one probe waits; two failed probes in a row make it stuck (NOT_SERVING).
  absl::Duration peer_probe_interval = absl::Seconds(2);
  absl::Duration peer_probe_timeout = absl::Seconds(1);
  /// Where config.backend came from, named in the backend's reason (BackendSource: e.g.
  /// "--backend=cuda on the command line"); empty = an in-process DaemonConfig. The daemon
  /// reads no command line: main.cc fills this from its flags.
  std::string backend_source;
  /// Root of sysfs for the NIC inventory ("/sys"); tests point it at a fake tree.
  std::string sysfs_root = "/sys";
  /// RDMA preflight facts; nullopt = read from this process and machine (tests inject
  /// them).
  std::optional<transport::PreflightFacts> preflight_facts;
  /// Reads the configuration again for a reload (SIGHUP, Control.ReloadConfig): main.cc
  /// resolves the same --config file and command line (ResolveDaemonConfigWithOverrides),
  /// with the fields a flag overrides the file for. Null = this daemon has nothing to
  /// re-read (ReloadConfig answers FAILED_PRECONDITION).
  std::function<absl::StatusOr<ResolvedDaemonConfig>()> config_source;
  /// The fields of the config started with whose command-line flag overrides the --config
  /// file's value (ResolvedDaemonConfig::overridden): each is logged at start-up.
  std::vector<ConfigFlagOverride> flag_overrides;
};

class Daemon {
 public:
  /// Starts a daemon on `config` (a filled, validated DaemonConfig: ResolveDaemonConfig).
  /// Errors: FAILED_PRECONDITION when a live epd already answers on the socket, when the
  /// socket path exists and is not a socket, or --backend=cuda without a GPU;
  /// UNAVAILABLE when a listener cannot be bound; NOT_FOUND for an unknown socket_group or
  /// gpu_uuids entry; FAILED_PRECONDITION when config.transport is "rdma" and RDMA cannot
  /// run here (the preflight's lines); the data plane's errors.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(v1::DaemonConfig config,
                                                       DaemonOptions options = {});
  ~Daemon();  ///< Shutdown().
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  /// Drains and stops (docs/DEPLOYMENT.md §5). Idempotent; returns once everything is
  /// released (drain_grace + at most ~1 s).
  void Shutdown();

  /// Filesystem path of the unix socket.
  const std::string& socket_path() const { return socket_path_; }
  /// gRPC target of the unix socket: "unix:///path".
  std::string unix_target() const { return "unix://" + socket_path_; }
  /// Bound TCP port of --listen (the real one for "host:0"); 0 when there is none.
  int tcp_port() const { return tcp_port_; }
  /// The configuration in effect: the one started with, with the live fields of every
  /// reload since (ApplyConfig).
  v1::DaemonConfig config() const;
  const BackendChoice& backend() const { return backend_; }
  /// Bound port of --metrics_listen (the real one for "host:0"); 0 when there is none.
  int metrics_port() const;
  /// The Peer mesh (peer_listen set), else null. Lives until Shutdown() returns.
  peer::PeerMesh* peer_mesh() const;

  /// What GetStats answers.
  v1::GetStatsResponse Stats() const;

  /// A config reload (SIGHUP; Control.ReloadConfig by `caller`): reads the configuration
  /// again through DaemonOptions::config_source and ApplyConfig's it. Errors (nothing is
  /// applied, the running configuration stays; logged, audited, counted as "failed"): the
  /// source's (a file that does not parse, a field that does not validate: the message
  /// names it), FAILED_PRECONDITION without a config_source, ApplyConfig's.
  absl::StatusOr<v1::ReloadConfigResponse> ReloadConfig(
      const std::optional<PeerCredentials>& caller);
  /// Applies `next` (completed with FillDaemonConfigDefaults and validated first) as a
  /// reload; `overridden` are the fields whose flag overrode the file's value in `next`
  /// (ReloadConfig's source says), each logged at warning level and named in the response
  /// (ReloadConfigResponse.overridden) and the reload's log line. Every field that differs
  /// from the running config and is live
  /// (config_reload.h LiveConfigFields: log_level, the quotas, metrics_listen) takes
  /// effect; every other one that differs is refused by name (one warning each: it needs a
  /// restart) and keeps its running value. Result "ok" or "refused"
  /// (ReloadConfigResponse). Errors, with nothing applied: INVALID_ARGUMENT for an invalid
  /// `next` (naming the field), UNAVAILABLE with reason CONFIG_INVALID when the new
  /// metrics_listen cannot be bound (the old listener keeps serving) or epd is shutting down. Each
  /// call is logged, written to the audit log (config_reload) and counted in
  /// epd_config_reloads_total{result}.
  absl::StatusOr<v1::ReloadConfigResponse> ApplyConfig(
      v1::DaemonConfig next, const std::optional<PeerCredentials>& caller = std::nullopt,
      const std::vector<ConfigFlagOverride>& overridden = {});

  /// The operator's drain (Control.Drain by `caller`; `epctl drain`/`undrain`): while
  /// drained, a join that would create a group is refused (DAEMON_DRAINED), live groups
  /// keep working (their ranks may join), health is NOT_SERVING, GetStats.draining and
  /// epd_draining are set. Logged and audited (drain / undrain). Returns the state before.
  bool SetDrained(bool drain, const std::optional<PeerCredentials>& caller = std::nullopt);
  bool drained() const;

 private:
  Daemon(v1::DaemonConfig config, DaemonOptions options);
  absl::Status Init();
  absl::Status PrepareSocketPath();
  absl::Status ApplySocketPermissions();
  /// Starts peer_mesh_ from the peer_* fields (secret and TLS files read here).
  absl::Status StartPeerMesh();
  /// What PlanTransports/StartTransports (transport_factory.h) are given: start them
  /// when peer_listen is set, the GPUs, the sysfs root and injected preflight facts.
  transport::TransportStartOptions TransportOptions() const;
  /// Recomputes health from the state below (starting, draining, GPU lost, listener
  /// stuck) and publishes it to both servers' health services when it changed.
  void PublishServing();
  /// Why health is NOT_SERVING ("" when serving); `count_drain` false: leaving out an
  /// operator's drain (the process's own health, "", which liveness asks).
  std::string NotServingReasonLocked(bool count_drain = true) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// The listeners whose health WatchHealth checks: the clients' (listener.h) and the Peer
  /// service's.
  enum class Listener { kClients, kPeers };
  /// Sets why `listener` is stuck ("" when it is not: listener_stuck_ or
  /// peer_listener_stuck_); when that changes whether it is stuck, logs it (an error, or its
  /// recovery) and republishes health (PublishServing).
  void SetListenerStuck(Listener listener, std::string stuck) ABSL_LOCKS_EXCLUDED(mu_);
  /// The process's own health: serving but for an operator's drain (epd_serving).
  bool ProcessServing() const ABSL_LOCKS_EXCLUDED(mu_);
  void MonitorGpus();
  /// The daemon's scrape-time samples (process, health, sessions, groups, endpoints, GPU
  /// memory) into `out`: the collector registered with metrics::Default().
  void CollectMetrics(metrics::SnapshotBuilder& out) const;
  /// Counts this start (metrics_state_file), registers CollectMetrics and starts the
  /// --metrics_listen server.
  absl::Status StartMetrics();
  /// Moves the metrics listener from `from` to `to` ("" = none) for a reload: the new one
  /// is bound before the old one stops (or, when that fails, right after it stopped, for a
  /// move that keeps the port); when `to` cannot be bound the old one serves on.
  absl::Status MoveMetricsListener(const std::string& from, const std::string& to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(operator_mu_);
  /// Logs, audits and counts a reload that ended with `result` ("ok", "refused",
  /// "failed"); `status` is the error of a failed one.
  void RecordReload(const std::string& trigger, const std::optional<PeerCredentials>& caller,
                    const absl::Status& status, const v1::ReloadConfigResponse& response);
  /// The health updater: listener health and unmapped-endpoint expiry, every
  /// health_interval until shutdown.
  void WatchHealth();

  /// The configuration in effect. Written (by ApplyConfig) under operator_mu_ and
  /// config_mu_; read under either (Init, before any reload, reads it freely).
  v1::DaemonConfig config_;
  mutable absl::Mutex config_mu_;
  DaemonOptions options_;
  const std::string socket_path_;
  const absl::Time started_;
  BackendChoice backend_;
  int tcp_port_ = 0;
  uint64_t socket_inode_ = 0;  ///< The socket file we created (removed only if unchanged).

  /// The Peer service and its clients (peer_listen); before the data plane, which uses it.
  std::unique_ptr<peer::GrpcPeerMesh> peer_mesh_;
  /// The transports between daemons by name, NICs and preflight lines; before the data
  /// plane, which uses them.
  std::unique_ptr<transport::Transports> transports_;
  std::unique_ptr<DataPlane> data_plane_;
  /// DaemonConfig.audit_log (null when off); before the registry and the Control service,
  /// which write to it.
  std::unique_ptr<AuditLog> audit_log_;
  std::unique_ptr<GroupRegistry> registry_;
  std::unique_ptr<ControlService> control_;
  /// Answers fd-channel connections of the unix socket (the endpoints' descriptors).
  std::unique_ptr<FdChannel> fd_channel_;
  ScopedFd socket_lock_;                      // flock on "<socket>.lock" (one epd per socket).
  std::unique_ptr<UnixListener> listener_;    // The unix socket: accepts, routes to server_.
  std::unique_ptr<grpc::Server> server_;      // Control and Health, fed by listener_.
  std::unique_ptr<grpc::Server> tcp_server_;  // --listen: Health only (no Control over TCP).
  /// The generated Control base class, whose every method answers UNIMPLEMENTED: registered
  /// on the TCP server so that it is a synchronous server (gRPC then polls its default
  /// health service), while Control calls over TCP are refused.
  std::unique_ptr<v1::Control::Service> tcp_control_refusal_;
  /// Restarts before this start (metrics_state_file); -1 when unknown.
  int64_t restarts_ = -1;
  metrics::Registration metrics_collector_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_ ABSL_GUARDED_BY(operator_mu_);
  /// Config reloads by result: ok, refused, failed (epd_config_reloads_total).
  std::atomic<uint64_t> reloads_[3] = {};
  std::thread gpu_monitor_;
  std::thread health_watcher_;

  absl::Mutex publish_mu_;  ///< Serialises PublishServing (the health services' order).
  mutable absl::Mutex mu_;
  GpuInventory inventory_ ABSL_GUARDED_BY(mu_);
  bool start_up_done_ ABSL_GUARDED_BY(mu_) = false;
  std::string gpu_lost_ ABSL_GUARDED_BY(mu_);             ///< Why a GPU is lost ("" = none).
  std::string listener_stuck_ ABSL_GUARDED_BY(mu_);       ///< Why the listener is stuck ("").
  std::string peer_listener_stuck_ ABSL_GUARDED_BY(mu_);  ///< Why the Peer listener is ("").
  bool drained_ ABSL_GUARDED_BY(mu_) = false;  ///< SetDrained (the registry has its own).
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex shutdown_mu_;  ///< Serialises Shutdown().
  /// Serialises the operator's actions (reloads, drains) and the metrics listener's moves;
  /// Shutdown waits for one in progress, and later ones find shutting_down_ set.
  mutable absl::Mutex operator_mu_;
};

}  // namespace epd
