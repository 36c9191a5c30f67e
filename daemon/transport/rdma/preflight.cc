#include "daemon/transport/rdma/preflight.h"

#include <sys/resource.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

#if EPD_HAVE_CUDA
#include <cuda.h>  // Driver API types only; entry points resolved at run time.
#include <cuda_runtime_api.h>
#endif

namespace epd::transport {
namespace {

/// CAP_IPC_LOCK (bit 14) in /proc/self/status CapEff.
bool HasCapIpcLock() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view v(line);
    if (!absl::ConsumePrefix(&v, "CapEff:")) continue;
    uint64_t caps = 0;
    if (!absl::SimpleHexAtoi(absl::StripAsciiWhitespace(v), &caps)) return false;
    return (caps >> 14) & 1;
  }
  return false;
}

#if EPD_HAVE_CUDA
/// CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED of CUDA device `ordinal`; nullopt when the driver
/// cannot be asked.
std::optional<bool> CudaDmabufSupported(int ordinal) {
  using GetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  static GetAttribute fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<GetAttribute>(nullptr);
    }
    return reinterpret_cast<GetAttribute>(p);
  }();
  if (fn == nullptr) return std::nullopt;
  int value = 0;
  if (fn(&value, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, ordinal) != CUDA_SUCCESS) {
    return std::nullopt;
  }
  return value != 0;
}
#endif

std::string PortName(absl::string_view device, uint32_t port) {
  return absl::StrCat(device, ":", port);
}

}  // namespace

std::string MemlockText(uint64_t bytes) {
  if (bytes == UINT64_MAX) return "unlimited";
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0) return absl::StrCat(bytes >> 30, " GiB");
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0) return absl::StrCat(bytes >> 20, " MiB");
  if (bytes >= (1ull << 10) && bytes % (1ull << 10) == 0) return absl::StrCat(bytes >> 10, " KiB");
  return absl::StrCat(bytes, " bytes");
}

PreflightFacts GatherPreflightFacts(const std::string& sysfs_root,
                                    const std::vector<v1::GpuInfo>& gpus) {
  PreflightFacts f;
#if EPD_HAVE_RDMA
  f.rdma_built = true;
#endif
#if EPD_HAVE_CUDA
  f.cuda_built = true;
  for (const v1::GpuInfo& g : gpus) {
    if (std::optional<bool> s = CudaDmabufSupported(g.ordinal()))
      f.dmabuf_supported[g.ordinal()] = *s;
  }
#else
  (void)gpus;
#endif
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) == 0) {
    f.memlock_bytes =
        lim.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(lim.rlim_cur);
  }
  f.cap_ipc_lock = HasCapIpcLock();
  std::error_code ec;
  f.nvidia_peermem_loaded =
      std::filesystem::exists(std::filesystem::path(sysfs_root) / "module" / "nvidia_peermem", ec);
  return f;
}

bool RdmaPreflightWanted(const v1::DaemonConfig& config, const std::vector<RdmaPortInfo>& ports) {
  return config.transport() == "rdma" || config.rdma().devices_size() > 0 || !ports.empty();
}

PreflightResult RunRdmaPreflight(const v1::DaemonConfig& config,
                                 const std::vector<RdmaPortInfo>& ports,
                                 const std::vector<v1::GpuInfo>& gpus, const PreflightFacts& facts,
                                 NicPlan* plan) {
  PreflightResult r;
  auto refuse = [&r](std::string line) {
    if (r.reason.empty()) r.reason = line;
    r.lines.push_back(absl::StrCat(kPreflightRefuse, line));
  };
  auto warn = [&r](std::string line) { r.lines.push_back(absl::StrCat(kPreflightWarn, line)); };
  const v1::RdmaConfig& rdma = config.rdma();
  // Only a daemon configured for rdma is told it could use tcp instead (it already does
  // otherwise).
  const std::string or_tcp = config.transport() == "rdma" ? ", or use transport \"tcp\"" : "";

  if (!facts.rdma_built) {
    refuse(absl::StrCat(
        "RDMA: this epd was built without libibverbs/librdmacm; install libibverbs-dev and "
        "librdmacm-dev and rebuild with -DEPD_WITH_RDMA=ON",
        or_tcp));
  }
  if (ports.empty()) {
    refuse(absl::StrCat(
        "RDMA: no RDMA device found (/sys/class/infiniband is empty or absent); load the NIC's "
        "RDMA driver (e.g. mlx5_ib)",
        or_tcp));
  }
  // Listed ports: present and active.
  for (const v1::RdmaDevicePort& d : rdma.devices()) {
    const uint32_t port = d.port() == 0 ? 1 : d.port();
    bool device_found = false;
    const RdmaPortInfo* found = nullptr;
    for (const RdmaPortInfo& p : ports) {
      if (p.device != d.device()) continue;
      device_found = true;
      if (p.port == port) found = &p;
    }
    if (found == nullptr) {
      refuse(absl::StrCat("RDMA: rdma.devices names ", PortName(d.device(), port), ", but ",
                          device_found ? "that device has no such port" : "no such device exists",
                          "; list a device:port that `ibv_devinfo` shows"));
    } else if (found->state != "ACTIVE") {
      refuse(absl::StrCat("RDMA: port ", PortName(d.device(), port), " is ", found->state,
                          ", not ACTIVE; bring its link up (cable, switch, subnet manager on "
                          "InfiniBand) or remove it from rdma.devices"));
    }
  }
  if (rdma.devices_size() == 0 && !ports.empty()) {
    bool any_active = false;
    for (const RdmaPortInfo& p : ports) any_active = any_active || p.state == "ACTIVE";
    if (!any_active) {
      refuse(absl::StrCat("RDMA: no port is ACTIVE (", ports.size(),
                          " found); bring a link up (cable, switch, subnet manager on "
                          "InfiniBand)"));
    }
  }
  // GID of each selected, active port.
  for (const RdmaPortInfo& p : ports) {
    if (!PortSelected(p, rdma) || p.state != "ACTIVE") continue;
    const std::string name = PortName(p.device, p.port);
    if (p.link_layer != "Ethernet" && p.link_layer != "InfiniBand") {
      refuse(absl::StrCat("RDMA: port ", name, " has link layer \"", p.link_layer,
                          "\" (neither InfiniBand nor Ethernet); check its driver"));
      continue;
    }
    if (rdma.has_gid_index()) {
      const GidEntry* g = nullptr;
      for (const GidEntry& e : p.gids) {
        if (static_cast<uint32_t>(e.index) == rdma.gid_index()) g = &e;
      }
      if (g == nullptr) {
        refuse(absl::StrCat("RDMA: rdma.gid_index ", rdma.gid_index(), " is empty on port ", name,
                            "; pick a populated index (`show_gids`), or leave gid_index unset"));
      } else if (p.link_layer == "Ethernet" && g->type != "RoCE v2") {
        refuse(absl::StrCat("RDMA: rdma.gid_index ", rdma.gid_index(), " on port ", name, " is ",
                            g->type.empty() ? "not" : absl::StrCat("\"", g->type, "\", not"),
                            " a RoCE v2 GID; pick a RoCE v2 index (`show_gids`) or leave "
                            "gid_index unset"));
      }
    } else if (p.link_layer == "Ethernet" && ChooseGidIndex(p, std::nullopt) < 0) {
      refuse(absl::StrCat("RDMA: port ", name,
                          " has no RoCE v2 GID with an IPv4 address; give its network "
                          "interface an IPv4 address, or set rdma.gid_index"));
    } else if (p.link_layer == "InfiniBand" && (p.gids.empty() || p.gids.front().index != 0)) {
      refuse(absl::StrCat("RDMA: port ", name,
                          " has no GID at index 0; check that a subnet manager runs"));
    }
  }
  // Locked memory.
  if (!facts.cap_ipc_lock && facts.memlock_bytes != UINT64_MAX) {
    const std::string line =
        absl::StrCat("RDMA: RLIMIT_MEMLOCK is ", MemlockText(facts.memlock_bytes),
                     "; set LimitMEMLOCK=infinity in the systemd unit (or `ulimit -l unlimited`, "
                     "docker --ulimit memlock=-1)");
    if (facts.memlock_bytes < kMinRdmaMemlockBytes) {
      refuse(line);
    } else {
      warn(line);
    }
  }
  // GPUDirect RDMA.
  bool dmabuf = false;
  for (const auto& [ordinal, ok] : facts.dmabuf_supported) dmabuf = dmabuf || ok;
  r.gpudirect_usable = !gpus.empty() && (dmabuf || facts.nvidia_peermem_loaded);
  if (!gpus.empty() && !r.gpudirect_usable && rdma.gpudirect() != "off") {
    const std::string why =
        facts.cuda_built
            ? "no GPU reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and nvidia_peermem is not "
              "loaded"
            : "this epd was built without CUDA and nvidia_peermem is not loaded";
    const std::string fix =
        "use the NVIDIA open kernel module on Linux >= 5.12 (dmabuf) or `modprobe "
        "nvidia_peermem`";
    if (rdma.gpudirect() == "on") {
      refuse(absl::StrCat("RDMA: rdma.gpudirect is \"on\" but GPUDirect RDMA is not usable (", why,
                          "); ", fix, ", or set gpudirect \"auto\""));
    } else {
      warn(absl::StrCat("RDMA: GPUDirect RDMA is not usable (", why,
                        "); GPU buffers are staged through pinned host memory; to register GPU "
                        "memory, ",
                        fix));
    }
  }
  r.rdma_usable = r.reason.empty();
  if (plan != nullptr) {
    for (v1::NicInfo& n : plan->nics) {
      n.set_gpudirect(n.selected() && r.gpudirect_usable && rdma.gpudirect() != "off");
    }
  }
  return r;
}

}  // namespace epd::transport
