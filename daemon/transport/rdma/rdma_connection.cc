// The RDMA transport's connection lifecycle (rdma_connection.h).
#include "daemon/transport/rdma/rdma_connection.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epd::transport::rdma {
namespace {

static_assert(std::endian::native == std::endian::little,
              "proto/abi/rdma_wire.h is little-endian on the wire");
static_assert(abi::kRdmaLinkInfiniBand == IBV_LINK_LAYER_INFINIBAND);
static_assert(abi::kRdmaLinkEthernet == IBV_LINK_LAYER_ETHERNET);

constexpr uint32_t k24Bits = 1u << 24;
constexpr uint8_t kMinRnrTimer = 12;  // 0.64 ms between RNR retries.
constexpr uint8_t kHopLimit = 64;

const char* StateName(ibv_qp_state s) {
  switch (s) {
    case IBV_QPS_RESET:
      return "RESET";
    case IBV_QPS_INIT:
      return "INIT";
    case IBV_QPS_RTR:
      return "RTR";
    case IBV_QPS_RTS:
      return "RTS";
    case IBV_QPS_ERR:
      return "ERROR";
    default:
      return "?";
  }
}

}  // namespace

std::string EncodeDescriptor(const LocalEndpoint& local, std::span<const QpEndpoint> qps) {
  abi::RdmaDescriptorHeader h{};
  h.magic = abi::kRdmaDescriptorMagic;
  h.version = abi::kRdmaWireVersion;
  h.num_qps = static_cast<uint16_t>(local.num_qps);
  h.node = local.node;
  h.num_nodes = local.num_nodes;
  std::memcpy(h.gid, local.port.gid.data(), sizeof h.gid);
  h.lid = local.port.lid;
  h.mtu = static_cast<uint8_t>(local.port.mtu);
  h.link_layer = local.port.link_layer;
  h.recv_rkey = local.recv_rkey;
  h.recv_addr = local.recv_addr;
  h.recv_bytes = local.recv_bytes;
  const size_t entries = static_cast<size_t>(local.num_nodes) * local.num_qps;
  std::string out(abi::RdmaDescriptorBytes(static_cast<uint64_t>(local.num_nodes), local.num_qps),
                  '\0');
  std::memcpy(out.data(), &h, sizeof h);
  for (size_t i = 0; i < entries && i < qps.size(); ++i) {
    if (static_cast<int32_t>(i / local.num_qps) == local.node) continue;
    abi::RdmaQpWire w{qps[i].qpn, qps[i].psn};
    std::memcpy(out.data() + sizeof h + i * sizeof w, &w, sizeof w);
  }
  return out;
}

absl::Status CompareDescriptorSettings(std::string_view ours, std::string_view theirs,
                                       std::string_view our_node, std::string_view their_node) {
  const std::string ours_name(our_node), theirs_name(their_node);
  abi::RdmaDescriptorHeader a{}, b{};
  if (ours.size() < sizeof a || theirs.size() < sizeof b) return absl::OkStatus();
  std::memcpy(&a, ours.data(), sizeof a);
  std::memcpy(&b, theirs.data(), sizeof b);
  for (const abi::RdmaDescriptorHeader* h : {&a, &b}) {
    if (h->magic != abi::kRdmaDescriptorMagic || h->version != abi::kRdmaWireVersion) {
      return absl::OkStatus();
    }
  }
  if (a.num_qps != b.num_qps) {
    return absl::FailedPreconditionError(
        absl::StrCat("rdma.qps_per_peer differs: ", ours_name, " uses ", a.num_qps,
                     " queue pairs per peer, ", theirs_name, " uses ", b.num_qps,
                     "; set rdma.qps_per_peer (--rdma_qps_per_peer) the same on every daemon"));
  }
  if (a.link_layer != b.link_layer) {
    const auto name = [](uint8_t l) {
      return l == abi::kRdmaLinkEthernet     ? std::string("Ethernet (RoCE)")
             : l == abi::kRdmaLinkInfiniBand ? std::string("InfiniBand")
                                             : absl::StrCat("link layer ", l);
    };
    return absl::FailedPreconditionError(absl::StrCat(
        "the RDMA link layer differs: ", ours_name, "'s port is ", name(a.link_layer), ", ",
        theirs_name, "'s is ", name(b.link_layer),
        "; select ports of one link layer on every daemon (rdma.devices), or use transport "
        "\"tcp\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<RemoteEndpoint> ParseDescriptor(std::string_view bytes, int32_t from, int32_t self,
                                               int32_t num_nodes, uint32_t num_qps,
                                               uint8_t link_layer) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("RDMA descriptor of node ", from, ": ", why));
  };
  abi::RdmaDescriptorHeader h{};
  if (bytes.size() < sizeof h) {
    return bad(absl::StrCat(bytes.size(), " bytes, shorter than its ", sizeof h, "-byte header"));
  }
  std::memcpy(&h, bytes.data(), sizeof h);
  if (h.magic != abi::kRdmaDescriptorMagic) {
    return bad(
        absl::StrFormat("magic 0x%08x (not an RDMA descriptor: the peer uses another "
                        "transport?)",
                        h.magic));
  }
  if (h.version != abi::kRdmaWireVersion) {
    return bad(
        absl::StrCat("wire version ", h.version, ", this daemon speaks ", abi::kRdmaWireVersion));
  }
  if (h.node != from) return bad(absl::StrCat("it is node ", h.node, "'s"));
  if (h.num_nodes != num_nodes) {
    return bad(absl::StrCat("num_nodes ", h.num_nodes, ", this group has ", num_nodes));
  }
  if (h.num_qps != num_qps) {
    return bad(absl::StrCat("num_qps ", h.num_qps, ", this node uses ", num_qps,
                            " queue pairs per peer (rdma qps_per_peer must match on every node)"));
  }
  const size_t want = abi::RdmaDescriptorBytes(static_cast<uint64_t>(num_nodes), num_qps);
  if (bytes.size() != want) {
    return bad(absl::StrCat(bytes.size(), " bytes, want ", want, " for ", num_nodes, " nodes and ",
                            num_qps, " queue pairs per peer"));
  }
  if (h.link_layer != abi::kRdmaLinkInfiniBand && h.link_layer != abi::kRdmaLinkEthernet) {
    return bad(absl::StrCat("link_layer ", h.link_layer));
  }
  if (h.link_layer != link_layer) {
    return bad(absl::StrCat("link_layer ",
                            h.link_layer == abi::kRdmaLinkEthernet ? "Ethernet" : "InfiniBand",
                            ", this node's port is ",
                            link_layer == abi::kRdmaLinkEthernet ? "Ethernet" : "InfiniBand"));
  }
  RemoteEndpoint r;
  r.node = from;
  std::memcpy(r.gid.data(), h.gid, r.gid.size());
  const bool gid_zero = std::all_of(r.gid.begin(), r.gid.end(), [](uint8_t b) { return b == 0; });
  if (h.link_layer == abi::kRdmaLinkEthernet && (gid_zero || h.lid != 0)) {
    return bad(absl::StrCat("RoCE port with ", gid_zero ? "a zero GID" : "a LID"));
  }
  if (h.link_layer == abi::kRdmaLinkInfiniBand && (h.lid == 0 || h.lid >= 0xc000)) {
    return bad(absl::StrCat("InfiniBand LID ", h.lid, " (not a unicast LID)"));
  }
  if (h.mtu < IBV_MTU_256 || h.mtu > IBV_MTU_4096) return bad(absl::StrCat("mtu ", h.mtu));
  if (h.reserved != 0) return bad("reserved bytes set");
  if (h.recv_bytes > 0 && (h.recv_addr == 0 || h.recv_addr + h.recv_bytes < h.recv_addr)) {
    return bad(absl::StrCat("receive region at ", h.recv_addr, " of ", h.recv_bytes,
                            " bytes wraps or is null"));
  }
  if (h.recv_bytes == 0 && (h.recv_addr != 0 || h.recv_rkey != 0)) {
    return bad("an empty receive region with an address or key");
  }
  r.lid = h.lid;
  r.mtu = static_cast<ibv_mtu>(h.mtu);
  r.link_layer = h.link_layer;
  r.recv_addr = h.recv_addr;
  r.recv_bytes = h.recv_bytes;
  r.recv_rkey = h.recv_rkey;
  r.num_qps = num_qps;
  for (int32_t n = 0; n < num_nodes; ++n) {
    for (uint32_t i = 0; i < num_qps; ++i) {
      abi::RdmaQpWire w{};
      const size_t at = sizeof h + (static_cast<size_t>(n) * num_qps + i) * sizeof w;
      std::memcpy(&w, bytes.data() + at, sizeof w);
      if (n == from) {
        if (w.qpn != 0 || w.psn != 0) {
          return bad(absl::StrCat("its own entry ", i, " is set (qpn ", w.qpn, ")"));
        }
        continue;
      }
      if (w.qpn == 0 || w.qpn >= k24Bits || w.psn >= k24Bits) {
        return bad(absl::StrCat("queue pair ", i, " towards node ", n, ": qpn ", w.qpn, ", psn ",
                                w.psn, " (want qpn in [1, 2^24), psn below 2^24)"));
      }
      if (n == self) r.qps[i] = QpEndpoint{w.qpn, w.psn};
    }
  }
  return r;
}

PathOptions MakePathOptions(const RdmaTransportOptions& o, const PortInfo& port) {
  PathOptions p;
  p.port = port.port;
  p.gid_index = port.gid_index;
  p.link_layer = port.link_layer;
  p.mtu = port.mtu;
  p.service_level = o.service_level;
  p.traffic_class = o.traffic_class;
  p.timeout = o.timeout;
  p.retry_count = o.retry_count;
  p.rnr_retry = o.rnr_retry;
  return p;
}

QpTransition InitTransition(const PathOptions& path) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = static_cast<uint8_t>(path.port);
  t.attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  return t;
}

QpTransition RtrTransition(const PathOptions& path, const RemoteEndpoint& remote,
                           const QpEndpoint& remote_qp) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTR;
  t.attr.path_mtu = std::min(path.mtu, remote.mtu);
  t.attr.dest_qp_num = remote_qp.qpn;
  t.attr.rq_psn = remote_qp.psn;
  t.attr.max_dest_rd_atomic = 1;
  t.attr.min_rnr_timer = kMinRnrTimer;
  ibv_ah_attr& ah = t.attr.ah_attr;
  ah.dlid = remote.lid;
  ah.sl = static_cast<uint8_t>(path.service_level);
  ah.src_path_bits = 0;
  ah.port_num = static_cast<uint8_t>(path.port);
  if (path.link_layer == IBV_LINK_LAYER_ETHERNET || remote.lid == 0) {
    ah.is_global = 1;
    std::memcpy(ah.grh.dgid.raw, remote.gid.data(), remote.gid.size());
    ah.grh.sgid_index = static_cast<uint8_t>(path.gid_index);
    ah.grh.hop_limit = kHopLimit;
    ah.grh.traffic_class = static_cast<uint8_t>(path.traffic_class);
    ah.grh.flow_label = 0;
  }
  t.mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition RtsTransition(const PathOptions& path, uint32_t local_psn) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.timeout = static_cast<uint8_t>(path.timeout);
  t.attr.retry_cnt = static_cast<uint8_t>(path.retry_count);
  t.attr.rnr_retry = static_cast<uint8_t>(path.rnr_retry);
  t.attr.sq_psn = local_psn;
  t.attr.max_rd_atomic = 1;
  t.mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
           IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

QpTransition StateTransition(ibv_qp_state state) {
  QpTransition t;
  t.attr.qp_state = state;
  t.mask = IBV_QP_STATE;
  return t;
}

absl::Status ModifyQp(ibv_qp* qp, const QpTransition& t, absl::string_view what) {
  const int rc = ibv_modify_qp(qp, const_cast<ibv_qp_attr*>(&t.attr), t.mask);
  if (rc == 0) return absl::OkStatus();
  const int err = rc > 0 ? rc : errno;
  return absl::InternalError(absl::StrCat(what, ": ibv_modify_qp to ", StateName(t.attr.qp_state),
                                          " (mask 0x", absl::Hex(t.mask), "): ", std::strerror(err),
                                          " (errno ", err, ")"));
}

void PeerLinkMachine::OnConnect(Clock::time_point deadline) {
  state_ = PeerState::kConnecting;
  deadline_ = deadline;
  probed_ = 0;
  probed_mask_ = 0;
  peer_mask_ = 0;
  reprobes_ = 0;
  last_error_ = IBV_WC_SUCCESS;
}

PeerLinkMachine::Action PeerLinkMachine::OnPeerProbe(uint32_t qp) {
  if (qp >= num_qps_ || qp >= 32 || (peer_mask_ & (1u << qp)) != 0) return Action::kNone;
  peer_mask_ |= 1u << qp;
  const bool answer = !initiator_ && (state_ == PeerState::kConnecting);
  return answer ? Action::kSendProbe : Action::kNone;
}

PeerLinkMachine::Action PeerLinkMachine::OnProbe(uint32_t qp, ibv_wc_status status,
                                                 Clock::time_point now) {
  if (state_ != PeerState::kConnecting || qp >= num_qps_ || qp >= 32) {
    // A probe answer outside connecting (or of no queue pair) is a late one: an error fails
    // a ready peer, a success changes nothing.
    if (status != IBV_WC_SUCCESS && state_ == PeerState::kReady) {
      state_ = PeerState::kFailed;
      return Action::kFail;
    }
    return Action::kNone;
  }
  if (status == IBV_WC_SUCCESS) {
    if ((probed_mask_ & (1u << qp)) == 0) {
      probed_mask_ |= 1u << qp;
      ++probed_;
    }
    if (probed_ == num_qps_) {
      state_ = PeerState::kReady;
      return Action::kReady;
    }
    return Action::kNone;
  }
  last_error_ = status;
  if (initiator_ && now < deadline_) {
    ++reprobes_;
    return Action::kReprobe;
  }
  state_ = PeerState::kFailed;
  return Action::kFail;
}

PeerLinkMachine::Action PeerLinkMachine::OnTick(Clock::time_point now) {
  if (state_ == PeerState::kConnecting && now >= deadline_) {
    state_ = PeerState::kFailed;
    return Action::kFail;
  }
  return Action::kNone;
}

}  // namespace epd::transport::rdma
