// The RDMA transport's bytes between daemons (daemon/transport/rdma/, DESIGN.md §5.4): the
// descriptor a node publishes for a group through the Peer service. One descriptor serves
// every peer of the group, so after the fixed-size header come `num_nodes * num_qps`
// RdmaQpWire entries, node-major: entry [n * num_qps + i] is this node's queue pair i towards
// node n (all zero for n == the publishing node). Every struct is a fixed-size POD in host
// byte order (little-endian; the transport refuses to build on a big-endian host) with
// static_asserts on its size and offsets; the reader checks `magic`, `version` and the total
// size and treats every other field as untrusted until checked. Bump kRdmaWireVersion when a
// byte moves or a meaning changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace epd::abi {

inline constexpr uint16_t kRdmaWireVersion = 1;
inline constexpr uint32_t kRdmaDescriptorMagic = 0x444d4452;  // "RDMD"
inline constexpr uint32_t kRdmaMaxQps = 16;                   // Queue pairs per peer.
inline constexpr size_t kRdmaGidBytes = 16;
/// The largest descriptor a node publishes (the Peer service carries at most 64 KiB).
inline constexpr size_t kRdmaMaxDescriptorBytes = 64 * 1024;
/// RdmaDescriptorHeader::link_layer (the values of IBV_LINK_LAYER_*).
inline constexpr uint8_t kRdmaLinkInfiniBand = 1;
inline constexpr uint8_t kRdmaLinkEthernet = 2;

/// One queue pair of the publishing node, towards one peer.
struct RdmaQpWire {
  uint32_t qpn;  ///< Queue pair number, [1, 2^24).
  uint32_t psn;  ///< The first packet sequence number it sends, [0, 2^24).
};
static_assert(std::is_trivially_copyable_v<RdmaQpWire>);
static_assert(sizeof(RdmaQpWire) == 8);

/// What a node publishes for one group (GroupLink::LocalDescriptor), followed by
/// `num_nodes * num_qps` RdmaQpWire entries.
struct RdmaDescriptorHeader {
  uint32_t magic;              ///< kRdmaDescriptorMagic.
  uint16_t version;            ///< kRdmaWireVersion.
  uint16_t num_qps;            ///< Queue pairs per peer, [1, kRdmaMaxQps].
  int32_t node;                ///< The publishing node's index in the group.
  int32_t num_nodes;           ///< Nodes of the group, >= 2.
  uint8_t gid[kRdmaGidBytes];  ///< The port's GID (RoCE: != 0).
  uint16_t lid;                ///< The port's LID (InfiniBand: != 0; RoCE: 0).
  uint8_t mtu;                 ///< The port's MTU as an ibv_mtu value, [1, 5] (256..4096 bytes).
  uint8_t link_layer;          ///< kRdmaLinkInfiniBand or kRdmaLinkEthernet.
  uint32_t recv_rkey;          ///< Remote key of the receive region (0 when it is empty).
  uint64_t recv_addr;          ///< Address (IO virtual address) of the receive region.
  uint64_t recv_bytes;         ///< Size of the receive region.
  uint64_t reserved;           ///< 0.
};
static_assert(std::is_trivially_copyable_v<RdmaDescriptorHeader>);
static_assert(sizeof(RdmaDescriptorHeader) == 64);
static_assert(offsetof(RdmaDescriptorHeader, node) == 8);
static_assert(offsetof(RdmaDescriptorHeader, num_nodes) == 12);
static_assert(offsetof(RdmaDescriptorHeader, gid) == 16);
static_assert(offsetof(RdmaDescriptorHeader, lid) == 32);
static_assert(offsetof(RdmaDescriptorHeader, mtu) == 34);
static_assert(offsetof(RdmaDescriptorHeader, link_layer) == 35);
static_assert(offsetof(RdmaDescriptorHeader, recv_rkey) == 36);
static_assert(offsetof(RdmaDescriptorHeader, recv_addr) == 40);
static_assert(offsetof(RdmaDescriptorHeader, recv_bytes) == 48);
static_assert(offsetof(RdmaDescriptorHeader, reserved) == 56);

/// Bytes of a descriptor with `num_nodes` nodes and `num_qps` queue pairs per peer.
constexpr size_t RdmaDescriptorBytes(uint64_t num_nodes, uint64_t num_qps) {
  return sizeof(RdmaDescriptorHeader) + num_nodes * num_qps * sizeof(RdmaQpWire);
}

}  // namespace epd::abi
