#include "daemon/transport/transport_factory.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/core/logging.h"
#include "daemon/transport/fault/fault_transport.h"
#include "daemon/transport/rdma/nic_inventory.h"
#include "daemon/transport/rdma/rdma_transport.h"
#include "daemon/transport/tcp/tcp_transport.h"

namespace epd::transport {
namespace {

/// `t` wrapped in the fault plan of testing_transport_faults, or `t` when none.
absl::StatusOr<std::unique_ptr<Transport>> WithFaults(const v1::DaemonConfig& config,
                                                      absl::string_view name,
                                                      std::unique_ptr<Transport> t) {
  if (config.testing_transport_faults().empty()) return t;
  EPD_ASSIGN_OR_RETURN(FaultPlan plan, ParseFaultPlan(config.testing_transport_faults()));
  GetLogger(kLogTransport)
      ->warn("testing_transport_faults \"{}\": transport {} injects faults (tests only)",
             config.testing_transport_faults(), name);
  return MakeFaultTransport(std::move(t), std::move(plan));
}

TcpTransportOptions TcpOptionsFromConfig(const v1::DaemonConfig& config) {
  TcpTransportOptions options;
  // The data listener: tcp_listen, else peer_listen's host on any free port. Peers learn
  // the address from the descriptor the Peer service carries; the host they connect to is
  // the advertised Peer address's.
  const std::string& peer_listen = config.peer_listen();
  const std::string& advertised =
      config.peer_advertise().empty() ? peer_listen : config.peer_advertise();
  options.listen_address = config.tcp_listen().empty()
                               ? absl::StrCat(peer_listen.substr(0, peer_listen.rfind(':')), ":0")
                               : config.tcp_listen();
  options.advertise_host = advertised.substr(0, advertised.rfind(':'));
  options.connections_per_peer = static_cast<int32_t>(config.tcp_connections_per_peer());
  options.connect_timeout = std::chrono::milliseconds(config.op_timeout_ms());
  return options;
}

}  // namespace

void Transports::Shutdown() {
  for (auto it = owned.rbegin(); it != owned.rend(); ++it) (*it)->Shutdown();
}

namespace {

/// The refusal of a daemon configured for "rdma" that cannot run it, listing `lines` (or
/// `reason` when there are none).
absl::Status RdmaConfiguredButRefused(const std::vector<std::string>& lines,
                                      const std::string& reason) {
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "transport: \"rdma\" is configured but this daemon cannot run it (no fallback to tcp): ",
          lines.empty() ? reason : absl::StrJoin(lines, "; "))),
      errors::Reason::kRdmaUnavailable);
}

}  // namespace

absl::StatusOr<TransportPlan> PlanTransports(const v1::DaemonConfig& config,
                                             const TransportStartOptions& options) {
  auto log = GetLogger(kLogTransport);
  const std::vector<RdmaPortInfo> ports = ScanRdmaPorts(options.sysfs_root);
  TransportPlan plan;
  plan.nics = PlanNics(ports, config.rdma(), options.gpus, options.sysfs_root);
  if (RdmaPreflightWanted(config, ports)) {
    const PreflightFacts facts = options.facts.has_value()
                                     ? *options.facts
                                     : GatherPreflightFacts(options.sysfs_root, options.gpus);
    plan.preflight = RunRdmaPreflight(config, ports, options.gpus, facts, &plan.nics);
    for (const std::string& line : plan.preflight.lines) log->warn("preflight: {}", line);
  } else {
    plan.preflight.reason =
        "RDMA: no RDMA device found (/sys/class/infiniband is empty or absent); use transport "
        "\"tcp\"";
  }
  for (const v1::NicInfo& n : plan.nics.nics) {
    log->info(
        "NIC {}:{} {} {} {} Gb/s, NUMA {}, GID index {} {}{}{}", n.device(), n.port(), n.state(),
        n.link_layer(), n.rate_gbps(), n.numa_node(), n.gid_index(), n.gid(),
        n.selected() ? ", selected" : "",
        n.gpu_uuids().empty() ? "" : absl::StrCat(", GPUs ", absl::StrJoin(n.gpu_uuids(), " ")));
  }
  if (config.transport() == "rdma" && !plan.preflight.rdma_usable) {
    return RdmaConfiguredButRefused(plan.preflight.lines, plan.preflight.reason);
  }
  return plan;
}

absl::StatusOr<std::unique_ptr<Transports>> StartTransports(const v1::DaemonConfig& config,
                                                            TransportPlan plan,
                                                            const TransportStartOptions& options) {
  auto log = GetLogger(kLogTransport);
  auto out = std::make_unique<Transports>();
  out->set.set_default_name(config.transport());
  out->nics = plan.nics.nics;
  out->preflight = plan.preflight.lines;

  // Why "rdma" cannot run here: the preflight's first refusing line, or its start error.
  std::string rdma_refusal = plan.preflight.rdma_usable ? "" : plan.preflight.reason;
  if (options.start) {
    // RDMA first: a daemon configured for it that cannot start it binds nothing. Listed
    // after tcp.
    std::unique_ptr<Transport> rdma_started;
    if (plan.preflight.rdma_usable) {
      RdmaTransportOptions rdma_options = plan.nics.options;
      rdma_options.connect_timeout_ms = config.op_timeout_ms();  // As TCP's connect bound.
      absl::StatusOr<std::unique_ptr<Transport>> rdma = MakeRdmaTransport(rdma_options);
      if (rdma.ok()) {
        EPD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t,
                             WithFaults(config, "rdma", *std::move(rdma)));
        log->info("transport rdma: {} port(s), {} queue pair(s) per peer per group",
                  plan.nics.options.ports.size(), plan.nics.options.qps_per_peer);
        rdma_started = std::move(t);
      } else {
        rdma_refusal = absl::StrCat("RDMA: the transport did not start: ", rdma.status().message());
        out->preflight.push_back(absl::StrCat(kPreflightRefuse, rdma_refusal));
        log->warn("preflight: {}", out->preflight.back());
      }
    }
    if (config.transport() == "rdma" && !rdma_refusal.empty()) {
      return RdmaConfiguredButRefused(out->preflight, rdma_refusal);
    }
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> tcp,
                         MakeTcpTransport(TcpOptionsFromConfig(config)));
    out->tcp_listen_address = TcpListenAddress(*tcp);
    log->info("transport tcp: data listener {} ({} connection(s) per peer per group)",
              out->tcp_listen_address, config.tcp_connections_per_peer());
    EPD_ASSIGN_OR_RETURN(tcp, WithFaults(config, "tcp", std::move(tcp)));
    out->set.Add("tcp", tcp.get());
    out->owned.push_back(std::move(tcp));
    if (rdma_started != nullptr) {
      out->set.Add("rdma", rdma_started.get());
      out->owned.push_back(std::move(rdma_started));
    }
  }
  constexpr char kNoPeerListener[] = "the Peer listener is off (peer_listen is unset)";
  if (!rdma_refusal.empty()) {
    out->set.SetUnavailable("rdma", rdma_refusal);
  } else if (!options.start) {
    out->set.SetUnavailable("rdma", kNoPeerListener);
  }
  if (!options.start) out->set.SetUnavailable("tcp", kNoPeerListener);
  return out;
}

}  // namespace epd::transport
