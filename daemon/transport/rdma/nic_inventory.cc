#include "daemon/transport/rdma/nic_inventory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <filesystem>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/os/scoped_fd.h"

namespace epd::transport {
namespace {

namespace fs = std::filesystem;

/// The most bytes read of one sysfs attribute (the kernel serves at most a page).
constexpr size_t kMaxAttributeBytes = 4096;
/// The most entries read of one sysfs directory (devices, ports, GID table).
constexpr size_t kMaxDirEntries = 4096;

/// The first line of a small sysfs file, trimmed: at most kMaxAttributeBytes are read, and
/// a FIFO or other special file never blocks (O_NONBLOCK); "" when it cannot be read.
std::string ReadLine(const fs::path& path) {
  const ScopedFd fd(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (!fd.valid()) return "";
  std::array<char, kMaxAttributeBytes> buf{};
  size_t got = 0;
  while (got < buf.size()) {
    const ssize_t n = ::read(fd.get(), buf.data() + got, buf.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  absl::string_view text(buf.data(), got);
  text = text.substr(0, text.find('\n'));
  return std::string(absl::StripAsciiWhitespace(text));
}

/// The resolved path of `path` ("" when it does not resolve).
std::string RealPath(const fs::path& path) {
  std::array<char, PATH_MAX> buf{};
  if (::realpath(path.c_str(), buf.data()) == nullptr) return "";
  return std::string(buf.data());
}

/// Entry names of `dir` (at most kMaxDirEntries), sorted; empty when it cannot be listed.
std::vector<std::string> ListDir(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end && names.size() < kMaxDirEntries;
       it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

/// sysfs "state": "4: ACTIVE" -> "ACTIVE".
std::string ParseState(const std::string& text) {
  if (text.empty()) return "UNKNOWN";
  const size_t colon = text.find(':');
  std::string name(absl::StripAsciiWhitespace(colon == std::string::npos
                                                  ? absl::string_view(text)
                                                  : absl::string_view(text).substr(colon + 1)));
  return name.empty() ? "UNKNOWN" : name;
}

/// sysfs "rate": "100 Gb/sec (4X EDR)", "2.5 Gb/sec (1X SDR)" -> whole Gb/s (0 unknown).
uint32_t ParseRate(const std::string& text) {
  const std::vector<absl::string_view> words = absl::StrSplit(text, ' ', absl::SkipEmpty());
  double gbps = 0;
  // Written so that NaN ("nan Gb/sec" parses) is refused too: casting it is undefined.
  if (words.empty() || !absl::SimpleAtod(words[0], &gbps) || !(gbps >= 0 && gbps <= 1e6)) {
    return 0;
  }
  return static_cast<uint32_t>(gbps);
}

/// A sysfs GID ("fe80:0000:...:0001", 8 groups of 4 hex digits) as 16 bytes; false when
/// malformed.
bool ParseGid(const std::string& text, std::array<uint8_t, 16>* bytes) {
  const std::vector<absl::string_view> groups = absl::StrSplit(text, ':');
  if (groups.size() != 8) return false;
  for (size_t i = 0; i < 8; ++i) {
    uint32_t v = 0;
    if (groups[i].size() != 4 || !absl::SimpleHexAtoi(groups[i], &v) || v > 0xffff) return false;
    (*bytes)[2 * i] = static_cast<uint8_t>(v >> 8);
    (*bytes)[2 * i + 1] = static_cast<uint8_t>(v & 0xff);
  }
  return true;
}

/// `name` normalised when it is a PCI function id ("[dddd:]bb:dd.f", hex), else "".
std::string PciBusIdOrEmpty(const std::string& name) {
  const std::string id = NormalizePciBusId(name);
  const std::vector<absl::string_view> parts = absl::StrSplit(id, absl::ByAnyChar(":."));
  if (parts.size() != 4) return "";
  const size_t widths[] = {4, 2, 2, 1};
  for (size_t i = 0; i < 4; ++i) {
    if (parts[i].size() != widths[i] || !std::all_of(parts[i].begin(), parts[i].end(), [](char c) {
          return absl::ascii_isxdigit(static_cast<unsigned char>(c));
        })) {
      return "";
    }
  }
  return id;
}

std::vector<GidEntry> ReadGids(const fs::path& port_dir) {
  std::vector<GidEntry> gids;
  for (const std::string& name : ListDir(port_dir / "gids")) {
    int32_t index = 0;
    if (!absl::SimpleAtoi(name, &index) || index < 0) continue;
    std::array<uint8_t, 16> bytes{};
    if (!ParseGid(ReadLine(port_dir / "gids" / name), &bytes)) continue;
    if (std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; })) continue;
    GidEntry e;
    e.index = index;
    std::array<char, INET6_ADDRSTRLEN> text{};
    if (::inet_ntop(AF_INET6, bytes.data(), text.data(), text.size()) != nullptr) {
      e.gid = text.data();
    }
    e.ipv4_mapped =
        std::all_of(bytes.begin(), bytes.begin() + 10, [](uint8_t b) { return b == 0; }) &&
        bytes[10] == 0xff && bytes[11] == 0xff;
    e.type = ReadLine(port_dir / "gid_attrs" / "types" / name);
    gids.push_back(std::move(e));
  }
  std::sort(gids.begin(), gids.end(),
            [](const GidEntry& a, const GidEntry& b) { return a.index < b.index; });
  return gids;
}

/// The port's network interface (RoCE; IPoIB on InfiniBand) and its MTU: the interface of
/// the port's first GID (gid_attrs/ndevs), else the device's first under device/net.
void ReadNetdev(const std::string& sysfs_root, const fs::path& dev_dir, const fs::path& port_dir,
                RdmaPortInfo* p) {
  for (const GidEntry& gid : p->gids) {
    p->netdev = ReadLine(port_dir / "gid_attrs" / "ndevs" / std::to_string(gid.index));
    if (!p->netdev.empty()) break;
  }
  if (p->netdev.empty()) {
    std::vector<std::string> nets = ListDir(dev_dir / "device" / "net");
    if (!nets.empty()) p->netdev = nets.front();
  }
  if (p->netdev.empty()) return;
  uint32_t mtu = 0;
  if (absl::SimpleAtoi(ReadLine(dev_dir / "device" / "net" / p->netdev / "mtu"), &mtu) ||
      absl::SimpleAtoi(ReadLine(fs::path(sysfs_root) / "class" / "net" / p->netdev / "mtu"),
                       &mtu)) {
    p->netdev_mtu = mtu;
  }
}

}  // namespace

std::vector<RdmaPortInfo> ScanRdmaPorts(const std::string& sysfs_root) {
  std::vector<RdmaPortInfo> ports;
  const fs::path class_dir = fs::path(sysfs_root) / "class" / "infiniband";
  for (const std::string& device : ListDir(class_dir)) {
    const fs::path dev_dir = class_dir / device;
    const std::string pci_path = RealPath(dev_dir / "device");
    // The bus id is the name the link resolves to; a link that does not resolve (a loop,
    // a dangling or unreadable target) or resolves to something not named like a PCI
    // function leaves it unknown.
    const std::string bus_id =
        pci_path.empty() ? "" : PciBusIdOrEmpty(fs::path(pci_path).filename().string());
    int32_t numa = -1;
    if (!absl::SimpleAtoi(ReadLine(dev_dir / "device" / "numa_node"), &numa)) numa = -1;
    for (const std::string& port_name : ListDir(dev_dir / "ports")) {
      uint32_t port = 0;
      if (!absl::SimpleAtoi(port_name, &port) || port == 0) continue;
      const fs::path port_dir = dev_dir / "ports" / port_name;
      RdmaPortInfo p;
      p.device = device;
      p.port = port;
      p.state = ParseState(ReadLine(port_dir / "state"));
      p.link_layer = ReadLine(port_dir / "link_layer");
      p.rate_gbps = ParseRate(ReadLine(port_dir / "rate"));
      p.numa_node = numa;
      p.pci_bus_id = bus_id;
      p.pci_path = pci_path;
      p.gids = ReadGids(port_dir);
      ReadNetdev(sysfs_root, dev_dir, port_dir, &p);
      ports.push_back(std::move(p));
    }
  }
  std::sort(ports.begin(), ports.end(), [](const RdmaPortInfo& a, const RdmaPortInfo& b) {
    return a.device != b.device ? a.device < b.device : a.port < b.port;
  });
  return ports;
}

std::string ReadSysfsLine(const std::string& path) { return ReadLine(path); }

std::string NormalizePciBusId(const std::string& bus_id) {
  std::string id = absl::AsciiStrToLower(absl::StripAsciiWhitespace(bus_id));
  const std::vector<std::string> parts = absl::StrSplit(id, ':');
  if (parts.size() == 2) return absl::StrCat("0000:", id);
  if (parts.size() == 3 && parts[0].size() > 4) {
    return absl::StrCat(parts[0].substr(parts[0].size() - 4), ":", parts[1], ":", parts[2]);
  }
  return id;
}

std::string ResolvePciPath(const std::string& sysfs_root, const std::string& bus_id) {
  if (bus_id.empty()) return "";
  return RealPath(fs::path(sysfs_root) / "bus" / "pci" / "devices" / NormalizePciBusId(bus_id));
}

int PciDistance(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return -1;
  const std::vector<absl::string_view> pa = absl::StrSplit(a, '/', absl::SkipEmpty());
  const std::vector<absl::string_view> pb = absl::StrSplit(b, '/', absl::SkipEmpty());
  size_t common = 0;
  while (common < pa.size() && common < pb.size() && pa[common] == pb[common]) ++common;
  return static_cast<int>((pa.size() - common) + (pb.size() - common));
}

int32_t ChooseGidIndex(const RdmaPortInfo& port, std::optional<uint32_t> configured) {
  if (configured) return static_cast<int32_t>(*configured);
  if (port.link_layer == "InfiniBand") return 0;
  for (const GidEntry& g : port.gids) {
    if (g.type == "RoCE v2" && g.ipv4_mapped) return g.index;
  }
  return -1;
}

bool PortSelected(const RdmaPortInfo& port, const v1::RdmaConfig& config) {
  if (config.devices_size() == 0) return port.state == "ACTIVE";
  for (const v1::RdmaDevicePort& d : config.devices()) {
    if (d.device() == port.device && (d.port() == 0 ? 1u : d.port()) == port.port) return true;
  }
  return false;
}

RdmaTransportOptions RdmaOptionsFromConfig(const v1::RdmaConfig& config) {
  RdmaTransportOptions o;
  o.service_level = config.service_level();
  o.traffic_class = config.traffic_class();
  if (config.has_timeout()) o.timeout = config.timeout();
  if (config.has_retry_count()) o.retry_count = config.retry_count();
  if (config.has_rnr_retry()) o.rnr_retry = config.rnr_retry();
  if (config.has_qps_per_peer()) o.qps_per_peer = config.qps_per_peer();
  if (config.has_max_send_wr()) o.max_send_wr = config.max_send_wr();
  if (config.has_cq_depth()) o.cq_depth = config.cq_depth();
  o.mtu = config.has_mtu() ? config.mtu() : 0;
  o.gpudirect = config.gpudirect() == "on"    ? GpuDirectMode::kOn
                : config.gpudirect() == "off" ? GpuDirectMode::kOff
                                              : GpuDirectMode::kAuto;
  return o;
}

NicPlan PlanNics(const std::vector<RdmaPortInfo>& ports, const v1::RdmaConfig& config,
                 const std::vector<v1::GpuInfo>& gpus, const std::string& sysfs_root) {
  NicPlan plan;
  plan.options = RdmaOptionsFromConfig(config);
  const std::optional<uint32_t> configured_gid =
      config.has_gid_index() ? std::optional<uint32_t>(config.gid_index()) : std::nullopt;
  std::vector<size_t> selected;  // Indices into `ports` / plan.nics.
  for (const RdmaPortInfo& p : ports) {
    v1::NicInfo n;
    n.set_device(p.device);
    n.set_port(p.port);
    n.set_state(p.state);
    n.set_link_layer(p.link_layer);
    n.set_pci_bus_id(p.pci_bus_id);
    n.set_numa_node(p.numa_node);
    n.set_rate_gbps(p.rate_gbps);
    const int32_t gid_index = ChooseGidIndex(p, configured_gid);
    n.set_gid_index(gid_index);
    for (const GidEntry& g : p.gids) {
      if (g.index == gid_index) n.set_gid(g.gid);
    }
    n.set_selected(PortSelected(p, config));
    if (n.selected()) selected.push_back(plan.nics.size());
    plan.nics.push_back(std::move(n));
  }
  std::vector<int> users(ports.size(), 0);
  std::vector<std::vector<int>> cuda_of(ports.size());
  for (const v1::GpuInfo& gpu : gpus) {
    if (selected.empty()) break;
    const std::string gpu_path = ResolvePciPath(sysfs_root, gpu.pci_bus_id());
    size_t best = selected[0];
    int best_distance = std::numeric_limits<int>::max();
    for (size_t i : selected) {
      int d = PciDistance(gpu_path, ports[i].pci_path);
      if (d < 0) d = std::numeric_limits<int>::max();
      if (d < best_distance || (d == best_distance && users[i] < users[best])) {
        best = i;
        best_distance = d;
      }
    }
    ++users[best];
    cuda_of[best].push_back(gpu.ordinal());
    plan.nics[best].add_gpu_uuids(gpu.uuid());
  }
  for (size_t i : selected) {
    RdmaPort rp;
    rp.device = ports[i].device;
    rp.port = ports[i].port;
    rp.gid_index = plan.nics[i].gid_index();
    rp.cuda_devices = cuda_of[i];
    plan.options.ports.push_back(std::move(rp));
  }
  return plan;
}

}  // namespace epd::transport
