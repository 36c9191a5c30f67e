// The host backend's data plane: shm endpoints, one engine, group ops by kernels/host. The
// lockstep part is LockstepGroup (daemon/dataplane/lockstep_group.h); this file adds the
// data area in each endpoint's shm region and runs each op on the engine thread.
#include "daemon/dataplane/host/host_data_plane.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/os/shm_region.h"
#include "common/status_macros.h"
#include "daemon/dataplane/engine_host.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

using kernels::EndpointLayout;

/// Brackets an op's calls into kernels/host for HostDataPlaneOptions::on_kernels.
class KernelScope {
 public:
  explicit KernelScope(const std::function<void(bool)>& hook) : hook_(hook) {
    if (hook_) hook_(true);
  }
  ~KernelScope() {
    if (hook_) hook_(false);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  const std::function<void(bool)>& hook_;
};

class HostGroup;

/// One attached rank's daemon-private memory on the host backend. Its shm region is
/// client-writable, so nothing there is read as an index or size: the op's topk_idx is
/// copied from it once into `topk_idx` and checked there, and the routing state that the
/// combine and a cached re-dispatch read as row indices (send_pos, the low-latency handle
/// positions) is kept here. After a dispatch the routing is published into the region's
/// send_pos / ll_handle_pos regions for the client to read; the daemon never reads them
/// back. Sized at attach: an op allocates nothing.
struct HostRank : RankResources {
  std::vector<int64_t> topk_idx;  ///< [max(M, Mll), K]: the current op's checked copy.
  std::vector<int32_t> send_pos;  ///< [M, R]: the routing of the last normal dispatch.
  std::vector<int32_t> ll_handle_pos[kernels::kLowLatencyBuffers];  ///< [Mll, K] per buffer.

  /// The bytes a HostRank of `s` holds.
  static uint64_t BytesFor(const kernels::GroupShape& s) {
    return static_cast<uint64_t>(s.max_input_tokens()) * s.num_topk * sizeof(int64_t) +
           static_cast<uint64_t>(s.max_tokens_per_rank) * s.num_ranks * sizeof(int32_t) +
           uint64_t{kernels::kLowLatencyBuffers} * s.ll_max_tokens_per_rank * s.num_topk *
               sizeof(int32_t);
  }

  explicit HostRank(const kernels::GroupShape& s)
      : topk_idx(static_cast<size_t>(s.max_input_tokens()) * s.num_topk),
        send_pos(static_cast<size_t>(s.max_tokens_per_rank) * s.num_ranks) {
    for (auto& h : ll_handle_pos) {
      h.resize(static_cast<size_t>(s.ll_max_tokens_per_rank) * s.num_topk);
    }
  }
};

class HostDataPlaneImpl : public DataPlane {
 public:
  explicit HostDataPlaneImpl(const HostDataPlaneOptions& options);
  ~HostDataPlaneImpl() override { Shutdown(); }

  absl::Status Init();
  std::string backend_name() const override { return "host"; }
  uint64_t BytesPerRank(const v1::GroupSpec& spec) const override {
    return abi::ComputeEndpointShmLayout(EndpointLayout::Compute(ShapeOf(spec)).total_bytes)
        .total_bytes;
  }
  /// The kernel scratch the group reserves at creation and every rank's HostRank: both in
  /// host memory, as the endpoints are.
  uint64_t GroupPrivateBytes(const v1::GroupSpec& spec) const override {
    const kernels::GroupShape shape = ShapeOf(spec);
    return kernels::host::HostScratch::ReservedBytes(shape, options_.host_threads) +
           static_cast<uint64_t>(spec.num_ranks()) * HostRank::BytesFor(shape);
  }
  absl::StatusOr<uint64_t> FreeBytes(const std::string&) const override { return ShmFreeBytes(); }
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override;
  void Shutdown() override;

  const HostDataPlaneOptions& options() const { return options_; }
  /// kernels/host's worker threads, shared by every group (all run on the one engine
  /// thread, one op at a time).
  kernels::host::HostWorkerPool& kernel_pool() { return kernel_pool_; }
  const ShmRegion& doorbell() const { return engine_.doorbell(); }
  void Unregister(HostGroup* group) { engine_.Remove(group); }

 private:
  HostDataPlaneOptions options_;
  kernels::host::HostWorkerPool kernel_pool_;  // Outlives engine_ (declared first).
  EngineHost<HostGroup> engine_;               // The one engine, serving every group.
  std::atomic<bool> shut_down_{false};
};

class HostGroup : public LockstepGroup {
 public:
  HostGroup(HostDataPlaneImpl* plane, const v1::GroupSpec& spec)
      : LockstepGroup(spec, LockstepOptionsOf(plane->options())),
        plane_(plane),
        layout_args_(spec.num_ranks()),
        dispatch_args_(spec.num_ranks()),
        combine_args_(spec.num_ranks()),
        ll_dispatch_args_(spec.num_ranks()),
        ll_combine_args_(spec.num_ranks()) {
    // Scratch for the group's largest ops, and the plane's kernel threads, made here so
    // that no op allocates (README "Hot path").
    const int threads = plane->options().host_threads;
    kernel_scratch_.Reserve(shape(), threads);
    plane->kernel_pool().Start(threads);
  }
  ~HostGroup() override { plane_->Unregister(this); }

 protected:
  uint64_t ShmDataBytes() const override { return layout().total_bytes; }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t rank,
                                                             const std::string& gpu_uuid,
                                                             v1::LaunchMode launch_mode,
                                                             v1::EndpointInfo* info) override;
  /// Runs the op synchronously on the engine thread (always true), with the per-rank
  /// kernel arguments kept in the group: no allocation outside kernels/host.
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                   std::span<RankOutcome> outcomes) override {
    Execute(plan, slots, outcomes);
    return true;
  }
  /// The plane's one doorbell page serves every rank.
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t /*rank*/) const override {
    return plane_->doorbell().DupFd();
  }
  /// The host backend has no streams: a stream-ordered request (kFlagStreamOrdered,
  /// CUDA daemon-launched mode) is INVALID_ARGUMENT.
  absl::Status CheckRequest(int32_t /*rank*/, const abi::RequestSlot& slot) const override {
    if (slot.flags & abi::kFlagStreamOrdered) {
      return absl::InvalidArgumentError(absl::StrCat(
          OpName(slot.op), ": request flag kFlagStreamOrdered (0x", absl::Hex(slot.flags),
          ") needs the CUDA backend; the host backend has no CUDA streams to order on"));
    }
    return absl::OkStatus();
  }

 private:
  void Execute(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
               std::span<RankOutcome> out);
  /// Region `r` of rank `rank`'s data area in its shm region (client-writable: outputs,
  /// and inputs read as values only).
  template <typename T>
  T* Ptr(int rank, const kernels::Region& r) const {
    return reinterpret_cast<T*>(endpoint(rank)->shm_data() + r.offset);
  }
  /// Rank `rank`'s private memory (HostRank).
  HostRank& Private(int rank) const { return static_cast<HostRank&>(*endpoint(rank)->backend); }
  /// Copies rank `rank`'s staged topk_idx [T, K] out of its shm region once, into its
  /// private copy, and checks the copy (CheckTopkIdx); the op reads only the copy.
  absl::StatusOr<const int64_t*> TakeTopkIdx(int rank, int32_t num_tokens) const;
  /// Copies `rows` rows of `row_elems` int32 from rank `rank`'s private routing `src` to
  /// region `dst` of its shm region, for the client to read (never read back).
  void Publish(int rank, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
               const kernels::Region& dst) const;

  HostDataPlaneImpl* plane_;
  // Each op kind's kernel arguments, [R], filled in per op (sized once: README "Hot path").
  std::vector<kernels::host::LayoutRankArgs> layout_args_;
  std::vector<kernels::host::DispatchRankArgs> dispatch_args_;
  std::vector<kernels::host::CombineRankArgs> combine_args_;
  std::vector<kernels::host::LowLatencyDispatchRankArgs> ll_dispatch_args_;
  std::vector<kernels::host::LowLatencyCombineRankArgs> ll_combine_args_;
  // kernels/host's temporaries for this group's ops (one op at a time: the engine thread).
  kernels::host::HostScratch kernel_scratch_;
};

// ---------------------------------------------------------------------------------------

HostDataPlaneImpl::HostDataPlaneImpl(const HostDataPlaneOptions& options)
    : options_(options), kernel_pool_(options.on_kernel_thread_start) {}

absl::Status HostDataPlaneImpl::Init() {
  return engine_.Start(options_.engine_idle_us, options_.on_engine_start);
}

absl::StatusOr<std::unique_ptr<DataPlaneGroup>> HostDataPlaneImpl::CreateGroup(
    const v1::GroupSpec& spec) {
  if (shut_down_.load()) return absl::UnavailableError("epd is shutting down");
  // Join checked GroupPrivateBytes against free memory; memory taken by others since then
  // can still make the reservation fail, which must not cross gRPC as an exception.
  std::unique_ptr<HostGroup> group;
  try {
    group = std::make_unique<HostGroup>(this, spec);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group \"", spec.name(), "\": out of host memory reserving its ", GroupPrivateBytes(spec),
        " bytes of kernel scratch and routing state; lower num_ranks or max_tokens_per_rank, "
        "or free memory"));
  }
  engine_.Add(group.get());
  return std::unique_ptr<DataPlaneGroup>(std::move(group));
}

void HostDataPlaneImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  engine_.Stop();
  engine_.ForEach([](HostGroup* g) { g->FailAll(absl::UnavailableError("epd is shutting down")); });
}

// ---------------------------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<RankResources>> HostGroup::PrepareRank(
    int32_t /*rank*/, const std::string& /*gpu_uuid*/, v1::LaunchMode launch_mode,
    v1::EndpointInfo* info) {
  if (launch_mode == v1::LAUNCH_MODE_CLIENT) {
    return absl::FailedPreconditionError(
        "launch_mode LAUNCH_MODE_CLIENT: client-launched mode needs the CUDA backend; the host "
        "backend runs every op in the daemon (use LAUNCH_MODE_DAEMON or leave it unspecified)");
  }
  info->set_backend("host");
  info->set_launch_mode(v1::LAUNCH_MODE_DAEMON);
  return std::shared_ptr<RankResources>(std::make_shared<HostRank>(shape()));
}

absl::StatusOr<const int64_t*> HostGroup::TakeTopkIdx(int rank, int32_t num_tokens) const {
  HostRank& hr = Private(rank);
  const kernels::GroupShape& gs = shape();
  // num_tokens comes from the validated slot: at most max(M, Mll) rows.
  const size_t n = static_cast<size_t>(std::max(num_tokens, 0)) * gs.num_topk;
  if (n > hr.topk_idx.size()) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": num_tokens ", num_tokens,
                                            " exceeds the private topk_idx copy"));
  }
  std::memcpy(hr.topk_idx.data(), Ptr<const int64_t>(rank, layout().in_topk_idx),
              n * sizeof(int64_t));
  EPD_RETURN_IF_ERROR(kernels::host::CheckTopkIdx(gs, rank, num_tokens, hr.topk_idx.data()));
  return hr.topk_idx.data();
}

void HostGroup::Publish(int rank, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
                        const kernels::Region& dst) const {
  const uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(rows, 0)) *
                         static_cast<uint64_t>(row_elems) * sizeof(int32_t);
  std::memcpy(Ptr<int32_t>(rank, dst), src.data(),
              std::min({bytes, dst.bytes, src.size() * sizeof(int32_t)}));
}

void HostGroup::Execute(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                        std::span<RankOutcome> out) {
  const int R = static_cast<int>(slots.size());
  const abi::OpKind op = plan.op;
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);  // Agreed by every rank.
  const kernels::GroupShape& gs = shape();
  kernels::host::HostExecution exec{plane_->options().host_threads, &plane_->kernel_pool(),
                                    &kernel_scratch_};
  auto fail_all = [&](const absl::Status& st) {
    for (auto& o : out) o.status = st;
  };
  const EndpointLayout& L = layout();
  switch (op) {
    case abi::OpKind::kGetDispatchLayout: {
      for (int r = 0; r < R; ++r) {
        auto& a = layout_args_[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.num_tokens_per_rank = Ptr<int32_t>(r, L.layout_tokens_per_rank);
        a.num_tokens_per_expert = Ptr<int32_t>(r, L.layout_tokens_per_expert);
        a.is_token_in_rank = Ptr<uint8_t>(r, L.layout_is_token_in_rank);
        absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens);
        out[r].status = idx.status();
        if (idx.ok()) {
          a.topk_idx = *idx;
          KernelScope k(plane_->options().on_kernels);
          out[r].status = kernels::host::GetDispatchLayout(gs, a, exec);
        }
      }
      return;
    }
    case abi::OpKind::kDispatch: {
      const bool cached = flags.cached_handle;
      const bool fp8 = flags.use_fp8;
      std::vector<kernels::host::DispatchRankArgs>& args = dispatch_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        const LockstepEndpoint& ep = *endpoint(r);
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const void>(r, L.in_x);
        a.x_scales = fp8 ? Ptr<const float>(r, L.in_scales) : nullptr;
        a.topk_weights = flags.dispatch_weights ? Ptr<const float>(r, L.in_topk_weights) : nullptr;
        HostRank& hr = Private(r);
        if (cached) {
          a.cached_send_pos = hr.send_pos.data();  // Rewritten in place (memmove).
          a.cached_num_recv_tokens = ep.handles.num_recv_tokens();
        } else {
          absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens);
          if (!idx.ok()) return fail_all(idx.status());
          a.topk_idx = *idx;
        }
        a.recv_capacity = gs.max_recv_tokens();
        a.recv_x = Ptr<void>(r, L.recv_x);
        a.recv_scales = fp8 ? Ptr<float>(r, L.recv_scales) : nullptr;
        a.recv_topk_idx = Ptr<int64_t>(r, L.recv_topk_idx);
        a.recv_topk_weights = Ptr<float>(r, L.recv_topk_weights);  // zeros without weights
        a.recv_tokens_per_expert = Ptr<int32_t>(r, L.recv_tokens_per_expert);
        a.recv_src_info = Ptr<int32_t>(r, L.recv_src_info);
        a.send_pos = hr.send_pos.data();
        a.rank_prefix = Ptr<int32_t>(r, L.rank_prefix);
      }
      kernels::host::DispatchOptions opt;
      opt.fp8 = fp8;
      opt.expert_alignment = slots[0].expert_alignment;
      absl::Status st;
      {
        KernelScope k(plane_->options().on_kernels);
        st = kernels::host::Dispatch(gs, opt, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      for (int r = 0; r < R; ++r) {
        *Ptr<int32_t>(r, L.recv_count) = args[r].num_recv_tokens;
        out[r].num_recv_tokens = args[r].num_recv_tokens;
        Publish(r, Private(r).send_pos, args[r].num_tokens, R, L.send_pos);
      }
      return;
    }
    case abi::OpKind::kCombine: {
      const bool weights = flags.combine_weights;
      std::vector<kernels::host::CombineRankArgs>& args = combine_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        const LockstepEndpoint& ep = *endpoint(r);
        a.num_tokens = ep.handles.routing_tokens();
        a.send_pos = Private(r).send_pos.data();
        a.num_recv_tokens = ep.handles.num_recv_tokens();
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_combine_x);
        a.topk_weights = weights ? Ptr<const float>(r, L.in_combine_weights) : nullptr;
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.combined_x);
        a.combined_topk_weights = weights ? Ptr<float>(r, L.combined_topk_weights) : nullptr;
      }
      absl::Status st;
      {
        KernelScope k(plane_->options().on_kernels);
        st = kernels::host::Combine(gs, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      return;
    }
    case abi::OpKind::kLowLatencyDispatch: {
      const int b = plan.ll_buffer;
      std::vector<kernels::host::LowLatencyDispatchRankArgs>& args = ll_dispatch_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_x);
        a.recv_x = Ptr<void>(r, L.ll_recv_x[b]);
        a.recv_scales = flags.use_fp8 ? Ptr<void>(r, L.ll_recv_scales[b]) : nullptr;
        a.recv_count = Ptr<int32_t>(r, L.ll_recv_count[b]);
        a.recv_src_info = Ptr<int32_t>(r, L.ll_recv_src_info[b]);
        a.handle_pos = Private(r).ll_handle_pos[b].data();
        absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens);
        if (!idx.ok()) return fail_all(idx.status());
        a.topk_idx = *idx;
      }
      kernels::host::LowLatencyDispatchOptions opt;
      opt.use_fp8 = flags.use_fp8;
      opt.round_scale = flags.round_scale;
      opt.use_ue8m0 = flags.use_ue8m0;
      absl::Status st;
      {
        KernelScope k(plane_->options().on_kernels);
        st = kernels::host::LowLatencyDispatch(gs, opt, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      for (int r = 0; r < R; ++r) {
        Publish(r, Private(r).ll_handle_pos[b], args[r].num_tokens, gs.num_topk,
                L.ll_handle_pos[b]);
      }
      return;
    }
    case abi::OpKind::kLowLatencyCombine: {
      const int hb = plan.ll_handle_buffer;
      const int ob = plan.ll_out_buffer;
      std::vector<kernels::host::LowLatencyCombineRankArgs>& args = ll_combine_args_;
      for (int r = 0; r < R; ++r) {
        auto& a = args[r];
        a = {};
        a.num_tokens = slots[r].num_tokens;
        a.topk_weights = Ptr<const float>(r, L.in_topk_weights);
        a.handle_pos = Private(r).ll_handle_pos[hb].data();
        a.x = Ptr<const kernels::bf16_bits>(r, L.in_ll_combine_x);
        a.combined_x = Ptr<kernels::bf16_bits>(r, L.ll_combined_x[ob]);
        absl::StatusOr<const int64_t*> idx = TakeTopkIdx(r, a.num_tokens);
        if (!idx.ok()) return fail_all(idx.status());
        a.topk_idx = *idx;
      }
      absl::Status st;
      {
        KernelScope k(plane_->options().on_kernels);
        st = kernels::host::LowLatencyCombine(gs, args, exec);
      }
      if (!st.ok()) return fail_all(st);
      return;
    }
    default:
      return fail_all(absl::InternalError(absl::StrCat(
          "host backend: op kind ", OpName(static_cast<uint32_t>(op)), " is not run by StartOp")));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> MakeHostDataPlane(const HostDataPlaneOptions& options) {
  auto plane = std::make_unique<HostDataPlaneImpl>(options);
  EPD_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

}  // namespace epd
