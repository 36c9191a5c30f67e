// RDMA preflight: what the RDMA transport needs, checked at start-up (device present and
// its port ACTIVE, a GID valid for the link layer, the locked-memory limit, GPUDirect RDMA,
// RDMA built in), one line per problem saying what to change. The facts come from the
// machine (GatherPreflightFacts) or from a test; the checks are a pure function of them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "daemon/transport/rdma/nic_inventory.h"
#include "epd/v1/config.pb.h"
#include "epd/v1/control.pb.h"

namespace epd::transport {

/// Below this RLIMIT_MEMLOCK (bytes) the RDMA transport is refused: registering a group's
/// receive regions would fail. A finite limit above it is reported but not refused.
inline constexpr uint64_t kMinRdmaMemlockBytes = 64ull << 20;

/// What the preflight checks, gathered from the machine.
struct PreflightFacts {
  bool rdma_built = false;  ///< Built with libibverbs (EPD_HAVE_RDMA).
  bool cuda_built = false;  ///< Built with CUDA (EPD_HAVE_CUDA).
  /// Soft RLIMIT_MEMLOCK in bytes; UINT64_MAX = unlimited.
  uint64_t memlock_bytes = UINT64_MAX;
  bool cap_ipc_lock = false;           ///< CAP_IPC_LOCK in the effective set (no limit).
  bool nvidia_peermem_loaded = false;  ///< /sys/module/nvidia_peermem exists.
  /// Per daemon CUDA ordinal: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (absent: not queried).
  std::map<int, bool> dmabuf_supported;
};

/// Reads the facts of this process and machine: RLIMIT_MEMLOCK, CAP_IPC_LOCK
/// (/proc/self/status CapEff), `sysfs_root`/module/nvidia_peermem, and with CUDA the
/// dmabuf attribute of each GPU of `gpus` (by ordinal).
PreflightFacts GatherPreflightFacts(const std::string& sysfs_root,
                                    const std::vector<v1::GpuInfo>& gpus);

/// Prefix of a preflight line whose problem keeps the RDMA transport from running (a
/// daemon configured for "rdma" does not start; a group asking for "rdma" is refused).
inline constexpr char kPreflightRefuse[] = "refuse: ";
/// Prefix of a preflight line whose problem RDMA runs with (slower or riskier).
inline constexpr char kPreflightWarn[] = "warn: ";

/// What the preflight found.
struct PreflightResult {
  /// One line per problem, each starting with its severity (kPreflightRefuse or
  /// kPreflightWarn) then "RDMA: ", and saying what to change. Warnings: a finite memlock
  /// limit above the minimum, GPUDirect unusable under "auto".
  std::vector<std::string> lines;
  /// Whether the RDMA transport can run (every refusing problem absent); when false,
  /// `reason` is the first refusing line without its severity prefix.
  bool rdma_usable = false;
  std::string reason;
  /// Whether GPU memory can be registered with the NIC (dmabuf or nvidia_peermem).
  bool gpudirect_usable = false;
};

/// Whether the preflight has anything to say: RDMA is configured (transport "rdma" or
/// rdma.devices listed) or the machine has RDMA ports.
bool RdmaPreflightWanted(const v1::DaemonConfig& config, const std::vector<RdmaPortInfo>& ports);

/// Checks `config` (filled and valid) against the ports found and the facts, and marks
/// `plan->nics[*].gpudirect`. `gpus` are the daemon's GPUs (GPUDirect matters only with
/// some).
PreflightResult RunRdmaPreflight(const v1::DaemonConfig& config,
                                 const std::vector<RdmaPortInfo>& ports,
                                 const std::vector<v1::GpuInfo>& gpus, const PreflightFacts& facts,
                                 NicPlan* plan);

/// "8 MiB", "unlimited": a memlock limit for messages.
std::string MemlockText(uint64_t bytes);

}  // namespace epd::transport
