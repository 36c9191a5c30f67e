#include "client/epctl/doctor.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/epctl/format.h"
#include "common/version.h"
#include "daemon/transport/rdma/preflight.h"
#include "google/protobuf/struct.pb.h"

namespace epd::epctl {
namespace {

constexpr int kMinComputeCapability = 80;  // sm_80 (A100).
constexpr int kMinFp8ComputeCapability = 89;
constexpr int kMinDriverVersion = 12000;  // epd resolves driver entry points of CUDA 12.
constexpr uint64_t kMinShmBytes = 1ull << 30;
constexpr uint64_t kMinFdLimit = 1024;
constexpr uint64_t kGoodFdLimit = 65536;
// RoCE: an interface MTU that fits RDMA's 4096-byte MTU plus headers.
constexpr uint32_t kRoceJumboMtu = 4200;

CheckResult Ok(std::string name, std::string detail) {
  return {std::move(name), Verdict::kOk, std::move(detail), ""};
}
CheckResult Warn(std::string name, std::string detail, std::string next) {
  return {std::move(name), Verdict::kWarn, std::move(detail), std::move(next)};
}
CheckResult Fail(std::string name, std::string detail, std::string next) {
  return {std::move(name), Verdict::kFail, std::move(detail), std::move(next)};
}

int ComputeCapability(const v1::GpuInfo& gpu) {
  return gpu.compute_capability_major() * 10 + gpu.compute_capability_minor();
}

std::string GpuName(const v1::GpuInfo& gpu) {
  return absl::StrCat("GPU ", gpu.ordinal(), " (", gpu.name().empty() ? "?" : gpu.name(), ")");
}

/// Whether the RDMA transport matters here: configured, or the machine has RDMA ports.
bool RdmaWanted(const DoctorFacts& facts) {
  return facts.config.transport() == "rdma" || facts.config.rdma().devices_size() > 0 ||
         !facts.nics.empty();
}

bool RdmaRequired(const DoctorFacts& facts) {
  return facts.config.transport() == "rdma" || facts.config.rdma().devices_size() > 0;
}

/// "; table: 0 v1, 1 v2, 2 v1 IPv4, 3 v2 IPv4": the port's non-zero GIDs by index, type and
/// whether IPv4-mapped ("" when the sysfs facts are unknown, as from a live daemon).
std::string GidTableText(const transport::RdmaPortInfo* port) {
  if (port == nullptr || port->gids.empty()) return "";
  std::vector<std::string> entries;
  for (const transport::GidEntry& gid : port->gids) {
    std::string type = gid.type == "RoCE v2" ? " v2" : gid.type == "IB/RoCE v1" ? " v1" : "";
    entries.push_back(absl::StrCat(gid.index, type, gid.ipv4_mapped ? " IPv4" : ""));
  }
  return absl::StrCat("; table: ", absl::StrJoin(entries, ", "));
}

/// The RDMA preflight's lines (each says what to change), one warning each.
void AppendPreflight(const DoctorFacts& facts, std::vector<CheckResult>* out) {
  for (const std::string& line : facts.preflight) {
    out->push_back(Warn("rdma.preflight", line, "see the line: it says what to change"));
  }
}

}  // namespace

const char* VerdictName(Verdict verdict) {
  switch (verdict) {
    case Verdict::kOk:
      return "ok";
    case Verdict::kWarn:
      return "warn";
    case Verdict::kFail:
      return "fail";
  }
  return "?";
}

std::optional<bool> BuildRunsOn(const std::string& built, int cc) {
  if (built.empty()) return std::nullopt;
  bool runs = false;
  for (absl::string_view entry : absl::StrSplit(built, absl::ByAnyChar(";, "), absl::SkipEmpty())) {
    if (entry == "native" || entry == "all" || entry == "all-major") return std::nullopt;
    bool sass = true;
    bool ptx = true;
    if (absl::ConsumeSuffix(&entry, "-real")) ptx = false;
    if (absl::ConsumeSuffix(&entry, "-virtual")) sass = false;
    // An arch-specific target (90a) runs on that exact GPU only, and has no portable PTX.
    const bool specific = absl::ConsumeSuffix(&entry, "a") || absl::ConsumeSuffix(&entry, "f");
    int arch = 0;
    if (!absl::SimpleAtoi(entry, &arch)) return std::nullopt;
    if (specific) {
      runs |= arch == cc;
      continue;
    }
    runs |= sass && arch / 10 == cc / 10 && arch <= cc;
    runs |= ptx && arch <= cc;
  }
  return runs;
}

std::vector<CheckResult> CheckGpuArchitecture(const DoctorFacts& facts) {
  std::vector<CheckResult> out;
  const std::string name = "gpu.architecture";
  if (facts.gpus.empty()) {
    std::string why = !facts.backend_reason.empty() ? facts.backend_reason
                      : !facts.cuda_error.empty()   ? facts.cuda_error
                                                    : "no GPU visible";
    out.push_back(Warn(name, absl::StrCat("no GPU: ", why, "; epd can run the host backend only"),
                       "on a GPU node: check `nvidia-smi`, the nvidia kernel module and that the "
                       "container sees /dev/nvidia* (the NVIDIA device plugin or runtime)"));
    return out;
  }
  for (const v1::GpuInfo& gpu : facts.gpus) {
    const int cc = ComputeCapability(gpu);
    const std::string sm = absl::StrCat("sm_", cc);
    if (cc < kMinComputeCapability) {
      out.push_back(Fail(name, absl::StrCat(GpuName(gpu), " is ", sm, ", below sm_80"),
                         "epd's CUDA kernels need sm_80 or newer (A100, H100, H200, B200); use "
                         "another GPU, or the host backend (--backend=host) for tests"));
      continue;
    }
    std::optional<bool> runs = BuildRunsOn(facts.built_cuda_architectures, cc);
    if (runs.has_value() && !*runs) {
      out.push_back(
          Fail(name,
               absl::StrCat(GpuName(gpu), " is ", sm, " but this build's kernels are for ",
                            facts.built_cuda_architectures),
               absl::StrCat("rebuild epd with -DCMAKE_CUDA_ARCHITECTURES=\"",
                            facts.built_cuda_architectures, ";", cc, "-real\"")));
      continue;
    }
    std::string works = cc >= kMinFp8ComputeCapability
                            ? "every op (normal, low-latency, FP8)"
                            : "normal and low-latency ops; FP8 groups (use_fp8) need sm_89+";
    out.push_back(Ok(name, absl::StrCat(GpuName(gpu), " ", sm, ": ", works)));
  }
  return out;
}

CheckResult CheckCudaVersions(const DoctorFacts& facts) {
  const std::string name = "cuda.versions";
  const std::string text = absl::StrCat("driver ", CudaVersionText(facts.driver_version),
                                        ", runtime ", CudaVersionText(facts.runtime_version));
  if (facts.driver_version == 0) {
    if (facts.gpus.empty()) {
      return Warn(name, facts.cuda_error.empty() ? std::string("no CUDA driver") : facts.cuda_error,
                  "on a GPU node install the NVIDIA driver (libcuda.so.1 must be loadable)");
    }
    return Ok(name, absl::StrCat(text, " (the daemon did not report the driver's version)"));
  }
  if (facts.driver_version < kMinDriverVersion) {
    return Fail(name, absl::StrCat(text, ": the driver is older than CUDA 12"),
                "upgrade the NVIDIA driver to one for CUDA 12 or newer (R525+)");
  }
  if (facts.runtime_version != 0 && facts.runtime_version / 1000 > facts.driver_version / 1000) {
    return Fail(
        name, absl::StrCat(text, ": the runtime's major version is newer than the driver's"),
        absl::StrCat("upgrade the driver to one for CUDA ", CudaVersionText(facts.runtime_version),
                     " or newer, or run an epd built with an older CUDA"));
  }
  if (facts.runtime_version > facts.driver_version) {
    return Warn(name, absl::StrCat(text, ": the runtime is newer than the driver"),
                "runs under CUDA minor-version compatibility (no PTX JIT, newer APIs missing); "
                "upgrade the driver to match");
  }
  return Ok(name, text);
}

CheckResult CheckP2p(const DoctorFacts& facts) {
  const std::string name = "gpu.p2p";
  const size_t n = facts.gpus.size();
  if (n < 2) return Ok(name, absl::StrCat(n, " GPU(s): nothing to connect"));
  std::vector<std::string> rows;
  std::vector<std::string> missing;
  bool all_atomics = !facts.p2p.empty();
  for (size_t i = 0; i < n; ++i) {
    std::string row = absl::StrCat(i, ":");
    for (size_t j = 0; j < n; ++j) {
      P2pLink link = P2pLink::kNone;
      if (!facts.p2p.empty() && i < facts.p2p.size() && j < facts.p2p[i].size()) {
        link = facts.p2p[i][j];
      } else if (j < static_cast<size_t>(facts.gpus[i].peer_access_size()) &&
                 facts.gpus[i].peer_access(static_cast<int>(j))) {
        link = P2pLink::kAccess;
      }
      if (i == j) {
        absl::StrAppend(&row, " X");
        continue;
      }
      absl::StrAppend(&row, link == P2pLink::kAtomics  ? " NV"
                            : link == P2pLink::kAccess ? " P"
                                                       : " -");
      if (link != P2pLink::kAtomics) all_atomics = false;
      if (link == P2pLink::kNone && i < j) missing.push_back(absl::StrCat(i, "-", j));
    }
    rows.push_back(row);
  }
  const std::string matrix =
      absl::StrCat("[", absl::StrJoin(rows, " | "), "] (NV = peer access with native atomics, ",
                   "NVLink class; P = peer access; - = none)");
  if (!missing.empty()) {
    return Warn(
        name,
        absl::StrCat("no peer access between GPUs ", absl::StrJoin(missing, ", "), " ", matrix),
        "ranks on those GPUs exchange through host memory (slow): check `nvidia-smi topo "
        "-m`, the BIOS ACS / IOMMU settings, or keep a group's ranks on connected GPUs");
  }
  return Ok(name, absl::StrCat(all_atomics ? "every pair NVLink class " : "peer access everywhere ",
                               matrix));
}

CheckResult CheckMps(const DoctorFacts& facts) {
  const std::string name = "gpu.mps";
  if (facts.mps_active) return Ok(name, absl::StrCat("active: ", facts.mps_detail));
  if (facts.gpus.empty()) return Ok(name, "not active (no GPU)");
  return Warn(name, absl::StrCat("not active: ", facts.mps_detail),
              "daemon-launched kernels need MPS beside the clients' (DESIGN.md §3): start it "
              "(deploy/mps/start-mps.sh, or the nvidia-mps.service unit) with the same "
              "CUDA_MPS_PIPE_DIRECTORY as epd");
}

CheckResult CheckDevShm(const DoctorFacts& facts) {
  const std::string name = "memory.dev_shm";
  if (!facts.shm_total_bytes) {
    return Warn(name, "/dev/shm is not mounted",
                "mount a tmpfs at /dev/shm (clients' frameworks, NCCL and Python "
                "multiprocessing use it)");
  }
  const std::string text = absl::StrCat(
      "/dev/shm ", HumanBytes(*facts.shm_total_bytes),
      facts.shm_free_bytes ? absl::StrCat(", ", HumanBytes(*facts.shm_free_bytes), " free") : "");
  if (*facts.shm_total_bytes < kMinShmBytes) {
    return Warn(name, absl::StrCat(text, ": smaller than 1 GiB"),
                "containers default to 64 MiB: give the pod an emptyDir with medium: Memory at "
                "/dev/shm (docker: --shm-size=16g)");
  }
  return Ok(name, text);
}

CheckResult CheckMemlock(const DoctorFacts& facts) {
  const std::string name = "limits.memlock";
  const std::string text =
      absl::StrCat("RLIMIT_MEMLOCK ", transport::MemlockText(facts.memlock_bytes),
                   facts.cap_ipc_lock ? " (CAP_IPC_LOCK held)" : "");
  if (facts.memlock_bytes == UINT64_MAX || facts.cap_ipc_lock) return Ok(name, text);
  const std::string next =
      "set LimitMEMLOCK=infinity in epd's unit (deploy/systemd/epd.service) or ulimit -l "
      "unlimited in the container";
  if (!RdmaWanted(facts)) return Ok(name, absl::StrCat(text, " (no RDMA here: enough)"));
  if (facts.memlock_bytes < transport::kMinRdmaMemlockBytes) {
    return Fail(name, absl::StrCat(text, ": RDMA cannot register a group's buffers"), next);
  }
  return Warn(name, absl::StrCat(text, ": large groups may not register"), next);
}

CheckResult CheckFdLimit(const DoctorFacts& facts) {
  const std::string name = "limits.nofile";
  if (facts.fd_limit == 0) return Warn(name, "RLIMIT_NOFILE unknown", "check `ulimit -Hn`");
  const std::string text = absl::StrCat("RLIMIT_NOFILE ", facts.fd_limit);
  const std::string next =
      "set LimitNOFILE=65536 or more in epd's unit (deploy/systemd/epd.service sets 65536)";
  if (facts.fd_limit < kMinFdLimit) {
    return Fail(name, absl::StrCat(text, ": too few for the listener, gRPC and endpoints"), next);
  }
  if (facts.fd_limit < kGoodFdLimit) {
    return Warn(name, absl::StrCat(text, ": every endpoint and connection holds descriptors"),
                next);
  }
  return Ok(name, text);
}

CheckResult CheckClockSource(const DoctorFacts& facts) {
  const std::string name = "clock.source";
  static const std::set<std::string> kFast = {"tsc", "kvm-clock", "arch_sys_counter",
                                              "hyperv_clocksource_tsc_page", "xen"};
  if (facts.clocksource.empty()) {
    return Warn(name, "current_clocksource unreadable",
                "check /sys/devices/system/clocksource/clocksource0/current_clocksource");
  }
  const std::string text = absl::StrCat(
      facts.clocksource, facts.available_clocksources.empty()
                             ? ""
                             : absl::StrCat(" (available: ", facts.available_clocksources, ")"));
  if (kFast.count(facts.clocksource) != 0) return Ok(name, text);
  return Warn(name, absl::StrCat(text, ": reading it costs microseconds"),
              "every timestamp and timeout of epd reads the clock: find why the kernel left tsc "
              "(`dmesg | grep -i clocksource`) and boot with clocksource=tsc if it is stable");
}

std::vector<CheckResult> CheckRdma(const DoctorFacts& facts) {
  std::vector<CheckResult> out;
  if (facts.nics.empty()) {
    if (RdmaRequired(facts)) {
      out.push_back(Fail("rdma.devices", "no RDMA device, but transport rdma is configured",
                         "load the NIC's driver (mlx5_ib), or use transport tcp"));
    } else {
      out.push_back(Ok("rdma.devices", "none (groups across nodes use the tcp transport)"));
    }
    AppendPreflight(facts, &out);
    return out;
  }
  std::vector<std::string> names;
  for (const v1::NicInfo& nic : facts.nics) {
    names.push_back(absl::StrCat(nic.device(), ":", nic.port(), nic.selected() ? "*" : ""));
  }
  out.push_back(
      Ok("rdma.devices",
         absl::StrCat(facts.nics.size(), " port(s): ", absl::StrJoin(names, ", "),
                      " (* = epd uses it)", facts.rdma_built ? "" : "; epd built without RDMA")));
  for (const v1::NicInfo& nic : facts.nics) {
    const std::string port = absl::StrCat(nic.device(), ":", nic.port());
    const std::string state =
        absl::StrCat(port, " ", nic.state(), " ", nic.link_layer(),
                     nic.rate_gbps() > 0 ? absl::StrCat(" ", nic.rate_gbps(), " Gb/s") : "");
    if (nic.state() != "ACTIVE") {
      if (nic.selected()) {
        out.push_back(Fail("rdma.port_state", state,
                           "bring the link up (cable, switch port, subnet manager on InfiniBand: "
                           "`ibstat`), or leave the port out of rdma.devices"));
      } else {
        out.push_back(Ok("rdma.port_state", absl::StrCat(state, " (not used)")));
      }
      continue;
    }
    out.push_back(Ok("rdma.port_state", state));
    if (!nic.selected()) continue;
    const transport::RdmaPortInfo* info = nullptr;
    for (const transport::RdmaPortInfo& p : facts.ports) {
      if (p.device == nic.device() && p.port == nic.port()) info = &p;
    }
    if (nic.gid_index() < 0) {
      out.push_back(Fail("rdma.gid", absl::StrCat(port, ": no usable GID"),
                         nic.link_layer() == "Ethernet"
                             ? "RoCE needs a RoCE v2 GID with an IPv4 address: give the "
                               "interface an IPv4 address, or set rdma.gid_index"
                             : "check the port's GID table (`show_gids`) and rdma.gid_index"));
    } else {
      out.push_back(Ok("rdma.gid", absl::StrCat(port, ": index ", nic.gid_index(), " ", nic.gid(),
                                                GidTableText(info))));
    }
    if (nic.link_layer() == "Ethernet") {
      const uint32_t mtu = info != nullptr ? info->netdev_mtu : 0;
      const std::string netdev = info != nullptr ? info->netdev : "";
      if (mtu == 0) {
        out.push_back(Warn("rdma.mtu", absl::StrCat(port, ": interface MTU unknown"),
                           "check `ip link` of the port's interface (9000 for RoCE)"));
      } else if (mtu < kRoceJumboMtu) {
        out.push_back(Warn(
            "rdma.mtu",
            absl::StrCat(port, " (", netdev, "): MTU ", mtu, ": RDMA runs with 1024-byte packets"),
            absl::StrCat("set MTU 9000 on ", netdev,
                         " on every node and on the switch ports (jumbo frames)")));
      } else {
        out.push_back(Ok("rdma.mtu", absl::StrCat(port, " (", netdev, "): MTU ", mtu)));
      }
    }
  }
  // GPU ↔ NIC: every GPU served by a selected port, on the same NUMA node when known.
  std::map<std::string, const v1::NicInfo*> nic_of_gpu;
  for (const v1::NicInfo& nic : facts.nics) {
    for (const std::string& uuid : nic.gpu_uuids()) nic_of_gpu[uuid] = &nic;
  }
  for (const v1::GpuInfo& gpu : facts.gpus) {
    auto it = nic_of_gpu.find(gpu.uuid());
    if (it == nic_of_gpu.end()) {
      out.push_back(Warn("rdma.affinity", absl::StrCat(GpuName(gpu), ": no selected RDMA port"),
                         "list a port near it in rdma.devices, or bring its port up"));
      continue;
    }
    const v1::NicInfo& nic = *it->second;
    auto numa = facts.gpu_numa.find(gpu.pci_bus_id());
    const int gpu_numa = numa == facts.gpu_numa.end() ? -1 : numa->second;
    const std::string text = absl::StrCat(GpuName(gpu), " -> ", nic.device(), ":", nic.port(),
                                          " (NUMA ", gpu_numa, " / ", nic.numa_node(), ")");
    if (gpu_numa >= 0 && nic.numa_node() >= 0 && gpu_numa != nic.numa_node()) {
      out.push_back(Warn("rdma.affinity", absl::StrCat(text, ": across sockets"),
                         "traffic crosses the CPU interconnect: prefer a NIC on the GPU's NUMA "
                         "node (rdma.devices, `nvidia-smi topo -m`)"));
    } else {
      out.push_back(Ok("rdma.affinity", text));
    }
  }
  AppendPreflight(facts, &out);
  return out;
}

std::vector<CheckResult> CheckPeers(const DoctorFacts& facts) {
  std::vector<CheckResult> out;
  for (const PeerProbe& peer : facts.peers) {
    if (peer.reachable) {
      out.push_back(Ok("peer.reachable", absl::StrCat(peer.address, ": TCP connect ok")));
    } else {
      out.push_back(Fail("peer.reachable", absl::StrCat(peer.address, ": ", peer.error),
                         "is epd running there with --peer_listen on that port? Open the port "
                         "in the firewalls between the nodes (TCP, both directions)"));
    }
  }
  return out;
}

std::vector<CheckResult> CheckDaemon(const DoctorFacts& facts) {
  std::vector<CheckResult> out;
  if (!facts.live) return out;
  if (facts.serving_status == "SERVING") {
    out.push_back(
        Ok("daemon.serving", absl::StrCat(facts.source, ": SERVING, backend ", facts.backend)));
  } else if (facts.draining && absl::StrContains(facts.serving_status, "drained by the operator")) {
    // Drained on purpose, and nothing else wrong (a fault would be the status's reason).
    out.push_back(Warn("daemon.serving",
                       absl::StrCat(facts.source, ": drained by an operator (no new groups)"),
                       "`epctl undrain` when the maintenance is over"));
  } else {
    out.push_back(Fail("daemon.serving", absl::StrCat(facts.source, ": ", facts.serving_status),
                       "the reason in parentheses says what is wrong; `journalctl -u epd`"));
  }
  absl::Status version = CheckClientVersion(kEpdVersion, facts.daemon_version);
  if (version.ok()) {
    out.push_back(
        Ok("daemon.version", absl::StrCat("epd ", facts.daemon_version, ", epctl ", kEpdVersion)));
  } else {
    out.push_back(Fail("daemon.version", std::string(version.message()),
                       "use the epctl and libepdclient of the release epd runs"));
  }
  return out;
}

std::vector<CheckResult> RunDoctorChecks(const DoctorFacts& facts) {
  std::vector<CheckResult> out = CheckDaemon(facts);
  auto append = [&out](std::vector<CheckResult> more) {
    for (CheckResult& r : more) out.push_back(std::move(r));
  };
  append(CheckGpuArchitecture(facts));
  out.push_back(CheckCudaVersions(facts));
  out.push_back(CheckP2p(facts));
  out.push_back(CheckMps(facts));
  out.push_back(CheckDevShm(facts));
  out.push_back(CheckMemlock(facts));
  out.push_back(CheckFdLimit(facts));
  out.push_back(CheckClockSource(facts));
  append(CheckRdma(facts));
  append(CheckPeers(facts));
  return out;
}

bool AnyFailed(const std::vector<CheckResult>& results) {
  return std::any_of(results.begin(), results.end(),
                     [](const CheckResult& r) { return r.verdict == Verdict::kFail; });
}

std::string FormatDoctor(const DoctorFacts& facts, const std::vector<CheckResult>& results) {
  Table table({"CHECK", "RESULT", "DETAIL"});
  int counts[3] = {0, 0, 0};
  for (const CheckResult& r : results) {
    ++counts[static_cast<int>(r.verdict)];
    table.AddRow({r.name, VerdictName(r.verdict), r.detail});
    if (!r.next_step.empty()) table.AddRow({"", "", absl::StrCat("next: ", r.next_step)});
  }
  return absl::StrCat("epctl doctor: ", facts.source, "\n", table.Render(), "summary: ", counts[0],
                      " ok, ", counts[1], " warn, ", counts[2], " fail\n");
}

std::string DoctorJson(const DoctorFacts& facts, const std::vector<CheckResult>& results) {
  google::protobuf::Struct doc;
  auto& fields = *doc.mutable_fields();
  fields["source"].set_string_value(facts.source);
  int counts[3] = {0, 0, 0};
  google::protobuf::ListValue* checks = fields["checks"].mutable_list_value();
  for (const CheckResult& r : results) {
    ++counts[static_cast<int>(r.verdict)];
    auto& check = *checks->add_values()->mutable_struct_value()->mutable_fields();
    check["name"].set_string_value(r.name);
    check["result"].set_string_value(VerdictName(r.verdict));
    check["detail"].set_string_value(r.detail);
    check["next_step"].set_string_value(r.next_step);
  }
  fields["ok"].set_number_value(counts[0]);
  fields["warn"].set_number_value(counts[1]);
  fields["fail"].set_number_value(counts[2]);
  return JsonOutput(doc);
}

DoctorFacts FactsFromStats(const v1::GetStatsResponse& stats, const std::string& target) {
  DoctorFacts f;
  f.live = true;
  f.source = absl::StrCat("epd ", stats.version(), " (pid ", stats.pid(), ") on ", target);
  f.daemon_version = stats.version();
  f.serving_status = stats.serving_status();
  f.draining = stats.draining();
  f.backend = stats.backend();
  f.backend_reason = stats.backend_reason();
  f.gpus.assign(stats.gpus().begin(), stats.gpus().end());
  f.driver_version = stats.cuda_driver_version();
  f.runtime_version = stats.cuda_runtime_version();
  f.cuda_driver_loaded = f.driver_version != 0;
  f.mps_active = stats.mps_active();
  f.mps_detail = stats.mps_active() ? "reported by epd" : "epd reports no MPS";
  f.memlock_bytes = stats.memlock_limit_bytes();
  f.fd_limit = stats.fd_limit();
  f.config = stats.effective_config();
  f.nics.assign(stats.nics().begin(), stats.nics().end());
  f.preflight.assign(stats.preflight().begin(), stats.preflight().end());
  f.rdma_built = std::find(stats.transports().begin(), stats.transports().end(), "rdma") !=
                     stats.transports().end() ||
                 !stats.nics().empty();
  f.own_peer_address = stats.peer_address();
  return f;
}

}  // namespace epd::epctl
