// NodeExchange's rows on the backend (DESIGN.md §5.5 "Rows on the GPU"): the memory shared
// with its backend's row gather, pack and reduce (the receive region, quantized rows, send
// staging and pack table mapped for it at Init, and handed over with their mappings when the
// backend must free them elsewhere), and the posts held until the backend packed the rows.
#include <chrono>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "daemon/dataplane/exchange/node_exchange.h"

namespace epd {

void NodeExchange::MapGatherMemory() {
  auto map_all = [&](std::span<const std::pair<void*, uint64_t>> memory,
                     std::vector<std::unique_ptr<ExchangeHostMapping>>* maps) {
    for (const auto& [p, bytes] : memory) {
      if (bytes == 0) continue;
      std::unique_ptr<ExchangeHostMapping> m = host_->ExchangeMapHostMemory(p, bytes);
      if (m == nullptr) {
        maps->clear();  // All or none: rows are then copied.
        return;
      }
      maps->push_back(std::move(m));
    }
  };
  // The backend reads rows where the exchange holds them: the peers' in the receive region,
  // a low-latency FP8 dispatch's local ones quantized here.
  const std::pair<void*, uint64_t> gather[] = {
      {span_.recv.data(), span_.recv.size() * sizeof(uint64_t)},
      {span_.quant_x.data(), span_.quant_x.size() * sizeof(kernels::e4m3_bits)},
      {span_.quant_scales.data(), span_.quant_scales.size() * sizeof(float)}};
  map_all(gather, &gather_maps_);
  if (gather_maps_.empty()) return;
  // And writes this node's rows into the send staging from the pack table: a set of its
  // own, so that when it cannot be mapped only the pack stays on the CPU.
  std::vector<std::pair<void*, uint64_t>> pack = {
      {span_.pack_rows.data(), span_.pack_rows.size() * sizeof(kernels::RowSource)}};
  for (std::vector<uint64_t>& send : span_.send) {
    pack.emplace_back(send.data(), send.size() * sizeof(uint64_t));
  }
  map_all(pack, &pack_maps_);
}

std::shared_ptr<void> NodeExchange::TakeMappedMemory() {
  if (gather_maps_.empty() && pack_maps_.empty()) return nullptr;
  struct Mapped {
    std::vector<uint64_t> recv;
    std::vector<kernels::e4m3_bits> quant_x;
    std::vector<float> quant_scales;
    std::vector<kernels::RowSource> pack_rows;
    std::vector<std::vector<uint64_t>> send;
    std::vector<std::unique_ptr<ExchangeHostMapping>> maps, pack_maps;  // Destroyed first.
  };
  auto m = std::make_shared<Mapped>();
  m->recv.swap(span_.recv);
  m->quant_x.swap(span_.quant_x);
  m->quant_scales.swap(span_.quant_scales);
  m->pack_rows.swap(span_.pack_rows);
  m->send.swap(span_.send);
  m->maps.swap(gather_maps_);
  m->pack_maps.swap(pack_maps_);
  return m;
}

void NodeExchange::PostDeferred(uint64_t seq, const absl::Status& status) {
  for (int32_t n = 0; n < span_.num_nodes; ++n) {
    std::vector<transport::WritePiece>& pieces = span_.deferred[n];
    if (pieces.empty()) continue;
    absl::Status st = absl::OkStatus();
    if (status.ok()) {
      st = PostToNode(n, seq, pieces);
    } else {
      // The header (and what follows it in the first piece) with the error; the rows stay.
      SetHeaderStatus(*reinterpret_cast<abi::ExchangeHeader*>(span_.send[n].data()), status);
      st = PostToNode(n, seq, {pieces.data(), 1});
    }
    if (!st.ok() && span_.local_status.ok()) span_.local_status = st;
    pieces.clear();
  }
}

bool NodeExchange::PollPack() {
  absl::Status st = absl::OkStatus();
  bool done = true;
  for (int32_t i = 0; i < local_count() && st.ok(); ++i) {
    if (!span_.packs[i]) continue;
    absl::StatusOr<bool> packed = host_->ExchangeRowsPacked(local_first() + i);
    if (!packed.ok()) {
      st = packed.status();
    } else if (!*packed) {
      done = false;
    } else {
      span_.packs[i] = 0;  // Packed: not asked again.
    }
  }
  if (st.ok() && !done) {
    const auto waited = std::chrono::steady_clock::now() - span_.started;
    if (waited < std::chrono::milliseconds(options_.op_timeout_ms)) return false;
    st = errors::WithReason(
        absl::DeadlineExceededError(absl::StrCat(
            "op ", span_.plan->seq, " of group ", spec().name(),
            ": the GPU did not pack this node's rows into the send staging within op_timeout ",
            options_.op_timeout_ms, " ms; check the GPU (nvidia-smi) and the daemon log")),
        errors::Reason::kGpuTimeout);
  }
  span_.packing = false;
  if (!st.ok() && span_.local_status.ok()) span_.local_status = st;
  PostDeferred(span_.plan->seq, st);
  return true;
}

}  // namespace epd
