// The CUDA backend's data plane (see cuda_data_plane.h): device endpoints exported by
// CUDA IPC, one engine per GPU, daemon-launched group ops on one stream per rank.
#include "daemon/dataplane/cuda/cuda_data_plane.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_handles.h"
#include "common/os/shm_region.h"
#include "common/status_macros.h"
#include "daemon/control/spec_validation.h"
#include "daemon/dataplane/engine.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/gpu/gpu_inventory.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_program.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"
#include "spdlog/spdlog.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using Clock = std::chrono::steady_clock;
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

/// Extra time the engine gives the GPU past op_timeout before it gives up on an op whose
/// kernels (themselves bounded by op_timeout) have not finished.
constexpr auto kGpuGrace = std::chrono::seconds(5);

/// Graph mode: program instances kept enqueued ahead on every rank's stream (DESIGN.md
/// §3.2 warns that ~1000 waits enqueued ahead hung under MPS; 2 lets the client run one
/// step ahead of the engine's polling).
constexpr int kProgramDepth = 2;


/// EPD_PROGRAM_TRACE=1 (off by default; a diagnostic): the engine logs every graph-mode
/// program instance it enqueues and completes, every disarm, and, while an instance is
/// pending, once a second every pending instance's state per rank (its go wait passed or
/// not, the instance done or not). At warning level ("program trace: ..."), so the lines
/// show at epd's usual log levels.
bool ProgramTrace() {
  static const bool on = [] {
    const char* v = std::getenv("EPD_PROGRAM_TRACE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

/// "done", "pending" or the error of cudaEventQuery(e) (clearing a non-sticky error).
const char* EventState(cudaEvent_t e) {
  const cudaError_t err = cudaEventQuery(e);
  if (err == cudaSuccess) return "done";
  if (err == cudaErrorNotReady) return "pending";
  cudaGetLastError();
  return cudaGetErrorString(err);
}

// ---- RAII for CUDA resources ------------------------------------------------------------

// epd/common/cuda_handles.h, shared with the client library.
using HostFree = CudaFreeHostDeleter;
using DevicePtr = DeviceMemory;
using StreamPtr = StreamHandle;
using EventPtr = EventHandle;

/// What the engine reads back after each op, per rank (pinned host memory).
struct Readback {
  kc::DeviceStatus status;
  int32_t recv_count;
  /// The staging_seq or ready_seq a daemon-launched low-latency op's WaitFlagAsync saw
  /// (written by that kernel once its wait passed): ReleaseReadyWaits tells from it
  /// whether the client's staging ever started for the op (once it did, the op's kernel
  /// waits for ready_seq itself, bounded by op_timeout).
  uint64_t ready_seen;
};

/// Allocates `bytes` on the current device. RESOURCE_EXHAUSTED when the GPU is full.
absl::StatusOr<DevicePtr> DeviceAlloc(uint64_t bytes, int device) {
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes on GPU ", device, " failed: out of memory"));
  }
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(err));
  return DevicePtr(static_cast<uint8_t*>(p));
}

// ---- in-process registry of exported areas ------------------------------------------------

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, void*>& Registry() {
  static auto* m = new std::map<std::string, void*>();
  return *m;
}

// ---- one rank's device resources ----------------------------------------------------------

/// One attached rank on the CUDA backend. Destroyed when the rank has detached and no op
/// still running holds it: nothing writes its area any more.
struct CudaRank : RankResources {
  int device = 0;  ///< The daemon's CUDA ordinal.
  int32_t rank = 0;
  uint64_t bytes = 0;
  uint64_t launch_flags_offset = 0;  ///< EndpointLayout::launch_flags.offset.
  bool client_launched = false;      ///< LAUNCH_MODE_CLIENT: the engine runs nothing.
  std::string ipc_handle;
  StreamPtr stream;  // Declared before area: destroyed after it is synchronised.
  EventPtr done;
  EventPtr waited;  ///< Recorded once a stream-ordered op's ready wait has passed.
  std::unique_ptr<Readback, HostFree> readback;
  DevicePtr area;

  ~CudaRank() override {
    if (!ipc_handle.empty()) {
      std::lock_guard<std::mutex> lock(RegistryMutex());
      Registry().erase(ipc_handle);
    }
    if (stream != nullptr) {
      cudaSetDevice(device);
      cudaStreamSynchronize(stream.get());  // Bounded: every kernel wait is bounded.
    }
    area.reset();
    cudaGetLastError();
  }

  /// launch_flags.ready_seq / done_seq in the rank's area (layout.h).
  uint8_t* ready_flag() const {
    return (area.get() + launch_flags_offset + kernels::kReadyFlagOffset);
  }
  uint8_t* done_flag() const {
    return (area.get() + launch_flags_offset + kernels::kDoneFlagOffset);
  }
  /// launch_flags.staging_seq (layout.h): the client's staging kernel has started.
  uint8_t* staging_flag() const {
    return (area.get() + launch_flags_offset + kernels::kStagingFlagOffset);
  }
};

class CudaGroup;

/// One engine: a thread and a doorbell page per GPU, polling the groups it serves.
struct GpuEngine {
  int device = 0;
  ShmRegion doorbell;
  std::unique_ptr<Engine> engine;
  std::mutex mu;  // Guards groups.
  std::vector<CudaGroup*> groups;
  /// For host writes into launch_flags while the ranks' own streams are held by a
  /// program's waits (graph mode). Created at start-up, before any rank's stream: every
  /// stream takes one of the CUDA_DEVICE_MAX_CONNECTIONS hardware queues, and a write
  /// queued behind a stream memory wait on a shared queue would wait with it.
  StreamPtr aux;

  bool PollAll();
};

class CudaDataPlaneImpl : public DataPlane {
 public:
  explicit CudaDataPlaneImpl(const CudaDataPlaneOptions& options) : options_(options) {}
  ~CudaDataPlaneImpl() override { Shutdown(); }

  absl::Status Init();
  std::string backend_name() const override { return "cuda"; }
  uint64_t BytesPerRank(const v1::GroupSpec& spec) const override {
    // cudaMalloc granularity is 2 MiB.
    const uint64_t bytes = EndpointLayout::Compute(ShapeOf(spec)).total_bytes;
    return (bytes + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
  }
  absl::StatusOr<uint64_t> FreeBytes(const std::string& gpu_uuid) const override;
  absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CreateGroup(const v1::GroupSpec& spec) override;
  /// Client-launched when the group's kernels can run side by side: MPS is active, or the
  /// daemon has a GPU for every rank (one rank per GPU). Otherwise daemon-launched: ranks of
  /// several client processes on one GPU without MPS would time-slice (~2 ms per hop,
  /// DESIGN.md §3.2), while the daemon runs every rank's kernels from its one context.
  /// Measured (docs/BENCHMARKS.md, H200, 8 ranks): client-launched 113 µs per FP8 dispatch,
  /// daemon-launched 462 µs without MPS and 192 µs with it.
  v1::LaunchMode DefaultLaunchMode(const v1::GroupSpec& spec) const override {
    if (static_cast<size_t>(spec.num_ranks()) <= uuids_.size()) return v1::LAUNCH_MODE_CLIENT;
    return DetectMps().active ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON;
  }
  void Shutdown() override;

  const CudaDataPlaneOptions& options() const { return options_; }
  /// Whether daemon-launched low-latency ops wait for ready_seq in a WaitFlagAsync kernel
  /// (CudaDataPlaneOptions::kernel_ready_wait; by default: MPS is active for this daemon).
  bool kernel_ready_wait() const { return kernel_ready_wait_; }
  /// The daemon's ordinal of `gpu_uuid` ("" = the first GPU). NOT_FOUND otherwise.
  absl::StatusOr<int> DeviceOf(const std::string& gpu_uuid) const;
  const std::string& UuidOf(int device) const { return uuids_.at(device); }
  bool PeerAccess(int a, int b) const { return a == b || peer_.at(a).count(b) > 0; }
  GpuEngine* EngineOf(int device) { return engines_.at(device).get(); }

  /// Claims every GPU in `devices` (daemon ordinals) for `group`'s next op when none of
  /// them runs another group's op (one group op per GPU at a time: spinning kernels must
  /// all be resident). Allocates nothing (the holder table is sized at Init).
  bool TryClaimGpus(std::span<const int> devices, const CudaGroup* group);
  /// Releases the GPUs `group` holds. Allocates nothing.
  void ReleaseGpus(const CudaGroup* group);

 private:
  CudaDataPlaneOptions options_;
  bool kernel_ready_wait_ = false;     // See kernel_ready_wait().
  std::map<int, std::string> uuids_;   // ordinal → UUID.
  std::map<int, std::set<int>> peer_;  // ordinal → peers it can access.
  std::map<int, std::unique_ptr<GpuEngine>> engines_;
  std::mutex claim_mu_;
  /// [max ordinal + 1], indexed by ordinal: the group whose op runs on the GPU, or null.
  /// Sized once at Init, so claiming and releasing per op allocate nothing.
  std::vector<const CudaGroup*> gpu_holder_;
  std::atomic<bool> shut_down_{false};
};

class CudaGroup : public LockstepGroup {
 public:
  CudaGroup(CudaDataPlaneImpl* plane, const v1::GroupSpec& spec)
      : LockstepGroup(spec, LockstepOptionsOf(plane->options())),
        plane_(plane),
        ranks_(spec.num_ranks()),
        host_bases_(spec.num_ranks(), nullptr),
        event_errors_(spec.num_ranks(), cudaSuccess) {
    devices_.reserve(spec.num_ranks());
    SizeOp(spare_);
  }
  ~CudaGroup() override;

  /// Shutdown: completes everything pending with `status`.
  void Stop(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      DisarmProgram(status);
    }
    FailAll(status);
  }

 protected:
  uint64_t ShmDataBytes() const override { return 0; }
  absl::StatusOr<std::shared_ptr<RankResources>> PrepareRank(int32_t rank,
                                                             const std::string& gpu_uuid,
                                                             v1::LaunchMode launch_mode,
                                                             v1::EndpointInfo* info) override;
  absl::Status RankAttached(int32_t rank, const std::shared_ptr<RankResources>& res) override;
  void RankDetached(int32_t rank) override;
  bool ReadyToStart() override;
  bool StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                   std::span<RankOutcome> outcomes) override;
  bool PollOpInto(std::span<RankOutcome> outcomes) override;
  void WakeEngine() override {
    GpuEngine* e = engine_.load();
    if (e != nullptr && e->engine != nullptr) e->engine->Wake();
  }
  /// Every rank of the group rings the engine the group adopted (its first rank's GPU).
  absl::StatusOr<ScopedFd> DoorbellFd(int32_t rank) const override {
    GpuEngine* e = engine_.load();
    if (e == nullptr) {
      return absl::InternalError(absl::StrCat("rank ", rank, ": the group has no engine yet"));
    }
    return e->doorbell.DupFd();
  }
  absl::Status CheckRequest(int32_t rank, const abi::RequestSlot& slot) const override;
  absl::Status AcceptsRequests(int32_t rank) const override;
  void OpEndedWithoutLaunch(int32_t rank, const abi::RequestSlot& slot) override;
  absl::Status CheckProgram(int32_t rank) const override;
  bool PollBackground() override;

 private:
  // ---- graph mode (DESIGN.md §3.2; layout.h kProgram*Offset) ----
  /// One rank's resources of an armed program: per instance slot (k % kProgramDepth) an
  /// event after the go wait, an event after the instance, and a pinned status read-back.
  struct ProgramRank {
    std::shared_ptr<CudaRank> rank;
    EventPtr waited[kProgramDepth];
    EventPtr done[kProgramDepth];
    /// [kProgramDepth], pinned and mapped: written by the step's kernel itself
    /// (KernelHandoff::status_out), or by EnqueueStatusReadback's kernel if its launch failed.
    std::unique_ptr<kc::DeviceStatus, HostFree> readback;
  };
  /// An instance enqueued on every rank's stream.
  struct ProgramInstance {
    uint64_t k = 0;                    ///< 1, 2, ... since the program was armed.
    int step = 0;                      ///< (k - 1) % steps.
    std::vector<absl::Status> launch;  ///< [R], sized once by ArmProgram.
  };
  struct Program {
    std::vector<ProgramStepPlan> steps;
    std::vector<ProgramRank> ranks;
    uint64_t next = 1;  ///< The next instance to enqueue.
    /// Instances in flight: next - inflight, ..., next - 1 (oldest first; at most
    /// kProgramDepth). Instance k's state is instances[k % kProgramDepth], the slot of its
    /// events and read-back too: a fixed ring, so enqueueing and completing an instance
    /// allocate nothing.
    int inflight = 0;
    std::array<ProgramInstance, kProgramDepth> instances;
    Clock::time_point trace_next;  ///< EPD_PROGRAM_TRACE: when to log pending events next.

    ProgramInstance& instance(uint64_t k) { return instances[k % kProgramDepth]; }
    /// The oldest instance in flight (inflight > 0).
    uint64_t front() const { return next - static_cast<uint64_t>(inflight); }
  };
  /// Register / unregister (from StartOpInto, GPUs claimed): writes every rank's outcome.
  void ProgramOp(const OpPlan& plan, std::span<RankOutcome> outcomes);
  absl::Status ArmProgram(const std::vector<ProgramStepPlan>& steps);
  /// Enqueues instance program_->next on every rank's stream.
  void EnqueueProgramInstance();
  /// Enqueues rank r's kernel of program step `st` for instance `k` on its stream (T of a
  /// dispatch read from the device); the kernel writes the instance word, done = 1 and its
  /// DeviceStatus to `status_out` itself (KernelHandoff).
  absl::Status LaunchProgramStep(const ProgramStepPlan& st, int32_t r, uint64_t k,
                                 kc::DeviceStatus* status_out);
  /// Disarms the program: releases every instance still waiting for its client's go (in
  /// instance order; they then run on whatever is staged, consistently on every rank, and
  /// their results are ignored), then writes done = kProgramReleased on every rank's
  /// stream so that no client stream waits forever, and marks the endpoints disarmed.
  /// `why` (non-OK) is published as a program error; OK for UnregisterProgram. The GPUs
  /// stay claimed until that tail has left the GPU (program_tail_).
  void DisarmProgram(const absl::Status& why);
  /// Publishes an error of instance k (step `step`) to every attached endpoint's shm.
  void PublishProgramError(const absl::Status& st, uint64_t k, int step);
  /// Publishes program_checked = k to every attached endpoint's shm.
  void PublishProgramChecked(uint64_t k);
  /// True once the disarmed program's tail has left the GPU (then releases it).
  bool ProgramTailDone();

  /// Recomputes devices_ from ranks_ (capacity R: allocates nothing).
  void UpdateDevices();
  kc::CudaRankContext Context(int32_t r, int32_t num_sms) const;
  /// Enqueues rank r's part of `plan` on its stream: for a stream-ordered slot first the
  /// wait for ready_seq >= seq (then *ready_wait = true), then the op's kernels. A
  /// stream-ordered low-latency op's kernel checks ready_seq and writes done_seq itself
  /// (KernelHandoff), and with kernel_ready_wait() the wait is a WaitFlagAsync kernel
  /// (SpinsForReady) instead of cuStreamWaitValue64.
  absl::Status LaunchRank(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                          bool* ready_wait);
  absl::Status ResetSync();
  /// Serves this group from the engine of `device` unless an engine already does.
  void AdoptEngine(int device);

  /// An op on the GPU: the ranks it runs on (kept alive until it finished), per-rank
  /// launch errors, which ranks' streams wait for their client (kFlagStreamOrdered), when
  /// it started. Every vector has R entries (SizeOp); a program's tail (DisarmProgram)
  /// too.
  struct GpuOp {
    abi::OpKind op = abi::OpKind::kInvalid;
    uint64_t seq = 0;
    std::vector<std::shared_ptr<CudaRank>> ranks;
    std::vector<absl::Status> launch;
    std::vector<bool> stream_ordered;
    std::vector<bool> ready_wait;  ///< The rank's stream got the ready_seq stream wait.
    Clock::time_point started;
  };
  /// Gives every vector of `op` R entries (no allocation when they already have).
  void SizeOp(GpuOp& op) const {
    const size_t R = ranks_.size();
    op.ranks.resize(R);
    op.launch.resize(R);
    op.stream_ordered.resize(R);
    op.ready_wait.resize(R);
  }
  /// Whether rank r's part of `op` hands off inside its low-latency kernel (LaunchRank).
  static bool KernelHandsOff(const GpuOp& op, size_t r) {
    return op.stream_ordered[r] &&
           (op.op == abi::OpKind::kLowLatencyDispatch || op.op == abi::OpKind::kLowLatencyCombine);
  }
  /// Whether that rank's ready wait is a WaitFlagAsync kernel (Readback::ready_seen).
  bool SpinsForReady(const GpuOp& op, size_t r) const {
    return KernelHandsOff(op, r) && plane_->kernel_ready_wait();
  }
  /// Moves a finished op's vectors back into spare_ for the next op, dropping its rank
  /// references (a rank that left during the op is freed here, not kept by the spare).
  void RecycleOp(std::optional<GpuOp>& op) {
    spare_ = std::move(*op);
    op.reset();
    for (auto& r : spare_.ranks) r.reset();
  }
  /// Enqueues done_seq = seq on rank `cr`'s stream (after everything already on it).
  absl::Status WriteDone(const CudaRank& cr, uint64_t seq) const;
  /// For every stream-ordered rank of `op` whose stream still waits for ready_seq (its
  /// client never wrote it), writes ready_seq = op.seq from the host so that the stream
  /// and the op's kernels (bounded by op_timeout) can end. Used when the op is given up
  /// on and before the group's memory is freed.
  void ReleaseReadyWaits(const GpuOp& op) const;

  CudaDataPlaneImpl* plane_;
  std::atomic<GpuEngine*> engine_{nullptr};
  std::mutex engine_mu_;  // Serialises AdoptEngine.
  // Guarded by LockstepGroup::mu_:
  std::vector<std::shared_ptr<CudaRank>> ranks_;  // Attached ranks.
  std::vector<uint8_t*> host_bases_;              // [R] data-area bases.
  std::map<int, DevicePtr> peer_bases_;           // GPU → device array [R].
  /// The distinct GPUs of the attached ranks, ascending (capacity R): what an op claims.
  std::vector<int> devices_;
  bool needs_sync_reset_ = false;  // Kernel sync state must be zeroed.
  // The per-op state is sized R once and moved, never reallocated (README "Hot path"): the
  // next op's GpuOp waits in spare_ while no op is on the GPU, moves into gpu_op_ while one
  // runs (into abandoned_ if it is given up on), and back into spare_ once it has left.
  GpuOp spare_;
  std::optional<GpuOp> gpu_op_;     // The op running on the GPU.
  std::optional<GpuOp> abandoned_;  // An op given up on, still on the GPU.
  /// [R] scratch of one poll (PollOpInto, PollBackground): each rank's cudaEventQuery.
  std::vector<cudaError_t> event_errors_;
  std::optional<Program> program_;     // The armed graph-mode program.
  std::optional<GpuOp> program_tail_;  // A disarmed program still on the GPU.
};

// ---------------------------------------------------------------------------------------

bool GpuEngine::PollAll() {
  std::lock_guard<std::mutex> lock(mu);
  bool worked = false;
  for (CudaGroup* g : groups) worked |= g->Poll();
  return worked;
}

absl::Status CudaDataPlaneImpl::Init() {
  (void)kCudaEnvironmentSet;
  EPD_ASSIGN_OR_RETURN(GpuInventory inventory, GpuInventory::Discover(options_.gpu_uuids));
  if (inventory.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA data plane needs a GPU: ", inventory.reason()));
  }
  auto log = EngineLog();
  kernel_ready_wait_ = options_.kernel_ready_wait.value_or(inventory.mps().active);
  log->info("daemon-launched low-latency ops wait for their client's ready flag {}",
            kernel_ready_wait_ ? "in a one-warp kernel (MPS or forced)"
                               : "with cuStreamWaitValue64 (no MPS: contexts time-slice)");
  for (const v1::GpuInfo& g : inventory.gpus()) uuids_[g.ordinal()] = g.uuid();
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
  // Eager kernel loading, then one engine per GPU.
  gpu_holder_.assign(static_cast<size_t>(uuids_.rbegin()->first) + 1, nullptr);
  for (const auto& [device, uuid] : uuids_) {
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaFree(nullptr)));  // Creates the context.
    EPD_RETURN_IF_ERROR(kc::PreloadKernels());
    auto engine = std::make_unique<GpuEngine>();
    engine->device = device;
    cudaStream_t aux = nullptr;
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamCreateWithFlags(&aux, cudaStreamNonBlocking)));
    engine->aux.reset(aux);
    EPD_ASSIGN_OR_RETURN(engine->doorbell,
                         ShmRegion::Create("epd-doorbell", sizeof(abi::DoorbellPage)));
    auto* page = reinterpret_cast<abi::DoorbellPage*>(engine->doorbell.data());
    page->size = sizeof(abi::DoorbellPage);
    page->magic = abi::kDoorbellMagic;
    page->version = abi::kShmAbiVersion;
    GpuEngine* e = engine.get();
    // Wake at least every 20 ms to enforce op timeouts while asleep.
    e->engine = std::make_unique<Engine>(
        page, options_.engine_idle_us, 20000,
        [e] {
          cudaSetDevice(e->device);
          return e->PollAll();
        },
        options_.on_engine_start);
    e->engine->Start();
    engines_[device] = std::move(engine);
    log->info("CUDA data plane: GPU {} ({}) ready: kernels loaded, engine started", device, uuid);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDataPlaneImpl::DeviceOf(const std::string& gpu_uuid) const {
  if (gpu_uuid.empty()) return uuids_.begin()->first;
  for (const auto& [device, uuid] : uuids_) {
    if (uuid == gpu_uuid) return device;
  }
  return absl::NotFoundError(
      absl::StrCat("gpu_uuid: \"", gpu_uuid, "\" is not a GPU of this CUDA data plane"));
}

absl::StatusOr<uint64_t> CudaDataPlaneImpl::FreeBytes(const std::string& gpu_uuid) const {
  EPD_ASSIGN_OR_RETURN(int device, DeviceOf(gpu_uuid));
  size_t free_bytes = 0, total = 0;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemGetInfo(&free_bytes, &total)));
  return static_cast<uint64_t>(free_bytes);
}

absl::StatusOr<std::unique_ptr<DataPlaneGroup>> CudaDataPlaneImpl::CreateGroup(
    const v1::GroupSpec& spec) {
  if (shut_down_.load()) return absl::UnavailableError("epd is shutting down");
  // The registry checked already (Join); a group past a kernel limit must never exist.
  EPD_RETURN_IF_ERROR(ValidateGroupSpecForBackend(spec, backend_name()));
  return std::unique_ptr<DataPlaneGroup>(std::make_unique<CudaGroup>(this, spec));
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

void CudaDataPlaneImpl::Shutdown() {
  if (shut_down_.exchange(true)) return;
  for (auto& [device, e] : engines_) {
    if (e->engine) e->engine->Stop();
  }
  for (auto& [device, e] : engines_) {
    std::lock_guard<std::mutex> lock(e->mu);
    for (CudaGroup* g : e->groups) g->Stop(absl::UnavailableError("epd is shutting down"));
  }
}

// ---------------------------------------------------------------------------------------

CudaGroup::~CudaGroup() {
  if (GpuEngine* e = engine_.load()) {
    std::lock_guard<std::mutex> lock(e->mu);
    e->groups.erase(std::remove(e->groups.begin(), e->groups.end(), this), e->groups.end());
  }
  // Ops still on the GPU end (their waits are bounded) before any memory of the group is
  // freed: the peer arrays below, the ranks' areas with the endpoints.
  std::lock_guard<std::mutex> lock(mu_);
  DisarmProgram(absl::UnavailableError("the group is being destroyed"));
  for (const std::optional<GpuOp>* op : {&gpu_op_, &abandoned_, &program_tail_}) {
    if (!op->has_value()) continue;
    ReleaseReadyWaits(**op);  // A client that never wrote ready_seq must not hang us.
    for (const auto& r : (*op)->ranks) {
      if (!r) continue;
      cudaSetDevice(r->device);
      cudaStreamSynchronize(r->stream.get());
    }
  }
  cudaGetLastError();
  gpu_op_.reset();
  abandoned_.reset();
  program_tail_.reset();
  plane_->ReleaseGpus(this);
}

void CudaGroup::AdoptEngine(int device) {
  std::lock_guard<std::mutex> lock(engine_mu_);
  if (engine_.load() != nullptr) return;
  GpuEngine* e = plane_->EngineOf(device);
  {
    std::lock_guard<std::mutex> elock(e->mu);
    e->groups.push_back(this);
  }
  engine_.store(e);
}

absl::StatusOr<std::shared_ptr<RankResources>> CudaGroup::PrepareRank(int32_t rank,
                                                                      const std::string& gpu_uuid,
                                                                      v1::LaunchMode launch_mode,
                                                                      v1::EndpointInfo* info) {
  EPD_ASSIGN_OR_RETURN(int device, plane_->DeviceOf(gpu_uuid));
  auto r = std::make_shared<CudaRank>();
  r->device = device;
  r->rank = rank;
  r->bytes = layout().total_bytes;
  r->launch_flags_offset = layout().launch_flags.offset;
  // Client-launched endpoints get the same (zeroed) area and IPC handle; the engine
  // refuses their ring slots (AcceptsRequests).
  r->client_launched = launch_mode == v1::LAUNCH_MODE_CLIENT;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  cudaStream_t stream = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  r->stream.reset(stream);
  cudaEvent_t event = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  r->done.reset(event);
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  r->waited.reset(event);
  void* pinned = nullptr;
  EPD_RETURN_IF_ERROR(
      EPD_CUDA_STATUS(cudaHostAlloc(&pinned, sizeof(Readback), cudaHostAllocPortable)));
  r->readback.reset(static_cast<Readback*>(pinned));
  std::memset(pinned, 0, sizeof(Readback));
  EPD_ASSIGN_OR_RETURN(r->area, DeviceAlloc(r->bytes, device));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemsetAsync(r->area.get(), 0, r->bytes, stream)));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(stream)));
  cudaIpcMemHandle_t handle;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaIpcGetMemHandle(&handle, r->area.get())));
  r->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry()[r->ipc_handle] = r->area.get();
  }
  AdoptEngine(device);
  info->set_backend("cuda");
  info->set_gpu_uuid(plane_->UuidOf(device));
  info->set_cuda_ipc_handle(r->ipc_handle);
  info->set_launch_mode(r->client_launched ? v1::LAUNCH_MODE_CLIENT : v1::LAUNCH_MODE_DAEMON);
  // Under MPS the client's staging kernel of a low-latency op waits for done itself (one
  // block of one SM per rank, which LaunchRank's grids leave free).
  info->set_kernel_done_wait(!r->client_launched && plane_->kernel_ready_wait());
  return std::shared_ptr<RankResources>(std::move(r));
}

void CudaGroup::UpdateDevices() {
  devices_.clear();
  for (const auto& r : ranks_) {
    if (!r) continue;
    auto it = std::lower_bound(devices_.begin(), devices_.end(), r->device);
    if (it == devices_.end() || *it != r->device) devices_.insert(it, r->device);
  }
}

absl::Status CudaGroup::RankAttached(int32_t rank, const std::shared_ptr<RankResources>& res) {
  auto r = std::static_pointer_cast<CudaRank>(res);
  for (int d : devices_) {
    if (!plane_->PeerAccess(r->device, d) || !plane_->PeerAccess(d, r->device)) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, " on GPU ", plane_->UuidOf(r->device), " cannot reach GPU ",
                       plane_->UuidOf(d), " of another rank of group ", spec().name(),
                       " (no peer access between them)"));
    }
  }
  std::vector<uint8_t*> bases = host_bases_;
  bases[rank] = r->area.get();
  std::set<int> devices(devices_.begin(), devices_.end());
  devices.insert(r->device);
  // Every GPU of the group gets the new [R] array of bases, copied on a stream of that GPU
  // (the new rank's, or an attached rank's) and waited for, so no kernel sees a stale array.
  for (int d : devices) {
    cudaStream_t stream = r->device == d ? r->stream.get() : nullptr;
    for (const auto& other : ranks_) {
      if (stream == nullptr && other && other->device == d) stream = other->stream.get();
    }
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(d)));
    auto it = peer_bases_.find(d);
    if (it == peer_bases_.end()) {
      EPD_ASSIGN_OR_RETURN(DevicePtr p, DeviceAlloc(sizeof(uint8_t*) * bases.size(), d));
      it = peer_bases_.emplace(d, std::move(p)).first;
    }
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemcpyAsync(it->second.get(), bases.data(),
                                                        sizeof(uint8_t*) * bases.size(),
                                                        cudaMemcpyHostToDevice, stream)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(stream)));
  }
  host_bases_ = std::move(bases);
  ranks_[rank] = std::move(r);
  UpdateDevices();
  // The new area's sync state is zero, the others' counters are not: zero them all
  // before the next op.
  needs_sync_reset_ = true;
  return absl::OkStatus();
}

void CudaGroup::RankDetached(int32_t rank) {
  if (program_) {
    DisarmProgram(absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " left group ", spec().name(),
                     ": its graph-mode program was disarmed; rejoin and register it again")));
  }
  ranks_[rank].reset();
  host_bases_[rank] = nullptr;
  UpdateDevices();
}

kc::CudaRankContext CudaGroup::Context(int32_t r, int32_t num_sms) const {
  const CudaRank& cr = *ranks_[r];
  kc::CudaRankContext ctx;
  ctx.shape = shape();
  ctx.layout = layout();
  ctx.rank = r;
  ctx.peer_bases = reinterpret_cast<uint8_t* const*>(peer_bases_.at(cr.device).get());
  ctx.own_base = cr.area.get();
  ctx.num_sms = num_sms;
  int32_t on_device = 0;
  for (const auto& other : ranks_) on_device += other && other->device == cr.device ? 1 : 0;
  ctx.ranks_on_device = on_device;
  // Flags at .gpu scope when the whole group is on this GPU (cuda_ops.h).
  ctx.all_ranks_on_device = on_device == shape().num_ranks;
  ctx.timeout_ns = static_cast<int64_t>(options().op_timeout_ms) * 1'000'000;
  return ctx;
}

bool CudaGroup::ReadyToStart() {
  if (program_tail_ && !ProgramTailDone()) return false;
  if (abandoned_) {
    for (const auto& r : abandoned_->ranks) {
      if (r && cudaEventQuery(r->done.get()) == cudaErrorNotReady) return false;
    }
    cudaGetLastError();
    RecycleOp(abandoned_);
    plane_->ReleaseGpus(this);
    needs_sync_reset_ = true;
  }
  return plane_->TryClaimGpus(devices_, this);
}

absl::Status CudaGroup::ResetSync() {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    kc::CudaRankContext ctx = Context(static_cast<int32_t>(r), 0);
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(ranks_[r]->device)));
    cudaStream_t s = ranks_[r]->stream.get();
    if (shape().ll_max_tokens_per_rank > 0) EPD_RETURN_IF_ERROR(kc::ResetLowLatencySync(ctx, s));
    if (shape().num_ranks <= kc::kNormalMaxRanks) {  // Else normal ops are refused anyway.
      EPD_RETURN_IF_ERROR(kc::ResetNormalSync(ctx, s));
    }
    EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(ctx, s, &ranks_[r]->readback->status));
  }
  // Every rank's reset must be complete before any rank's next kernel writes a peer's flags.
  for (const auto& r : ranks_) {
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(r->stream.get())));
  }
  needs_sync_reset_ = false;
  return absl::OkStatus();
}

absl::Status CudaGroup::LaunchRank(const OpPlan& plan, const abi::RequestSlot& slot, int32_t r,
                                   bool* ready_wait) {
  const CudaRank& cr = *ranks_[r];
  const EndpointLayout& L = layout();
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  cudaStream_t s = cr.stream.get();
  const bool low_latency =
      plan.op == abi::OpKind::kLowLatencyDispatch || plan.op == abi::OpKind::kLowLatencyCombine;
  // A client's SM budget applies to normal ops only: low-latency kernels spin on each
  // other, so their grids keep the default that makes every rank resident.
  const int32_t num_sms = low_latency
                              ? plane_->options().num_sms
                              : (slot.num_sms > 0 ? slot.num_sms : plane_->options().num_sms);
  kc::CudaRankContext ctx = Context(r, num_sms);
  // Its clients' staging kernels wait for done on the GPU (EndpointInfo kernel_done_wait):
  // one SM per rank of the GPU stays outside the low-latency grids for them.
  if (low_latency && plane_->kernel_ready_wait()) ctx.sms_left_per_rank = 1;
  // Daemon-launched low-latency ops hand off inside kernels (cuda_ops.h "stream-ordered
  // hand-off inside kernels"): a one-warp WaitFlagAsync for staging_seq or ready_seq, the
  // op's kernel launched programmatically behind it (it waits for ready_seq itself and
  // writes done_seq).
  // Its bound outlasts the engine's give-up (op_timeout + kGpuGrace), after which
  // ReleaseReadyWaits writes ready_seq from the host.
  // Without MPS (plane_->kernel_ready_wait() false) the client's and the daemon's contexts
  // time-slice the GPU, and a spinning wait would hold the slice the client's staging kernel
  // needs (~2 ms a hop, DESIGN.md §3.2): the ready wait is then cuStreamWaitValue64, and
  // the kernel still checks ready_seq and writes done_seq.
  kc::KernelHandoff handoff;
  const bool kernel_handoff = (slot.flags & abi::kFlagStreamOrdered) && low_latency;
  if (kernel_handoff) {
    handoff.ready_flag = reinterpret_cast<const uint64_t*>(cr.ready_flag());
    handoff.ready_value = slot.seq;
    handoff.done_flag = reinterpret_cast<uint64_t*>(cr.done_flag());
    handoff.done_value = slot.seq;
    handoff.status_out = &cr.readback->status;  // No read-back kernel behind it (StartOpInto).
  }
  if (kernel_handoff && plane_->kernel_ready_wait()) {
    // The wait passes once the client's staging kernel has started (staging_seq, layout.h)
    // or, from a client that does not write staging_seq, once it is done (ready_seq): the
    // op's kernel is then launched while the inputs are still being copied (the ~2 µs of
    // the programmatic launch overlap the ~1.5-2 µs of staging), and its blocks wait for
    // ready_seq themselves. staging_seq comes only once every block of the staging kernel
    // is resident, so that kernel ends whatever SMs the op's grid then takes
    // (docs/CUDA_BACKEND.md "Launch modes").
    const auto bound = std::chrono::milliseconds(options().op_timeout_ms) + 2 * kGpuGrace;
    EPD_RETURN_IF_ERROR(kc::WaitFlagAsync(
        reinterpret_cast<const uint64_t*>(cr.staging_flag()), slot.seq,
        std::chrono::duration_cast<std::chrono::nanoseconds>(bound).count(),
        &cr.readback->ready_seen, s, reinterpret_cast<const uint64_t*>(cr.ready_flag())));
    handoff.programmatic = true;
  } else if (slot.flags & abi::kFlagStreamOrdered) {
    // The client's stream writes ready_seq = seq once it has staged the inputs; this
    // stream waits for it on the GPU (the CPU never does).
    EPD_RETURN_IF_ERROR(kc::StreamWaitValue64Geq(s, cr.ready_flag(), slot.seq));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(cr.waited.get(), s)));
    *ready_wait = true;
  }
  switch (plan.op) {
    case abi::OpKind::kGetDispatchLayout:
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::GetDispatchLayout(ctx, kc::GetDispatchLayoutArgs{}, s));
      break;
    case abi::OpKind::kDispatch: {
      kc::NormalDispatchArgs a;
      a.fp8 = plan.flags & abi::kFlagFp8;
      a.expert_alignment = slot.expert_alignment;
      a.with_weights = plan.flags & abi::kFlagDispatchWeights;
      a.cached = plan.flags & abi::kFlagCachedHandle;
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::NormalDispatch(ctx, a, s));
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(
          cudaMemcpyAsync(&cr.readback->recv_count, cr.area.get() + L.recv_count.offset,
                          sizeof(int32_t), cudaMemcpyDeviceToHost, s)));
      break;
    }
    case abi::OpKind::kCombine: {
      kc::NormalCombineArgs a;
      a.with_weights = plan.flags & abi::kFlagCombineWeights;
      // The handle's T (validated equal to the routing dispatch's T).
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, slot.num_tokens, s));
      EPD_RETURN_IF_ERROR(kc::NormalCombine(ctx, a, s));
      break;
    }
    case abi::OpKind::kLowLatencyDispatch: {
      kc::LowLatencyDispatchArgs a;
      a.buffer = plan.ll_buffer;
      a.use_fp8 = plan.flags & abi::kFlagFp8;
      a.round_scale = plan.flags & abi::kFlagRoundScale;
      a.num_tokens_value = slot.num_tokens;  // By value: no slot write to enqueue.
      a.handoff = handoff;
      EPD_RETURN_IF_ERROR(kc::LowLatencyDispatch(ctx, a, s));
      break;
    }
    case abi::OpKind::kLowLatencyCombine: {
      kc::LowLatencyCombineArgs a;
      a.buffer = plan.ll_handle_buffer;
      a.combined_x = reinterpret_cast<kernels::bf16_bits*>(
          cr.area.get() + L.ll_combined_x[plan.ll_out_buffer].offset);
      a.handoff = handoff;
      EPD_RETURN_IF_ERROR(kc::LowLatencyCombine(ctx, a, s));
      break;
    }
    default:
      return absl::InternalError(absl::StrCat("unreachable op kind ", static_cast<int>(plan.op)));
  }
  return absl::OkStatus();
}

bool CudaGroup::StartOpInto(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                            std::span<RankOutcome> outcomes) {
  const int R = static_cast<int>(slots.size());
  // Not while a program is armed: the ranks' streams are held by its waits (the only op
  // then is UnregisterProgram, whose disarm sets the reset for the op after it).
  if (needs_sync_reset_ && !program_) {
    absl::Status st = ResetSync();
    if (!st.ok()) {
      EngineLog()->error("group {}: resetting the kernels' sync state failed: {}", spec().name(),
                         st.ToString());
      plane_->ReleaseGpus(this);
      for (int r = 0; r < R; ++r) {
        outcomes[r].status = st;
        OpEndedWithoutLaunch(r, slots[r]);  // No kernel runs: release the client's stream.
      }
      return true;
    }
  }
  if (plan.op == abi::OpKind::kRegisterProgram || plan.op == abi::OpKind::kUnregisterProgram) {
    ProgramOp(plan, outcomes);
    return true;
  }
  // The op's state: spare_'s vectors (R entries each; SizeOp allocates only if an earlier
  // path had not given them back, which none does), filled in place.
  GpuOp& op = spare_;
  SizeOp(op);
  op.op = plan.op;
  op.seq = plan.seq;
  op.started = Clock::now();
  for (int r = 0; r < R; ++r) {
    op.ranks[r] = ranks_[r];
    op.launch[r] = absl::OkStatus();
    op.stream_ordered[r] = (slots[r].flags & abi::kFlagStreamOrdered) != 0;
    op.ready_wait[r] = false;
  }
  // Every rank's kernel is enqueued before any is waited for; a launch error on one rank
  // still launches the others, whose waits then end at the kernel timeout.
  for (int r = 0; r < R; ++r) {
    bool ready_wait = false;
    op.launch[r] = LaunchRank(plan, slots[r], r, &ready_wait);
    op.ready_wait[r] = ready_wait;
  }
  for (int r = 0; r < R; ++r) {
    const CudaRank& cr = *ranks_[r];
    cudaSetDevice(cr.device);
    // A launched low-latency kernel that hands off wrote done and its status itself
    // (KernelHandoff::status_out); every other path gets the read-back kernel and, when
    // stream-ordered, done_seq = seq after it, so the client's stream is released on every
    // path.
    const bool kernel_wrote_all = KernelHandsOff(op, r) && op.launch[r].ok();
    absl::Status st = kernel_wrote_all ? absl::OkStatus()
                                       : kc::EnqueueStatusReadback(Context(r, 0), cr.stream.get(),
                                                                   &cr.readback->status);
    if (op.stream_ordered[r] && !kernel_wrote_all) {
      absl::Status done = WriteDone(cr, plan.seq);
      if (st.ok()) st = done;
    }
    absl::Status recorded = EPD_CUDA_STATUS(cudaEventRecord(cr.done.get(), cr.stream.get()));
    if (st.ok()) st = recorded;
    if (!st.ok() && op.launch[r].ok()) op.launch[r] = st;
  }
  gpu_op_.emplace(std::move(spare_));  // The vectors move: no allocation.
  return false;
}

absl::Status CudaGroup::CheckRequest(int32_t /*rank*/, const abi::RequestSlot& slot) const {
  if (slot.flags & abi::kFlagStreamOrdered) {
    absl::Status mem = kc::StreamMemOpsAvailable();
    if (!mem.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          OpName(slot.op), ": kFlagStreamOrdered cannot be served by this epd: ", mem.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaGroup::AcceptsRequests(int32_t rank) const {
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (cr && cr->client_launched) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", spec().name(),
        " is client-launched (LAUNCH_MODE_CLIENT): the daemon runs no op for it and refuses "
        "its ring slots; its client launches the kernels itself"));
  }
  return absl::OkStatus();
}

absl::Status CudaGroup::WriteDone(const CudaRank& cr, uint64_t seq) const {
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
  return kc::StreamWriteValue64(cr.stream.get(), cr.done_flag(), seq);
}

void CudaGroup::OpEndedWithoutLaunch(int32_t rank, const abi::RequestSlot& slot) {
  if (!(slot.flags & abi::kFlagStreamOrdered)) return;
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (!cr) return;
  if (program_ && program_->ranks[rank].rank == cr) {
    // The rank's stream is held by the program's waits: write done_seq from the host (no
    // ring op of the group runs while a program is armed, so nothing else writes it).
    // A stream memory write on the engine's aux stream (no copy: see DisarmProgram).
    cudaSetDevice(cr->device);
    cudaStream_t aux = plane_->EngineOf(cr->device)->aux.get();
    absl::Status st = kc::StreamWriteValue64(aux, cr->done_flag(), slot.seq);
    if (st.ok()) st = EPD_CUDA_STATUS(cudaStreamSynchronize(aux));
    if (!st.ok()) {
      EngineLog()->error("group {} rank {}: releasing the client's stream for op {} failed: {}",
                         spec().name(), rank, slot.seq, st.ToString());
    }
    return;
  }
  absl::Status st = WriteDone(*cr, slot.seq);
  if (!st.ok()) {
    EngineLog()->error("group {} rank {}: releasing the client's stream for op {} failed: {}",
                       spec().name(), rank, slot.seq, st.ToString());
  }
}

void CudaGroup::ReleaseReadyWaits(const GpuOp& op) const {
  for (size_t r = 0; r < op.ranks.size() && r < op.ready_wait.size(); ++r) {
    const bool spins = SpinsForReady(op, r);
    if (!(op.ready_wait[r] || spins) || !op.ranks[r]) continue;
    const CudaRank& cr = *op.ranks[r];
    cudaSetDevice(cr.device);
    if (spins) {
      // Written by the rank's WaitFlagAsync once its wait passed (pinned host memory).
      const uint64_t seen = *reinterpret_cast<const volatile uint64_t*>(&cr.readback->ready_seen);
      if (seen >= op.seq) continue;
    } else if (cudaEventQuery(cr.waited.get()) != cudaErrorNotReady) {
      continue;
    }
    // The stream is still at the ready wait, so its client has not written ready_seq =
    // seq (nor anything later): writing seq cannot hide a newer value.
    const uint64_t seq = op.seq;
    cudaError_t err = cudaMemcpy(reinterpret_cast<void*>(cr.ready_flag()), &seq, sizeof(seq),
                                 cudaMemcpyHostToDevice);
    LogRankCaused(static_cast<int32_t>(r), spdlog::level::warn,
                  "group {} rank {}: its client never wrote ready_seq = {}; released the stream "
                  "from the host ({})",
                  spec().name(), r, seq, cudaGetErrorString(err));
  }
  cudaGetLastError();
}

bool CudaGroup::PollOpInto(std::span<RankOutcome> outcomes) {
  GpuOp& op = *gpu_op_;
  const int R = static_cast<int>(op.ranks.size());
  bool all_done = true;
  for (int r = 0; r < R; ++r) {
    const cudaError_t err = cudaEventQuery(op.ranks[r]->done.get());
    event_errors_[r] = err;
    if (err == cudaErrorNotReady) {
      all_done = false;
    } else if (err != cudaSuccess) {
      cudaGetLastError();  // Clear a non-sticky error: it is reported below, not later.
    }
  }
  if (!all_done) {
    if (Clock::now() - op.started <
        std::chrono::milliseconds(options().op_timeout_ms) + kGpuGrace) {
      return false;
    }
    // The kernels bound their own waits by op_timeout; past that and a grace period the
    // op is given up on. Its resources stay held until the GPU is done with them, and the
    // group's next op waits for that (ReadyToStart, which recycles it into spare_).
    absl::Status st = absl::DeadlineExceededError(
        absl::StrCat(OpName(static_cast<uint32_t>(op.op)), " of group ", spec().name(),
                     ": the GPU did not finish the op within op_timeout ", options().op_timeout_ms,
                     " ms + 5 s; check the GPU (nvidia-smi) and the daemon log"));
    LogClientCaused(spdlog::level::err, "{}", st.message());
    for (RankOutcome& o : outcomes) o.status = st;
    ReleaseReadyWaits(op);
    abandoned_ = std::move(gpu_op_);
    gpu_op_.reset();
    return true;
  }
  const char* name = OpName(static_cast<uint32_t>(op.op));
  const bool low_latency =
      op.op == abi::OpKind::kLowLatencyDispatch || op.op == abi::OpKind::kLowLatencyCombine;
  for (int r = 0; r < R; ++r) {
    const Readback& rb = *op.ranks[r]->readback;
    RankOutcome& out = outcomes[r];
    const bool event_failed = event_errors_[r] != cudaSuccess;
    if (!op.launch[r].ok()) {
      out.status = op.launch[r];
    } else if (event_failed) {
      out.status = kc::CudaErrorToStatus(event_errors_[r], "cudaEventQuery(the op's done event)",
                                         __FILE__, __LINE__);
    } else {
      // OK allocates nothing (a DeviceStatus without findings).
      out.status = kc::StatusFromDevice(rb.status, shape(), r, name, low_latency);
      if (op.op == abi::OpKind::kDispatch) {
        // Read back from the rank's area, which its client can write: checked before use.
        const int32_t n = rb.recv_count;
        if (n >= 0 && n <= shape().max_recv_tokens()) {
          out.num_recv_tokens = n;
        } else if (out.status.ok()) {
          out.status = absl::InvalidArgumentError(absl::StrCat(
              name, ": rank ", r, ": the received count read back from the endpoint's memory, ", n,
              ", is outside [0, num_ranks * max_tokens_per_rank = ", shape().max_recv_tokens(),
              "]: the endpoint's memory was overwritten during the op"));
        }
      }
    }
    // A device-side timeout or a launch error leaves the ranks' sequence counters out of
    // step: zero the sync state before the next op.
    if (out.status.code() == absl::StatusCode::kDeadlineExceeded || !op.launch[r].ok() ||
        event_failed) {
      needs_sync_reset_ = true;
    }
  }
  RecycleOp(gpu_op_);
  plane_->ReleaseGpus(this);
  return true;
}

// ---- graph mode -------------------------------------------------------------------------

absl::Status CudaGroup::CheckProgram(int32_t rank) const {
  const std::shared_ptr<CudaRank>& cr = ranks_[rank];
  if (cr && cr->client_launched) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", spec().name(),
        " is client-launched: its ops are captured in CUDA graphs natively; graph-mode "
        "programs are for daemon-launched endpoints"));
  }
  absl::Status mem = kc::StreamMemOpsAvailable();
  if (!mem.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("graph-mode programs need stream memory operations: ", mem.message()));
  }
  return absl::OkStatus();
}

void CudaGroup::ProgramOp(const OpPlan& plan, std::span<RankOutcome> outcomes) {
  absl::Status st;
  if (plan.op == abi::OpKind::kRegisterProgram) {
    st = ArmProgram(plan.program);
    if (!st.ok()) {
      program_.reset();
      plane_->ReleaseGpus(this);
      EngineLog()->error("group {}: arming the program failed: {}", spec().name(), st.ToString());
    } else {
      std::string steps;
      for (const ProgramStepPlan& p : plan.program) {
        absl::StrAppend(&steps, steps.empty() ? "" : ", ", ProgramStepName(p));
      }
      EngineLog()->info("group {}: graph-mode program armed: [{}]", spec().name(), steps);
    }
  } else {
    DisarmProgram(absl::OkStatus());
    if (!program_tail_) plane_->ReleaseGpus(this);
  }
  for (RankOutcome& o : outcomes) o.status = st;
}

absl::Status CudaGroup::ArmProgram(const std::vector<ProgramStepPlan>& steps) {
  Program p;
  p.steps = steps;
  const int R = static_cast<int>(ranks_.size());
  p.ranks.resize(R);
  for (ProgramInstance& in : p.instances) in.launch.assign(R, absl::OkStatus());
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = p.ranks[r];
    pr.rank = ranks_[r];
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(pr.rank->device)));
    for (int i = 0; i < kProgramDepth; ++i) {
      cudaEvent_t e = nullptr;
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)));
      pr.waited[i].reset(e);
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)));
      pr.done[i].reset(e);
    }
    void* pinned = nullptr;
    EPD_RETURN_IF_ERROR(
        EPD_CUDA_STATUS(cudaHostAlloc(&pinned, sizeof(kc::DeviceStatus) * kProgramDepth,
                                      cudaHostAllocPortable | cudaHostAllocMapped)));
    pr.readback.reset(static_cast<kc::DeviceStatus*>(pinned));
    std::memset(pinned, 0, sizeof(kc::DeviceStatus) * kProgramDepth);
    // go, done and instance start at 0 (the client runs no step while it registers).
    cudaStream_t s = pr.rank->stream.get();
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemsetAsync(
        pr.rank->area.get() + pr.rank->launch_flags_offset + kernels::kProgramGoOffset, 0,
        kernels::kProgramInstanceOffset + sizeof(uint64_t) - kernels::kProgramGoOffset, s)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(s)));
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {} rank {}: GPU {} stream {} go at {}", spec().name(),
                        r, pr.rank->device, static_cast<void*>(s),
                        static_cast<void*>(pr.rank->area.get() + pr.rank->launch_flags_offset +
                                           kernels::kProgramGoOffset));
    }
  }
  for (int r = 0; r < R; ++r) {
    abi::EndpointShmHeader* h = endpoint(r)->header;
    abi::Atomic(h->program_errors).store(0, std::memory_order_relaxed);
    abi::Atomic(h->program_checked).store(0, std::memory_order_relaxed);
    abi::Atomic(h->program_armed).store(1, std::memory_order_release);
  }
  program_ = std::move(p);
  while (program_->inflight < kProgramDepth) EnqueueProgramInstance();
  return absl::OkStatus();
}

absl::Status CudaGroup::LaunchProgramStep(const ProgramStepPlan& st, int32_t r, uint64_t k,
                                          kc::DeviceStatus* status_out) {
  const CudaRank& cr = *ranks_[r];
  const kc::CudaRankContext ctx = Context(r, plane_->options().num_sms);
  cudaStream_t s = cr.stream.get();
  // The step's kernel writes the instance number and then done = 1 itself (a stream memory
  // write behind the kernels and the read-back lands ~14 µs later, cuda_ops.h).
  uint8_t* flags = cr.area.get() + cr.launch_flags_offset;
  kc::KernelHandoff handoff;
  handoff.done_flag = reinterpret_cast<uint64_t*>(flags + kernels::kProgramDoneOffset);
  handoff.done_value = 1;
  handoff.instance_flag = reinterpret_cast<uint64_t*>(flags + kernels::kProgramInstanceOffset);
  handoff.instance_value = k;
  handoff.status_out = status_out;
  if (st.op == abi::OpKind::kLowLatencyDispatch) {
    kc::LowLatencyDispatchArgs a;
    a.buffer = st.buffer;
    a.use_fp8 = st.use_fp8;
    a.round_scale = st.round_scale;
    a.num_tokens_value = -1;  // T from the rank's token-count slot, staged by the client.
    a.handoff = handoff;
    return kc::LowLatencyDispatch(ctx, a, s);
  }
  kc::LowLatencyCombineArgs a;
  a.buffer = st.buffer;
  a.handoff = handoff;
  a.combined_x = reinterpret_cast<kernels::bf16_bits*>(
      cr.area.get() + layout().ll_combined_x[st.out_buffer].offset);
  return kc::LowLatencyCombine(ctx, a, s);
}

void CudaGroup::EnqueueProgramInstance() {
  Program& p = *program_;
  // Instance k takes the ring entry of instance k - kProgramDepth, which has completed
  // (inflight < kProgramDepth); its launch vector already has R entries (ArmProgram).
  const uint64_t k = p.next++;
  ProgramInstance& in = p.instance(k);
  in.k = k;
  in.step = static_cast<int>((in.k - 1) % p.steps.size());
  const int slot = static_cast<int>(in.k % kProgramDepth);
  const int R = static_cast<int>(p.ranks.size());
  // Every rank's wait and kernel before any rank's event (as StartOpInto).
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = p.ranks[r];
    const CudaRank& cr = *pr.rank;
    uint8_t* flags = cr.area.get() + cr.launch_flags_offset;
    in.launch[r] = [&]() -> absl::Status {
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
      cudaStream_t s = cr.stream.get();
      EPD_RETURN_IF_ERROR(kc::StreamWaitValue64Geq(s, flags + kernels::kProgramGoOffset, 1));
      EPD_RETURN_IF_ERROR(kc::StreamWriteValue64(s, flags + kernels::kProgramGoOffset, 0));
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(pr.waited[slot].get(), s)));
      return LaunchProgramStep(p.steps[in.step], r, in.k, &pr.readback.get()[slot]);
    }();
  }
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = p.ranks[r];
    const CudaRank& cr = *pr.rank;
    uint8_t* flags = cr.area.get() + cr.launch_flags_offset;
    cudaSetDevice(cr.device);
    cudaStream_t s = cr.stream.get();
    // The kernel wrote instance, done and its status; when its launch failed, the stream
    // writes them (the read-back is a kernel, not a copy: this is enqueued long before the
    // go wait passes, and a device-to-host copy waiting there would hold a copy-engine
    // queue that other streams' copies share, epd/kernels/cuda_program.h), so the client's
    // stream is released on every path.
    absl::Status st;
    absl::Status w;
    if (!in.launch[r].ok()) {
      st = kc::EnqueueStatusReadback(Context(r, 0), s, &pr.readback.get()[slot]);
      w = kc::StreamWriteValue64(s, flags + kernels::kProgramInstanceOffset, in.k);
      if (st.ok()) st = w;
      w = kc::StreamWriteValue64(s, flags + kernels::kProgramDoneOffset, 1);
      if (st.ok()) st = w;
    }
    w = EPD_CUDA_STATUS(cudaEventRecord(pr.done[slot].get(), s));
    if (st.ok()) st = w;
    if (in.launch[r].ok()) in.launch[r] = st;
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {}: enqueued instance {} (step {}) on rank {}: {}",
                        spec().name(), in.k, in.step, r, in.launch[r].ToString());
    }
  }
  ++p.inflight;
}

void CudaGroup::PublishProgramError(const absl::Status& st, uint64_t k, int step) {
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    LockstepEndpoint* ep = endpoint(r);
    if (!ep) continue;
    abi::EndpointShmHeader* h = ep->header;
    h->program_error_instance = k;
    h->program_error_code = static_cast<int32_t>(st.code());
    h->program_error_step = step;
    const std::string msg(st.message());
    const size_t n = std::min(msg.size(), static_cast<size_t>(abi::kMessageBytes - 1));
    std::memcpy(h->program_error_message, msg.data(), n);
    h->program_error_message[n] = '\0';
    abi::Atomic(h->program_errors).fetch_add(1, std::memory_order_release);
  }
}

void CudaGroup::PublishProgramChecked(uint64_t k) {
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (LockstepEndpoint* ep = endpoint(r)) {
      abi::Atomic(ep->header->program_checked).store(k, std::memory_order_release);
    }
  }
}

void CudaGroup::DisarmProgram(const absl::Status& why) {
  if (!program_) return;
  Program& p = *program_;
  if (ProgramTrace()) {
    EngineLog()->warn("program trace: group {}: disarming ({}) with {} instance(s) in flight",
                      spec().name(), why.ToString(), p.inflight);
  }
  // Release the instances still waiting for their client's go, in instance order. go = 1
  // for instance j is written only once instance j-1 has passed its wait and written
  // go = 0 (its `waited` event), so no write is lost; a redundant go = 1 only releases the
  // next instance early, which is released anyway.
  for (uint64_t k = p.front(); k < p.next; ++k) {
    const ProgramInstance& in = p.instance(k);
    const int slot = static_cast<int>(in.k % kProgramDepth);
    for (ProgramRank& pr : p.ranks) {
      cudaSetDevice(pr.rank->device);
      if (cudaEventQuery(pr.waited[slot].get()) != cudaErrorNotReady) continue;
      // A stream memory write, not a copy (epd/kernels/cuda_program.h: a copy could queue
      // behind another stream's copy that waits on the GPU).
      cudaStream_t aux = plane_->EngineOf(pr.rank->device)->aux.get();
      absl::Status st = kc::StreamWriteValue64(
          aux, pr.rank->area.get() + pr.rank->launch_flags_offset + kernels::kProgramGoOffset, 1);
      if (st.ok()) st = EPD_CUDA_STATUS(cudaStreamSynchronize(aux));
      if (!st.ok()) {
        EngineLog()->error("group {} rank {}: releasing program instance {} failed: {}",
                           spec().name(), pr.rank->rank, in.k, st.ToString());
      }
    }
    for (ProgramRank& pr : p.ranks) {
      cudaSetDevice(pr.rank->device);
      cudaEventSynchronize(pr.waited[slot].get());
    }
  }
  GpuOp tail;
  SizeOp(tail);  // ranks[r] set below; no ready waits (ReleaseReadyWaits reads ready_wait).
  tail.seq = 0;
  tail.started = Clock::now();
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    ProgramRank& pr = p.ranks[r];
    CudaRank& cr = *pr.rank;
    cudaSetDevice(cr.device);
    absl::Status st = kc::StreamWriteValue64(
        cr.stream.get(), cr.area.get() + cr.launch_flags_offset + kernels::kProgramDoneOffset,
        kernels::kProgramReleased);
    if (!st.ok()) {
      EngineLog()->error("group {} rank {}: releasing the program's client stream failed: {}",
                         spec().name(), cr.rank, st.ToString());
    }
    cudaEventRecord(cr.done.get(), cr.stream.get());
    tail.ranks[r] = pr.rank;
  }
  cudaGetLastError();
  if (!why.ok()) {
    LogClientCaused(spdlog::level::warn, "group {}: graph-mode program disarmed: {}", spec().name(),
                    why.message());
    PublishProgramError(why, p.next - 1, -1);
  } else {
    EngineLog()->info("group {}: graph-mode program unregistered", spec().name());
  }
  // The released instances' results are not checked: nothing waits for them.
  PublishProgramChecked(~uint64_t{0});
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (LockstepEndpoint* ep = endpoint(r)) {
      abi::Atomic(ep->header->program_armed).store(0, std::memory_order_release);
    }
  }
  program_.reset();
  program_armed_ = false;
  program_tail_ = std::move(tail);
  // The released instances ran on stale inputs, possibly without a rank that left.
  needs_sync_reset_ = true;
}

bool CudaGroup::ProgramTailDone() {
  if (!program_tail_) return true;
  for (const auto& r : program_tail_->ranks) {
    if (!r) continue;
    cudaSetDevice(r->device);
    if (cudaEventQuery(r->done.get()) == cudaErrorNotReady) return false;
  }
  cudaGetLastError();
  program_tail_.reset();
  if (!gpu_op_ && !abandoned_) plane_->ReleaseGpus(this);
  return true;
}

bool CudaGroup::PollBackground() {
  bool worked = false;
  if (program_tail_ && ProgramTailDone()) worked = true;
  if (!program_) return worked;
  Program& p = *program_;
  const int R = static_cast<int>(p.ranks.size());
  while (p.inflight > 0) {
    ProgramInstance& in = p.instance(p.front());
    const int slot = static_cast<int>(in.k % kProgramDepth);
    bool done = true;
    for (int r = 0; r < R && done; ++r) {
      cudaSetDevice(p.ranks[r].rank->device);
      const cudaError_t err = cudaEventQuery(p.ranks[r].done[slot].get());
      event_errors_[r] = err;
      if (err == cudaErrorNotReady) {
        done = false;
      } else if (err != cudaSuccess) {
        cudaGetLastError();  // Clear a non-sticky error: it is reported below.
      }
    }
    if (!done) {
      if (ProgramTrace() && Clock::now() >= p.trace_next) {
        p.trace_next = Clock::now() + std::chrono::seconds(1);
        for (uint64_t k = p.front(); k < p.next; ++k) {
          const int ps = static_cast<int>(k % kProgramDepth);
          std::string ranks;
          for (int r = 0; r < R; ++r) {
            cudaSetDevice(p.ranks[r].rank->device);
            absl::StrAppend(&ranks, " rank ", r, ": go wait ",
                            EventState(p.ranks[r].waited[ps].get()), ", instance ",
                            EventState(p.ranks[r].done[ps].get()), ";");
          }
          EngineLog()->warn("program trace: group {}: instance {} pending:{}", spec().name(), k,
                            ranks);
        }
      }
      break;
    }
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {}: instance {} (step {}) done on every rank",
                        spec().name(), in.k, in.step);
    }
    const ProgramStepPlan& step = p.steps[in.step];
    const char* name = OpName(static_cast<uint32_t>(step.op));
    absl::Status bad;  // OK (no allocation) unless a rank failed.
    bool disarm = false;
    for (int r = 0; r < R && bad.ok(); ++r) {
      const bool event_failed = event_errors_[r] != cudaSuccess;
      absl::Status st =
          !in.launch[r].ok() ? in.launch[r]
          : event_failed
              ? kc::CudaErrorToStatus(event_errors_[r], "cudaEventQuery(the instance's done event)",
                                      __FILE__, __LINE__)
              : kc::StatusFromDevice(p.ranks[r].readback.get()[slot], shape(), r, name, true);
      if (!st.ok()) {
        disarm =
            !in.launch[r].ok() || event_failed || st.code() == absl::StatusCode::kDeadlineExceeded;
        bad = absl::Status(st.code(),
                           absl::StrCat("program instance ", in.k, " step ", in.step, " (",
                                        ProgramStepName(step), "): rank ", r, ": ", st.message()));
      }
    }
    const uint64_t k = in.k;
    const int step_index = in.step;
    --p.inflight;  // Its ring entry is free for instance k + kProgramDepth.
    CountProgramInstance(bad.ok());
    worked = true;
    if (!bad.ok()) {
      LogClientCaused(spdlog::level::warn, "group {}: {}", spec().name(), bad.message());
      PublishProgramError(bad, k, step_index);
    }
    PublishProgramChecked(k);
    if (disarm) {
      // The ranks' kernel counters may be out of step: later instances could not pair up.
      DisarmProgram(absl::Status(bad.code(), absl::StrCat(bad.message(),
                                                          "; the program was disarmed: "
                                                          "register it again")));
      return true;
    }
  }
  while (program_->inflight < kProgramDepth) EnqueueProgramInstance();
  // Keep the engine polling while a program is armed: the client never touches the ring,
  // so only polling sees instances complete and enqueues the next ones.
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const CudaDataPlaneOptions& options) {
  auto plane = std::make_unique<CudaDataPlaneImpl>(options);
  EPD_RETURN_IF_ERROR(plane->Init());
  return std::unique_ptr<DataPlane>(std::move(plane));
}

absl::StatusOr<void*> FindInProcessCudaArea(const std::string& cuda_ipc_handle) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(cuda_ipc_handle);
  if (it == Registry().end()) {
    return absl::NotFoundError("no endpoint of this process exported that CUDA IPC handle");
  }
  return it->second;
}

}  // namespace epd
