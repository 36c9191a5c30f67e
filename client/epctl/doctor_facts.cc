#include "client/epctl/doctor_facts.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/os/scoped_fd.h"
#include "daemon/core/fd_limits.h"
#include "daemon/gpu/mps.h"
#include "daemon/transport/rdma/preflight.h"
#include "google/protobuf/text_format.h"

namespace epd::epctl {
namespace {

/// Connects to one resolved address within `timeout`; "" on success, else why not.
std::string ConnectOnce(const addrinfo& ai, absl::Duration timeout) {
  ScopedFd fd(
      ::socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol));
  if (!fd.valid()) return absl::StrCat("socket: ", std::strerror(errno));
  if (::connect(fd.get(), ai.ai_addr, ai.ai_addrlen) == 0) return "";
  if (errno != EINPROGRESS) return std::strerror(errno);
  pollfd p{fd.get(), POLLOUT, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(timeout));
  int rc;
  do {
    rc = ::poll(&p, 1, ms);
  } while (rc < 0 && errno == EINTR);
  if (rc == 0) {
    return absl::StrCat("no answer within ", absl::FormatDuration(timeout),
                        " (a firewall drops the packets, or the host is down)");
  }
  if (rc < 0) return absl::StrCat("poll: ", std::strerror(errno));
  int error = 0;
  socklen_t len = sizeof(error);
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
  return error == 0 ? "" : std::strerror(error);
}

}  // namespace

void GatherLocalFacts(const NodePaths& paths, DoctorFacts* facts) {
  struct statvfs vfs {};
  if (::statvfs(paths.dev_shm.c_str(), &vfs) == 0) {
    facts->shm_total_bytes = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    facts->shm_free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  const std::string clock_dir =
      absl::StrCat(paths.sysfs_root, "/devices/system/clocksource/clocksource0/");
  facts->clocksource = transport::ReadSysfsLine(clock_dir + "current_clocksource");
  facts->available_clocksources = transport::ReadSysfsLine(clock_dir + "available_clocksource");
  for (const v1::GpuInfo& gpu : facts->gpus) {
    if (gpu.pci_bus_id().empty()) continue;
    int numa = -1;
    const std::string path =
        absl::StrCat(paths.sysfs_root, "/bus/pci/devices/",
                     transport::NormalizePciBusId(gpu.pci_bus_id()), "/numa_node");
    if (!absl::SimpleAtoi(transport::ReadSysfsLine(path), &numa)) numa = -1;
    facts->gpu_numa[gpu.pci_bus_id()] = numa;
  }
}

DoctorFacts GatherStandaloneFacts(const NodePaths& paths, v1::DaemonConfig config,
                                  const std::string& built_cuda_architectures) {
  DoctorFacts f;
  f.source = "standalone (no daemon asked)";
  f.built_cuda_architectures = built_cuda_architectures;
  CudaDriverFacts cuda = ProbeCudaDriver();
  f.cuda_driver_loaded = cuda.library_loaded;
  f.cuda_error = cuda.error;
  f.driver_version = cuda.driver_version;
  f.runtime_version = cuda.runtime_version;
  f.gpus = std::move(cuda.gpus);
  f.p2p = std::move(cuda.p2p);
  MpsStatus mps = DetectMps();
  f.mps_active = mps.active;
  f.mps_detail = mps.detail;
  if (absl::StatusOr<FdLimit> fds = GetFdLimit(); fds.ok()) f.fd_limit = fds->hard;
  // The daemon's defaults where the config leaves them out.
  if (config.transport().empty()) config.set_transport("tcp");
  if (config.rdma().gpudirect().empty()) config.mutable_rdma()->set_gpudirect("auto");
  f.ports = transport::ScanRdmaPorts(paths.sysfs_root);
  transport::PreflightFacts preflight = transport::GatherPreflightFacts(paths.sysfs_root, f.gpus);
  f.memlock_bytes = preflight.memlock_bytes;
  f.cap_ipc_lock = preflight.cap_ipc_lock;
  f.rdma_built = preflight.rdma_built;
  transport::NicPlan plan = transport::PlanNics(f.ports, config.rdma(), f.gpus, paths.sysfs_root);
  if (transport::RdmaPreflightWanted(config, f.ports)) {
    transport::PreflightResult result =
        transport::RunRdmaPreflight(config, f.ports, f.gpus, preflight, &plan);
    f.preflight = std::move(result.lines);
  }
  f.nics = std::move(plan.nics);
  f.own_peer_address =
      !config.peer_advertise().empty() ? config.peer_advertise() : config.peer_listen();
  f.config = std::move(config);
  GatherLocalFacts(paths, &f);
  return f;
}

absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address) {
  std::string host;
  std::string port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find("]:");
    if (close != std::string::npos) {
      host = address.substr(1, close - 1);
      port = address.substr(close + 2);
    }
  } else if (const size_t colon = address.rfind(':');
             colon != std::string::npos && address.find(':') == colon) {
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  int number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &number) || number < 1 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer address \"", address, "\" is not host:port (e.g. 10.0.0.2:7100)"));
  }
  return std::make_pair(host, port);
}

std::vector<PeerProbe> ProbePeers(const std::vector<std::string>& addresses,
                                  absl::Duration timeout) {
  std::vector<PeerProbe> out;
  for (const std::string& address : addresses) {
    PeerProbe probe;
    probe.address = address;
    absl::StatusOr<std::pair<std::string, std::string>> hp = SplitHostPort(address);
    if (!hp.ok()) {
      probe.error = std::string(hp.status().message());
      out.push_back(std::move(probe));
      continue;
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    if (int rc = ::getaddrinfo(hp->first.c_str(), hp->second.c_str(), &hints, &list); rc != 0) {
      probe.error = absl::StrCat("cannot resolve ", hp->first, ": ", ::gai_strerror(rc));
      out.push_back(std::move(probe));
      continue;
    }
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(list, ::freeaddrinfo);
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      std::string error = ConnectOnce(*ai, timeout);
      if (error.empty()) {
        probe.reachable = true;
        break;
      }
      if (probe.error.empty()) probe.error = error;
    }
    out.push_back(std::move(probe));
  }
  return out;
}

absl::StatusOr<v1::DaemonConfig> ReadDaemonConfigText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read \"", path, "\""));
  std::stringstream text;
  text << in.rdbuf();
  v1::DaemonConfig config;
  if (!google::protobuf::TextFormat::ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", path, "\" is not a DaemonConfig in text format (epd --config)"));
  }
  return config;
}

}  // namespace epd::epctl
