// A CUDA group's part of the plane's graceful stop (cuda_group.h "graceful stop",
// CudaDataPlaneImpl::Shutdown; docs/CUDA_BACKEND.md "Stopping"): the program disarmed,
// every request failed, the clients' stagings still to come noted and awaited, and every
// client wait on the group's GPU memory released from the host.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/stream_memops.h"
#include "daemon/dataplane/cuda/cuda_group.h"
#include "epd/kernels/cuda_program.h"
#include "proto/abi/launch_flags.h"

namespace epd {

namespace kc = kernels::cuda;

bool CudaGroup::StagingLanded(PendingStaging& p, std::vector<const CudaRank*>* read) {
  const CudaRank& cr = *p.rank;
  if (*reinterpret_cast<const volatile uint64_t*>(&cr.readback->stop_ready) >= p.seq) return true;
  const auto now = std::chrono::steady_clock::now();
  if (now < p.next_read) return false;
  if (std::find(read->begin(), read->end(), &cr) != read->end()) return false;
  read->push_back(&cr);
  // Read into mapped pinned memory by a kernel (no copy engine on the op path), on the aux
  // stream, which holds only stream memory writes and such reads: it waits for nothing.
  p.next_read = now + std::chrono::milliseconds(2);
  cudaSetDevice(cr.device);
  const absl::Status st =
      kc::ReadWordAsync(reinterpret_cast<const uint64_t*>(cr.ready_flag()),
                        &cr.readback->stop_ready, plane_->EngineOf(cr.device)->aux.get());
  if (!st.ok()) {
    cudaGetLastError();
    return true;  // Cannot be read: nothing to wait for.
  }
  return false;
}

template <typename F>
void CudaGroup::ForEachStreamRank(F&& f) const {
  std::vector<const CudaRank*> seen;  // A shutdown path: allocating is fine.
  auto visit = [&](int32_t r, const std::shared_ptr<CudaRank>& cr) {
    if (!cr || std::find(seen.begin(), seen.end(), cr.get()) != seen.end()) return;
    seen.push_back(cr.get());
    f(r, *cr);
  };
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const auto q = static_cast<int32_t>(r);
    visit(q, ranks_[r]);
    visit(q, standins_[r]);
    visit(q, masked_areas_[r]);
  }
  for (const std::optional<GpuOp>* op : {&gpu_op_, &abandoned_, &program_tail_}) {
    if (!op->has_value()) continue;
    for (size_t r = 0; r < (*op)->ranks.size(); ++r) {
      visit(static_cast<int32_t>(r), (*op)->ranks[r]);
    }
  }
  for (const std::shared_ptr<CudaRank>& cr : stopped_program_ranks_) visit(cr->rank, cr);
}

CudaGroup::StopReport CudaGroup::Stop(const absl::Status& status) {
  StopReport report;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (program_) {
      for (size_t r = 0; r < program_->num_ranks(); ++r) {
        stopped_program_ranks_.push_back(program_->rank(r));
      }
      report.program_disarmed = true;
      DisarmProgram(status, /*stopping=*/true);
    }
    // The running op's kernels end on the shutdown word; a client that has not staged its
    // inputs yet still will, into this group's memory. Noted here, read from the GPU later
    // (StagingsLanded).
    for (const std::optional<GpuOp>* op : {&gpu_op_, &abandoned_}) {
      if (!op->has_value()) continue;
      const GpuOp& o = **op;
      for (size_t r = 0; r < o.ranks.size(); ++r) {
        if (!o.stream_ordered[r] || !o.ranks[r]) continue;
        pending_stagings_.push_back({o.ranks[r], static_cast<int32_t>(r), o.seq, false});
      }
    }
  }
  // Every request completes with `status`; those never launched are noted by
  // OpEndedWithoutLaunch (stopping_).
  report.ops_failed = FailAll(status);
  return report;
}

bool CudaGroup::StagingsLanded(std::vector<std::string>* missed, int32_t* awaited) {
  std::lock_guard<std::mutex> lock(mu_);
  bool all = true;
  std::vector<const CudaRank*> read;  // A shutdown path: allocating is fine.
  int32_t unnamed = 0;
  for (PendingStaging& p : pending_stagings_) {
    if (p.landed) continue;
    if (StagingLanded(p, &read)) {
      p.landed = true;
      continue;
    }
    all = false;
    if (awaited != nullptr) ++*awaited;
    if (missed != nullptr) {
      // Named up to kMaxNamed in all (a client with a full ring has hundreds).
      constexpr size_t kMaxNamed = 8;
      if (missed->size() < kMaxNamed) {
        missed->push_back(absl::StrCat("group ", spec().name(), " rank ", p.r, " op ", p.seq));
      } else {
        ++unnamed;
      }
    }
  }
  if (unnamed > 0) missed->push_back(absl::StrCat("group ", spec().name(), ": ", unnamed, " more"));
  return all;
}

bool CudaGroup::StreamsIdle(std::vector<std::string>* busy) {
  std::lock_guard<std::mutex> lock(mu_);
  bool idle = true;
  ForEachStreamRank([&](int32_t r, const CudaRank& cr) {
    cudaSetDevice(cr.device);
    const cudaError_t err = cudaStreamQuery(cr.stream.get());
    if (err == cudaErrorNotReady) {
      idle = false;
      if (busy != nullptr) busy->push_back(absl::StrCat("group ", spec().name(), " rank ", r));
    } else if (err != cudaSuccess) {
      cudaGetLastError();  // Not sticky: the stream has ended either way.
    }
  });
  // An op graph's streams (op graphs: cuda_group_graphs.cc) are not the ranks' own.
  for (const std::optional<GpuOp>* op : {&gpu_op_, &abandoned_}) {
    if (op->has_value() && GraphStreamsBusy(**op)) {
      idle = false;
      if (busy != nullptr) busy->push_back(absl::StrCat("group ", spec().name(), " op graph"));
    }
  }
  return idle;
}

void CudaGroup::ReleaseClients() {
  std::lock_guard<std::mutex> lock(mu_);
  // The daemon's own ready waits first (a stream memory wait, or a WaitFlagAsync that the
  // shutdown word ended), so its streams can drain: from the host for every rank whose
  // client has not staged (a staged one needs nothing, and its wait kernel may have ended
  // on the shutdown word before it saw the flag), and for every stream memory wait whose
  // `waited` event has not passed, staged or not: `landed` is an earlier reading of a word
  // the client can lower again (ReleaseReadyWait checks the event itself).
  for (std::optional<GpuOp>* op : {&gpu_op_, &abandoned_}) {
    if (!op->has_value()) continue;
    GpuOp& o = **op;
    for (size_t r = 0; r < o.ranks.size(); ++r) {
      const bool staged = std::any_of(pending_stagings_.begin(), pending_stagings_.end(),
                                      [&](const PendingStaging& p) {
                                        return p.landed && p.seq == o.seq && p.rank == o.ranks[r];
                                      });
      if (!staged || !SpinsForReady(o, r)) ReleaseReadyWait(o, r);
      // Settled: the group's destructor must not write ready_seq from the host again.
      o.done_written[r] = true;
    }
  }
  ForEachStreamRank([&](int32_t r, const CudaRank& cr) {
    if (cr.client_launched) return;  // Its client waits on no done word of the daemon's.
    cudaSetDevice(cr.device);
    // From the aux stream, not behind whatever the rank's own stream still holds
    // (kReleasedSeq passes every wait, shm_abi.h). A write the rank's stream still holds
    // (a kernel's done store, FailAll's done_seq = seq) can land after it and lower the
    // word again: Shutdown calls this once more when the streams are idle.
    cudaStream_t aux = plane_->EngineOf(cr.device)->aux.get();
    absl::Status st = StreamWriteValue64(aux, cr.done_flag(), abi::kReleasedSeq);
    const bool program_rank =
        std::any_of(stopped_program_ranks_.begin(), stopped_program_ranks_.end(),
                    [&](const std::shared_ptr<CudaRank>& p) { return p.get() == &cr; });
    if (st.ok() && program_rank) {
      st = StreamWriteValue64(aux, cr.flag(abi::kProgramDoneOffset), abi::kProgramReleased);
    }
    if (!st.ok()) {
      EngineLog()->error("group {} rank {}: releasing its client's waits at shutdown failed: {}",
                         spec().name(), r, st.ToString());
    }
  });
  cudaGetLastError();
}

}  // namespace epd
