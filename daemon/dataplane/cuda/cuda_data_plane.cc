// The CUDA backend's data plane (see cuda_data_plane.h, cuda_plane.h): GPU discovery,
// peer access, eager kernel loading, one engine per GPU, the GPU claim table.
#include "daemon/dataplane/cuda/cuda_data_plane.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/control/spec_validation.h"
#include "daemon/dataplane/cuda/cuda_group.h"
#include "daemon/dataplane/cuda/cuda_plane.h"
#include "daemon/dataplane/cuda/cuda_rank.h"
#include "daemon/dataplane/exchange/node_exchange.h"
#include "daemon/dataplane/gpu_drain.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/gpu/gpu_inventory.h"
#include "daemon/peer/peer_mesh.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using kernels::EndpointLayout;

// Before the CUDA runtime starts in this process: enough hardware queues that the streams
// of up to 32 ranks run side by side (shared queues would put false dependencies between
// kernels that spin on each other), and eager module loading (DESIGN.md §3.2). setenv does
// not override a value the operator set.
const bool kCudaEnvironmentSet = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  return true;
}();

}  // namespace

uint64_t CudaDataPlaneImpl::BytesPerRank(const v1::GroupSpec& spec) const {
  // cudaMalloc granularity is 2 MiB.
  const uint64_t bytes = EndpointLayout::Compute(ShapeOf(spec)).total_bytes;
  return (bytes + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
}

uint64_t CudaDataPlaneImpl::GroupPrivateBytes(const v1::GroupSpec& spec) const {
  if (spec.nodes_size() < 2) return 0;
  const kernels::GroupShape shape = ShapeOf(spec);
  int32_t most_ranks = 0;  // Of any node: the mirrors this daemon may hold.
  for (const v1::NodeSpec& n : spec.nodes()) most_ranks = std::max(most_ranks, n.num_ranks());
  return kernels::host::HostScratch::ReservedBytes(shape, options_.host_threads) +
         static_cast<uint64_t>(most_ranks) * CudaRankMirror::BytesFor(shape) +
         NodeExchangeBytes(spec, shape);
}

v1::LaunchMode CudaDataPlaneImpl::DefaultLaunchMode(const v1::GroupSpec& spec) const {
  // Across nodes the exchange runs in the daemon either way (DESIGN.md §5.5); daemon-
  // launched copies the op's rows in one daemon kernel per rank, while client-launched adds
  // a spinning kernel per rank on the client's stream and its command round trip: the
  // default stays daemon-launched, client-launched is for CUDA graphs (asked for by name).
  if (spec.nodes_size() >= 2) return v1::LAUNCH_MODE_DAEMON;
  // Rank masking needs the daemon to run a masked rank's part of each op (its client may be
  // dead): only daemon-launched groups mask (GroupRegistry::Join refuses client-launched).
  if (spec.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK) return v1::LAUNCH_MODE_DAEMON;
  if (static_cast<size_t>(spec.num_ranks()) <= uuids_.size()) return v1::LAUNCH_MODE_CLIENT;
  return DetectMps().active ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON;
}

absl::Status CudaDataPlaneImpl::Init() {
  (void)kCudaEnvironmentSet;
  EPD_ASSIGN_OR_RETURN(GpuInventory inventory, GpuInventory::Discover(options_.gpu_uuids));
  if (inventory.empty()) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "the CUDA data plane needs a GPU: ", inventory.reason())),
                              errors::Reason::kCudaNoDevice);
  }
  auto log = EngineLog();
  kernel_ready_wait_ = options_.kernel_ready_wait.value_or(inventory.mps().active);
  log->info("daemon-launched low-latency ops wait for their client's ready flag {}",
            kernel_ready_wait_ ? "in a one-warp kernel (MPS or forced)"
                               : "with cuStreamWaitValue64 (no MPS: contexts time-slice)");
  // EPD_CUDA_OP_GRAPHS=1 turns op graphs on for every plane of the process (a test and
  // bench aid: the GPU suite runs through them without editing each test's options).
  if (const char* v = std::getenv("EPD_CUDA_OP_GRAPHS"); v != nullptr && std::strcmp(v, "1") == 0) {
    options_.op_graphs = true;
  }
  // EPD_CUDA_FUSED_LAUNCH=0 turns fused launches off for every plane of the process (an A/B
  // aid for the GPU suite and the bench, as EPD_CUDA_OP_GRAPHS).
  if (const char* v = std::getenv("EPD_CUDA_FUSED_LAUNCH");
      v != nullptr && std::strcmp(v, "0") == 0) {
    options_.fused_launch = false;
  }
  log->info("daemon-launched low-latency ops under MPS: {}",
            options_.fused_launch ? "one fused launch per GPU (cuda_fused_launch)"
                                  : "each rank's own launches (cuda_fused_launch off)");
  if (options_.op_graphs) {
    log->info(
        "daemon-launched low-latency ops{} go through per-GPU op graphs (one launch per GPU "
        "per op)",
        kernel_ready_wait_ ? "" : " would (under kernel_ready_wait only; off here)");
  }
  std::vector<std::string> unsupported;
  for (const v1::GpuInfo& g : inventory.gpus()) {
    if (g.supported()) {
      uuids_[g.ordinal()] = g.uuid();
    } else {
      unsupported_[g.uuid()] = g.unsupported_reason();
      unsupported.push_back(g.unsupported_reason());
      log->warn("{}: it serves no rank", g.unsupported_reason());
    }
  }
  if (uuids_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("the CUDA data plane has no supported GPU: ",
                                                      absl::StrJoin(unsupported, "; ")));
  }
  // Peer access among every pair of GPUs that supports it.
  for (const auto& [a, ua] : uuids_) {
    for (const auto& [b, ub] : uuids_) {
      if (a == b) continue;
      int can = 0;
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaDeviceCanAccessPeer(&can, a, b)));
      if (!can) {
        log->warn("GPU {} cannot access GPU {}: a group cannot span them", a, b);
        continue;
      }
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(a)));
      cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
      } else {
        EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(err));
      }
      peer_[a].insert(b);
    }
  }
  // The shutdown word the kernels' spins poll (portable: mapped in every GPU's context).
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(uuids_.begin()->first)));
  EPD_ASSIGN_OR_RETURN(shutdown_word_, AllocatePinnedArray<uint32_t>(
                                           1, cudaHostAllocPortable | cudaHostAllocMapped));
  // Eager kernel loading and one engine per GPU, every engine in engines_ before any
  // starts: an engine thread walks engines_ (AllEnginesQuiescent), which is not changed
  // after this.
  gpu_holder_.assign(static_cast<size_t>(uuids_.rbegin()->first) + 1, nullptr);
  for (const auto& [device, uuid] : uuids_) {
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaFree(nullptr)));  // Creates the context.
    EPD_RETURN_IF_ERROR(kc::PreloadKernels());
    auto engine = std::make_unique<GpuEngine>();
    engine->device = device;
    EPD_ASSIGN_OR_RETURN(engine->aux, CreateStream());
    engine->host.SetDeferredRelease(&deferred_release_, [this] { return AllEnginesQuiescent(); });
    engines_[device] = std::move(engine);
  }
  for (auto& [device, engine] : engines_) {
    GpuEngine* e = engine.get();
    EPD_RETURN_IF_ERROR(e->host.Start(options_.engine_idle_us, options_.on_engine_start,
                                      [e] { cudaSetDevice(e->device); }));
    log->info("CUDA data plane: GPU {} ({}) ready: kernels loaded, engine started", device,
              uuids_.at(device));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDataPlaneImpl::DeviceOf(const std::string& gpu_uuid) const {
  if (gpu_uuid.empty()) return uuids_.begin()->first;
  for (const auto& [device, uuid] : uuids_) {
    if (uuid == gpu_uuid) return device;
  }
  if (auto it = unsupported_.find(gpu_uuid); it != unsupported_.end()) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat("gpu_uuid: ", it->second)),
                              errors::Reason::kGpuArchUnsupported);
  }
  return errors::WithReason(
      absl::NotFoundError(
          absl::StrCat("gpu_uuid: \"", gpu_uuid, "\" is not a GPU of this CUDA data plane")),
      errors::Reason::kGpuNotFound);
}

absl::StatusOr<uint64_t> CudaDataPlaneImpl::FreeBytes(const std::string& gpu_uuid) const {
  EPD_ASSIGN_OR_RETURN(int device, DeviceOf(gpu_uuid));
  size_t free_bytes = 0, total = 0;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemGetInfo(&free_bytes, &total)));
  return static_cast<uint64_t>(free_bytes);
}

absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CudaDataPlaneImpl::CreateGroup(
    const v1::GroupSpec& spec, const GroupCreateOptions& options) {
  if (shut_down_.load()) {
    return errors::WithReason(absl::UnavailableError("epd is shutting down"),
                              errors::Reason::kDaemonDraining);
  }
  // The registry checked already (Join); a group past a kernel limit must never exist.
  EPD_RETURN_IF_ERROR(ValidateGroupSpecForBackend(spec, backend_name()));
  const bool spans = spec.nodes_size() >= 2;
  EPD_ASSIGN_OR_RETURN(SpanTransport span_transport,
                       TransportForSpan(spec, options_.peer_mesh, options_.transports));
  std::unique_ptr<CudaGroup> group;
  try {
    group = std::make_unique<CudaGroup>(this, spec);
    if (spans) {
      group->MakeExchange(options_.peer_mesh->JoinSecretDigest(spec.name(), options.join_secret),
                          std::move(span_transport));
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "group \"", spec.name(), "\": out of host memory reserving its ", GroupPrivateBytes(spec),
        " bytes of kernel scratch and exchange buffers; lower num_ranks or max_tokens_per_rank, "
        "or free memory"));
  }
  return std::unique_ptr<DataPlaneGroup>(std::move(group));
}

bool CudaDataPlaneImpl::TryClaimGpus(std::span<const int> devices, const CudaGroup* group) {
  std::lock_guard<std::mutex> lock(claim_mu_);
  for (int d : devices) {
    const CudaGroup* holder = gpu_holder_[static_cast<size_t>(d)];
    if (holder != nullptr && holder != group) return false;
  }
  for (int d : devices) gpu_holder_[static_cast<size_t>(d)] = group;
  return true;
}

void CudaDataPlaneImpl::ReleaseGpus(const CudaGroup* group) {
  std::lock_guard<std::mutex> lock(claim_mu_);
  for (const CudaGroup*& holder : gpu_holder_) {
    if (holder == group) holder = nullptr;
  }
}

bool CudaDataPlaneImpl::AllEnginesQuiescent() {
  if (groups_ending_.load() != 0) return false;
  // Memory that waits long says which group keeps the GPU busy (once a minute at most); the
  // name is copied while the engine's list still holds the group.
  constexpr auto kWarnAfter = std::chrono::seconds(30);
  constexpr auto kWarnEvery = std::chrono::seconds(60);
  const auto waited = deferred_release_.pending_for();
  const auto now = std::chrono::steady_clock::now();
  const bool warn = waited >= kWarnAfter && now - last_release_warning_ >= kWarnEvery;
  std::string busy;
  for (auto& [device, e] : engines_) {
    auto name_it = [&](CudaGroup& g) {
      if (warn) busy = g.spec().name();
    };
    if (e->host.FirstBusyGroup(name_it) == nullptr) continue;
    if (warn) {
      last_release_warning_ = now;
      EngineLog()->warn(
          "{} item(s) of GPU memory of ranks that left or groups that ended have waited "
          "{} s to be freed: group {} has had work on a GPU at every check (an armed "
          "graph-mode program keeps it so); they are freed once no group has",
          deferred_release_.pending(),
          std::chrono::duration_cast<std::chrono::seconds>(waited).count(), busy);
    }
    return false;
  }
  return true;
}

bool CudaDataPlaneImpl::AuxStreamsIdle(std::vector<std::string>* busy) {
  bool idle = true;
  for (auto& [device, e] : engines_) {
    cudaSetDevice(device);
    const cudaError_t err = cudaStreamQuery(e->aux.get());
    if (err == cudaErrorNotReady) {
      idle = false;
      if (busy != nullptr) busy->push_back(absl::StrCat("the engine aux stream of GPU ", device));
    } else if (err != cudaSuccess) {
      cudaGetLastError();
    }
  }
  return idle;
}

void CudaDataPlaneImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  if (engines_.empty()) return;  // Init failed before any engine: nothing ran.
  const absl::Time begin = absl::Now();
  // No engine launches or polls from here on.
  for (auto& [device, e] : engines_) e->host.Stop();
  // Every spin of the daemon's kernels ends (as a timeout: the op's failure path, which
  // still writes done and its status) within about 2 * kAbortPollNs of this store.
  if (shutdown_word_) {
    std::atomic_ref<uint32_t>(*shutdown_word_).store(1, std::memory_order_seq_cst);
  }
  const absl::Status why = absl::UnavailableError("epd is shutting down");
  GpuDrainReport report;
  for (auto& [device, e] : engines_) {
    e->host.ForEach([&](CudaGroup* g) {
      const CudaGroup::StopReport s = g->Stop(why);
      ++report.groups;
      report.ops_failed += s.ops_failed;
      report.programs_disarmed += s.program_disarmed ? 1 : 0;
    });
  }
  // True when `pred(g)` holds for every group of every engine (each list locked meanwhile,
  // so no group is destroyed under it).
  auto every_group = [&](auto&& pred) {
    bool all = true;
    for (auto& [device, e] : engines_) {
      e->host.WithGroups([&](std::span<CudaGroup* const> groups) {
        for (CudaGroup* g : groups) all = pred(g) && all;
      });
    }
    return all;
  };
  // The clients' staging kernels still to come write into the groups' memory, which goes
  // with epd: wait for them (bounded), and for the daemon's streams. The first pass only
  // enqueues the reads of the ready words; the count is taken once they have run.
  every_group([](CudaGroup* g) { return g->StagingsLanded(); });
  PollUntil([&] { return AuxStreamsIdle(nullptr); }, absl::Now() + absl::Milliseconds(50));
  every_group([&](CudaGroup* g) { return g->StagingsLanded(nullptr, &report.stagings_awaited); });
  PollUntil(
      [&] {
        return every_group([](CudaGroup* g) { return g->StagingsLanded() && g->StreamsIdle(); });
      },
      begin + kGpuDrainStagingBound);
  report.staging_wait = absl::Now() - begin;
  every_group([&](CudaGroup* g) {
    g->StagingsLanded(&report.stagings_missed);
    g->ReleaseClients();
    return true;
  });
  const bool idle = PollUntil(
      [&] {
        return AuxStreamsIdle(nullptr) &&
               every_group([](CudaGroup* g) { return g->StreamsIdle(); });
      },
      absl::Now() + kGpuDrainIdleBound);
  if (!idle) {
    every_group([&](CudaGroup* g) { return g->StreamsIdle(&report.busy); });
    AuxStreamsIdle(&report.busy);
  }
  // Again, now that nothing the ranks' streams held can land after the release and lower a
  // done word (a done store of a kernel that ran late, FailAll's done_seq = seq).
  every_group([](CudaGroup* g) {
    g->ReleaseClients();
    return true;
  });
  PollUntil([&] { return AuxStreamsIdle(nullptr); }, absl::Now() + absl::Milliseconds(20));
  report.took = absl::Now() - begin;
  if (report.busy.empty() && report.stagings_missed.empty()) {
    EngineLog()->info("shutdown: {}", DescribeGpuDrain(report));
  } else {
    EngineLog()->warn("shutdown: {}", DescribeGpuDrain(report));
  }
}

absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const CudaDataPlaneOptions& options) {
  auto plane = std::make_unique<CudaDataPlaneImpl>(options);
  EPD_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

}  // namespace epd
