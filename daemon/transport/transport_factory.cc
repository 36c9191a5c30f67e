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

absl::StatusOr<std::unique_ptr<Transports>> StartTransports(const v1::DaemonConfig& config,
                                                            const TransportStartOptions& options) {
  auto log = GetLogger(kLogTransport);
  auto out = std::make_unique<Transports>();
  out->set.set_default_name(config.transport());

  // NICs and preflight (also without the Peer listener: GetStats shows them).
  const std::vector<RdmaPortInfo> ports = ScanRdmaPorts(options.sysfs_root);
  NicPlan plan = PlanNics(ports, config.rdma(), options.gpus, options.sysfs_root);
  PreflightResult preflight;
  if (RdmaPreflightWanted(config, ports)) {
    const PreflightFacts facts = options.facts.has_value()
                                     ? *options.facts
                                     : GatherPreflightFacts(options.sysfs_root, options.gpus);
    preflight = RunRdmaPreflight(config, ports, options.gpus, facts, &plan);
    for (const std::string& line : preflight.lines) log->warn("preflight: {}", line);
  } else {
    preflight.reason =
        "RDMA: no RDMA device found (/sys/class/infiniband is empty or absent); use transport "
        "\"tcp\"";
  }
  for (const v1::NicInfo& n : plan.nics) {
    log->info(
        "NIC {}:{} {} {} {} Gb/s, NUMA {}, GID index {} {}{}{}", n.device(), n.port(), n.state(),
        n.link_layer(), n.rate_gbps(), n.numa_node(), n.gid_index(), n.gid(),
        n.selected() ? ", selected" : "",
        n.gpu_uuids().empty() ? "" : absl::StrCat(", GPUs ", absl::StrJoin(n.gpu_uuids(), " ")));
  }
  out->nics = plan.nics;
  out->preflight = preflight.lines;

  // Why "rdma" cannot run here: the preflight's first refusing line, or its start error.
  std::string rdma_refusal = preflight.rdma_usable ? "" : preflight.reason;
  if (options.start) {
    EPD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> tcp,
                         MakeTcpTransport(TcpOptionsFromConfig(config)));
    out->tcp_listen_address = TcpListenAddress(*tcp);
    log->info("transport tcp: data listener {} ({} connection(s) per peer per group)",
              out->tcp_listen_address, config.tcp_connections_per_peer());
    EPD_ASSIGN_OR_RETURN(tcp, WithFaults(config, "tcp", std::move(tcp)));
    out->set.Add("tcp", tcp.get());
    out->owned.push_back(std::move(tcp));
    if (preflight.rdma_usable) {
      RdmaTransportOptions rdma_options = plan.options;
      rdma_options.connect_timeout_ms = config.op_timeout_ms();  // As TCP's connect bound.
      absl::StatusOr<std::unique_ptr<Transport>> rdma = MakeRdmaTransport(rdma_options);
      if (rdma.ok()) {
        EPD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t,
                             WithFaults(config, "rdma", *std::move(rdma)));
        log->info("transport rdma: {} port(s), {} queue pair(s) per peer per group",
                  plan.options.ports.size(), plan.options.qps_per_peer);
        out->set.Add("rdma", t.get());
        out->owned.push_back(std::move(t));
      } else {
        rdma_refusal = absl::StrCat("RDMA: the transport did not start: ", rdma.status().message());
        out->preflight.push_back(rdma_refusal);
        log->warn("preflight: {}", rdma_refusal);
      }
    }
  }
  constexpr char kNoPeerListener[] = "the Peer listener is off (peer_listen is unset)";
  if (!rdma_refusal.empty()) {
    out->set.SetUnavailable("rdma", rdma_refusal);
  } else if (!options.start) {
    out->set.SetUnavailable("rdma", kNoPeerListener);
  }
  if (!options.start) out->set.SetUnavailable("tcp", kNoPeerListener);

  if (config.transport() == "rdma" && !rdma_refusal.empty()) {
    std::vector<std::string> lines = out->preflight;
    if (lines.empty()) lines.push_back(rdma_refusal);
    out->Shutdown();
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("transport: \"rdma\" is configured but this "
                                                   "daemon cannot run it (no fallback to tcp): ",
                                                   absl::StrJoin(lines, "; "))),
        errors::Reason::kRdmaUnavailable);
  }
  return out;
}

}  // namespace epd::transport
