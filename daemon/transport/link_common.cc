// Checks and names shared by the GroupLink implementations (link_common.h).
#include "daemon/transport/link_common.h"

#include "absl/strings/str_cat.h"

namespace epd::transport {

absl::Status CheckGroupLinkOptions(const GroupLinkOptions& o, int32_t max_nodes) {
  if (o.num_nodes < 2 || o.num_nodes > max_nodes) {
    return absl::InvalidArgumentError(absl::StrCat("group '", o.group, "': num_nodes ", o.num_nodes,
                                                   " not in [2, ", max_nodes, "]"));
  }
  if (o.self_node < 0 || o.self_node >= o.num_nodes) {
    return absl::InvalidArgumentError(absl::StrCat("group '", o.group, "': self_node ", o.self_node,
                                                   " not in [0, ", o.num_nodes, ")"));
  }
  if (o.recv_base == nullptr && o.recv_bytes > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", o.group, "': recv_base is null with recv_bytes ", o.recv_bytes));
  }
  return absl::OkStatus();
}

std::string PeerNodeName(const GroupLinkOptions& o, int32_t node, absl::string_view where,
                         absl::string_view labeled_prefix) {
  const auto i = static_cast<size_t>(node);
  if (node >= 0 && i < o.node_labels.size() && !o.node_labels[i].empty()) {
    return absl::StrCat("group '", o.group, "': node ", node, " (", o.node_labels[i], "; ",
                        labeled_prefix, where, ")");
  }
  return absl::StrCat("group '", o.group, "': node ", node, " (", where, ")");
}

PeerState NonPeerState(const GroupLinkOptions& o, int32_t node) {
  return node == o.self_node && node >= 0 && node < o.num_nodes ? PeerState::kReady
                                                                : PeerState::kIdle;
}

absl::Status NonPeerStatus(const GroupLinkOptions& o, int32_t node) {
  if (node == o.self_node && node >= 0 && node < o.num_nodes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("group '", o.group, "': node ", node, " not in [0, ", o.num_nodes, ")"));
}

absl::Status NotAPeerError(const GroupLinkOptions& o, int32_t node, absl::string_view call) {
  return absl::InvalidArgumentError(absl::StrCat("group '", o.group, "': ", call, " to node ", node,
                                                 ", not a peer (num_nodes ", o.num_nodes, ", self ",
                                                 o.self_node, ")"));
}

ptrdiff_t FirstPieceOutside(std::span<const WritePiece> pieces, uint64_t region_bytes) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    const WritePiece& w = pieces[i];
    if (w.bytes > region_bytes || w.remote_offset > region_bytes - w.bytes ||
        (w.src == nullptr && w.bytes > 0)) {
      return static_cast<ptrdiff_t>(i);
    }
  }
  return -1;
}

absl::Status PieceOutsideError(std::span<const WritePiece> pieces, ptrdiff_t index,
                               uint64_t region_bytes, absl::string_view peer) {
  const WritePiece& w = pieces[static_cast<size_t>(index)];
  return absl::InvalidArgumentError(absl::StrCat(
      peer, ": piece ", index, " (offset ", w.remote_offset, ", ", w.bytes,
      " bytes) is outside its receive region of ", region_bytes, " bytes or has no source"));
}

absl::Status SourceOutsideError(std::span<const WritePiece> pieces, ptrdiff_t index,
                                absl::string_view peer) {
  const WritePiece& w = pieces[static_cast<size_t>(index)];
  return absl::InvalidArgumentError(absl::StrCat(
      peer, ": piece ", index, " (", w.bytes, " bytes at 0x",
      absl::Hex(reinterpret_cast<uint64_t>(w.src)),
      ") has its source outside every registered region of the link (the receive region, "
      "GroupLinkOptions.send_regions and the regions of GroupLink::AddSendRegion)"));
}

}  // namespace epd::transport
