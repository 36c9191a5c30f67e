// The Daemon's operator-facing side (daemon.h): health (what makes it NOT_SERVING, the GPU
// monitor and the listener watcher, publishing to both servers' health services), the metrics
// it exports and its --metrics_listen listener, config reload (SIGHUP, Control.ReloadConfig)
// and the operator's drain. Start-up, the socket and shutdown are in daemon.cc.
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/control/audit_log.h"
#include "daemon/control/group_registry.h"
#include "daemon/core/config.h"
#include "daemon/core/config_overrides.h"
#include "daemon/core/config_reload.h"
#include "daemon/core/daemon.h"
#include "daemon/core/logging.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/metrics/start_count.h"
#include "daemon/peer/grpc_peer_mesh.h"
#include "daemon/server/listener.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace epd {

namespace {

/// Results of a config reload, as epd_config_reloads_total labels them (Daemon::reloads_).
constexpr const char* kReloadResults[] = {"ok", "refused", "failed"};

/// The --metrics_listen server on `listen`, serving the default registry; logged.
absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> StartMetricsServer(
    const std::string& listen) {
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<metrics::MetricsServer> server,
                       metrics::MetricsServer::Start(listen, [] {
                         return metrics::RenderPrometheus(metrics::Default().Collect());
                       }));
  GetLogger(kLogDaemon)
      ->info("metrics listener {} (port {}): Prometheus text format at /metrics", listen,
             server->port());
  return server;
}

/// Who asked for an operator action, for its log and audit lines: "`rpc` from uid 0 (pid
/// 12, ...)", or `own` when epd acts on its own (a signal, a call inside the process).
std::string Asker(const std::optional<PeerCredentials>& caller, absl::string_view rpc,
                  absl::string_view own) {
  return caller ? absl::StrCat(rpc, " from ", DescribeCredentials(*caller)) : std::string(own);
}

}  // namespace

std::string Daemon::NotServingReasonLocked(bool count_drain) const {
  if (shutting_down_) return "draining: shutting down";
  if (!start_up_done_) return "starting";
  if (!gpu_lost_.empty()) return gpu_lost_;
  if (!listener_stuck_.empty()) return listener_stuck_;
  if (!peer_listener_stuck_.empty()) return peer_listener_stuck_;
  // Last: a fault above is what an operator must see first on a drained node.
  if (count_drain && drained_) return "drained by the operator: `epctl undrain` serves again";
  return "";
}

bool Daemon::ProcessServing() const {
  absl::MutexLock lock(&mu_);
  return NotServingReasonLocked(/*count_drain=*/false).empty();
}

void Daemon::PublishServing() {
  absl::MutexLock publish(&publish_mu_);
  bool control_serving = false;
  bool process_serving = false;
  {
    absl::MutexLock lock(&mu_);
    control_serving = NotServingReasonLocked().empty();
    // A drain is the operator's, on purpose: the Control service (what readiness and load
    // balancers ask) stops serving, the process's own health ("", what liveness asks) does
    // not, or a liveness probe would restart epd and end every group on the node.
    process_serving = NotServingReasonLocked(/*count_drain=*/false).empty();
  }
  for (grpc::Server* server : {server_.get(), tcp_server_.get()}) {
    if (server != nullptr && server->GetHealthCheckService() != nullptr) {
      server->GetHealthCheckService()->SetServingStatus("", process_serving);
      server->GetHealthCheckService()->SetServingStatus(kControlServiceName, control_serving);
    }
  }
}

void Daemon::MonitorGpus() {
  auto log = GetLogger(kLogGpu);
  bool lost = false;
  while (true) {
    GpuInventory copy;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), options_.gpu_poll_interval)) {
        return;
      }
      copy = inventory_;
    }
    absl::Status status = copy.Refresh();
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      inventory_ = std::move(copy);
      continue;
    }
    if (!lost) {
      lost = true;
      log->error(
          "{}; health is NOT_SERVING. Check `nvidia-smi` and the kernel log for Xid "
          "errors, then restart epd",
          status.message());
      {
        absl::MutexLock lock(&mu_);
        gpu_lost_ = absl::StrCat("GPU lost: ", status.message());
      }
      PublishServing();
    }
  }
}

void Daemon::SetListenerStuck(Listener listener, std::string stuck) {
  bool changed = false;
  {
    absl::MutexLock lock(&mu_);
    std::string& reason = listener == Listener::kClients ? listener_stuck_ : peer_listener_stuck_;
    changed = stuck.empty() != reason.empty();
    reason = stuck;  // The reason GetStats shows, kept current.
  }
  if (!changed) return;
  auto log = GetLogger(kLogDaemon);
  if (!stuck.empty()) {
    log->error("{}; health is NOT_SERVING", stuck);
  } else if (listener == Listener::kClients) {
    log->info("listener recovered: accepting connections again");
  } else {
    log->info("Peer listener recovered: taking connections again");
  }
  PublishServing();
}

void Daemon::WatchHealth() {
  absl::Time next_peer_probe = absl::Now() + options_.peer_probe_interval;
  int failed_peer_probes = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&shutting_down_), options_.health_interval)) {
        return;
      }
    }
    const absl::Time now = absl::Now();
    const ListenerStatus listener = listener_->status();
    std::string stuck;
    if (now - listener.heartbeat > options_.listener_stall_limit) {
      stuck = absl::StrCat(
          "listener stuck: its accept loop last ran ",
          absl::FormatDuration(absl::Trunc(now - listener.heartbeat, absl::Milliseconds(1))),
          " ago; new clients cannot connect (restart epd if this persists)");
    } else if (listener.failing_for > options_.listener_stall_limit) {
      stuck = absl::StrCat(
          "listener failing: accept has failed for ",
          absl::FormatDuration(absl::Trunc(listener.failing_for, absl::Milliseconds(1))), " (",
          listener.last_failure, ")");
    }
    SetListenerStuck(Listener::kClients, std::move(stuck));
    if (peer_mesh_ != nullptr && now >= next_peer_probe) {
      next_peer_probe = now + options_.peer_probe_interval;
      const absl::Status probe = peer_mesh_->ProbeListener(options_.peer_probe_timeout);
      failed_peer_probes = probe.ok() ? 0 : failed_peer_probes + 1;
      // One failed probe is not yet stuck; a stuck listener stays so until a probe succeeds.
      SetListenerStuck(Listener::kPeers,
                       failed_peer_probes >= 2
                           ? absl::StrCat("Peer listener stuck: ", probe.message())
                           : std::string());
    }
    registry_->ExpireUnmappedEndpoints(now);
    registry_->ReportSuppressedLogLines();
  }
}

absl::Status Daemon::StartMetrics() {
  auto log = GetLogger(kLogDaemon);
  const std::string state = metrics::StartCountPath(config_.metrics_state_file(), socket_path_);
  if (!state.empty()) {
    absl::StatusOr<uint64_t> before = metrics::RecordStart(state);
    if (before.ok()) {
      restarts_ = static_cast<int64_t>(*before);
    } else {
      // A garbled file was rewritten: this start counts from 0. I/O errors leave it unknown.
      restarts_ = before.status().code() == absl::StatusCode::kInvalidArgument ? 0 : -1;
      log->warn("{}; epd_restarts_total {}", before.status().message(),
                restarts_ < 0 ? "is not exported" : "starts at 0");
    }
  }
  metrics_collector_ = metrics::Default().AddCollector(
      [this](metrics::SnapshotBuilder& out) { CollectMetrics(out); });
  if (config_.metrics_listen().empty()) return absl::OkStatus();
  absl::MutexLock lock(&operator_mu_);
  EPD_ASSIGN_OR_RETURN(metrics_server_, StartMetricsServer(config_.metrics_listen()));
  return absl::OkStatus();
}

int Daemon::metrics_port() const {
  absl::MutexLock lock(&operator_mu_);
  return metrics_server_ != nullptr ? metrics_server_->port() : 0;
}

absl::Status Daemon::MoveMetricsListener(const std::string& from, const std::string& to) {
  auto log = GetLogger(kLogDaemon);
  if (to.empty()) {
    if (metrics_server_ != nullptr) metrics_server_->Stop();
    metrics_server_.reset();
    log->info("metrics listener {} stopped (metrics_listen is now off)", from);
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> next = StartMetricsServer(to);
  if (!next.ok() && metrics_server_ != nullptr) {
    // The new address may overlap the old one (the same port on another host): free it.
    metrics_server_->Stop();
    metrics_server_.reset();
    next = StartMetricsServer(to);
    if (!next.ok()) {
      absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> back = StartMetricsServer(from);
      if (back.ok()) {
        metrics_server_ = *std::move(back);
      } else {
        log->error(
            "metrics listener: could not listen on {} again either ({}); metrics are not "
            "served until a reload that succeeds",
            from, back.status().message());
      }
    }
  }
  if (!next.ok()) return next.status();
  if (metrics_server_ != nullptr) metrics_server_->Stop();
  metrics_server_ = *std::move(next);
  if (!from.empty()) log->info("metrics listener {} stopped", from);
  return absl::OkStatus();
}

void Daemon::CollectMetrics(metrics::SnapshotBuilder& out) const {
  const v1::GetStatsResponse stats = Stats();
  out.AddGauge("epd_build_info", "Constant 1, labelled with epd's version and backend.",
               {{"backend", stats.backend()}, {"version", stats.version()}}, 1);
  out.AddGauge("process_start_time_seconds", "When epd started, in seconds since the epoch.", {},
               absl::ToDoubleSeconds(started_ - absl::UnixEpoch()));
  out.AddGauge("epd_uptime_seconds", "Seconds since epd started.", {},
               static_cast<double>(stats.uptime_ms()) / 1000.0);
  if (restarts_ >= 0) {
    out.AddCounter("epd_restarts_total",
                   "Starts of epd before this one, as counted in metrics_state_file (since "
                   "that file was created: boot, or the pod's start).",
                   {}, static_cast<double>(restarts_));
  }
  out.AddGauge("epd_serving",
               "1 when the process's health is SERVING, 0 when NOT_SERVING (starting, shutting "
               "down, a GPU lost, a listener stuck; not an operator's drain: epd_draining).",
               {}, ProcessServing() ? 1 : 0);
  out.AddGauge("epd_draining",
               "1 while drained by the operator (`epctl drain`: no new groups, health "
               "NOT_SERVING), else 0.",
               {}, stats.draining() ? 1 : 0);
  for (int i = 0; i < 3; ++i) {
    out.AddCounter("epd_config_reloads_total",
                   "Config reloads (SIGHUP, `epctl reload`) by result: ok (every change "
                   "applied), refused (some fields need a restart; the live ones applied), "
                   "failed (nothing applied: the config did not parse or validate).",
                   {{"result", kReloadResults[i]}},
                   static_cast<double>(reloads_[i].load(std::memory_order_relaxed)));
  }
  out.AddGauge("epd_sessions", "Open client sessions.", {}, stats.num_sessions());
  out.AddGauge("epd_groups", "Live groups.", {}, stats.num_groups());
  if (registry_ != nullptr) {
    out.AddGauge("epd_endpoints", "Joined ranks (endpoints), over every group.", {},
                 registry_->counters().num_endpoints);
  }
  for (const v1::GpuInfo& g : stats.gpus()) {
    const metrics::Labels l = {{"gpu", absl::StrCat(g.ordinal())}, {"uuid", g.uuid()}};
    out.AddGauge("epd_gpu_memory_total_bytes", "GPU memory, total.", l,
                 static_cast<double>(g.total_memory_bytes()));
    out.AddGauge("epd_gpu_memory_free_bytes",
                 "GPU memory free (read every gpu poll interval, 2 s).", l,
                 static_cast<double>(g.free_memory_bytes()));
  }
}

absl::StatusOr<v1::ReloadConfigResponse> Daemon::ReloadConfig(
    const std::optional<PeerCredentials>& caller) {
  absl::StatusOr<ResolvedDaemonConfig> next =
      options_.config_source
          ? options_.config_source()
          : errors::WithReason(absl::FailedPreconditionError(
                                   "this epd has no configuration source to read again (it "
                                   "runs inside another process, not as the epd binary)"),
                               errors::Reason::kConfigInvalid);
  if (!next.ok()) {
    RecordReload(Asker(caller, "Control.ReloadConfig", "SIGHUP"), caller, next.status(), {});
    return next.status();
  }
  return ApplyConfig(std::move(next->config), caller, next->overridden);
}

absl::StatusOr<v1::ReloadConfigResponse> Daemon::ApplyConfig(
    v1::DaemonConfig next, const std::optional<PeerCredentials>& caller,
    const std::vector<ConfigFlagOverride>& overridden) {
  const std::string asker = Asker(caller, "Control.ReloadConfig", "SIGHUP");
  auto fail = [&](const absl::Status& status) {
    RecordReload(asker, caller, status, {});
    return status;
  };
  FillDaemonConfigDefaults(&next);
  if (absl::Status valid = ValidateDaemonConfig(next); !valid.ok()) return fail(valid);
  absl::MutexLock serialise(&operator_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_ || shut_down_) {
      return fail(errors::WithReason(absl::UnavailableError("epd is shutting down"),
                                     errors::Reason::kDaemonDraining));
    }
  }
  const v1::DaemonConfig running = config();
  const ConfigDiff diff = DiffDaemonConfig(running, next);
  auto log = GetLogger(kLogConfig);
  for (const std::string& field : diff.refused) {
    log->warn(
        "config reload: {} changed ({} -> {}) but only a restart applies it; epd keeps {} "
        "(restart epd to apply it, or put the running value back)",
        field, ConfigFieldText(running, field), ConfigFieldText(next, field),
        ConfigFieldText(running, field));
  }
  // The one live change that can fail first: then nothing is applied.
  if (running.metrics_listen() != next.metrics_listen()) {
    if (absl::Status moved = MoveMetricsListener(running.metrics_listen(), next.metrics_listen());
        !moved.ok()) {
      // The daemon's error, with its reason: the address is the config's to fix (`epctl
      // reload` shows it as such, not as a daemon that does not answer).
      return fail(errors::WithDefaultReason(
          absl::Status(moved.code(),
                       absl::StrCat(moved.message(),
                                    "; the reload changed nothing (choose a free "
                                    "metrics_listen address of this host, or stop what holds "
                                    "it, then reload again)")),
          errors::Reason::kConfigInvalid));
    }
  }
  registry_->SetQuotas({next.max_groups(), next.max_groups_per_uid(), next.max_endpoints_per_uid(),
                        next.max_endpoint_bytes_per_uid(), next.max_sessions_per_uid()});
  listener_->SetMaxConnectionsPerUid(next.max_connections_per_uid());
  // Validated above: cannot fail.
  if (absl::Status levels = SetLogLevel(next.log_level()); !levels.ok()) return fail(levels);
  for (const std::string& field : diff.live) {
    log->info("config reload: {} -> {}", ConfigFieldText(running, field),
              ConfigFieldText(next, field));
  }
  for (const ConfigFlagOverride& o : overridden) {
    log->warn(
        "config reload: {} (the flag wins at a reload as at start-up: remove {} from epd's "
        "command line and restart epd for the file to set {})",
        ConfigFlagOverrideText(o), o.flag, o.field);
  }
  {
    absl::MutexLock lock(&config_mu_);
    config_ = WithLiveFields(running, next);
  }
  v1::ReloadConfigResponse response;
  response.set_result(diff.refused.empty() ? "ok" : "refused");
  for (const std::string& field : diff.live) response.add_applied(field);
  for (const std::string& field : diff.refused) response.add_refused(field);
  for (const ConfigFlagOverride& o : overridden) {
    v1::FlagOverride* out = response.add_overridden();
    out->set_field(o.field);
    out->set_flag(o.flag);
  }
  RecordReload(asker, caller, absl::OkStatus(), response);
  return response;
}

void Daemon::RecordReload(const std::string& trigger, const std::optional<PeerCredentials>& caller,
                          const absl::Status& status, const v1::ReloadConfigResponse& response) {
  auto log = GetLogger(kLogConfig);
  std::string detail;
  absl::Status audited = status;
  int result = 2;
  if (!status.ok()) {
    detail = absl::StrCat(trigger, ": nothing applied");
    log->error(
        "config reload ({}) failed: {}; nothing was applied, epd runs on as before (fix the "
        "configuration and reload again)",
        trigger, errors::StatusText(status));
  } else {
    result = response.refused().empty() ? 0 : 1;
    const std::string applied =
        response.applied().empty() ? "nothing changed" : absl::StrJoin(response.applied(), ", ");
    // The fields a flag holds: the file's value for them was not applied.
    std::string overridden;
    for (const v1::FlagOverride& o : response.overridden()) {
      absl::StrAppend(&overridden, overridden.empty() ? "" : ", ", o.field(), ": set by ",
                      o.flag());
    }
    if (!overridden.empty()) {
      overridden = absl::StrCat(
          "; overridden by the command line, the file's value is not "
          "applied: ",
          overridden);
    }
    detail = absl::StrCat(trigger, ": applied: ", applied, overridden);
    if (result == 1) {
      const std::string refused = absl::StrJoin(response.refused(), ", ");
      absl::StrAppend(&detail, "; refused (restart needed): ", refused);
      audited = absl::FailedPreconditionError(absl::StrCat("needs a restart: ", refused));
      log->warn("config reload ({}): applied: {}{}; refused, needs a restart: {}", trigger, applied,
                overridden, refused);
    } else if (!overridden.empty()) {
      log->warn("config reload ({}): applied: {}{}", trigger, applied, overridden);
    } else {
      log->info("config reload ({}): applied: {}", trigger, applied);
    }
  }
  reloads_[result].fetch_add(1, std::memory_order_relaxed);
  Audit(audit_log_.get(), {audit::kConfigReload, caller, "", -1, audited, detail});
}

bool Daemon::SetDrained(bool drain, const std::optional<PeerCredentials>& caller) {
  absl::MutexLock serialise(&operator_mu_);
  bool before = false;
  {
    absl::MutexLock lock(&mu_);
    before = drained_;
    if (shutting_down_ || shut_down_) return before;
    drained_ = drain;
  }
  registry_->SetDrained(drain);
  PublishServing();
  const std::string asker = Asker(caller, "Control.Drain", "in-process call");
  auto log = GetLogger(kLogDaemon);
  if (before == drain) {
    log->info("{} ({}): already {}", drain ? "drain" : "undrain", asker,
              drain ? "drained" : "serving new groups");
  } else if (drain) {
    log->warn(
        "drained ({}): health NOT_SERVING, joins that would create a group are refused; live "
        "groups are served. `epctl undrain` serves new groups again",
        asker);
  } else {
    log->info("undrained ({}): new groups are accepted again", asker);
  }
  Audit(audit_log_.get(),
        {drain ? audit::kDrain : audit::kUndrain, caller, "", -1, absl::OkStatus(),
         drain ? absl::StrCat("operator drain", before ? " (already drained)" : "",
                              ": new groups refused, health NOT_SERVING")
               : absl::StrCat("operator undrain", before ? "" : " (was not drained)",
                              ": new groups accepted")});
  return before;
}

bool Daemon::drained() const {
  absl::MutexLock lock(&mu_);
  return drained_;
}

}  // namespace epd
