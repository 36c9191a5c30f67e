// The exchange of a group that spans nodes (node_exchange.h, DESIGN.md §5.1).
#include "daemon/dataplane/exchange/node_exchange.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/exchange/mirror_spans.h"
#include "epd/kernels/op_rules.h"

namespace epd {
namespace {

using kernels::EndpointLayout;

/// How long a running op waits for the message of a node the Peer service reports lost
/// while that node's data link still stands (a node that finished the op and left).
constexpr std::chrono::milliseconds kLostGrace{200};

/// How much longer than op_timeout a running op waits for the message of a node whose
/// Peer service reports it alive and whose data link is up: min(1 s, op_timeout). A node
/// whose own rank never submitted fails the op at its op_timeout and sends that error
/// (naming the rank); the grace lets it arrive before this node gives up naming the node.
std::chrono::milliseconds PeerFailureGrace(uint32_t op_timeout_ms) {
  return std::min(std::chrono::milliseconds(1000), std::chrono::milliseconds(op_timeout_ms));
}

/// Rows of one dispatch block of the exchange (ExchangeSlotLayout::block_rows).
uint64_t BlockRows(const abi::ExchangeShape& xs) {
  return static_cast<uint64_t>(std::max(xs.max_tokens, xs.ll_max_tokens));
}

/// Bytes of the private copies of the other nodes' indices (NodeExchange's in_ids, in_idx,
/// in_pos) at a node of `local_ranks` ranks.
uint64_t RemoteIndexBytes(const abi::ExchangeShape& xs, int64_t local_ranks) {
  const uint64_t remote = static_cast<uint64_t>(std::max<int64_t>(xs.num_ranks - local_ranks, 0));
  return remote * BlockRows(xs) * (4 + 8 * xs.num_topk + 4 * xs.num_ranks);
}

}  // namespace

uint64_t NodeExchangeBytes(const v1::GroupSpec& spec, const kernels::GroupShape& gs) {
  if (spec.nodes_size() < 2) return 0;
  const abi::ExchangeShape xs{gs.num_ranks, gs.num_experts,         gs.hidden,
                              gs.num_topk,  gs.max_tokens_per_rank, gs.ll_max_tokens_per_rank};
  uint64_t most = 0;
  for (int m = 0; m < spec.nodes_size(); ++m) {
    uint64_t bytes = 0;
    for (int n = 0; n < spec.nodes_size(); ++n) {
      if (n == m) continue;
      const int64_t rn = spec.nodes(n).num_ranks(), rm = spec.nodes(m).num_ranks();
      bytes += 2 * abi::ExchangeSlotLayout::Compute(xs, rn, rm).total +
               abi::ExchangeSlotLayout::Compute(xs, rm, rn).total;
    }
    bytes += 2 * abi::ExchangeCombineLayout::Compute(xs, spec.nodes(m).num_ranks()).total;
    bytes += RemoteIndexBytes(xs, spec.nodes(m).num_ranks());
    // The pack table (Span::pack_rows).
    bytes += static_cast<uint64_t>(spec.nodes_size()) * spec.nodes(m).num_ranks() * BlockRows(xs) *
             sizeof(kernels::RowSource);
    most = std::max(most, bytes);
  }
  return most;
}

absl::StatusOr<SpanTransport> TransportForSpan(const v1::GroupSpec& spec,
                                               const peer::PeerMesh* peer_mesh,
                                               const transport::TransportSet* transports) {
  if (spec.nodes_size() < 2) return SpanTransport{};
  if (peer_mesh == nullptr || transports == nullptr) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            "group \"", spec.name(), "\" spans ", spec.nodes_size(),
            " nodes, but this daemon has no Peer listener (peer_listen is unset in its config), so "
            "it cannot reach the other nodes; set peer_listen (and peer_secret_file) on every "
            "daemon")),
        errors::Reason::kNodesInvalid);
  }
  SpanTransport t;
  EPD_ASSIGN_OR_RETURN(t.transport, transports->Find(spec.transport(), spec.name()));
  t.name = transports->Resolve(spec.transport());
  return t;
}

NodeExchange::NodeExchange(const v1::GroupSpec& spec, const kernels::GroupShape& shape,
                           const kernels::EndpointLayout& layout, NodeExchangeHost* host,
                           NodeExchangeOptions options)
    : spec_(spec),
      shape_(shape),
      layout_(layout),
      host_(host),
      options_(std::move(options)),
      dispatch_args_(shape.num_ranks),
      combine_args_(shape.num_ranks),
      ll_dispatch_args_(shape.num_ranks),
      ll_combine_args_(shape.num_ranks),
      recv_tokens_(shape.num_ranks),
      routing_tokens_(shape.num_ranks) {}

NodeExchange::~NodeExchange() {
  // A scrape may hold a link's metrics past this point: it must no longer reach the link.
  for (const auto& m : link_metrics_) {
    if (m) m->SetTransportProbe({});
  }
}

void NodeExchange::SetLocalRanksJoined(const std::vector<bool>& bits) {
  if (span_.peers) span_.peers->SetLocalRanksJoined(bits);
}

absl::Status NodeExchange::Init(int32_t node, int32_t local_first, int32_t local_count) {
  local_first_ = local_first;
  local_count_ = local_count;
  pack_maps_.clear();  // Before any memory they map is replaced.
  gather_maps_.clear();
  const v1::GroupSpec& sp = spec();
  const kernels::GroupShape& gs = shape();
  Span s;
  s.num_nodes = sp.nodes_size();
  s.self = node;
  int32_t at = 0;
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    s.first.push_back(at);
    s.count.push_back(sp.nodes(n).num_ranks());
    at += sp.nodes(n).num_ranks();
  }
  s.xs = {gs.num_ranks, gs.num_experts,         gs.hidden,
          gs.num_topk,  gs.max_tokens_per_rank, gs.ll_max_tokens_per_rank};
  uint64_t recv_bytes = 0;
  s.remote_offset.assign(s.num_nodes, 0);
  for (int32_t n = 0; n < s.num_nodes; ++n) {  // Where this node's slots lie at node n.
    uint64_t off = 0;
    for (int32_t k = 0; k < node && n != node; ++k) {
      if (k != n) off += 2 * abi::ExchangeSlotLayout::Compute(s.xs, s.count[k], s.count[n]).total;
    }
    s.remote_offset[n] = off;
  }
  s.in_layout.resize(s.num_nodes);
  s.out_layout.resize(s.num_nodes);
  s.recv_offset.assign(s.num_nodes, 0);
  s.send.resize(s.num_nodes);
  s.fail_send.resize(s.num_nodes);
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    if (n == node) continue;
    s.in_layout[n] = abi::ExchangeSlotLayout::Compute(s.xs, s.count[n], s.count[node]);
    s.out_layout[n] = abi::ExchangeSlotLayout::Compute(s.xs, s.count[node], s.count[n]);
    s.recv_offset[n] = recv_bytes;
    recv_bytes += 2 * s.in_layout[n].total;
  }
  // The combine area (both parities) after the slots, here and at every peer.
  s.combine_layout.resize(s.num_nodes);
  s.combine_offset.assign(s.num_nodes, 0);
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    s.combine_layout[n] = abi::ExchangeCombineLayout::Compute(s.xs, s.count[n]);
    for (int32_t k = 0; k < s.num_nodes; ++k) {
      if (k != n) {
        s.combine_offset[n] +=
            2 * abi::ExchangeSlotLayout::Compute(s.xs, s.count[k], s.count[n]).total;
      }
    }
  }
  recv_bytes += 2 * s.combine_layout[node].total;
  const int32_t R = gs.num_ranks, E = gs.num_experts;
  try {
    s.recv.assign(recv_bytes / 8 + 1, 0);
    for (int32_t n = 0; n < s.num_nodes; ++n) {
      if (n == node) continue;
      s.send[n].assign(s.out_layout[n].total / 8 + 1, 0);
      s.fail_send[n].assign(sizeof(abi::ExchangeHeader) / 8, 0);
    }
    s.local_counts.assign(static_cast<size_t>(s.count[node]) * E, 0);
    s.counts.assign(static_cast<size_t>(R) * E, 0);
    s.dispatch_counts.assign(static_cast<size_t>(R) * R, 0);
    for (auto& c : s.ll_counts) c.assign(static_cast<size_t>(R) * E, 0);
    s.remote_first.assign(static_cast<size_t>(E), 0);
    s.block_start.assign(static_cast<size_t>(E), 0);
    s.combine_off.assign(static_cast<size_t>(std::max(R, E)) + 1, 0);
    s.remote_rows.assign(static_cast<size_t>(E), 0);
    s.headers.assign(s.num_nodes, abi::ExchangeHeader{});
    const size_t remote_rows = static_cast<size_t>(R - s.count[node]) * BlockRows(s.xs);
    s.in_ids.assign(remote_rows, 0);
    s.in_idx.assign(remote_rows * gs.num_topk, 0);
    s.in_pos.assign(remote_rows * R, 0);
    s.dispatch_sources.resize(R);
    s.ll_sources.resize(R);
    s.pack_sources.resize(s.count[node]);
    s.pack_jobs.resize(s.count[node]);
    if (gs.ll_max_tokens_per_rank > 0) {
      const size_t rows = static_cast<size_t>(s.count[node]) * gs.ll_max_tokens_per_rank;
      s.quant_x.assign(rows * gs.hidden, 0);
      s.quant_scales.assign(rows * gs.num_scales(), 0.0F);
    }
    s.pieces.reserve(8 * static_cast<size_t>(s.count[node]) * (gs.num_local_experts() + 8) + 8);
    s.pack_rows.assign(static_cast<size_t>(s.count[node]) * s.num_nodes * BlockRows(s.xs),
                       kernels::RowSource{});
    s.packs.assign(s.count[node], 0);
    s.deferred.resize(s.num_nodes);
    for (auto& d : s.deferred) d.reserve(8 * static_cast<size_t>(s.count[node]) + 8);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("group ", sp.name(), ": out of memory for ",
                                                     recv_bytes, " bytes of receive region"));
  }
  s.posted.assign(s.num_nodes, 0);
  s.fail_posted.assign(s.num_nodes, 0);
  s.connected.assign(s.num_nodes, 0);
  s.incarnation.assign(s.num_nodes, 0);
  s.connect_error.assign(s.num_nodes, std::string());
  s.link_base.assign(s.num_nodes, 0);
  s.pending.assign(s.num_nodes, std::nullopt);
  s.got.assign(s.num_nodes, 0);
  transport::GroupLinkOptions lo;
  lo.group = sp.name();
  lo.num_nodes = s.num_nodes;
  lo.self_node = node;
  lo.recv_base = s.recv.data();
  lo.recv_bytes = recv_bytes;
  lo.wake = options_.wake;
  // Every write's sources: the send staging and error headers here (dispatch rows are packed
  // into the staging); the local ranks' data areas, which combine rows are sent from, are
  // declared as they attach (DeclareRankRegions).
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    if (n == node) continue;
    lo.send_regions.push_back({s.send[n].data(), s.send[n].size() * sizeof(uint64_t)});
    lo.send_regions.push_back({s.fail_send[n].data(), s.fail_send[n].size() * sizeof(uint64_t)});
  }
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    lo.node_labels.push_back(absl::StrCat(sp.nodes(n).peer_address(), ", ",
                                          peer::RankRangeText(s.first[n], s.count[n])));
  }
  absl::StatusOr<std::unique_ptr<transport::GroupLink>> link =
      options_.transport->CreateGroupLink(lo);
  if (!link.ok()) return link.status();
  s.link = *std::move(link);
  rank_region_.assign(static_cast<size_t>(local_count), -1);
  rank_memory_id_.assign(static_cast<size_t>(local_count), 0);
  peer::GroupMembership m;
  m.spec = sp;
  // The daemons compare the transport each resolved ("" = its own default): nodes whose
  // defaults differ are refused at rendezvous, not left with descriptors they cannot read.
  m.spec.set_transport(options_.transport_name);
  m.self_node = node;
  m.transport_descriptor = s.link->LocalDescriptor();
  for (int32_t n = 0; n < s.num_nodes; ++n) {
    m.transport_descriptors.push_back(n == node ? std::string() : s.link->LocalDescriptorFor(n));
  }
  m.join_secret_digest = options_.join_secret_digest;
  // The transport outlives the group (options_.transport): settings the nodes must share
  // are compared at rendezvous.
  m.compare_descriptors = [t = options_.transport](std::string_view ours, std::string_view theirs,
                                                   std::string_view our_node,
                                                   std::string_view their_node) {
    return t->CompareDescriptorSettings(ours, theirs, our_node, their_node);
  };
  m.wake = options_.wake;
  absl::StatusOr<std::unique_ptr<peer::GroupPeers>> peers =
      options_.peer_mesh->RegisterGroup(std::move(m));
  if (!peers.ok()) return peers.status();
  s.peers = *std::move(peers);
  span_ = std::move(s);  // The vectors' buffers move with them.
  MapGatherMemory();
  masking_ = sp.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK;
  view_mask_.assign(static_cast<size_t>(R), 0);
  self_mask_.assign(static_cast<size_t>(R), 0);
  op_mask_.assign(static_cast<size_t>(R), 0);
  peer_mask_.assign(static_cast<size_t>(span_.num_nodes) * R, 0);
  peer_epoch_.assign(span_.num_nodes, 0);
  agreed_epoch_.assign(span_.num_nodes, 0);
  excluded_.assign(span_.num_nodes, 0);
  excluded_at_start_.assign(span_.num_nodes, 0);
  mask_words_.assign(abi::ExchangeMaskWords(R), 0);
  link_metrics_.assign(span_.num_nodes, nullptr);
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == node) continue;
    link_metrics_[n] =
        metrics::Default().AddLink(sp.name(), options_.transport_name, sp.nodes(n).peer_address());
    link_metrics_[n]->SetTransportProbe([link = span_.link.get(), n] {
      const transport::LinkCounters c = link->Counters(n);
      return metrics::TransportCounts{c.retransmits, c.error_completions};
    });
  }
  return absl::OkStatus();
}

bool NodeExchange::PollBackground() {
  if (!span_.peers) return false;
  // Descriptors are looked at every few milliseconds, not on every poll (a lookup copies
  // the descriptor: an allocation the steady state must not make per poll).
  const auto now = std::chrono::steady_clock::now();
  bool all_connected = true;
  for (int32_t n = 0; n < span_.num_nodes; ++n)
    all_connected &= n == span_.self || span_.connected[n];
  if (all_connected && now < span_.next_descriptor_check) return false;
  span_.next_descriptor_check = now + std::chrono::milliseconds(5);
  bool worked = false;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self) continue;
    std::optional<peer::PeerDescriptor> d = span_.peers->Descriptor(n);
    if (!d) continue;
    // A peer that registered the group anew (restarted) is reconnected, between ops only.
    if (span_.connected[n] && (d->incarnation == span_.incarnation[n] || span_.in_op)) continue;
    absl::Status st = span_.link->Connect(n, d->transport);
    span_.connect_error[n].clear();
    if (!st.ok()) {
      span_.connect_error[n] = std::string(st.message());
      host_->ExchangeWarning(
          absl::StrCat("group ", spec().name(), ": connecting to node ", n, ": ", st.message()));
    }
    // A new incarnation's immediates and writes count anew; at the first connect an
    // immediate may already be pending (polled while the op was collected) and is kept.
    if (span_.connected[n]) span_.pending[n].reset();
    span_.posted[n] = 0;
    span_.fail_posted[n] = 0;
    for (RetiredRegion& old : retired_regions_) old.posted[n] = 0;  // Its writes are gone.
    // The op collected now is the link's op 0 at both ends (the peer's first op after its
    // connect); an op one end failed alone is told by the usual error header or a later
    // op's immediate.
    span_.link_base[n] = host_->ExchangeCurrentSeq();
    span_.connected[n] = 1;
    if (!agreed_epoch_.empty()) agreed_epoch_[n] = 0;  // A restarted peer starts its count anew.
    span_.incarnation[n] = d->incarnation;
    worked = true;
  }
  return worked;
}

bool NodeExchange::ReadyToStart() {
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self || span_.link->State(n) == transport::PeerState::kReady) continue;
    // Under MASK a node lost since it was connected does not hold the op up: it runs
    // without that node's ranks. A node never connected yet is waited for (the group forms).
    if (masking_ && NodeLost(n)) continue;
    return false;
  }
  return true;
}

uint32_t NodeExchange::NextMask(std::vector<uint8_t>* mask) const {
  // The last op's mask, with this node's own ranks as it masks them now.
  const std::vector<uint8_t>& local = host_->ExchangeRankMasked();
  std::copy(view_mask_.begin(), view_mask_.end(), mask->begin());
  bool changed = false;
  for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
    const uint8_t m = local[r] ? 1 : 0;
    changed |= (*mask)[r] != m;
    (*mask)[r] = m;
  }
  return view_epoch_ + (changed ? 1 : 0);
}

bool NodeExchange::NodeLost(int32_t n) const {
  if (!span_.connected[n]) return false;
  if (span_.link->State(n) != transport::PeerState::kReady || !span_.link->PeerStatus(n).ok()) {
    return true;
  }
  // The descriptor lookup copies it: only while the Peer service reports a node lost.
  return !span_.peers->Health().ok() && !span_.peers->Descriptor(n);
}

absl::Status NodeExchange::ComputeOpMask(uint64_t seq) {
  const int32_t R = shape().num_ranks;
  std::fill(op_mask_.begin(), op_mask_.end(), 0);
  uint32_t epoch = 0;
  // Each node is the authority on its own ranks; a lost node's ranks are masked.
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    const uint8_t* m = n == span_.self ? self_mask_.data() : peer_mask_.data() + size_t(n) * R;
    for (int32_t r = span_.first[n]; r < span_.first[n] + span_.count[n]; ++r) {
      op_mask_[r] = excluded_[n] ? 1 : m[r];
    }
    if (excluded_[n]) continue;
    epoch = std::max(epoch, n == span_.self ? self_epoch_ : peer_epoch_[n]);
  }
  // The epoch: the latest any node had, plus one when a node that had it saw another mask
  // (so every node that sees the same headers counts the same change once).
  bool changed = false;
  for (int32_t n = 0; n < span_.num_nodes && !changed; ++n) {
    if (excluded_[n]) continue;
    const uint32_t e = n == span_.self ? self_epoch_ : peer_epoch_[n];
    const uint8_t* m = n == span_.self ? self_mask_.data() : peer_mask_.data() + size_t(n) * R;
    if (e == epoch) changed = !std::equal(op_mask_.begin(), op_mask_.end(), m);
  }
  // CheckHeader bounds every peer's epoch by kMaxMaskEpoch; the step must not pass it either.
  const uint64_t next = uint64_t{epoch} + (changed ? 1 : 0);
  if (next > kMaxMaskEpoch) {
    return absl::OutOfRangeError(absl::StrCat("op ", seq, " of group ", spec().name(),
                                              ": the rank mask epoch would pass its limit ",
                                              kMaxMaskEpoch, "; recreate the group"));
  }
  op_epoch_ = static_cast<uint32_t>(next);
  return absl::OkStatus();
}

std::string NodeExchange::NotReadyReason() const {
  // The Peer mesh's account (nodes not registered and why, ranks not joined) comes first: a
  // client's copy of the message is cut to a fixed length.
  std::string why = span_.peers ? span_.peers->DescribeMissing() : std::string();
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self || span_.link->State(n) == transport::PeerState::kReady) continue;
    absl::StrAppend(
        &why, why.empty() ? "" : "; ", "node ", n, " (", spec().nodes(n).peer_address(),
        span_.count[n] == 1 ? ", rank " : ", ranks ", span_.first[n],
        span_.count[n] == 1 ? "" : absl::StrCat("-", span_.first[n] + span_.count[n] - 1),
        ") is not connected",
        span_.connect_error[n].empty() ? "" : absl::StrCat(" (", span_.connect_error[n], ")"));
  }
  return why;
}

abi::ExchangeHeader& NodeExchange::StageHeader(int32_t n, uint64_t seq, uint32_t op, uint32_t flags,
                                               int32_t alignment, uint64_t handle_age,
                                               const absl::Status& status) {
  auto& h = *reinterpret_cast<abi::ExchangeHeader*>(status.ok() ? span_.send[n].data()
                                                                : span_.fail_send[n].data());
  h = abi::ExchangeHeader{};
  h.seq = LinkSeq(n, seq);
  h.op = op;
  h.flags = flags & rules::kAgreedFlags;
  h.expert_alignment = alignment;
  h.source_node = span_.self;
  h.first_rank = span_.first[span_.self];
  h.num_ranks = span_.count[span_.self];
  h.handle_seq = handle_age;
  SetHeaderStatus(h, status);
  return h;
}

void NodeExchange::SetHeaderStatus(abi::ExchangeHeader& h, const absl::Status& status) {
  h.status_code = static_cast<int32_t>(status.code());
  h.reason = status.ok() ? 0 : static_cast<uint32_t>(errors::ReasonOf(status));
  std::memset(h.message, 0, sizeof(h.message));
  const size_t len = std::min<size_t>(status.message().size(), abi::kExchangeMessageBytes);
  if (len > 0) std::memcpy(h.message, status.message().data(), len);
  h.message_bytes = static_cast<uint32_t>(len);
}

void NodeExchange::OpFailedHere(uint64_t seq, uint32_t op, const absl::Status& status) {
  if (!span_.link) return;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self) continue;
    if (masking_ && NodeLost(n)) {
      // Not an op of the link to a lost node: it stays the link's next op (as in Poll).
      ++span_.link_base[n];
      continue;
    }
    if (span_.link->State(n) != transport::PeerState::kReady) continue;
    // The error header's staging is reused only once the previous one left.
    if (span_.link->WritesCompleted(n) < span_.posted[n]) continue;
    StageHeader(n, seq, op, 0, 0, 0, status);
    const transport::WritePiece piece{
        span_.fail_send[n].data(), sizeof(abi::ExchangeHeader),
        span_.remote_offset[n] + (LinkSeq(n, seq) % 2) * span_.out_layout[n].total};
    if (span_.link
            ->PostWrite(n, {&piece, 1}, abi::ExchangeImm(LinkSeq(n, seq), abi::kExchangePhaseOp))
            .ok()) {
      ++span_.posted[n];
    }
  }
}

int64_t NodeExchange::CombineOffsets(int32_t m, const std::vector<int32_t>& counts, int32_t width) {
  const int32_t per_owner = width == shape().num_ranks ? 1 : shape().num_local_experts();
  const int32_t first = span_.first[m], last = span_.first[m] + span_.count[m];
  int64_t total = 0;
  for (int32_t x = 0; x < width; ++x) {
    span_.combine_off[x] = total;
    const int32_t owner = x / per_owner;
    if (owner >= first && owner < last) continue;
    for (int32_t s = first; s < last; ++s) total += counts[static_cast<size_t>(s) * width + x];
  }
  span_.combine_off[width] = total;
  return total;
}

absl::Status NodeExchange::PostToNode(int32_t n, uint64_t seq,
                                      std::span<const transport::WritePiece> pieces) {
  absl::Status st =
      span_.link->PostWrite(n, pieces, abi::ExchangeImm(LinkSeq(n, seq), abi::kExchangePhaseOp));
  if (st.ok()) ++span_.posted[n];
  if (metrics::LinkMetrics* m = link_metrics_[n].get()) {
    if (st.ok()) {
      uint64_t bytes = 0;
      for (const transport::WritePiece& p : pieces) bytes += p.bytes;
      m->writes.Add();
      m->bytes_sent.Add(bytes);
    } else {
      m->errors.Add();
    }
  }
  return st;
}

absl::Status NodeExchange::DeclareRankRegions() {
  WithdrawRetiredRegions(false);
  for (int32_t i = 0; i < local_count(); ++i) {
    const int32_t r = local_first() + i;
    if (masking_ && host_->ExchangeRankMasked()[r]) continue;  // It sends no rows.
    uint64_t id = 0;
    const transport::MemoryRegion region = host_->ExchangeRankRegion(r, &id);
    if (rank_region_[i] >= 0 && rank_memory_id_[i] == id) continue;
    absl::StatusOr<int> handle = span_.link->AddSendRegion(region);
    if (!handle.ok()) {
      return absl::Status(
          handle.status().code(),
          absl::StrCat("group ", spec().name(), " rank ", r, ": declaring its data area (",
                       region.bytes, " bytes) to the ", options_.transport_name,
                       " link: ", handle.status().message()));
    }
    // The old area is withdrawn after the new one is declared: a transport that looks for
    // a source's region finds the latest declaration first.
    if (rank_region_[i] >= 0) retired_regions_.push_back({rank_region_[i], span_.posted});
    rank_region_[i] = *handle;
    rank_memory_id_[i] = id;
  }
  WithdrawRetiredRegions(false);
  return absl::OkStatus();
}

void NodeExchange::WithdrawRetiredRegions(bool all) {
  std::erase_if(retired_regions_, [&](const RetiredRegion& old) {
    for (int32_t n = 0; n < span_.num_nodes && !all; ++n) {
      if (n != span_.self && span_.link->WritesCompleted(n) < old.posted[n]) return false;
    }
    span_.link->RemoveSendRegion(old.handle);
    return true;
  });
}

bool NodeExchange::ImmFor(int32_t n, uint64_t seq) {
  for (;;) {
    if (!span_.pending[n]) {
      uint32_t imm = 0;
      if (!span_.link->PollImm(n, &imm)) return false;
      span_.pending[n] = imm;
    }
    const uint64_t got = abi::ExchangeImmSeq(*span_.pending[n]);
    const uint64_t want = LinkSeq(n, seq) % abi::kExchangeImmSeqModulo;
    const uint64_t ahead = (got + abi::kExchangeImmSeqModulo - want) % abi::kExchangeImmSeqModulo;
    if (ahead == 0) return true;
    if (ahead < abi::kExchangeImmSeqModulo / 2) return false;  // A later op's: keep it.
    span_.pending[n].reset();  // An op this node already finished or failed: drop it.
  }
}

bool NodeExchange::MissingPeersAlive() const {
  bool any = false;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self || span_.got[n] || excluded_[n]) continue;
    if (span_.link->State(n) != transport::PeerState::kReady || !span_.link->PeerStatus(n).ok()) {
      return false;
    }
    any = true;
  }
  return any && span_.peers->Health().ok();
}

absl::Status NodeExchange::PeerFailure(uint64_t seq, int64_t local_op) {
  if (!span_.peers) return absl::OkStatus();
  if (absl::Status h = span_.peers->Health(); !h.ok() && !masking_) return h;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self) continue;
    if (masking_ && NodeLost(n)) continue;  // Its ranks are masked, not waited for.
    if (span_.connected[n]) {
      if (absl::Status st = span_.link->PeerStatus(n); !st.ok()) return st;
    }
    // Another node's failure of this op is taken once every peer can be told (else one
    // still running it would wait for this node until op_timeout).
    if (!ReadyToStart() || !ImmFor(n, seq)) continue;
    int64_t peer_op = -1;
    absl::Status st = CheckHeader(n, seq, &peer_op);
    if (!st.ok()) {
      span_.pending[n].reset();
      // Node n's failure of another op than the one this node's ranks submitted is not
      // theirs; an error found in node n's message (peer_op -1) is.
      if (local_op >= 0 && peer_op >= 0 && peer_op != local_op) {
        return NotInStep(seq, span_.self, static_cast<uint32_t>(local_op), n,
                         static_cast<uint32_t>(peer_op), st);
      }
      return st;
    }
  }
  return absl::OkStatus();
}

void NodeExchange::StagePackSources(const OpPlan& plan,
                                    const std::vector<abi::RequestSlot>& slots) {
  const kernels::host::HostExecution& exec = options_.exec;
  const kernels::GroupShape& gs = shape();
  const EndpointLayout& L = layout();
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);
  const int32_t first = local_first(), Rl = local_count();
  const int64_t H = gs.hidden, S = gs.num_scales(), Mll = gs.ll_max_tokens_per_rank;
  const bool ll = plan.op == abi::OpKind::kLowLatencyDispatch;
  const bool cached = !ll && flags.cached_handle;
  const bool weights = !ll && !cached && flags.dispatch_weights;
  for (int32_t i = 0; i < Rl; ++i) {
    const int32_t r = first + i;
    kernels::host::NodePackSource& src = span_.pack_sources[i];
    src = {slots[r].num_tokens,
           cached ? nullptr : Private(r).topk_idx.data(),
           cached ? Private(r).send_pos.data() : nullptr,
           Ptr<const void>(r, L.in_x),
           flags.use_fp8 ? H : 2 * H,
           !ll && flags.use_fp8 ? Ptr<const float>(r, L.in_scales) : nullptr,
           weights ? Ptr<const float>(r, L.in_topk_weights) : nullptr};
    if (ll && flags.use_fp8) {
      // Each token quantized once, here (the rows to every node and to this node's ranks).
      kernels::e4m3_bits* q = span_.quant_x.data() + i * Mll * H;
      float* q_scales = span_.quant_scales.data() + i * Mll * S;
      if (!host_->ExchangeRowsQuantized(r, plan.seq)) {
        KernelScope k(options_.on_kernels);
        kernels::host::QuantizeRowsFp8(gs, slots[r].num_tokens,
                                       Ptr<const kernels::bf16_bits>(r, L.in_x), flags.round_scale,
                                       q, q_scales, exec);
      }
      src.x = q;
      src.x_scales = q_scales;
    }
  }
}

void NodeExchange::Start(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots) {
  // The handles as the op starts: a rank may detach while the op runs on.
  for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
    if (masking_ && host_->ExchangeRankMasked()[r]) continue;  // Its endpoint may be gone.
    const rules::HandleTable& h = host_->ExchangeRankHandles(r);
    recv_tokens_[r] = h.num_recv_tokens();
    routing_tokens_[r] = h.routing_tokens();
  }
  if (masking_) {
    self_epoch_ = NextMask(&self_mask_);
    for (int32_t r = local_first(); r < local_first() + local_count(); ++r) {
      if (self_mask_[r]) recv_tokens_[r] = routing_tokens_[r] = 0;  // A stand-in: no handles.
    }
    for (int32_t n = 0; n < span_.num_nodes; ++n) {
      excluded_[n] = excluded_at_start_[n] = n != span_.self && NodeLost(n);
    }
  }
  span_.started = std::chrono::steady_clock::now();
  span_.plan = &plan;
  span_.slots = &slots;
  span_.in_op = true;
  span_.packing = false;
  span_.lost_seen.reset();
  std::fill(span_.got.begin(), span_.got.end(), 0);
  span_.local_status = SendOp(plan, slots);
}

absl::Status NodeExchange::SendOp(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots) {
  const kernels::GroupShape& gs = shape();
  const EndpointLayout& L = layout();
  const int32_t R = gs.num_ranks, E = gs.num_experts, K = gs.num_topk;
  const int32_t El = gs.num_local_experts();
  const int32_t S = gs.num_scales();
  const int64_t H = gs.hidden;
  const int32_t first = local_first(), Rl = local_count();
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);
  const uint32_t op = static_cast<uint32_t>(plan.op);
  const int32_t alignment = slots[first].expert_alignment;
  // A low-latency combine names its dispatch by how many ops before it that ran (the same
  // at every node whatever each node's own numbering).
  const uint64_t handle_age = HandleAge(plan.seq, slots[first].handle_seq);
  // This node's checks first: a bad request here fails the op on every node.
  absl::Status local = absl::OkStatus();
  if (plan.op == abi::OpKind::kLowLatencyCombine) {
    for (int32_t n = 0; n < span_.num_nodes && local.ok(); ++n) {
      if (n != span_.self && slots[first].handle_seq < span_.link_base[n]) {
        local = errors::WithReason(
            absl::InvalidArgumentError(absl::StrCat(
                "LowLatencyCombine (op ", plan.seq, " of group ", spec().name(),
                "): its dispatch (op ", slots[first].handle_seq, ") ran before node ", n, " (",
                spec().nodes(n).peer_address(), ") rejoined the group; dispatch again")),
            errors::Reason::kHandleInvalid);
      }
    }
  }
  // (GetDispatchLayout checks each rank's topk_idx on its own, in FinishExchange: one
  // rank's error is its own, as on one node.)
  const bool needs_idx = plan.op == abi::OpKind::kLowLatencyDispatch ||
                         plan.op == abi::OpKind::kLowLatencyCombine ||
                         (plan.op == abi::OpKind::kDispatch && !flags.cached_handle);
  for (int32_t r = first; r < first + Rl && local.ok() && needs_idx; ++r) {
    local = TakeTopkIdx(r, slots[r].num_tokens).status();
  }
  std::vector<int32_t>& lc = span_.local_counts;  // [Rl, E]: this node's sources' counts.
  std::fill(lc.begin(), lc.end(), 0);
  for (int32_t i = 0; i < Rl && local.ok(); ++i) {
    const int32_t r = first + i;
    if (plan.op == abi::OpKind::kDispatch) {
      kernels::host::CountDispatchRows(gs, slots[r].num_tokens,
                                       flags.cached_handle ? nullptr : Private(r).topk_idx.data(),
                                       flags.cached_handle ? Private(r).send_pos.data() : nullptr,
                                       lc.data() + static_cast<size_t>(i) * E);
    } else if (plan.op == abi::OpKind::kLowLatencyDispatch) {
      kernels::host::CountLowLatencyRows(gs, slots[r].num_tokens, Private(r).topk_idx.data(),
                                         lc.data() + static_cast<size_t>(i) * E);
    }
  }
  // Combine rows go out straight from the ranks' data areas: each declared to the link.
  if (local.ok() &&
      (plan.op == abi::OpKind::kCombine || plan.op == abi::OpKind::kLowLatencyCombine)) {
    local = DeclareRankRegions();
  }
  const bool header_only = !local.ok() || plan.op == abi::OpKind::kGetDispatchLayout;
  const kernels::host::HostExecution& exec = options_.exec;
  const bool dispatch =
      plan.op == abi::OpKind::kDispatch || plan.op == abi::OpKind::kLowLatencyDispatch;
  if (!header_only && dispatch) StagePackSources(plan, slots);
  // Rows on the backend: the ranks whose rows it packs; every node's posts wait for it.
  bool backend_packs = false;
  for (int32_t i = 0; i < Rl; ++i) {
    span_.packs[i] =
        !header_only && dispatch && packs_rows() && host_->ExchangePacksRows(first + i);
    backend_packs = backend_packs || span_.packs[i];
  }
  absl::Status pack_status = absl::OkStatus();
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self || excluded_[n]) continue;
    const abi::ExchangeSlotLayout& sl = span_.out_layout[n];
    uint8_t* base = reinterpret_cast<uint8_t*>(span_.send[n].data());
    const uint64_t remote = span_.remote_offset[n] + (LinkSeq(n, plan.seq) % 2) * sl.total;
    abi::ExchangeHeader& h =
        StageHeader(n, plan.seq, op, plan.flags, alignment, handle_age, absl::OkStatus());
    std::vector<transport::WritePiece>& pieces = span_.pieces;
    pieces.clear();
    uint64_t header_bytes = sizeof(abi::ExchangeHeader);
    if (masking_ && local.ok()) {
      // This node's mask travels after the header (ExchangeSlotLayout::mask).
      const uint64_t words = abi::ExchangeMaskWords(R);
      auto* mw = reinterpret_cast<uint64_t*>(base + sl.mask);
      std::fill(mw, mw + words, 0);
      for (int32_t r = 0; r < R; ++r) {
        if (self_mask_[r]) mw[r / 64] |= uint64_t{1} << (r % 64);
      }
      h.mask_epoch = self_epoch_;
      h.mask_words = static_cast<uint32_t>(words);
      header_bytes = sl.tokens;
    }
    if (header_only) {
      SetHeaderStatus(h, local);
      pieces.push_back({base, header_bytes, remote});
      EPD_RETURN_IF_ERROR(PostToNode(n, plan.seq, pieces));
      continue;
    }
    auto* tokens = reinterpret_cast<int32_t*>(base + sl.tokens);
    auto* counts = reinterpret_cast<int32_t*>(base + sl.counts);
    auto* rows = reinterpret_cast<int32_t*>(base + sl.rows);
    for (int32_t i = 0; i < Rl; ++i) tokens[i] = slots[first + i].num_tokens;
    std::memcpy(counts, lc.data(), lc.size() * sizeof(int32_t));
    std::memset(rows, 0, static_cast<size_t>(Rl) * E * sizeof(int32_t));
    pieces.push_back({base, sl.payload, remote});
    const kernels::host::NodeRanks to{span_.first[n], span_.count[n]};
    switch (plan.op) {
      case abi::OpKind::kDispatch:
      case abi::OpKind::kLowLatencyDispatch: {
        const bool ll = plan.op == abi::OpKind::kLowLatencyDispatch;
        const bool fp8 = flags.use_fp8;
        const bool cached = !ll && flags.cached_handle;
        const bool weights = !ll && !cached && flags.dispatch_weights;
        const int64_t x_bytes = fp8 ? H : 2 * H;
        std::vector<kernels::host::NodePackJob>& jobs = span_.pack_jobs;
        const uint64_t C = sl.block_rows;
        for (int32_t i = 0; i < Rl; ++i) {
          const uint64_t blk = sl.payload + static_cast<uint64_t>(i) * sl.block_bytes;
          jobs[i] = {&span_.pack_sources[i],
                     to,
                     reinterpret_cast<int32_t*>(base + blk + sl.ids),
                     cached ? nullptr : reinterpret_cast<int64_t*>(base + blk + sl.idx),
                     cached ? reinterpret_cast<int32_t*>(base + blk + sl.pos) : nullptr,
                     weights ? reinterpret_cast<float*>(base + blk + sl.weights) : nullptr,
                     base + blk + sl.x,
                     fp8 ? reinterpret_cast<float*>(base + blk + sl.scales) : nullptr,
                     rows + i,
                     span_.packs[i] ? span_.pack_rows.data() +
                                          (static_cast<uint64_t>(i) * span_.num_nodes + n) * C
                                    : nullptr};
        }
        {
          KernelScope k(options_.on_kernels);
          kernels::host::PackNodeRows(gs, std::span(jobs.data(), static_cast<size_t>(Rl)), exec);
        }
        for (int32_t i = 0; i < Rl && pack_status.ok(); ++i) {
          if (!span_.packs[i] || rows[i] == 0) continue;  // Nothing to copy to node n.
          kernels::RowGather g;
          g.x = jobs[i].x;
          g.row_bytes = x_bytes;
          g.blocks = 1;
          g.block_rows = static_cast<int64_t>(C);
          g.counts = rows + i;
          g.sources = jobs[i].x_sources;
          g.scales_kind = fp8 ? kernels::GatherScales::kRows : kernels::GatherScales::kNone;
          g.scales = jobs[i].x_scales;
          pack_status = host_->ExchangePackRows(first + i, g);
        }
        for (int32_t i = 0; i < Rl; ++i) {
          const uint64_t blk = sl.payload + static_cast<uint64_t>(i) * sl.block_bytes;
          const kernels::host::NodePackJob& j = jobs[i];
          const int32_t m = rows[i];
          const uint64_t rb = remote + blk;
          pieces.push_back({j.token, uint64_t(m) * 4, rb + sl.ids});
          if (cached) {
            pieces.push_back({j.send_pos, uint64_t(m) * R * 4, rb + sl.pos});
          } else {
            pieces.push_back({j.topk_idx, uint64_t(m) * K * 8, rb + sl.idx});
          }
          if (weights) pieces.push_back({j.topk_weights, uint64_t(m) * K * 4, rb + sl.weights});
          if (fp8) pieces.push_back({j.x_scales, uint64_t(m) * S * 4, rb + sl.scales});
          pieces.push_back({j.x, uint64_t(m) * x_bytes, rb + sl.x});
        }
        break;
      }
      case abi::OpKind::kCombine: {
        // Rows of this node's ranks that belong to node n's tokens: one range per rank, to
        // its count-addressed block of node n's combine area.
        const std::vector<int32_t>& dc = span_.dispatch_counts;
        const abi::ExchangeCombineLayout& cl = span_.combine_layout[n];
        const uint64_t area = span_.combine_offset[n] + (LinkSeq(n, plan.seq) % 2) * cl.total;
        if (static_cast<uint64_t>(CombineOffsets(n, dc, R)) > cl.rows) {
          return absl::InternalError(absl::StrCat("op ", plan.seq, ": ", span_.combine_off[R],
                                                  " combine rows for node ", n, ", more than ",
                                                  cl.rows));
        }
        for (int32_t i = 0; i < Rl; ++i) {
          const int32_t r = first + i;
          const auto [start, cnt] = RowsFromSources(dc, R, r, span_.first[n], span_.count[n]);
          rows[i] = static_cast<int32_t>(cnt);
          // A masked rank's rows are not sent: every node drops the routes to it.
          if (masking_ && self_mask_[r]) continue;
          const uint64_t off = static_cast<uint64_t>(span_.combine_off[r]);
          pieces.push_back({Ptr<const uint8_t>(r, L.in_combine_x) + start * 2 * H,
                            static_cast<uint64_t>(cnt) * 2 * H, area + cl.x + off * 2 * H});
          if (flags.combine_weights) {
            pieces.push_back({Ptr<const uint8_t>(r, L.in_combine_weights) + start * K * 4,
                              static_cast<uint64_t>(cnt) * K * 4, area + cl.weights + off * K * 4});
          }
        }
        break;
      }
      case abi::OpKind::kLowLatencyCombine: {
        const std::vector<int32_t>& c = span_.ll_counts[plan.ll_handle_buffer];
        const int64_t rpe = gs.ll_rows_per_expert();
        const abi::ExchangeCombineLayout& cl = span_.combine_layout[n];
        const uint64_t area = span_.combine_offset[n] + (LinkSeq(n, plan.seq) % 2) * cl.total;
        if (static_cast<uint64_t>(CombineOffsets(n, c, E)) > cl.ll_rows) {
          return absl::InternalError(absl::StrCat("op ", plan.seq, ": ", span_.combine_off[E],
                                                  " low-latency combine rows for node ", n,
                                                  ", more than ", cl.ll_rows));
        }
        for (int32_t i = 0; i < Rl; ++i) {
          const int32_t r = first + i;
          for (int32_t j = 0; j < El; ++j) {
            const int32_t e = r * El + j;
            const auto [start, cnt] = RowsFromSources(c, E, e, span_.first[n], span_.count[n]);
            rows[i * El + j] = static_cast<int32_t>(cnt);
            if (masking_ && self_mask_[r]) continue;  // As for a normal combine.
            const uint64_t off = static_cast<uint64_t>(span_.combine_off[e]);
            pieces.push_back({Ptr<const uint8_t>(r, L.in_ll_combine_x) + (j * rpe + start) * 2 * H,
                              static_cast<uint64_t>(cnt) * 2 * H, area + cl.x + off * 2 * H});
          }
        }
        break;
      }
      default:
        break;
    }
    if (backend_packs) {
      span_.deferred[n].assign(pieces.begin(), pieces.end());  // Posted once packed.
      continue;
    }
    EPD_RETURN_IF_ERROR(PostToNode(n, plan.seq, pieces));
  }
  if (backend_packs && !pack_status.ok()) {
    // Nothing was posted: every node gets this node's error instead of its rows.
    PostDeferred(plan.seq, pack_status);
    return pack_status;
  }
  span_.packing = backend_packs;
  return local;
}

bool NodeExchange::Poll(std::span<RankOutcome> outcomes) {
  if (span_.packing && !PollPack()) return false;
  const OpPlan& plan = *span_.plan;
  // The link to a node lost as the op started does not count it: its next op is still the
  // link's next (ImmFor and the slot parity stay in step with the node's numbering).
  auto end_op = [&] {
    span_.in_op = false;
    for (int32_t n = 0; n < span_.num_nodes && masking_; ++n) {
      if (excluded_at_start_[n]) ++span_.link_base[n];
    }
  };
  auto fail = [&](const absl::Status& st) {
    uint32_t num_masked = 0;
    for (uint8_t m : self_mask_) num_masked += m;
    for (RankOutcome& o : outcomes) {
      o.status = st;
      o.mask_epoch = self_epoch_;  // The mask this node brought to the op.
      o.num_masked = num_masked;
    }
    end_op();
    return true;
  };
  bool all = true;
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    if (n == span_.self || span_.got[n] || excluded_[n]) continue;
    // A message that arrived counts even when the peer closed since (it finished the op
    // and left): the immediate is looked for again once the peer's state says failed (the
    // transport delivers what arrived before it fails the peer).
    bool in = ImmFor(n, plan.seq);
    if (!in) {
      if (absl::Status st = span_.link->PeerStatus(n); !st.ok()) {
        in = ImmFor(n, plan.seq);
        if (!in) {
          if (link_metrics_[n]) link_metrics_[n]->errors.Add();
          if (masking_) {
            // Under MASK a lost node's ranks are masked and the op goes on without it.
            excluded_[n] = 1;
            host_->ExchangeWarning(absl::StrCat(
                "op ", plan.seq, " of group ", spec().name(), " runs without node ", n, " (",
                spec().nodes(n).peer_address(), "): ", st.message(), "; its ranks are masked"));
            continue;
          }
          return fail(st);
        }
      }
    }
    if (in) {
      span_.pending[n].reset();
      span_.got[n] = 1;
    } else if (span_.pending[n]) {
      return fail(absl::AbortedError(
          absl::StrCat("op ", plan.seq, " of group ", spec().name(), ": node ", n, " (",
                       spec().nodes(n).peer_address(), ") failed it and went on to its next op")));
    } else {
      all = false;
    }
  }
  for (int32_t n = 0; n < span_.num_nodes && all; ++n) {
    if (n != span_.self && !excluded_[n] && span_.link->WritesCompleted(n) < span_.posted[n]) {
      all = false;
    }
  }
  if (!all) {
    if (absl::Status h = span_.peers->Health(); !h.ok()) {
      // A node that finished the op (its message is in) and then left does not fail it; a
      // lost one (no descriptor) whose message is still missing does once kLostGrace
      // passed with its link standing (a leaving node's message may still be on its way:
      // the Peer service and the data links are different connections). A failed link is
      // left to the next poll's loop above (its message may have come in meanwhile).
      // Looked at only while a peer is lost, not in the steady state.
      const auto now = std::chrono::steady_clock::now();
      if (!span_.lost_seen) span_.lost_seen = now;
      for (int32_t n = 0; n < span_.num_nodes; ++n) {
        if (n == span_.self || span_.got[n] || excluded_[n] || span_.peers->Descriptor(n)) {
          continue;
        }
        if (span_.link->PeerStatus(n).ok() && now - *span_.lost_seen >= kLostGrace) {
          if (link_metrics_[n]) link_metrics_[n]->errors.Add();  // Lost by the Peer service.
          if (masking_) {
            excluded_[n] = 1;
            host_->ExchangeWarning(absl::StrCat(
                "op ", plan.seq, " of group ", spec().name(), " runs without node ", n, " (",
                spec().nodes(n).peer_address(), "): ", h.message(), "; its ranks are masked"));
            return false;  // The next poll goes on without it.
          }
          return fail(h);
        }
      }
    }
    const auto waited = std::chrono::steady_clock::now() - span_.started;
    const std::chrono::milliseconds timeout(options_.op_timeout_ms);
    if (waited >= timeout) {
      // A live peer still owes its message (or its failure header, which names its silent
      // rank): wait for it up to the grace, so that every node reports the same error.
      const std::chrono::milliseconds grace = PeerFailureGrace(options_.op_timeout_ms);
      const bool alive = MissingPeersAlive();
      if (alive && waited < timeout + grace) return false;
      std::string who;
      for (int32_t n = 0; n < span_.num_nodes; ++n) {
        if (n == span_.self || span_.got[n] || excluded_[n]) continue;
        if (link_metrics_[n]) link_metrics_[n]->timeouts.Add();
        absl::StrAppend(&who, who.empty() ? "" : ", ", "node ", n, " (",
                        spec().nodes(n).peer_address(), ", ranks ", span_.first[n], "-",
                        span_.first[n] + span_.count[n] - 1, ")");
      }
      const std::string missing = span_.peers->DescribeMissing();
      return fail(errors::WithReason(
          absl::DeadlineExceededError(
              absl::StrCat("op ", plan.seq, " of group ", spec().name(), ": ",
                           who.empty() ? std::string("the writes to the peers did not complete")
                                       : absl::StrCat(who, " sent nothing"),
                           " within op_timeout ", options_.op_timeout_ms, " ms",
                           alive ? absl::StrCat(" (+ ", grace.count(), " ms grace for a live peer)")
                                 : std::string(),
                           missing.empty() ? "" : "; ", missing)),
          errors::Reason::kOpTimeout));
    }
    return false;
  }
  absl::Status st = FailedOpStatus(plan);
  if (!rules::Describe(static_cast<uint32_t>(plan.op)).exchanges_data) {
    st = span_.local_status;  // GetDispatchLayout: another node's error is its own.
  }
  if (st.ok() && masking_) st = ComputeOpMask(plan.seq);
  if (st.ok() && masking_) {
    uint32_t num_masked = 0;
    for (uint8_t m : op_mask_) num_masked += m;
    for (RankOutcome& o : outcomes) {
      o.mask_epoch = op_epoch_;
      o.num_masked = num_masked;
    }
  }
  if (st.ok()) st = FinishExchange(plan, *span_.slots, outcomes);
  if (!st.ok()) return fail(st);
  if (masking_) {
    std::copy(op_mask_.begin(), op_mask_.end(), view_mask_.begin());
    view_epoch_ = op_epoch_;
    for (int32_t n = 0; n < span_.num_nodes; ++n) {
      if (n != span_.self && !excluded_[n]) agreed_epoch_[n] = peer_epoch_[n];
    }
  }
  end_op();
  return true;
}

absl::Status NodeExchange::FinishExchange(const OpPlan& plan,
                                          const std::vector<abi::RequestSlot>& slots,
                                          std::span<RankOutcome> out) {
  const kernels::GroupShape& gs = shape();
  const EndpointLayout& L = layout();
  const int32_t R = gs.num_ranks, E = gs.num_experts, El = gs.num_local_experts();
  const int32_t first = local_first(), Rl = local_count();
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);
  const kernels::host::NodeRanks node{first, Rl};
  const kernels::host::HostExecution& exec = options_.exec;
  // Every node must run the same op: each is compared with node 0's.
  auto header = [&](int32_t n) {
    abi::ExchangeHeader h;
    if (n == span_.self) {
      h.op = static_cast<uint32_t>(plan.op);
      h.flags = plan.flags & rules::kAgreedFlags;
      h.expert_alignment = slots[first].expert_alignment;
      h.handle_seq = HandleAge(plan.seq, slots[first].handle_seq);
    } else {
      h = span_.headers[n];  // Checked by CheckHeader (Poll) for this op.
    }
    return h;
  };
  // Every node taking part must run the same op: each is compared with the first one's.
  int32_t ref = 0;
  while (excluded_[ref]) ++ref;  // This node is never excluded.
  const abi::ExchangeHeader h0 = header(ref);
  // The op's mask (ComputeOpMask) when any rank is masked, else null: pairs routed to a
  // masked rank's experts are dropped, its rows are neither read nor written.
  const bool any_masked =
      masking_ && std::any_of(op_mask_.begin(), op_mask_.end(), [](uint8_t m) { return m != 0; });
  const std::span<const uint8_t> mask(op_mask_);
  auto gone = [&](int32_t rank) { return any_masked && op_mask_[rank] != 0; };
  for (int32_t n = ref + 1; n < span_.num_nodes; ++n) {
    if (excluded_[n]) continue;
    const abi::ExchangeHeader h = header(n);
    const bool dispatch = h0.op == static_cast<uint32_t>(abi::OpKind::kDispatch);
    const bool ll_combine = h0.op == static_cast<uint32_t>(abi::OpKind::kLowLatencyCombine);
    if (h.op != h0.op || h.flags != h0.flags ||
        (dispatch && h.expert_alignment != h0.expert_alignment) ||
        (ll_combine && h.handle_seq != h0.handle_seq)) {
      auto describe = [](const abi::ExchangeHeader& x) {
        return absl::StrCat(OpName(x.op), " (flags 0x", absl::Hex(x.flags), ", expert_alignment ",
                            x.expert_alignment, ", dispatch ", x.handle_seq, " ops before)");
      };
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "op ", plan.seq, " of group ", spec().name(), ": nodes disagree: node ", ref,
              " (ranks ", span_.first[ref], "-", span_.first[ref] + span_.count[ref] - 1,
              ") submitted ", describe(h0), ", node ", n, " (ranks ", span_.first[n], "-",
              span_.first[n] + span_.count[n] - 1, ") submitted ", describe(h))),
          errors::Reason::kOpInputInvalid);
    }
  }
  // Node n's rows per block (each read once, into a local, and checked there).
  auto rows_of = [&](int32_t n) {
    return reinterpret_cast<const int32_t*>(RecvSlot(n, plan.seq) + span_.in_layout[n].rows);
  };
  auto malformed = [&](int32_t n, const std::string& what) {
    return errors::WithReason(
        absl::DataLossError(absl::StrCat("op ", plan.seq, " of group ", spec().name(), ": node ", n,
                                         " (", spec().nodes(n).peer_address(), ") sent ", what)),
        errors::Reason::kPeerProtocol);
  };
  switch (plan.op) {
    case abi::OpKind::kGetDispatchLayout: {
      for (int32_t r = first; r < first + Rl; ++r) {
        if (!gone(r)) out[r].status = RunLayout(r, slots[r]);
      }
      return absl::OkStatus();
    }
    case abi::OpKind::kDispatch:
    case abi::OpKind::kLowLatencyDispatch: {
      const bool ll = plan.op == abi::OpKind::kLowLatencyDispatch;
      const int32_t width = ll ? E : R;  // Counts per source.
      std::vector<int32_t>& counts = span_.counts;
      for (int32_t n = 0; n < span_.num_nodes; ++n) {
        if (excluded_[n]) {  // A lost node sent nothing: its ranks are masked.
          std::fill(counts.begin() + static_cast<size_t>(span_.first[n]) * width,
                    counts.begin() + static_cast<size_t>(span_.first[n] + span_.count[n]) * width,
                    0);
          continue;
        }
        const int32_t* c = n == span_.self ? span_.local_counts.data()
                                           : reinterpret_cast<const int32_t*>(
                                                 RecvSlot(n, plan.seq) + span_.in_layout[n].counts);
        for (int32_t i = 0; i < span_.count[n]; ++i) {
          std::memcpy(counts.data() + static_cast<size_t>(span_.first[n] + i) * width,
                      c + static_cast<size_t>(i) * E, sizeof(int32_t) * width);
        }
      }
      if (any_masked) {
        // Every node drops the same rows: none from a masked rank, none to one (the senders
        // counted rows to ranks masked elsewhere; the receivers drop those pairs below).
        const int32_t per_owner = ll ? El : 1;
        for (int32_t s = 0; s < R; ++s) {
          for (int32_t x = 0; x < width; ++x) {
            if (op_mask_[s] || op_mask_[x / per_owner])
              counts[static_cast<size_t>(s) * width + x] = 0;
          }
        }
      }
      const std::span<const int32_t> all_counts(counts.data(), static_cast<size_t>(R) * width);
      for (int32_t s = 0; s < R; ++s) {
        const int32_t n = NodeOf(s);
        if (n == span_.self) {
          if (any_masked && !gone(s)) {
            // This node's sources drop their pairs to masked ranks (their private copies).
            out[s].dropped_pairs =
                flags.cached_handle && !ll
                    ? kernels::host::DropMaskedRoutes(gs, mask, slots[s].num_tokens,
                                                      Private(s).send_pos.data())
                    : kernels::host::DropMaskedExperts(gs, mask, slots[s].num_tokens,
                                                       Private(s).topk_idx.data());
          }
          const bool fp8 = flags.use_fp8 && !ll;
          span_.dispatch_sources[s] = {
              slots[s].num_tokens,
              nullptr,
              Ptr<const void>(s, L.in_x),
              fp8 ? Ptr<const float>(s, L.in_scales) : nullptr,
              flags.cached_handle ? nullptr : Private(s).topk_idx.data(),
              flags.dispatch_weights ? Ptr<const float>(s, L.in_topk_weights) : nullptr,
              flags.cached_handle ? Private(s).send_pos.data() : nullptr};
          // A low-latency FP8 source's rows were quantized by SendOp.
          const bool q = ll && flags.use_fp8;
          span_.ll_sources[s] = {slots[s].num_tokens,
                                 nullptr,
                                 Private(s).topk_idx.data(),
                                 q ? span_.pack_sources[s - first].x : Ptr<const void>(s, L.in_x),
                                 q ? span_.pack_sources[s - first].x_scales : nullptr,
                                 q};
          continue;
        }
        if (excluded_[n] || gone(s)) {  // Nothing of a masked rank is read.
          span_.dispatch_sources[s] = {};
          span_.ll_sources[s] = {};
          continue;
        }
        const abi::ExchangeSlotLayout& sl = span_.in_layout[n];
        const int32_t i = s - span_.first[n];
        const int32_t rows = rows_of(n)[i];
        if (rows < 0 || static_cast<uint64_t>(rows) > sl.block_rows) {
          return malformed(
              n, absl::StrCat(rows, " rows of rank ", s, " (at most ", sl.block_rows, ")"));
        }
        const uint8_t* blk = RecvSlot(n, plan.seq) + sl.payload + i * sl.block_bytes;
        // The peer may write this slot again while the kernels run (its next op's write may
        // follow this op's immediate at once): what they check and then use as indices (token
        // ids, topk_idx, send_pos) is copied out first, and only the copies are read. The rows'
        // values (x, scales, weights) are read in place.
        const size_t at = RemoteIndex(s) * sl.block_rows;
        const bool cached = flags.cached_handle && !ll;
        int32_t* ids = span_.in_ids.data() + at;
        int64_t* idx = span_.in_idx.data() + at * gs.num_topk;
        int32_t* pos = span_.in_pos.data() + at * R;
        std::memcpy(ids, blk + sl.ids, sizeof(int32_t) * rows);
        // A peer's token ids are its data: checked here, so that a bad one is the peer's
        // fault (DATA_LOSS naming its node), not an argument of this node's ranks.
        const int64_t capacity = ll ? gs.ll_max_tokens_per_rank : gs.max_tokens_per_rank;
        for (int32_t row = 0; row < rows; ++row) {
          if (ids[row] < 0 || ids[row] >= capacity || (row > 0 && ids[row] <= ids[row - 1])) {
            return malformed(n, absl::StrCat("token index ", ids[row], " in row ", row, " of rank ",
                                             s, ", not ascending within [0, ", capacity, ")"));
          }
        }
        if (cached) {
          std::memcpy(pos, blk + sl.pos, sizeof(int32_t) * static_cast<size_t>(rows) * R);
          if (any_masked) kernels::host::DropMaskedRoutes(gs, mask, rows, pos);
        } else {
          std::memcpy(idx, blk + sl.idx, sizeof(int64_t) * static_cast<size_t>(rows) * gs.num_topk);
          if (any_masked) kernels::host::DropMaskedExperts(gs, mask, rows, idx);
        }
        const auto* sc = reinterpret_cast<const float*>(blk + sl.scales);
        span_.dispatch_sources[s] = {
            rows,
            ids,
            blk + sl.x,
            flags.use_fp8 ? sc : nullptr,
            cached ? nullptr : idx,
            flags.dispatch_weights ? reinterpret_cast<const float*>(blk + sl.weights) : nullptr,
            cached ? pos : nullptr};
        span_.ll_sources[s] = {rows,         ids, idx, blk + sl.x, flags.use_fp8 ? sc : nullptr,
                               flags.use_fp8};
      }
      absl::Status st;
      if (!ll) {
        for (int32_t r = first; r < first + Rl; ++r) {
          auto& a = dispatch_args_[r];
          a = {};
          RankRouting& hr = Private(r);
          a.num_tokens = slots[r].num_tokens;
          if (flags.cached_handle) {
            a.cached_send_pos = hr.send_pos.data();
            a.cached_num_recv_tokens = recv_tokens_[r];
          }
          a.recv_capacity = gs.max_recv_tokens();
          a.recv_x = Ptr<void>(r, L.recv_x);
          a.recv_scales = flags.use_fp8 ? Ptr<float>(r, L.recv_scales) : nullptr;
          a.recv_topk_idx = Ptr<int64_t>(r, L.recv_topk_idx);
          a.recv_topk_weights = Ptr<float>(r, L.recv_topk_weights);
          a.recv_tokens_per_expert = Ptr<int32_t>(r, L.recv_tokens_per_expert);
          a.recv_src_info = Ptr<int32_t>(r, L.recv_src_info);
          a.send_pos = hr.send_pos.data();
          a.rank_prefix = Ptr<int32_t>(r, L.rank_prefix);
          a.recv_row_src = gathers_rows() && !gone(r) ? host_->ExchangeRowSources(r) : nullptr;
        }
        kernels::host::DispatchOptions opt;
        opt.fp8 = flags.use_fp8;
        opt.expert_alignment = slots[first].expert_alignment;
        int32_t bad_source = -1;
        {
          KernelScope k(options_.on_kernels);
          st = kernels::host::NodeDispatch(
              gs, opt, flags.dispatch_weights, node, all_counts, span_.dispatch_sources,
              std::span(dispatch_args_).subspan(first, Rl), exec, &bad_source);
        }
        if (!st.ok()) return PeerAtFault(plan.seq, bad_source, st);
        for (int32_t r = first; r < first + Rl; ++r) {
          *Ptr<int32_t>(r, L.recv_count) = dispatch_args_[r].num_recv_tokens;
          out[r].num_recv_tokens = dispatch_args_[r].num_recv_tokens;
          Publish(r, Private(r).send_pos, dispatch_args_[r].num_tokens, R, L.send_pos);
        }
        span_.dispatch_counts.assign(all_counts.begin(), all_counts.end());
        return absl::OkStatus();
      }
      const int b = plan.ll_buffer;
      for (int32_t r = first; r < first + Rl; ++r) {
        auto& a = ll_dispatch_args_[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_x);
        a.topk_idx = Private(r).topk_idx.data();
        a.recv_x = Ptr<void>(r, L.ll_recv_x[b]);
        a.recv_scales = flags.use_fp8 ? Ptr<void>(r, L.ll_recv_scales[b]) : nullptr;
        a.recv_count = Ptr<int32_t>(r, L.ll_recv_count[b]);
        a.recv_src_info = Ptr<int32_t>(r, L.ll_recv_src_info[b]);
        a.handle_pos = Private(r).ll_handle_pos[b].data();
        a.recv_row_src = gathers_rows() && !gone(r) ? host_->ExchangeRowSources(r) : nullptr;
      }
      kernels::host::LowLatencyDispatchOptions opt;
      opt.use_fp8 = flags.use_fp8;
      opt.round_scale = flags.round_scale;
      opt.use_ue8m0 = flags.use_ue8m0;
      int32_t bad_source = -1;
      {
        KernelScope k(options_.on_kernels);
        st = kernels::host::NodeLowLatencyDispatch(gs, opt, node, all_counts, span_.ll_sources,
                                                   std::span(ll_dispatch_args_).subspan(first, Rl),
                                                   exec, &bad_source);
      }
      if (!st.ok()) return PeerAtFault(plan.seq, bad_source, st);
      for (int32_t r = first; r < first + Rl; ++r) {
        Publish(r, Private(r).ll_handle_pos[b], slots[r].num_tokens, gs.num_topk,
                L.ll_handle_pos[b]);
      }
      span_.ll_counts[b].assign(all_counts.begin(), all_counts.end());
      return absl::OkStatus();
    }
    case abi::OpKind::kCombine: {
      const std::vector<int32_t>& dc = span_.dispatch_counts;
      const abi::ExchangeCombineLayout& cl = span_.combine_layout[span_.self];
      if (static_cast<uint64_t>(CombineOffsets(span_.self, dc, R)) > cl.rows) {
        return errors::WithReason(
            absl::DataLossError(absl::StrCat("op ", plan.seq, " of group ", spec().name(), ": ",
                                             span_.combine_off[R],
                                             " combine rows come back here, more than ", cl.rows,
                                             ": the dispatch's counts were wrong")),
            errors::Reason::kPeerProtocol);
      }
      for (int32_t r = 0; r < R; ++r) {
        auto& a = combine_args_[r];
        a = {};
        const int32_t n = NodeOf(r);
        if (n == span_.self) {
          a.num_tokens = routing_tokens_[r];  // 0 for a masked rank (Start).
          a.send_pos = Private(r).send_pos.data();
          a.num_recv_tokens = recv_tokens_[r];
          if (any_masked && !gone(r)) {
            out[r].dropped_pairs =
                kernels::host::DropMaskedRoutes(gs, mask, a.num_tokens, Private(r).send_pos.data());
          }
          a.x = Ptr<const kernels::bf16_bits>(r, L.in_combine_x);
          a.topk_weights =
              flags.combine_weights ? Ptr<const float>(r, L.in_combine_weights) : nullptr;
          a.combined_x = Ptr<kernels::bf16_bits>(r, L.combined_x);
          a.combined_topk_weights =
              flags.combine_weights ? Ptr<float>(r, L.combined_topk_weights) : nullptr;
          a.reduce = gathers_rows() && !gone(r) ? host_->ExchangeReduceTable(r) : nullptr;
          continue;
        }
        if (excluded_[n] || gone(r)) continue;  // Its rows are not read: routes to it dropped.
        const auto [start, cnt] = RowsFromSources(dc, R, r, first, Rl);
        const int32_t i = r - span_.first[n];
        if (const int32_t rows = rows_of(n)[i]; rows != cnt) {
          return malformed(n,
                           absl::StrCat(rows, " combine rows of rank ", r, ", ", cnt, " expected"));
        }
        const int64_t off = span_.combine_off[r];
        const uint8_t* area = CombineArea(n, plan.seq);
        a.x = reinterpret_cast<const kernels::bf16_bits*>(area + cl.x) + off * gs.hidden;
        a.topk_weights = flags.combine_weights
                             ? reinterpret_cast<const float*>(area + cl.weights) + off * gs.num_topk
                             : nullptr;
        a.x_first_row = static_cast<int32_t>(start);
        a.num_recv_tokens = static_cast<int32_t>(start + cnt);
      }
      KernelScope k(options_.on_kernels);
      return kernels::host::Combine(gs, combine_args_, exec);
    }
    case abi::OpKind::kLowLatencyCombine: {
      const std::vector<int32_t>& c = span_.ll_counts[plan.ll_handle_buffer];
      const abi::ExchangeCombineLayout& cl = span_.combine_layout[span_.self];
      if (static_cast<uint64_t>(CombineOffsets(span_.self, c, E)) > cl.ll_rows) {
        return errors::WithReason(
            absl::DataLossError(absl::StrCat("op ", plan.seq, " of group ", spec().name(), ": ",
                                             span_.combine_off[E],
                                             " low-latency combine rows come back here, more than ",
                                             cl.ll_rows, ": the dispatch's counts were wrong")),
            errors::Reason::kPeerProtocol);
      }
      for (int32_t r = 0; r < R; ++r) {
        auto& a = ll_combine_args_[r];
        a = {};
        const int32_t n = NodeOf(r);
        if (n == span_.self) {
          a.num_tokens = slots[r].num_tokens;
          if (any_masked && !gone(r)) {
            out[r].dropped_pairs = kernels::host::DropMaskedExperts(gs, mask, a.num_tokens,
                                                                    Private(r).topk_idx.data());
          }
          a.topk_weights = Ptr<const float>(r, L.in_topk_weights);
          a.handle_pos = Private(r).ll_handle_pos[plan.ll_handle_buffer].data();
          a.x = Ptr<const kernels::bf16_bits>(r, L.in_ll_combine_x);
          a.combined_x = Ptr<kernels::bf16_bits>(r, L.ll_combined_x[plan.ll_out_buffer]);
          a.topk_idx = Private(r).topk_idx.data();
          a.reduce = gathers_rows() && !gone(r) ? host_->ExchangeReduceTable(r) : nullptr;
          continue;
        }
        if (excluded_[n] || gone(r)) continue;  // As for a normal combine.
        const int32_t i = r - span_.first[n];
        for (int32_t j = 0; j < El; ++j) {
          const int32_t e = r * El + j;
          const auto [start, cnt] = RowsFromSources(c, E, e, first, Rl);
          if (const int32_t rows = rows_of(n)[i * El + j]; rows != cnt) {
            return malformed(n, absl::StrCat(rows, " rows of expert ", e, ", ", cnt, " expected"));
          }
          span_.remote_first[e] = static_cast<int32_t>(start);
          span_.remote_rows[e] = static_cast<int32_t>(cnt);
          span_.block_start[e] = span_.combine_off[e];
        }
        a.x = reinterpret_cast<const kernels::bf16_bits*>(CombineArea(n, plan.seq) + cl.x);
        a.x_first_row = span_.remote_first.data() + static_cast<size_t>(r) * El;
        a.x_num_rows = span_.remote_rows.data() + static_cast<size_t>(r) * El;
        a.x_block_start = span_.block_start.data() + static_cast<size_t>(r) * El;
      }
      KernelScope k(options_.on_kernels);
      return kernels::host::LowLatencyCombine(gs, ll_combine_args_, exec);
    }
    default:
      return errors::WithReason(
          absl::UnimplementedError(absl::StrCat(OpName(static_cast<uint32_t>(plan.op)),
                                                " is not run by a group that spans nodes")),
          errors::Reason::kUnsupported);
  }
}

}  // namespace epd
