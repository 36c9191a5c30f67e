// epctl doctor's facts from this node: what epctl reads itself (sysfs, /dev/shm, rlimits,
// the CUDA driver through dlopen, MPS, TCP connects to the peers). The checks that judge
// them are in doctor.h.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/epctl/doctor.h"
#include "epd/v1/config.pb.h"

namespace epd::epctl {

/// Where GatherLocalFacts looks ("/sys" and "/dev/shm" on a node; tests give a temporary
/// tree).
struct NodePaths {
  std::string sysfs_root = "/sys";
  std::string dev_shm = "/dev/shm";
};

/// What epctl reads on the node in both modes: /dev/shm size and free space (statvfs),
/// the clock source (devices/system/clocksource/clocksource0), and each GPU's NUMA node
/// (bus/pci/devices/<bus id>/numa_node) for the GPUs already in `facts`.
void GatherLocalFacts(const NodePaths& paths, DoctorFacts* facts);

/// --standalone: everything without a daemon. The CUDA driver (ProbeCudaDriver), MPS
/// (DetectMps), this process's limits as epd would have them (RLIMIT_MEMLOCK, the hard
/// RLIMIT_NOFILE epd raises its soft limit to, CAP_IPC_LOCK), the RDMA ports under
/// sysfs_root planned and preflighted as the daemon does (PlanNics, RunRdmaPreflight) for
/// `config`, then GatherLocalFacts. `built_cuda_architectures` as DoctorFacts has it.
DoctorFacts GatherStandaloneFacts(const NodePaths& paths, v1::DaemonConfig config,
                                  const std::string& built_cuda_architectures);

/// Splits "host:port" or "[v6]:port". INVALID_ARGUMENT naming `address` otherwise.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& address);

/// A TCP connect to each address, each bounded by `timeout` (name resolution included
/// only as far as getaddrinfo allows). Never throws, never blocks longer per address than
/// the resolver plus `timeout`.
std::vector<PeerProbe> ProbePeers(const std::vector<std::string>& addresses,
                                  absl::Duration timeout);

/// Reads a DaemonConfig in text format (epd's --config file) without epd's validation.
/// INVALID_ARGUMENT naming the path and the parse error; NOT_FOUND when it cannot be read.
absl::StatusOr<v1::DaemonConfig> ReadDaemonConfigText(const std::string& path);

}  // namespace epd::epctl
