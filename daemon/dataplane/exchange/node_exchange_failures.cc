// A spanning op's failure (node_exchange.h): what a peer's header of the op says, checked on
// a private copy (CheckHeader), and which error this node's ranks get when nodes failed it
// (FailedOpStatus, NotInStep): only a node that submitted the same op shares its error; and
// which node a dispatch's rows that fail the checks came from (PeerAtFault).
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "daemon/dataplane/exchange/node_exchange.h"

namespace epd {

absl::Status NodeExchange::CheckHeader(int32_t n, uint64_t seq, int64_t* failed_op) {
  if (failed_op != nullptr) *failed_op = -1;
  const auto* slot = reinterpret_cast<const uint8_t*>(span_.recv.data()) + span_.recv_offset[n] +
                     (LinkSeq(n, seq) % 2) * span_.in_layout[n].total;
  abi::ExchangeHeader& h = span_.headers[n];
  std::memcpy(&h, slot, sizeof(h));
  if (h.magic != abi::kExchangeMagic || h.version != abi::kExchangeAbiVersion ||
      h.seq != LinkSeq(n, seq) || h.source_node != n || h.first_rank != span_.first[n] ||
      h.num_ranks != span_.count[n] || h.message_bytes > abi::kExchangeMessageBytes) {
    return errors::WithReason(
        absl::DataLossError(absl::StrCat(
            "op ", seq, " of group ", spec().name(), ": node ", n, " (",
            spec().nodes(n).peer_address(), ") sent a malformed exchange header (magic 0x",
            absl::Hex(h.magic), ", version ", h.version, ", seq ", h.seq, ", node ", h.source_node,
            ", ranks ", h.first_rank, "+", h.num_ranks, ")")),
        errors::Reason::kPeerProtocol);
  }
  if (h.status_code != 0) {
    const int code = h.status_code > 0 && h.status_code <= 16 ? h.status_code : 2;
    // The peer's text reaches clients and logs: bytes outside printable ASCII are escaped
    // (a real peer's messages are printable, so every node still reports the same text).
    std::string text;
    for (const char c : absl::string_view(h.message, h.message_bytes)) {
      const auto u = static_cast<unsigned char>(c);
      if (u >= 0x20 && u < 0x7f) {
        text.push_back(c);
      } else {
        absl::StrAppend(&text, "\\x", absl::Hex(u, absl::kZeroPad2));
      }
    }
    if (failed_op != nullptr) *failed_op = h.op;  // Compared, and named through OpName, only.
    return errors::WithReason(absl::Status(static_cast<absl::StatusCode>(code), text),
                              static_cast<errors::Reason>(h.reason));  // 0: none.
  }
  if (masking_) {
    // The peer's mask: its words copied out once, every bit checked on the copy.
    const int32_t R = shape().num_ranks;
    const uint64_t words = abi::ExchangeMaskWords(R);
    uint8_t* m = peer_mask_.data() + static_cast<size_t>(n) * R;
    std::fill(m, m + R, 0);
    // The epoch is checked before it is used: a peer's count never goes back, and steps at
    // most one per op, so one far ahead of this node's (or past the limit) is not a count.
    if (h.mask_epoch < agreed_epoch_[n] || h.mask_epoch > kMaxMaskEpoch ||
        uint64_t{h.mask_epoch} > uint64_t{view_epoch_} + kMaxMaskEpochAhead) {
      return errors::WithReason(
          absl::DataLossError(absl::StrCat(
              "op ", seq, " of group ", spec().name(), ": node ", n, " (",
              spec().nodes(n).peer_address(), ") sent rank mask epoch ", h.mask_epoch,
              "; it brought ", agreed_epoch_[n], " to the last op and this node is at ",
              view_epoch_, " (an epoch never goes back, nor leads by more than ",
              kMaxMaskEpochAhead, ")")),
          errors::Reason::kPeerProtocol);
    }
    peer_epoch_[n] = h.mask_epoch;
    if (h.mask_words != 0 && h.mask_words != words) {
      return errors::WithReason(absl::DataLossError(absl::StrCat(
                                    "op ", seq, " of group ", spec().name(), ": node ", n, " (",
                                    spec().nodes(n).peer_address(), ") sent a rank mask of ",
                                    h.mask_words, " words; a group of ", R, " ranks has ", words)),
                                errors::Reason::kPeerProtocol);
    }
    if (h.mask_words != 0) {
      std::memcpy(mask_words_.data(), slot + span_.in_layout[n].mask, words * 8);
      for (uint64_t w = 0; w < words; ++w) {
        for (int b = 0; b < 64; ++b) {
          if (((mask_words_[w] >> b) & 1) == 0) continue;
          const uint64_t r = w * 64 + b;
          if (r >= static_cast<uint64_t>(R)) {
            return errors::WithReason(
                absl::DataLossError(absl::StrCat("op ", seq, " of group ", spec().name(), ": node ",
                                                 n, " (", spec().nodes(n).peer_address(),
                                                 ") sent a rank mask naming rank ", r,
                                                 ", beyond the group's ", R, " ranks")),
                errors::Reason::kPeerProtocol);
          }
          m[r] = 1;
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status NodeExchange::NotInStep(uint64_t seq, int32_t a, uint32_t op_a, int32_t b,
                                     uint32_t op_b, const absl::Status& st) const {
  auto describe = [&](int32_t x, uint32_t op) {
    return absl::StrCat("node ", x, " (ranks ", span_.first[x], "-",
                        span_.first[x] + span_.count[x] - 1, ") submitted ", OpName(op));
  };
  const int32_t failed = b;
  if (a > b) {
    std::swap(a, b);
    std::swap(op_a, op_b);
  }
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          "op ", seq, " of group ", spec().name(),
          ": the nodes are not in step: ", describe(a, op_a), ", ", describe(b, op_b),
          " (a rank joining a running group starts with the group's next op, a combine with a "
          "dispatch that ran on every node); node ",
          failed, "'s error: ", st.message())),
      errors::Reason::kFailedPrecondition);
}

absl::Status NodeExchange::FailedOpStatus(const OpPlan& plan) {
  // A node's error is every node's only where they submitted the same op: the lowest such
  // node's wins, so that they all report the same one. The error of a request another node
  // made instead (a node's first op after it joined late, a combine whose dispatch ran
  // before a node rejoined) would blame ranks that never made it: a node that only sees
  // such errors reports the nodes as not in step. Every message is in: each peer's header
  // of this op is copied, so no op is read from an earlier op's header.
  const uint32_t self_op = static_cast<uint32_t>(plan.op);
  absl::Status same = absl::OkStatus(), other = absl::OkStatus();
  int32_t other_node = -1;
  uint32_t other_op = 0;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (excluded_[n]) continue;
    int64_t failed_op = -1;
    absl::Status st = n == span_.self ? span_.local_status : CheckHeader(n, plan.seq, &failed_op);
    if (st.ok()) continue;
    if (failed_op < 0 || failed_op == self_op) {
      if (same.ok()) same = std::move(st);
    } else if (other_node < 0) {
      other = std::move(st);
      other_node = n;
      other_op = static_cast<uint32_t>(failed_op);
    }
  }
  if (!same.ok() || other_node < 0) return same;
  return NotInStep(plan.seq, span_.self, self_op, other_node, other_op, other);
}

absl::Status NodeExchange::PeerAtFault(uint64_t seq, int32_t source,
                                       const absl::Status& status) const {
  if (source < 0 || (source >= local_first() && source < local_first() + local_count())) {
    return status;
  }
  int32_t n = 0;
  while (n + 1 < span_.num_nodes && source >= span_.first[n + 1]) ++n;
  return errors::WithReason(
      absl::DataLossError(absl::StrCat("op ", seq, " of group ", spec().name(), ": node ", n, " (",
                                       spec().nodes(n).peer_address(),
                                       ") sent rows that fail the checks: ", status.message())),
      errors::Reason::kPeerProtocol);
}

}  // namespace epd
