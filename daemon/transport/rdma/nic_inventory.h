// NIC inventory: the RDMA devices and ports of this machine read from sysfs (no
// libibverbs needed), the GID index epd uses on each port, and which GPU uses which port
// (the nearest on the PCIe tree). Feeds GetStatsResponse.nics, the preflight
// (preflight.h) and the RdmaTransportOptions MakeRdmaTransport is built with.
//
// sysfs layout read, under a root directory ("/sys" in the daemon, a temporary tree in
// tests):
//   class/infiniband/<dev>/device            -> the device's PCI function (symlink)
//   class/infiniband/<dev>/device/numa_node  -> "-1" or the node
//   class/infiniband/<dev>/ports/<p>/state, link_layer, rate
//   class/infiniband/<dev>/ports/<p>/gids/<i>, gid_attrs/types/<i>, gid_attrs/ndevs/<i>
//   class/infiniband/<dev>/device/net/<if>/mtu, class/net/<if>/mtu
//   bus/pci/devices/<bus id>                 -> a GPU's PCI function (symlink)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/transport/rdma/rdma_transport.h"
#include "epd/v1/config.pb.h"
#include "epd/v1/control.pb.h"

namespace epd::transport {

/// One non-zero entry of a port's GID table.
struct GidEntry {
  int32_t index = 0;
  std::string gid;           ///< Text form, e.g. "fe80::1" or "::ffff:10.0.0.1".
  std::string type;          ///< gid_attrs/types: "IB/RoCE v1", "RoCE v2"; "" when unreadable.
  bool ipv4_mapped = false;  ///< ::ffff:a.b.c.d (RoCE v2 over IPv4).
};

/// One port of one RDMA device as sysfs shows it.
struct RdmaPortInfo {
  std::string device;          ///< "mlx5_0".
  uint32_t port = 1;           ///< 1-based.
  std::string state;           ///< "ACTIVE", "DOWN", ...; "UNKNOWN" when unreadable.
  std::string link_layer;      ///< "InfiniBand", "Ethernet"; "" when unreadable.
  uint32_t rate_gbps = 0;      ///< 0 when unknown.
  int32_t numa_node = -1;      ///< -1 when unknown.
  std::string pci_bus_id;      ///< "0000:1a:00.0"; "" when unknown.
  std::string pci_path;        ///< Resolved sysfs path of the PCI function; "" when unknown.
  std::vector<GidEntry> gids;  ///< Non-zero GIDs, by index.
  std::string netdev;          ///< Its network interface ("eth2", "ib0"); "" when none.
  uint32_t netdev_mtu = 0;     ///< That interface's MTU in bytes; 0 when unknown.
};

/// Reads every port of every device under `sysfs_root`/class/infiniband, sorted by device
/// then port. No such directory (no RDMA driver loaded) = an empty list. A file that is
/// missing or unreadable leaves its field unknown; never an error for one bad device.
std::vector<RdmaPortInfo> ScanRdmaPorts(const std::string& sysfs_root);

/// The first line of a small sysfs (or /proc) file, trimmed; "" when it cannot be read.
/// Never blocks on a special file and reads at most a few KiB.
std::string ReadSysfsLine(const std::string& path);

/// Normalises a PCI bus id as sysfs names it: lower case, 4-digit domain
/// ("00000000:1A:00.0" and "1a:00.0" -> "0000:1a:00.0").
std::string NormalizePciBusId(const std::string& bus_id);

/// The resolved sysfs path of PCI function `bus_id` (`sysfs_root`/bus/pci/devices/<id>),
/// "" when it does not exist.
std::string ResolvePciPath(const std::string& sysfs_root, const std::string& bus_id);

/// Hops between two resolved sysfs paths through their deepest common ancestor (each
/// path component one hop); -1 when either is empty.
int PciDistance(const std::string& a, const std::string& b);

/// The GID index epd uses on `port`: `configured` when given (even if that entry is
/// empty: the preflight names it), else on Ethernet the first RoCE v2 GID with an
/// IPv4-mapped address, on InfiniBand 0; -1 when none fits.
int32_t ChooseGidIndex(const RdmaPortInfo& port, std::optional<uint32_t> configured);

/// Whether `port` is selected by `config.devices` (every ACTIVE port when empty).
bool PortSelected(const RdmaPortInfo& port, const v1::RdmaConfig& config);

/// The ports, the GPUs and the resolved transport options.
struct NicPlan {
  /// Every port found (GetStatsResponse.nics), selected or not, with GPUs assigned.
  std::vector<v1::NicInfo> nics;
  /// The selected ports (their GID index, the CUDA ordinals nearest to each) and the
  /// settings of `config`; ports empty when none is selected.
  RdmaTransportOptions options;
};

/// Builds the plan: selects the ports of `config.devices` (or every ACTIVE one), chooses
/// each one's GID index (ChooseGidIndex) and maps each GPU of `gpus` to its nearest
/// selected port by PciDistance (GPU paths resolved under `sysfs_root` from
/// GpuInfo.pci_bus_id); ties, and GPUs whose path is unknown, go to the least used port.
/// NicInfo.gpudirect is left false (the preflight sets it).
NicPlan PlanNics(const std::vector<RdmaPortInfo>& ports, const v1::RdmaConfig& config,
                 const std::vector<v1::GpuInfo>& gpus, const std::string& sysfs_root);

/// The settings of a validated RdmaConfig as transport options (ports left empty).
RdmaTransportOptions RdmaOptionsFromConfig(const v1::RdmaConfig& config);

}  // namespace epd::transport
