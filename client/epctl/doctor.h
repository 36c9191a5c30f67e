// epctl doctor: the pre-flight of a node. Facts are gathered once (from a live epd's
// GetStats plus what epctl reads on the node itself, or all by epctl with --standalone:
// doctor_facts.cc); every check is a pure function of those facts, so tests feed fake
// facts and assert verdicts. One result per check: ok, warn, or fail with the next step.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "daemon/gpu/cuda_driver_probe.h"
#include "daemon/transport/rdma/nic_inventory.h"
#include "epd/v1/config.pb.h"
#include "epd/v1/control.pb.h"

namespace epd::epctl {

/// What a TCP connect to a peer's address found.
struct PeerProbe {
  std::string address;  ///< "host:port" as given.
  bool reachable = false;
  std::string error;  ///< Why not: "connection refused", "timed out after 1s", ...
};

/// Everything the checks look at. Unknown values stay at their defaults, and the check
/// that needs them says so.
struct DoctorFacts {
  bool live = false;   ///< From a live epd (GetStats), else standalone.
  std::string source;  ///< "epd 0.1.0 (pid 42) on unix:///run/epd/epd.sock" or "standalone".

  // A live daemon only.
  std::string daemon_version;
  std::string serving_status;
  bool draining = false;  ///< Drained by an operator (`epctl drain`).
  std::string backend;
  std::string backend_reason;

  // CUDA.
  bool cuda_driver_loaded = false;
  std::string cuda_error;   ///< Why the driver could not be asked ("" = it answered).
  int driver_version = 0;   ///< 12080 = 12.8; 0 = unknown.
  int runtime_version = 0;  ///< 0 = unknown.
  std::vector<v1::GpuInfo> gpus;
  /// p2p[i][j] for GPUs i, j (empty = unknown: then GpuInfo.peer_access is used).
  std::vector<std::vector<P2pLink>> p2p;
  /// The CUDA architectures of this build (CMAKE_CUDA_ARCHITECTURES, e.g. "90-real;90-virtual");
  /// "" = not built with CUDA or unknown.
  std::string built_cuda_architectures;
  /// NUMA node of each GPU by its pci_bus_id as the GPU reports it (-1 unknown).
  std::map<std::string, int> gpu_numa;

  bool mps_active = false;
  std::string mps_detail;

  // Memory, limits, clock.
  std::optional<uint64_t> shm_total_bytes;  ///< Size of /dev/shm; nullopt = not mounted.
  std::optional<uint64_t> shm_free_bytes;
  uint64_t memlock_bytes = UINT64_MAX;  ///< UINT64_MAX = unlimited.
  bool cap_ipc_lock = false;
  uint64_t fd_limit = 0;    ///< The limit epd runs with (its soft limit, raised to the hard).
  std::string clocksource;  ///< current_clocksource; "" = unreadable.
  std::string available_clocksources;

  // RDMA.
  v1::DaemonConfig config;        ///< The daemon's (live) or --daemon_config (standalone).
  std::vector<v1::NicInfo> nics;  ///< Every port, with the GPUs using it and `selected`.
  std::vector<transport::RdmaPortInfo> ports;  ///< Sysfs facts of the same ports.
  std::vector<std::string> preflight;          ///< The RDMA preflight's lines.
  bool rdma_built = false;

  // Peers.
  std::string own_peer_address;  ///< This daemon's Peer address ("" = none known).
  std::vector<PeerProbe> peers;
};

enum class Verdict { kOk, kWarn, kFail };

/// "ok", "warn", "fail".
const char* VerdictName(Verdict verdict);

struct CheckResult {
  std::string name;  ///< "gpu.architecture", "rdma.ports", ...
  Verdict verdict = Verdict::kOk;
  std::string detail;     ///< What was found.
  std::string next_step;  ///< What to do (warn and fail only).
};

/// GPU architecture: below sm_80 fails (epd's CUDA kernels need sm_80+); a GPU the build's
/// CUDA architectures cannot run (no matching SASS, no PTX at or below it) fails; FP8
/// groups need sm_89+ (said in the detail). No GPU: warn (host backend only).
std::vector<CheckResult> CheckGpuArchitecture(const DoctorFacts& facts);
/// Driver and runtime: no driver with GPUs expected fails; a driver older than CUDA 12
/// fails; a runtime of a newer major than the driver fails, of a newer minor warns
/// (minor-version compatibility: no PTX JIT).
CheckResult CheckCudaVersions(const DoctorFacts& facts);
/// P2P / NVLink matrix: every pair with native atomics = ok (NVLink class); PCIe peer
/// access = ok with a note; a pair without peer access warns.
CheckResult CheckP2p(const DoctorFacts& facts);
/// MPS: active = ok; GPUs and no MPS warns (daemon-launched kernels need it).
CheckResult CheckMps(const DoctorFacts& facts);
/// /dev/shm: missing or smaller than 1 GiB warns (containers default to 64 MiB).
CheckResult CheckDevShm(const DoctorFacts& facts);
/// RLIMIT_MEMLOCK: with RDMA wanted, below kMinRdmaMemlockBytes without CAP_IPC_LOCK fails,
/// another finite limit warns.
CheckResult CheckMemlock(const DoctorFacts& facts);
/// RLIMIT_NOFILE: below 1024 fails, below 65536 warns (every endpoint and connection holds
/// descriptors).
CheckResult CheckFdLimit(const DoctorFacts& facts);
/// Clock source: tsc (and the VM and ARM counters) ok; hpet, acpi_pm and unknown warn.
CheckResult CheckClockSource(const DoctorFacts& facts);
/// RDMA: devices and port state, GID, MTU, GPU ↔ NIC affinity, and the preflight lines.
std::vector<CheckResult> CheckRdma(const DoctorFacts& facts);
/// Reachability of the Peer port of each peer (fail per unreachable peer).
std::vector<CheckResult> CheckPeers(const DoctorFacts& facts);
/// A live daemon: serving, and its version serves this epctl's (CheckClientVersion).
std::vector<CheckResult> CheckDaemon(const DoctorFacts& facts);

/// Every check above, in the order printed.
std::vector<CheckResult> RunDoctorChecks(const DoctorFacts& facts);

/// Whether any result failed (epctl doctor's exit code 1).
bool AnyFailed(const std::vector<CheckResult>& results);

/// The table: one line per check (CHECK, RESULT, DETAIL), the next step on the line below a
/// warn or fail, then "summary: N ok, N warn, N fail".
std::string FormatDoctor(const DoctorFacts& facts, const std::vector<CheckResult>& results);
/// {"source": ..., "checks": [{"name","result","detail","next_step"}], "ok": N, "warn": N,
///  "fail": N} (protobuf's JSON printer over a Struct).
std::string DoctorJson(const DoctorFacts& facts, const std::vector<CheckResult>& results);

/// The live facts GetStats carries: version, serving status, backend, GPUs, MPS, limits,
/// CUDA versions, NICs, preflight, config, Peer address. The caller adds what epctl reads
/// itself (GatherLocalFacts) and the peer probes.
DoctorFacts FactsFromStats(const v1::GetStatsResponse& stats, const std::string& target);

/// The GPU architectures `built` ("90-real;90-virtual", "80;90", "native", "") can run
/// compute capability `cc` (major * 10 + minor): SASS of the same major at or below cc, or
/// PTX at or below cc ("80" means both). nullopt when `built` is empty or not understood.
std::optional<bool> BuildRunsOn(const std::string& built, int cc);

}  // namespace epd::epctl
