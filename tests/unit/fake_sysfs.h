// A fake sysfs tree in a temporary directory for the NIC inventory (nic_inventory.h): PCI
// functions under devices/ on a chosen bridge path, RDMA devices under class/infiniband
// with ports, GIDs and their types, GPUs under bus/pci/devices.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace epd::testing {

class FakeSysfs {
 public:
  FakeSysfs() {
    char dir[] = "/tmp/epd_fake_sysfs_XXXXXX";
    EXPECT_NE(::mkdtemp(dir), nullptr);
    root_ = dir;
  }
  ~FakeSysfs() { std::filesystem::remove_all(root_); }
  FakeSysfs(const FakeSysfs&) = delete;
  FakeSysfs& operator=(const FakeSysfs&) = delete;

  const std::string& root() const { return root_; }

  /// A PCI function `bus_id` at devices/<bridges>/<bus_id> ("pci0000:00/0000:00:01.0"),
  /// linked from bus/pci/devices/<bus_id>. Returns its directory.
  std::filesystem::path AddPci(const std::string& bridges, const std::string& bus_id,
                               int numa_node = -1) {
    const std::filesystem::path dir = std::filesystem::path(root_) / "devices" / bridges / bus_id;
    std::filesystem::create_directories(dir);
    Write(dir / "numa_node", std::to_string(numa_node));
    const std::filesystem::path bus = std::filesystem::path(root_) / "bus" / "pci" / "devices";
    std::filesystem::create_directories(bus);
    std::filesystem::create_symlink(std::filesystem::relative(dir, bus), bus / bus_id);
    return dir;
  }

  /// An RDMA device `name` on PCI function `bus_id` (which AddPci made).
  void AddDevice(const std::string& name, const std::string& bridges, const std::string& bus_id,
                 int numa_node = -1) {
    const std::filesystem::path pci = AddPci(bridges, bus_id, numa_node);
    const std::filesystem::path dev = std::filesystem::path(root_) / "class" / "infiniband" / name;
    std::filesystem::create_directories(dev / "ports");
    std::filesystem::create_symlink(std::filesystem::relative(pci, dev), dev / "device");
  }

  /// Port `port` of `device`: state ("4: ACTIVE"), link layer and rate files; "" = the
  /// file is left out.
  void AddPort(const std::string& device, int port, const std::string& state,
               const std::string& link_layer, const std::string& rate = "100 Gb/sec (4X EDR)") {
    const std::filesystem::path dir = PortDir(device, port);
    std::filesystem::create_directories(dir / "gids");
    std::filesystem::create_directories(dir / "gid_attrs" / "types");
    if (!state.empty()) Write(dir / "state", state);
    if (!link_layer.empty()) Write(dir / "link_layer", link_layer);
    if (!rate.empty()) Write(dir / "rate", rate);
  }

  /// GID table entry `index` ("fe80:0000:...") and its type ("RoCE v2"; "" = no type file).
  void AddGid(const std::string& device, int port, int index, const std::string& gid,
              const std::string& type) {
    const std::filesystem::path dir = PortDir(device, port);
    Write(dir / "gids" / std::to_string(index), gid);
    if (!type.empty()) Write(dir / "gid_attrs" / "types" / std::to_string(index), type);
  }

  std::filesystem::path PortDir(const std::string& device, int port) const {
    return std::filesystem::path(root_) / "class" / "infiniband" / device / "ports" /
           std::to_string(port);
  }

  static void Write(const std::filesystem::path& path, const std::string& text) {
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text << "\n";
  }

 private:
  std::string root_;
};

/// GIDs as sysfs prints them.
inline constexpr char kZeroGid[] = "0000:0000:0000:0000:0000:0000:0000:0000";
inline constexpr char kLinkLocalGid[] = "fe80:0000:0000:0000:0a00:27ff:fe00:0001";
inline constexpr char kIpv4MappedGid[] = "0000:0000:0000:0000:0000:ffff:0a00:0002";  // 10.0.0.2

/// A RoCE port with the usual four GIDs: link-local v1/v2 (0, 1), IPv4-mapped v1/v2 (2, 3).
inline void AddRocePort(FakeSysfs& fs, const std::string& device, int port,
                        const std::string& state = "4: ACTIVE") {
  fs.AddPort(device, port, state, "Ethernet");
  fs.AddGid(device, port, 0, kLinkLocalGid, "IB/RoCE v1");
  fs.AddGid(device, port, 1, kLinkLocalGid, "RoCE v2");
  fs.AddGid(device, port, 2, kIpv4MappedGid, "IB/RoCE v1");
  fs.AddGid(device, port, 3, kIpv4MappedGid, "RoCE v2");
  fs.AddGid(device, port, 4, kZeroGid, "");
}

}  // namespace epd::testing
