// Fuzz target: the RDMA descriptor a peer daemon publishes (proto/abi/rdma_wire.h), parsed by
// rdma::ParseDescriptor. Any bytes must give a Status (never a crash or an out-of-bounds
// read); half the inputs overwrite a valid descriptor so the checks past the header run;
// a descriptor that parses must carry checked values. Built without RDMA: nothing to fuzz.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(EPD_HAVE_RDMA)
#include "daemon/transport/rdma/rdma_connection.h"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
#if defined(EPD_HAVE_RDMA)
  using epd::transport::rdma::LocalEndpoint;
  using epd::transport::rdma::QpEndpoint;
  if (size == 0) return 0;
  const int32_t num_nodes = 2 + data[0] % 4;
  const uint32_t num_qps = 1 + (data[0] >> 2) % 4;
  const uint8_t link_layer = (data[0] & 0x40) ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 0x80) {
    LocalEndpoint l;
    l.node = 1;
    l.num_nodes = num_nodes;
    l.num_qps = num_qps;
    l.port.link_layer = link_layer;
    l.port.lid = link_layer == IBV_LINK_LAYER_INFINIBAND ? 9 : 0;
    l.port.gid[0] = 0xfe;
    l.port.mtu = IBV_MTU_2048;
    l.recv_addr = 0x10000;
    l.recv_bytes = 4096;
    l.recv_rkey = 5;
    std::vector<QpEndpoint> qps(static_cast<size_t>(num_nodes) * num_qps, QpEndpoint{77, 3});
    std::string valid = epd::transport::rdma::EncodeDescriptor(l, qps);
    // The input overwrites the valid bytes from an offset it chooses.
    const size_t at = bytes.empty() ? 0 : static_cast<uint8_t>(bytes[0]) % valid.size();
    for (size_t i = 1; i < bytes.size() && at + i - 1 < valid.size(); ++i) {
      valid[at + i - 1] = bytes[i];
    }
    bytes = std::move(valid);
  }
  auto r = epd::transport::rdma::ParseDescriptor(bytes, 1, 0, num_nodes, num_qps, link_layer);
  if (r.ok()) {
    if (r->num_qps != num_qps || r->node != 1 || r->mtu < IBV_MTU_256 || r->mtu > IBV_MTU_4096 ||
        r->link_layer != link_layer || (r->recv_bytes > 0 && r->recv_addr == 0)) {
      std::abort();
    }
    for (uint32_t i = 0; i < num_qps; ++i) {
      if (r->qps[i].qpn == 0 || r->qps[i].qpn >= (1u << 24) || r->qps[i].psn >= (1u << 24)) {
        std::abort();
      }
    }
  }
#else
  (void)data;
  (void)size;
#endif
  return 0;
}
