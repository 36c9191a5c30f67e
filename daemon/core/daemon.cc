#include "daemon/core/daemon.h"

#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "daemon/control/audit_log.h"
#include "daemon/control/control_service.h"
#include "daemon/control/group_registry.h"
#include "daemon/core/config.h"
#include "daemon/core/config_overrides.h"
#include "daemon/core/fd_limits.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/gpu/cuda_driver_probe.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "daemon/server/fd_channel.h"
#include "daemon/server/listener.h"
#include "daemon/transport/transport_factory.h"
#if EPD_HAVE_CUDA
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#endif
#include "common/status_macros.h"
#include "daemon/core/logging.h"
#include "daemon/core/socket_lock.h"
#include "daemon/server/socket_path_checks.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace epd {
namespace {

/// GetStats' limits and CUDA versions of this process (what `epctl doctor` checks).
void FillNodeLimits(v1::GetStatsResponse* stats) {
  struct rlimit memlock {};
  if (::getrlimit(RLIMIT_MEMLOCK, &memlock) == 0) {
    stats->set_memlock_limit_bytes(
        memlock.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(memlock.rlim_cur));
  }
  if (absl::StatusOr<FdLimit> fds = GetFdLimit(); fds.ok()) stats->set_fd_limit(fds->soft);
  // The versions do not change while epd runs: asked once.
  static const CudaDriverFacts cuda = ProbeCudaDriver(/*list_gpus=*/false);
  stats->set_cuda_driver_version(cuda.driver_version);
  stats->set_cuda_runtime_version(cuda.runtime_version);
  if (absl::StatusOr<Version> version = ParseVersion(kEpdVersion); version.ok()) {
    stats->set_compatible_client_versions(CompatibleClientVersions(*version));
  }
}

/// Whether the CUDA data plane exists in this build (daemon/dataplane/cuda/, built with CUDA).
/// Without it, a GPU choice runs the host data plane (and GetStats says so).
#if EPD_HAVE_CUDA
constexpr bool kCudaDataPlaneBuilt = true;
#else
constexpr bool kCudaDataPlaneBuilt = false;
#endif

/// gRPC limits of each unix-socket connection: concurrent calls (streams), and how long it
/// may stay without any call before gRPC closes it.
constexpr int kMaxStreamsPerConnection = 64;
constexpr absl::Duration kMaxConnectionIdle = absl::Minutes(5);

std::string Errno(int err) { return std::strerror(err); }

/// Result of connecting to an existing socket file.
enum class SocketProbe { kLive, kStale, kError };

SocketProbe ProbeUnixSocket(const std::string& path, int* err) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return SocketProbe::kError;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size() + 1, sizeof(addr.sun_path)));
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  *err = rc == 0 ? 0 : errno;
  ::close(fd);
  if (rc == 0) return SocketProbe::kLive;
  if (*err == ECONNREFUSED || *err == ENOENT) return SocketProbe::kStale;
  return SocketProbe::kError;
}

/// A description of whoever answers on `path`, to follow "a live " ("epd 0.1.0 (pid 123,
/// SERVING)" or "process that does not answer ...").
std::string DescribeLiveServer(const std::string& path) {
  auto channel = grpc::CreateChannel("unix://" + path, grpc::InsecureChannelCredentials());
  auto stub = v1::Control::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::GetStatsRequest request;
  v1::GetStatsResponse response;
  grpc::Status status = stub->GetStats(&context, request, &response);
  if (!status.ok()) {
    return absl::StrCat("process that does not answer epd's GetStats (", status.error_message(),
                        ")");
  }
  return absl::StrCat("epd ", response.version(), " (pid ", response.pid(), ", ",
                      response.serving_status(), ")");
}

/// FAILED_PRECONDITION: another server answers on `socket_path`.
absl::Status SocketInUse(const std::string& socket_path) {
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "socket_path: ", socket_path, " is in use by a live ", DescribeLiveServer(socket_path),
          "; refusing to start a second epd on it (stop the other one or choose another "
          "--socket)")),
      errors::Reason::kSocketUnsafe);
}

/// The gid of the socket_group `name` (which owns the socket).
/// NOT_FOUND naming the field, its flag and the value when the machine has no such group.
absl::StatusOr<gid_t> LookUpSocketGroup(const std::string& name) {
  std::vector<char> buffer(16384);
  group entry{};
  group* result = nullptr;
  int rc = 0;
  while ((rc = ::getgrnam_r(name.c_str(), &entry, buffer.data(), buffer.size(), &result)) ==
             ERANGE &&
         buffer.size() < (1u << 24)) {
    buffer.resize(buffer.size() * 2);
  }
  if (rc != 0 || result == nullptr) {
    return errors::WithReason(
        absl::NotFoundError(absl::StrCat(
            "socket_group (--socket_group or the config file's socket_group): \"", name,
            "\" is not a group on this machine", rc != 0 ? absl::StrCat(" (", Errno(rc), ")") : "",
            "; it must name an existing group (see `getent group`), which then owns the socket")),
        errors::Reason::kConfigInvalid);
  }
  return result->gr_gid;
}

/// ChooseBackend, with `requested_by` naming where the requested backend came from
/// (ConfigValueSource: the command line, the config file or an in-process config), so the
/// log line and GetStats.backend_reason do not claim a flag the user never gave.
absl::StatusOr<BackendChoice> ChooseBackendRequestedBy(v1::Backend requested,
                                                       const std::string& requested_by,
                                                       const GpuInventory& inventory,
                                                       bool cuda_data_plane_built) {
  const std::string not_built =
      "but the CUDA data plane is not built yet; using host buffers (the GPU inventory is "
      "still reported)";
  switch (requested) {
    case v1::BACKEND_HOST:
      return BackendChoice{"host", absl::StrCat("requested by ", requested_by)};
    case v1::BACKEND_CUDA:
      if (inventory.empty()) {
        return errors::WithReason(absl::FailedPreconditionError(
                                      absl::StrCat("backend: cuda requested by ", requested_by,
                                                   " but no GPU is usable: ", inventory.reason(),
                                                   "; use --backend=auto or --backend=host")),
                                  errors::Reason::kCudaNoDevice);
      }
      if (!cuda_data_plane_built) {
        return BackendChoice{"host", absl::StrCat("cuda requested by ", requested_by, " with ",
                                                  inventory.reason(), ", ", not_built)};
      }
      return BackendChoice{"cuda",
                           absl::StrCat("requested by ", requested_by, "; ", inventory.reason())};
    default:
      if (inventory.empty()) {
        return BackendChoice{"host",
                             absl::StrCat("auto: no usable GPU (", inventory.reason(), ")")};
      }
      if (!cuda_data_plane_built) {
        return BackendChoice{"host",
                             absl::StrCat("auto: ", inventory.reason(), " found, ", not_built)};
      }
      return BackendChoice{"cuda", absl::StrCat("auto: ", inventory.reason(), " found")};
  }
}

}  // namespace

absl::StatusOr<BackendChoice> ChooseBackend(v1::Backend requested, const GpuInventory& inventory,
                                            bool cuda_data_plane_built) {
  return ChooseBackendRequestedBy(requested, "--backend=" + BackendFlagName(requested), inventory,
                                  cuda_data_plane_built);
}

absl::StatusOr<std::unique_ptr<DataPlane>> MakeDefaultDataPlane(
    const v1::DaemonConfig& config, const BackendChoice& choice, peer::PeerMesh* peer_mesh,
    const transport::TransportSet* transports) {
#if EPD_HAVE_CUDA
  if (choice.backend == "cuda") {
    CudaDataPlaneOptions options;
    options.op_timeout_ms = config.op_timeout_ms();
    options.engine_idle_us = config.engine_idle_us();
    options.gpu_uuids.assign(config.gpu_uuids().begin(), config.gpu_uuids().end());
    options.host_threads = static_cast<int>(config.host_threads());
    options.op_graphs = config.cuda_op_graphs() == "on";
    options.fused_launch = config.cuda_fused_launch() != "off";
    options.peer_mesh = peer_mesh;
    options.transports = transports;
    return MakeCudaDataPlane(options);
  }
#endif
  if (choice.backend != "host") {
    return absl::UnimplementedError(
        absl::StrCat("backend \"", choice.backend, "\" has no data plane in this build"));
  }
  HostDataPlaneOptions options;
  options.op_timeout_ms = config.op_timeout_ms();
  options.engine_idle_us = config.engine_idle_us();
  options.host_threads = static_cast<int>(config.host_threads());
  options.peer_mesh = peer_mesh;
  options.transports = transports;
  return MakeHostDataPlane(options);
}

Daemon::Daemon(v1::DaemonConfig config, DaemonOptions options)
    : config_(std::move(config)),
      options_(std::move(options)),
      socket_path_(SocketFilePath(config_.socket_path())),
      started_(absl::Now()) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(v1::DaemonConfig config,
                                                      DaemonOptions options) {
  std::unique_ptr<Daemon> daemon(new Daemon(std::move(config), std::move(options)));
  absl::Status status = daemon->Init();
  if (!status.ok()) {
    GetLogger(kLogDaemon)->error("epd failed to start: {}", errors::StatusText(status));
    return status;
  }
  return daemon;
}

absl::Status Daemon::Init() {
  EPD_RETURN_IF_ERROR(SetLogLevel(config_.log_level()));
  auto log = GetLogger(kLogDaemon);
  // Create every subsystem's logger now, so components that look theirs up find it.
  for (const char* name : {kLogControl, kLogRegistry, kLogEngine, kLogGpu, kLogConfig, kLogPeer}) {
    GetLogger(name);
  }
  log->info("epd {} starting (pid {}) on socket {}", kEpdVersion, ::getpid(), socket_path_);
  for (const std::string& warning : DaemonConfigWarnings(config_)) {
    GetLogger(kLogConfig)->warn("{}", warning);
  }
  for (const ConfigFlagOverride& o : options_.flag_overrides) {
    GetLogger(kLogConfig)->info("{}", ConfigFlagOverrideText(o));
  }
  // Every connection, endpoint and doorbell holds a descriptor: take all the kernel allows.
  if (absl::StatusOr<FdLimitChange> fds = RaiseFdLimitToHard(); fds.ok()) {
    log->info(
        "RLIMIT_NOFILE: soft limit {} (hard limit {}); joins are refused while fewer than "
        "min_free_fds = {} are free",
        fds->before.soft == fds->after.soft
            ? absl::StrCat(fds->after.soft, ", already the hard limit")
            : absl::StrCat(fds->before.soft, " -> ", fds->after.soft),
        fds->after.hard, config_.min_free_fds());
    if (config_.min_free_fds() >= fds->after.soft) {
      GetLogger(kLogConfig)
          ->warn(
              "min_free_fds = {} is not below epd's descriptor limit {}: every join will be "
              "refused; lower min_free_fds or raise the hard limit (LimitNOFILE=)",
              config_.min_free_fds(), fds->after.soft);
    }
  } else {
    log->warn("{}; epd keeps its soft limit", fds.status().message());
  }
  // The group owns the socket: check it before anything is created.
  if (!config_.socket_group().empty()) {
    EPD_RETURN_IF_ERROR(LookUpSocketGroup(config_.socket_group()).status());
  }

  // GPUs and backend.
  GpuInventory inventory;
  if (options_.inventory) {
    inventory = *options_.inventory;
  } else {
    std::vector<std::string> allowed(config_.gpu_uuids().begin(), config_.gpu_uuids().end());
    EPD_ASSIGN_OR_RETURN(inventory, GpuInventory::Discover(allowed));
  }
  auto gpu_log = GetLogger(kLogGpu);
  gpu_log->info("GPU inventory: {}", inventory.reason());
  for (const v1::GpuInfo& g : inventory.gpus()) {
    gpu_log->info("GPU {}: {} {} {} SMs, {:.1f}/{:.1f} GiB free, sm_{}{}", g.ordinal(), g.uuid(),
                  g.pci_bus_id(), g.sm_count(), g.free_memory_bytes() / double(1ull << 30),
                  g.total_memory_bytes() / double(1ull << 30), g.compute_capability_major(),
                  g.compute_capability_minor());
  }
  gpu_log->info("MPS {}: {}", inventory.mps().active ? "active" : "not active",
                inventory.mps().detail);
  if (!inventory.empty() && !inventory.mps().active) {
    gpu_log->warn(
        "MPS is not running: daemon-launched kernels will time-slice with client processes "
        "(~ms per hop); start it with deploy/mps/ for daemon-launched mode");
  }
  // Which of the command line or the config file asked for the backend (main.cc says;
  // an in-process daemon's DaemonConfig otherwise).
  const std::string backend_source = options_.backend_source.empty()
                                         ? BackendSource(config_, ConfigFlags{})
                                         : options_.backend_source;
  EPD_ASSIGN_OR_RETURN(backend_, ChooseBackendRequestedBy(config_.backend(), backend_source,
                                                          inventory, kCudaDataPlaneBuilt));
  log->info("backend {} ({})", backend_.backend, backend_.reason);
  {
    absl::MutexLock lock(&mu_);
    inventory_ = inventory;
  }

  // NICs and preflight before anything is created or bound: a daemon configured for a
  // transport it cannot run is refused here.
  const transport::TransportStartOptions transport_options = TransportOptions();
  EPD_ASSIGN_OR_RETURN(transport::TransportPlan transport_plan,
                       transport::PlanTransports(config_, transport_options));
  // One epd per socket (its lock file).
  EPD_RETURN_IF_ERROR(PrepareSocketPath());
  // The transports before the Peer listener: RDMA, when it is configured and fails to
  // start, refuses the daemon before anything listens.
  EPD_ASSIGN_OR_RETURN(transports_, transport::StartTransports(config_, std::move(transport_plan),
                                                               transport_options));
  if (!config_.peer_listen().empty()) EPD_RETURN_IF_ERROR(StartPeerMesh());
  if (options_.data_plane_factory) {
    EPD_ASSIGN_OR_RETURN(data_plane_, options_.data_plane_factory(config_, backend_));
  } else {
    EPD_ASSIGN_OR_RETURN(data_plane_,
                         MakeDefaultDataPlane(config_, backend_, peer_mesh_.get(),
                                              peer_mesh_ != nullptr ? &transports_->set : nullptr));
  }
  if (!config_.audit_log().empty()) {
    EPD_ASSIGN_OR_RETURN(audit_log_, AuditLog::Open(config_.audit_log()));
  }
  GroupRegistry::Options registry_options;
  registry_options.audit_log = audit_log_.get();
  registry_options.max_groups = config_.max_groups();
  // GetGroupEndpoints waits at most an op timeout (plus slack) for the ranks to join.
  registry_options.max_endpoints_wait_ms = config_.op_timeout_ms() + 5000;
  registry_options.min_free_fds = config_.min_free_fds();
  registry_options.unmapped_endpoint_timeout =
      absl::Milliseconds(config_.unmapped_endpoint_timeout_ms());
  registry_options.max_groups_per_uid = config_.max_groups_per_uid();
  registry_options.max_endpoints_per_uid = config_.max_endpoints_per_uid();
  registry_options.max_endpoint_bytes_per_uid = config_.max_endpoint_bytes_per_uid();
  registry_options.max_sessions_per_uid = config_.max_sessions_per_uid();
  registry_options.operator_uid = ::geteuid();  // With root, sees every group.
  registry_options.peer_mesh = peer_mesh_.get();
  registry_options.transports = peer_mesh_ != nullptr ? &transports_->set : nullptr;
  registry_ = std::make_unique<GroupRegistry>(data_plane_.get(), inventory, registry_options);
  OperatorActions actions;
  actions.drain = [this](bool drain, const PeerCredentials& caller) {
    return SetDrained(drain, caller);
  };
  actions.reload = [this](const PeerCredentials& caller) { return ReloadConfig(caller); };
  control_ = std::make_unique<ControlService>(
      registry_.get(), [this] { return Stats(); }, std::move(actions));
  EPD_ASSIGN_OR_RETURN(fd_channel_, FdChannel::Start([registry = registry_.get()](
                                                         const v1::FdChannelRequest& request,
                                                         const PeerCredentials& peer) {
                         return registry->TakeEndpointFds(request.session_id(), request.group(),
                                                          request.rank(), peer);
                       }));

  // gRPC servers: Control and Health on the unix socket (local clients: its mode and group
  // are the access control, SO_PEERCRED their identity); Health alone on the optional TCP
  // listener, for load balancers and kubelet probes. Control has no authentication, so it
  // is never served over TCP (DESIGN.md §3.1: Control is for local clients over the unix
  // socket). epd accepts the unix socket's connections itself (listener_) and hands gRPC's
  // to server_, which has no listening port of its own.
  grpc::EnableDefaultHealthCheckService(true);
  if (!config_.listen().empty()) {
    grpc::ServerBuilder tcp_builder;
    tcp_builder.AddListeningPort(config_.listen(), grpc::InsecureServerCredentials(), &tcp_port_);
    tcp_builder.SetMaxReceiveMessageSize(4096);  // Health requests only.
    // gRPC sets SO_REUSEPORT by default: a second epd on the same port would then share
    // it, and probes could be answered by the wrong daemon. Bind exclusively instead.
    tcp_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    tcp_control_refusal_ = std::make_unique<v1::Control::Service>();
    tcp_builder.RegisterService(tcp_control_refusal_.get());
    tcp_server_ = tcp_builder.BuildAndStart();
    if (tcp_server_ == nullptr || tcp_port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("listen: cannot listen on ", config_.listen(),
                       " (address in use or not permitted; see the gRPC error above)"));
    }
  }
  UnixListener::Options listener_options;
  listener_options.socket_path = socket_path_;
  listener_options.fd_channel_handler = fd_channel_->Handler();
  listener_options.loop_hook_for_testing = options_.listener_loop_hook_for_testing;
  // Connection caps: per uid (root and epd's own uid exempt, so an operator always gets
  // in), and in all, keeping min_free_fds descriptors (at least half the limit) for
  // endpoints, gRPC and the exempt uids.
  listener_options.max_connections_per_uid = config_.max_connections_per_uid();
  listener_options.exempt_uids = {0, static_cast<uint32_t>(::geteuid())};
  if (absl::StatusOr<FdLimit> fd_limit = GetFdLimit(); fd_limit.ok()) {
    listener_options.max_connections =
        fd_limit->soft - std::min<uint64_t>(config_.min_free_fds(), fd_limit->soft / 2);
  }
  // Bound with mode 0600: nobody but us may connect until the mode and group are applied.
  absl::StatusOr<std::unique_ptr<UnixListener>> listener =
      UnixListener::Bind(std::move(listener_options));
  if (!listener.ok()) {
    return absl::UnavailableError(absl::StrCat("socket_path: cannot listen on ", unix_target(),
                                               ": ", listener.status().message()));
  }
  listener_ = *std::move(listener);
  struct stat st {};
  if (::stat(socket_path_.c_str(), &st) == 0) socket_inode_ = st.st_ino;
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_request_bytes()));
  // Per connection: a bounded number of concurrent calls (a client has one Session stream
  // and a few calls at a time), and a connection without any call for a while is closed
  // (a client holds its Session stream open for its whole life, so only connections that
  // never opened one, or finished with it, go idle).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(absl::ToInt64Milliseconds(kMaxConnectionIdle)));
  builder.RegisterService(control_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError("cannot start the gRPC server of the unix socket");
  }
  PublishServing();  // NOT_SERVING (starting) until start-up is done.
  EPD_RETURN_IF_ERROR(StartMetrics());
  listener_->Start(server_.get());
  EPD_RETURN_IF_ERROR(ApplySocketPermissions());
  if (!config_.listen().empty()) {
    log->info(
        "TCP listener {} (port {}): grpc.health.v1 only (Control is served on the unix "
        "socket alone)",
        config_.listen(), tcp_port_);
  }
  if (!inventory.empty()) gpu_monitor_ = std::thread([this] { MonitorGpus(); });
  health_watcher_ = std::thread([this] { WatchHealth(); });
  {
    absl::MutexLock lock(&mu_);
    start_up_done_ = true;
  }
  PublishServing();
  log->info("epd serving on {} (socket mode {}{}{}), backend {}", unix_target(),
            config_.socket_mode(), config_.socket_group().empty() ? "" : ", group ",
            config_.socket_group(), backend_.backend);
  return absl::OkStatus();
}

absl::Status Daemon::PrepareSocketPath() {
  auto log = GetLogger(kLogDaemon);
  // Before anything is created: the socket path is free or a socket, and no user but root
  // and epd's can replace files in its directory or the ones above.
  EPD_RETURN_IF_ERROR(CheckSocketPathIsFreeOrASocket(socket_path_));
  EPD_RETURN_IF_ERROR(CheckSocketDirectories(socket_path_, ::geteuid()));
  // Missing parents are created (deploy/examples/host-dev.textproto's /tmp/epd-dev relies
  // on it; systemd's RuntimeDirectory= and the Kubernetes hostPath make /run/epd), and said
  // at info level naming the topmost one, where a typo in --socket would show.
  std::string created_top;
  EPD_RETURN_IF_ERROR(CreateSocketDirectories(socket_path_, &created_top));
  if (!created_top.empty()) {
    const std::string parent = std::filesystem::path(socket_path_).parent_path().string();
    log->info(
        "socket_path: created the missing directory {}{} for the socket (epd creates the "
        "socket's missing parent directories; if this is unexpected, check --socket or the "
        "config file's socket_path for a typo)",
        parent, created_top == parent ? "" : absl::StrCat(" (from ", created_top, " down)"));
    EPD_RETURN_IF_ERROR(CheckSocketDirectories(socket_path_, ::geteuid()));
  }
  // One epd per socket, also when two start at the same instant (both would find no live
  // socket below, and the later bind would take the socket file from the earlier): an
  // exclusive flock on "<socket>.lock", held for the daemon's life (released by the kernel
  // however epd ends; the file itself stays, harmlessly).
  const std::string lock_path = socket_path_ + ".lock";
  EPD_ASSIGN_OR_RETURN(SocketLockAttempt attempt, TryLockSocketFile(lock_path));
  if (!attempt.lock.valid()) {
    const int err = attempt.error;
    const pid_t holder = attempt.holder;
    int probe_err = 0;
    if (ProbeUnixSocket(socket_path_, &probe_err) == SocketProbe::kLive) {
      return SocketInUse(socket_path_);
    }
    if (holder != 0) {
      // A running epd that does not answer on the socket: still starting, or its socket
      // file was deleted or replaced (it then serves nobody, and only stopping it helps).
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "socket_path: ", socket_path_, " is held by epd pid ", holder, " (", lock_path,
              " is locked), which does not answer on it: it is still starting, or its socket "
              "file was deleted (then stop it, e.g. kill ",
              holder, ", and start again); refusing to start a second epd on it")),
          errors::Reason::kSocketUnsafe);
    }
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "socket_path: ", socket_path_, " is held by another epd that is starting (", lock_path,
            " is locked: ", Errno(err), "); refusing to start a second epd on it")),
        errors::Reason::kSocketUnsafe);
  }
  socket_lock_ = std::move(attempt.lock);
  struct stat st {};
  if (::lstat(socket_path_.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "socket_path: cannot stat ", socket_path_, ": ", Errno(errno))),
                              errors::Reason::kSocketUnsafe);
  }
  if (!S_ISSOCK(st.st_mode)) return CheckSocketPathIsFreeOrASocket(socket_path_);
  int err = 0;
  switch (ProbeUnixSocket(socket_path_, &err)) {
    case SocketProbe::kLive:
      return SocketInUse(socket_path_);
    case SocketProbe::kStale:
      log->warn("replacing stale socket file {} (nothing listens on it)", socket_path_);
      if (::unlink(socket_path_.c_str()) != 0 && errno != ENOENT) {
        return errors::WithReason(
            absl::FailedPreconditionError(absl::StrCat("socket_path: cannot remove stale socket ",
                                                       socket_path_, ": ", Errno(errno))),
            errors::Reason::kSocketUnsafe);
      }
      return absl::OkStatus();
    case SocketProbe::kError:
      break;
  }
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat("socket_path: cannot probe existing socket ",
                                                 socket_path_, ": ", Errno(err))),
      errors::Reason::kSocketUnsafe);
}

absl::Status Daemon::StartPeerMesh() {
  peer::PeerMeshOptions options;
  options.listen = config_.peer_listen();
  options.advertise = config_.peer_advertise();
  EPD_ASSIGN_OR_RETURN(options.secret, ReadPeerSecretFile(config_.peer_secret_file()));
  if (!config_.peer_tls_cert_file().empty()) {
    EPD_ASSIGN_OR_RETURN(options.tls_cert_pem,
                         ReadPemFile("peer_tls_cert_file", config_.peer_tls_cert_file()));
    EPD_ASSIGN_OR_RETURN(options.tls_key_pem,
                         ReadPemFile("peer_tls_key_file", config_.peer_tls_key_file()));
    EPD_ASSIGN_OR_RETURN(options.tls_ca_pem,
                         ReadPemFile("peer_tls_ca_file", config_.peer_tls_ca_file()));
  }
  options.heartbeat_interval = absl::Milliseconds(config_.peer_heartbeat_ms());
  options.max_message_bytes = static_cast<int>(config_.max_request_bytes());
  EPD_ASSIGN_OR_RETURN(peer_mesh_, peer::GrpcPeerMesh::Start(std::move(options)));
  return absl::OkStatus();
}

peer::PeerMesh* Daemon::peer_mesh() const { return peer_mesh_.get(); }

transport::TransportStartOptions Daemon::TransportOptions() const {
  transport::TransportStartOptions options;
  options.start = !config_.peer_listen().empty();
  {
    absl::MutexLock lock(&mu_);
    options.gpus = inventory_.gpus();
  }
  options.sysfs_root = options_.sysfs_root;
  options.facts = options_.preflight_facts;
  return options;
}

absl::Status Daemon::ApplySocketPermissions() {
  EPD_ASSIGN_OR_RETURN(uint32_t mode, ParseFileMode("socket_mode", config_.socket_mode()));
  if (!config_.socket_group().empty()) {
    EPD_ASSIGN_OR_RETURN(gid_t gid, LookUpSocketGroup(config_.socket_group()));
    if (::chown(socket_path_.c_str(), static_cast<uid_t>(-1), gid) != 0) {
      const int err = errno;
      return errors::WithReason(
          absl::PermissionDeniedError(absl::StrCat(
              "socket_group: cannot give ", socket_path_, " to group \"", config_.socket_group(),
              "\" (gid ", gid, "): ", Errno(err),
              err == EPERM
                  ? absl::StrCat("; epd's user (uid ", ::geteuid(),
                                 ") must be a member of group \"", config_.socket_group(),
                                 "\" (socket_group)",
                                 // Never advise joining group root: it gives far more than this.
                                 gid == 0 ? ": set socket_group to a dedicated group instead of "
                                            "root (e.g. epd, which deploy/systemd/epd.sysusers "
                                            "creates) that epd's user is a member of"
                                          : "",
                                 ", or run epd as root")
                  : "")),
          errors::Reason::kSocketUnsafe);
    }
  }
  if (::chmod(socket_path_.c_str(), static_cast<mode_t>(mode)) != 0) {
    return errors::WithReason(
        absl::PermissionDeniedError(absl::StrCat("socket_mode: cannot chmod ", socket_path_, " to ",
                                                 config_.socket_mode(), ": ", Errno(errno))),
        errors::Reason::kSocketUnsafe);
  }
  return absl::OkStatus();
}

v1::GetStatsResponse Daemon::Stats() const {
  v1::GetStatsResponse stats;
  stats.set_version(kEpdVersion);
  stats.set_backend(data_plane_ != nullptr ? data_plane_->backend_name() : backend_.backend);
  stats.set_backend_reason(backend_.reason);
  stats.set_uptime_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(absl::Now() - started_)));
  if (registry_ != nullptr) {
    GroupRegistry::Counters c = registry_->counters();
    stats.set_num_groups(c.num_groups);
    stats.set_num_sessions(c.num_sessions);
    stats.set_ops_completed(c.ops_completed);
    stats.set_ops_failed(c.ops_failed);
  }
  *stats.mutable_effective_config() = config();
  if (peer_mesh_ != nullptr) stats.set_peer_address(peer_mesh_->advertised_address());
  if (transports_ != nullptr) {
    for (const v1::NicInfo& n : transports_->nics) *stats.add_nics() = n;
    for (const std::string& line : transports_->preflight) stats.add_preflight(line);
    if (peer_mesh_ != nullptr) {
      for (const std::string& name : transports_->set.names()) stats.add_transports(name);
    }
  }
  stats.set_pid(::getpid());
  FillNodeLimits(&stats);
  absl::MutexLock lock(&mu_);
  stats.set_mps_active(inventory_.mps().active);
  for (const v1::GpuInfo& g : inventory_.gpus()) *stats.add_gpus() = g;
  stats.set_draining(drained_);
  const std::string not_serving = NotServingReasonLocked();
  stats.set_serving_status(not_serving.empty() ? "SERVING"
                                               : absl::StrCat("NOT_SERVING (", not_serving, ")"));
  return stats;
}

v1::DaemonConfig Daemon::config() const {
  absl::MutexLock lock(&config_mu_);
  return config_;
}

void Daemon::Shutdown() {
  absl::MutexLock serialise(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
  }
  auto log = GetLogger(kLogDaemon);
  const absl::Time begin = absl::Now();
  if (server_ != nullptr) log->info("draining: health NOT_SERVING, joins refused");
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;  // Also stops the GPU monitor and the health updater.
  }
  // An operator action in progress ends first; later ones see shutting_down_.
  { absl::MutexLock barrier(&operator_mu_); }
  PublishServing();
  if (registry_ != nullptr) registry_->SetDraining();
  Audit(audit_log_.get(), {audit::kDrain, std::nullopt, "", -1, absl::OkStatus(),
                           "shutdown: health NOT_SERVING, sessions and joins refused"});
  if (server_ != nullptr) {
    absl::SleepFor(options_.drain_grace);
    // Ops still in flight complete with UNAVAILABLE ("epd is shutting down") before the
    // sessions end; otherwise they would fail as "rank N left the group".
    if (data_plane_ != nullptr) data_plane_->Shutdown();
    if (control_ != nullptr) control_->DrainSessions();
    // No new connection from here on; those gRPC has keep being served until its Shutdown.
    if (listener_ != nullptr) listener_->Stop();
    for (grpc::Server* server : {server_.get(), tcp_server_.get()}) {
      if (server == nullptr) continue;
      if (server->GetHealthCheckService() != nullptr) server->GetHealthCheckService()->Shutdown();
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(1000));
      server->Wait();
    }
  }
  if (gpu_monitor_.joinable()) gpu_monitor_.join();
  if (health_watcher_.joinable()) health_watcher_.join();
  if (listener_ != nullptr) listener_->Stop();
  // Scrapes end before what they read goes.
  {
    absl::MutexLock lock(&operator_mu_);
    if (metrics_server_ != nullptr) metrics_server_->Stop();
    metrics_server_.reset();
  }
  metrics_collector_.Reset();
  server_.reset();
  listener_.reset();
  tcp_server_.reset();
  tcp_control_refusal_.reset();
  control_.reset();
  fd_channel_.reset();
  if (registry_ != nullptr) registry_->ReleaseAll();
  registry_.reset();
  if (data_plane_ != nullptr) data_plane_->Shutdown();
  data_plane_.reset();
  // After the data plane: its groups' teardown notices go out before the mesh stops, and
  // its links are closed before the transport's thread goes.
  if (transports_ != nullptr) transports_->Shutdown();
  transports_.reset();
  if (peer_mesh_ != nullptr) peer_mesh_->Shutdown();
  peer_mesh_.reset();
  struct stat st {};
  if (socket_inode_ != 0 && ::stat(socket_path_.c_str(), &st) == 0 && st.st_ino == socket_inode_) {
    ::unlink(socket_path_.c_str());
  }
  if (socket_inode_ != 0) {
    log->info("epd stopped: resources released in {}",
              absl::FormatDuration(absl::Trunc(absl::Now() - begin, absl::Milliseconds(1))));
  }
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
}

}  // namespace epd
