// RdmaTransport (rdma_transport.h, DESIGN.md §5.4).
//
// Threads: the engine thread of each group calls its RdmaGroupLink: PostWrite posts work
// requests straight to the peer's queue pairs (ibv_post_send; no lock), PollImm pops from a
// per-peer ring and tops up the receive queues once the peer is ready. The one progress
// thread of the transport polls every peer's completion queue under RdmaCore::mu_, drives
// connecting (probe writes, their retries and the deadline), counts completed writes and
// delivered immediates, and fails a peer on an error completion; when nothing completes it
// arms the completion queues and sleeps on the devices' completion channels and an eventfd
// (bounded by a tick). Connect, FailPeer, Close and Shutdown take the same mutex, so a peer's
// queue pairs are reset or destroyed only while the progress thread is out of them.
//
// Work request ids: kind (bits 62-63), queue pair index (56-61), the queue pair's epoch
// (48-55: bumped whenever the queue pair is reset, so completions of an earlier life are
// dropped) and a per-queue-pair ordinal (0-47).
#include "daemon/transport/rdma/rdma_transport.h"

#if defined(EPD_HAVE_RDMA)

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "daemon/core/logging.h"
#include "daemon/transport/link_common.h"
#include "daemon/transport/rdma/rdma_connection.h"
#include "daemon/transport/rdma/rdma_datapath.h"
#include "daemon/transport/rdma/rdma_device.h"
#include "daemon/transport/rdma/rdma_memory.h"

namespace epd::transport {
namespace {

using rdma::IbvPtr;
using rdma::PeerLinkMachine;
using Clock = std::chrono::steady_clock;

constexpr int kTickMs = 20;          // Sleep bound when idle (connect deadlines).
constexpr int kPollBatch = 32;       // Completions per ibv_poll_cq.
constexpr int kPollRounds = 8;       // Batches per peer per loop turn.
constexpr uint32_t kPostBatch = 32;  // Work requests per ibv_post_send / ibv_post_recv.
constexpr int32_t kMaxNodes = 4096;
constexpr uint64_t kOrdinalMask = (uint64_t{1} << 48) - 1;

std::shared_ptr<spdlog::logger> Log() { return GetLogger(kLogTransport); }

std::string Errno(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

enum WrKind : uint64_t { kWrSend = 0, kWrSendLast = 1, kWrProbe = 2, kWrRecv = 3 };

uint64_t WrId(WrKind kind, uint32_t qp, uint8_t epoch, uint64_t ordinal) {
  return (uint64_t{kind} << 62) | (uint64_t{qp & 0x3fu} << 56) | (uint64_t{epoch} << 48) |
         (ordinal & kOrdinalMask);
}

std::string GidText(const std::array<uint8_t, 16>& gid) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (::inet_ntop(AF_INET6, gid.data(), buf, sizeof buf) == nullptr) return "?";
  return buf;
}

/// One queue pair towards a peer.
struct QpSlot {
  IbvPtr<ibv_qp> qp;
  uint32_t psn = 0;   // Its first send PSN (published).
  uint8_t epoch = 0;  // Bumped at every reset.
  // Send side: the engine thread posts (sq_posted), the progress thread completes.
  uint64_t sq_posted = 0;
  std::atomic<uint64_t> sq_done{0};
  uint64_t writes_done = 0;  // Progress thread: writes whose last work request completed.
  // Receive side: work requests posted (progress thread while connecting, the engine thread
  // once ready) and immediates received (progress thread).
  uint64_t recv_posted = 0;
  uint64_t got = 0;
  // Receives the peer's probe used (0 or 1 since Connect; progress thread): given back
  // beside those the engine consumed.
  std::atomic<uint64_t> probe_recvs{0};
  // The initiator's queue pair is reset and waits until reprobe_at to probe again.
  bool reprobe = false;
  Clock::time_point reprobe_at{};
};

/// One peer node of a link.
struct RdmaPeer : PeerCounters {
  int32_t node = 0;
  PeerLinkMachine machine;  // Under RdmaCore::mu_.
  absl::Status status;      // Why it failed (guarded by RdmaGroupLink::status_mu_).
  std::string address;      // "rdma GID ..." of its descriptor (Connect).
  rdma::RemoteEndpoint remote;
  IbvPtr<ibv_cq> cq;  // Declared before qps: destroyed after them.
  std::unique_ptr<QpSlot[]> qps;
  uint32_t num_qps = 0;
  // imm_slots: a ring of recv_wr, indexed by write seq.
  uint64_t got_max = 0;                        // Progress thread: the most any queue pair got.
  std::atomic<uint64_t> error_completions{0};  // rdma::CountsAsErrorCompletion, once kReady.
};

class RdmaGroupLink;

/// What the transport shares between its links: devices, ports, the progress thread.
class RdmaCore {
 public:
  explicit RdmaCore(RdmaTransportOptions options) : options_(std::move(options)) {}
  ~RdmaCore() { Shutdown(); }

  /// Opens the devices and ports, plans the queues, starts the progress thread.
  absl::Status Start();
  void Shutdown();
  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
  }
  absl::Status Register(RdmaGroupLink* link);
  void Unregister(RdmaGroupLink* link);

  const RdmaTransportOptions& options() const { return options_; }
  const rdma::QueuePlan& plan() const { return plan_; }
  bool gpu_direct() const { return gpu_direct_; }
  bool stopped() const { return stop_.load(); }
  std::mutex& mu() { return mu_; }
  /// The port a link receiving into `kind` memory of `cuda_device` uses: the first whose
  /// cuda_devices names it, else the first port.
  size_t ChoosePort(MemoryKind kind, int cuda_device) const {
    if (kind == MemoryKind::kCudaDevice) {
      for (size_t i = 0; i < options_.ports.size(); ++i) {
        const auto& c = options_.ports[i].cuda_devices;
        if (std::find(c.begin(), c.end(), cuda_device) != c.end()) return i;
      }
    }
    return 0;
  }
  const rdma::PortInfo& port(size_t i) const { return ports_[i]; }
  const rdma::RdmaDevice& device_of(size_t port) const { return *devices_[port_device_[port]]; }

 private:
  void Run();
  void DrainChannels();

  const RdmaTransportOptions options_;
  std::vector<std::unique_ptr<rdma::RdmaDevice>> devices_;
  std::vector<rdma::PortInfo> ports_;
  std::vector<size_t> port_device_;
  rdma::QueuePlan plan_;
  bool gpu_direct_ = false;
  ScopedFd epoll_fd_;
  ScopedFd wake_fd_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  ShutdownOnce shutdown_;

  std::mutex mu_;  // Guards links_ and every link's completion queues and queue pair states.
  std::vector<RdmaGroupLink*> links_;
};

class RdmaGroupLink final : public GroupLink {
 public:
  RdmaGroupLink(std::shared_ptr<RdmaCore> core, GroupLinkOptions options)
      : core_(std::move(core)), options_(std::move(options)) {}
  ~RdmaGroupLink() override { Close(); }

  /// Registers the regions, creates every peer's completion queue and queue pairs and the
  /// descriptor; the link is not yet registered with the progress thread.
  absl::Status Init();

  std::string LocalDescriptor() const override { return descriptor_; }
  absl::Status Connect(int32_t node, std::string_view descriptor) override;
  PeerState State(int32_t node) const override;
  absl::Status PeerStatus(int32_t node) const override;
  absl::Status PostWrite(int32_t node, std::span<const WritePiece> pieces, uint32_t imm) override;
  uint64_t WritesCompleted(int32_t node) const override;
  bool PollImm(int32_t node, uint32_t* imm) override;
  void FailPeer(int32_t node, const absl::Status& cause) override;
  absl::StatusOr<int> AddSendRegion(const MemoryRegion& region) override;
  void RemoveSendRegion(int handle) override;
  LinkCounters Counters(int32_t node) const override;
  void Close() override;

  // Progress-thread side, under RdmaCore::mu_.
  /// Polls every peer's completion queue; true when something completed.
  bool Progress(Clock::time_point now);
  /// Arms every peer's completion queue for the next completion (before sleeping).
  void Arm();
  /// Fails every peer with `cause` (Close: `wake` false; Shutdown: true).
  void Detach(const absl::Status& cause, bool wake);

 private:
  bool ValidNode(int32_t node) const { return IsPeerNode(options_, node); }
  /// "group 'g': node 1 (LABEL; rdma GID ...)" or "(rdma GID ...)" without a label.
  std::string PeerName(const RdmaPeer& p) const {
    return PeerNodeName(options_, p.node, p.address.empty() ? "address unknown" : p.address, "");
  }
  void CallWake() const {
    if (options_.wake) options_.wake();
  }
  enum class FailedBy { kProgress, kEngine, kClose };
  /// Moves `p`'s queue pairs to ERROR (the peer sees its writes fail) and makes it kFailed
  /// with `status` (the first cause wins). Under RdmaCore::mu_.
  void Fail(RdmaPeer& p, absl::Status status, FailedBy by = FailedBy::kProgress);
  absl::Status PeerError(const RdmaPeer& p, absl::string_view why) const {
    return errors::WithReason(absl::UnavailableError(absl::StrCat(PeerName(p), ": ", why)),
                              errors::Reason::kTransportFailed);
  }
  /// Brings queue pair `q` of `p` from RESET to RTS towards the peer's, posts its receives
  /// and, on the initiator, the probe (PeerLinkMachine). Under RdmaCore::mu_.
  absl::Status BringUp(RdmaPeer& p, uint32_t q);
  /// Posts the probe of queue pair `q` (PeerLinkMachine). Under RdmaCore::mu_.
  absl::Status PostProbe(RdmaPeer& p, uint32_t q);
  /// Resets queue pair `q` of `p` (new epoch, counters zero). Under RdmaCore::mu_.
  absl::Status ResetQp(RdmaPeer& p, uint32_t q);
  /// Posts receives on queue pair `q` until recv_wr wait beyond what was consumed.
  absl::Status TopUpRecv(RdmaPeer& p, uint32_t q);
  void HandleCompletion(RdmaPeer& p, const ibv_wc& wc, Clock::time_point now);
  /// Posts the chained work requests wrs_[0, n) on `qp`.
  absl::Status Flush(RdmaPeer& p, uint32_t q, uint32_t n);

  const std::shared_ptr<RdmaCore> core_;
  const GroupLinkOptions options_;
  const rdma::RdmaDevice* device_ = nullptr;
  rdma::PortInfo port_;
  rdma::PathOptions path_;
  rdma::QueuePlan plan_;
  uint32_t num_qps_ = 1;
  uint64_t stripe_ = rdma::kStripeBytes;
  std::vector<IbvPtr<ibv_mr>> mrs_;  // Declared before peers_: deregistered after the QPs.
  std::vector<rdma::RegisteredRegion> regions_;  // [mrs_] Engine thread (PostWrite).
  /// [mrs_] AddSendRegion's handle of each region; -1 for those of the options.
  std::vector<int> region_handles_;
  int next_region_handle_ = 0;                    // Engine thread.
  std::vector<std::unique_ptr<RdmaPeer>> peers_;  // Indexed by node (self's is null).
  std::string descriptor_;
  mutable std::mutex status_mu_;  // Guards RdmaPeer::status.
  // Engine-thread scratch for posting (no allocation per op).
  std::array<ibv_send_wr, kPostBatch> wrs_{};
  std::array<ibv_sge, kPostBatch> sges_{};
  std::array<uint32_t, abi::kRdmaMaxQps> counts_{};
  bool registered_ = false;  // Engine thread.
  bool closed_ = false;      // Engine thread.
};

// ---------------------------------------------------------------------------------------
// RdmaCore

absl::Status RdmaCore::Start() {
  EPD_RETURN_IF_ERROR(rdma::ValidateRdmaOptions(options_));
  for (const RdmaPort& p : options_.ports) {
    size_t d = 0;
    while (d < devices_.size() && devices_[d]->name() != p.device) ++d;
    if (d == devices_.size()) {
      EPD_ASSIGN_OR_RETURN(auto dev, rdma::OpenRdmaDevice(p.device));
      devices_.push_back(std::move(dev));
    }
    EPD_ASSIGN_OR_RETURN(rdma::PortInfo info,
                         rdma::QueryPort(*devices_[d], p.port, p.gid_index, options_.mtu));
    ports_.push_back(info);
    port_device_.push_back(d);
  }
  rdma::DeviceCaps caps = devices_.front()->caps();
  for (const auto& d : devices_) {
    caps.max_qp_wr = std::min(caps.max_qp_wr, d->caps().max_qp_wr);
    caps.max_cqe = std::min(caps.max_cqe, d->caps().max_cqe);
  }
  EPD_ASSIGN_OR_RETURN(plan_, rdma::PlanQueues(options_, caps));
  if (options_.gpudirect != GpuDirectMode::kOff) {
    std::vector<int> cuda;
    for (const RdmaPort& p : options_.ports) {
      cuda.insert(cuda.end(), p.cuda_devices.begin(), p.cuda_devices.end());
    }
    const absl::Status usable = rdma::CudaDmabufUsable(cuda);
    if (!usable.ok() && options_.gpudirect == GpuDirectMode::kOn) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rdma gpudirect is on but GPU memory cannot be registered: ", usable.message()));
    }
    gpu_direct_ = usable.ok();
    if (!usable.ok()) {
      Log()->info("RDMA: GPU memory is staged through host memory: {}", usable.message());
    }
  }
  epoll_fd_.Reset(::epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.Reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!epoll_fd_.valid() || !wake_fd_.valid()) {
    return absl::InternalError(absl::StrCat("rdma: epoll/eventfd: ", Errno(errno)));
  }
  const auto add = [&](int fd) -> absl::Status {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(absl::StrCat("rdma: epoll_ctl: ", Errno(errno)));
    }
    return absl::OkStatus();
  };
  EPD_RETURN_IF_ERROR(add(wake_fd_.get()));
  for (const auto& d : devices_) EPD_RETURN_IF_ERROR(add(d->channel()->fd));
  links_.reserve(64);
  thread_ = std::thread([this] { Run(); });
  for (size_t i = 0; i < ports_.size(); ++i) {
    const rdma::PortInfo& p = ports_[i];
    Log()->info(
        "RDMA transport: {} port {} ({}, GID[{}] {}, LID {}, MTU {}), {} queue pairs "
        "per peer, {} send / {} receive work requests each, GPU memory {}",
        options_.ports[i].device, p.port,
        p.link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "InfiniBand", p.gid_index,
        GidText(p.gid), p.lid, rdma::MtuBytes(p.mtu), options_.qps_per_peer, plan_.send_wr,
        plan_.recv_wr, gpu_direct_ ? "registered (dmabuf)" : "staged");
  }
  return absl::OkStatus();
}

void RdmaCore::Shutdown() {
  ShutdownCore(
      shutdown_, stop_, thread_, [this] { Wake(); }, mu_, links_, "RDMA");
}

absl::Status RdmaCore::Register(RdmaGroupLink* link) {
  std::lock_guard<std::mutex> l(mu_);
  if (stop_.load()) return absl::FailedPreconditionError("the RDMA transport was shut down");
  links_.push_back(link);
  return absl::OkStatus();
}

void RdmaCore::Unregister(RdmaGroupLink* link) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = std::find(links_.begin(), links_.end(), link);
  if (it != links_.end()) links_.erase(it);
  link->Detach(errors::WithReason(absl::UnavailableError("the link was closed"),
                                  errors::Reason::kTransportFailed),
               /*wake=*/false);
}

void RdmaCore::DrainChannels() {
  for (const auto& d : devices_) {
    for (;;) {
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      if (ibv_get_cq_event(d->channel(), &cq, &ctx) != 0) break;  // EAGAIN: none left.
      ibv_ack_cq_events(cq, 1);
    }
  }
}

void RdmaCore::Run() {
  std::array<epoll_event, 8> events{};
  while (!stop_.load()) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      const Clock::time_point now = Clock::now();
      for (RdmaGroupLink* link : links_) busy |= link->Progress(now);
      if (!busy) {
        // Arm, then look once more: a completion between the last poll and the arming
        // raises no event.
        for (RdmaGroupLink* link : links_) link->Arm();
        for (RdmaGroupLink* link : links_) busy |= link->Progress(now);
      }
    }
    if (busy) continue;
    const int n =
        ::epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()), kTickMs);
    if (n < 0 && errno != EINTR) {
      Log()->error("rdma: epoll_wait: {}", Errno(errno));
      std::this_thread::sleep_for(std::chrono::milliseconds(kTickMs));
    }
    uint64_t v = 0;
    [[maybe_unused]] ssize_t r = ::read(wake_fd_.get(), &v, sizeof v);
    std::lock_guard<std::mutex> l(mu_);
    DrainChannels();
  }
}

// ---------------------------------------------------------------------------------------
// RdmaGroupLink: setup and the caller's side

absl::Status RdmaGroupLink::Init() {
  const RdmaTransportOptions& o = core_->options();
  const std::string g = absl::StrCat("group '", options_.group, "'");
  EPD_RETURN_IF_ERROR(CheckGroupLinkOptions(options_, kMaxNodes));
  num_qps_ = o.qps_per_peer;
  stripe_ = rdma::StripeBytes(num_qps_);
  const size_t desc_bytes =
      abi::RdmaDescriptorBytes(static_cast<uint64_t>(options_.num_nodes), num_qps_);
  if (desc_bytes > abi::kRdmaMaxDescriptorBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(g, ": ", options_.num_nodes, " nodes with ", num_qps_,
                     " queue pairs per peer need a ", desc_bytes, "-byte descriptor, more than ",
                     abi::kRdmaMaxDescriptorBytes, ": lower rdma qps_per_peer"));
  }
  const size_t port_index = core_->ChoosePort(options_.recv_kind, options_.recv_cuda_device);
  device_ = &core_->device_of(port_index);
  port_ = core_->port(port_index);
  path_ = rdma::MakePathOptions(o, port_);
  plan_ = core_->plan();

  // Registration: the receive region (peers write it) and the send regions.
  uint32_t recv_rkey = 0;
  if (options_.recv_bytes > 0) {
    MemoryRegion recv{options_.recv_base, options_.recv_bytes, options_.recv_kind,
                      options_.recv_cuda_device};
    EPD_ASSIGN_OR_RETURN(
        auto mr,
        rdma::RegisterRegion(device_->pd(), recv, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
                             absl::StrCat(g, ": receive region")));
    recv_rkey = mr->rkey;
    regions_.push_back({reinterpret_cast<uint64_t>(options_.recv_base),
                        reinterpret_cast<uint64_t>(options_.recv_base) + options_.recv_bytes,
                        mr->lkey, mr->rkey});
    mrs_.push_back(std::move(mr));
    region_handles_.push_back(-1);
  }
  for (size_t i = 0; i < options_.send_regions.size(); ++i) {
    const MemoryRegion& r = options_.send_regions[i];
    EPD_ASSIGN_OR_RETURN(auto mr, rdma::RegisterRegion(device_->pd(), r, IBV_ACCESS_LOCAL_WRITE,
                                                       absl::StrCat(g, ": send region ", i)));
    regions_.push_back({reinterpret_cast<uint64_t>(r.base),
                        reinterpret_cast<uint64_t>(r.base) + r.bytes, mr->lkey, mr->rkey});
    mrs_.push_back(std::move(mr));
    region_handles_.push_back(-1);
  }

  // Every peer's completion queue and queue pairs (RESET until Connect).
  std::vector<rdma::QpEndpoint> endpoints(static_cast<size_t>(options_.num_nodes) * num_qps_);
  peers_.resize(static_cast<size_t>(options_.num_nodes));
  for (int32_t n = 0; n < options_.num_nodes; ++n) {
    if (n == options_.self_node) continue;
    auto p = std::make_unique<RdmaPeer>();
    p->node = n;
    p->num_qps = num_qps_;
    p->machine = PeerLinkMachine(num_qps_, /*initiator=*/options_.self_node < n);
    p->imm_slots.resize(plan_.recv_wr);
    p->cq.reset(ibv_create_cq(device_->context(), static_cast<int>(plan_.cq_depth), nullptr,
                              device_->channel(), 0));
    if (p->cq == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(g, ": ibv_create_cq(", plan_.cq_depth,
                                                       ") for node ", n, ": ", Errno(errno)));
    }
    p->qps = std::make_unique<QpSlot[]>(num_qps_);
    for (uint32_t q = 0; q < num_qps_; ++q) {
      ibv_qp_init_attr a{};
      a.send_cq = p->cq.get();
      a.recv_cq = p->cq.get();
      a.cap.max_send_wr = plan_.send_wr;
      a.cap.max_recv_wr = plan_.recv_wr;
      a.cap.max_send_sge = 1;
      a.cap.max_recv_sge = 1;
      a.qp_type = IBV_QPT_RC;
      a.sq_sig_all = 0;
      QpSlot& s = p->qps[q];
      s.qp.reset(ibv_create_qp(device_->pd(), &a));
      if (s.qp == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            g, ": ibv_create_qp for node ", n, " (queue pair ", q, " of ", num_qps_, ", ",
            plan_.send_wr, "/", plan_.recv_wr, " work requests): ", Errno(errno)));
      }
      uint32_t psn = 0;
      if (::getrandom(&psn, sizeof psn, 0) != static_cast<ssize_t>(sizeof psn)) psn = 0x5eed;
      s.psn = psn & 0xffffffu;
      endpoints[static_cast<size_t>(n) * num_qps_ + q] = {s.qp->qp_num, s.psn};
    }
    peers_[static_cast<size_t>(n)] = std::move(p);
  }
  rdma::LocalEndpoint local;
  local.node = options_.self_node;
  local.num_nodes = options_.num_nodes;
  local.num_qps = num_qps_;
  local.port = port_;
  local.recv_addr = options_.recv_bytes > 0 ? reinterpret_cast<uint64_t>(options_.recv_base) : 0;
  local.recv_bytes = options_.recv_bytes;
  local.recv_rkey = recv_rkey;
  descriptor_ = rdma::EncodeDescriptor(local, endpoints);
  EPD_RETURN_IF_ERROR(core_->Register(this));
  registered_ = true;
  core_->Wake();  // The progress thread arms the new completion queues.
  return absl::OkStatus();
}

absl::Status RdmaGroupLink::ResetQp(RdmaPeer& p, uint32_t q) {
  QpSlot& s = p.qps[q];
  ++s.epoch;
  s.sq_posted = 0;
  s.sq_done.store(0, std::memory_order_relaxed);
  s.writes_done = 0;
  s.recv_posted = s.probe_recvs.load(std::memory_order_relaxed);
  s.got = 0;
  s.reprobe = false;
  return rdma::ModifyQp(s.qp.get(), rdma::StateTransition(IBV_QPS_RESET),
                        absl::StrCat("queue pair ", q));
}

absl::Status RdmaGroupLink::TopUpRecv(RdmaPeer& p, uint32_t q) {
  QpSlot& s = p.qps[q];
  const uint64_t target = p.consumed.load(std::memory_order_acquire) + plan_.recv_wr +
                          s.probe_recvs.load(std::memory_order_acquire);
  std::array<ibv_recv_wr, kPostBatch> rwrs{};
  while (s.recv_posted < target) {
    const uint32_t n =
        static_cast<uint32_t>(std::min<uint64_t>(kPostBatch, target - s.recv_posted));
    for (uint32_t i = 0; i < n; ++i) {
      rwrs[i] = ibv_recv_wr{};
      rwrs[i].wr_id = WrId(kWrRecv, q, s.epoch, s.recv_posted + i);
      rwrs[i].num_sge = 0;
      rwrs[i].next = i + 1 < n ? &rwrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_recv(s.qp.get(), rwrs.data(), &bad); rc != 0) {
      return PeerError(p, absl::StrCat("queue pair ", q, ": ibv_post_recv: ", Errno(rc)));
    }
    s.recv_posted += n;
  }
  return absl::OkStatus();
}

absl::Status RdmaGroupLink::BringUp(RdmaPeer& p, uint32_t q) {
  QpSlot& s = p.qps[q];
  const std::string what = absl::StrCat(PeerName(p), ": queue pair ", q);
  EPD_RETURN_IF_ERROR(rdma::ModifyQp(s.qp.get(), rdma::InitTransition(path_), what));
  EPD_RETURN_IF_ERROR(TopUpRecv(p, q));
  // A peer probe already received (before a reset of this end) moved the peer's PSN on.
  rdma::QpEndpoint remote = p.remote.qps[q];
  if (p.machine.peer_probed(q)) remote.psn = (remote.psn + 1) & 0xffffffu;
  EPD_RETURN_IF_ERROR(
      rdma::ModifyQp(s.qp.get(), rdma::RtrTransition(path_, p.remote, remote), what));
  EPD_RETURN_IF_ERROR(rdma::ModifyQp(s.qp.get(), rdma::RtsTransition(path_, s.psn), what));
  if (p.machine.initiator()) return PostProbe(p, q);
  return absl::OkStatus();
}

absl::Status RdmaGroupLink::PostProbe(RdmaPeer& p, uint32_t q) {
  QpSlot& s = p.qps[q];
  ibv_send_wr probe{};
  probe.wr_id = WrId(kWrProbe, q, s.epoch, s.sq_posted);
  probe.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  probe.send_flags = IBV_SEND_SIGNALED;
  probe.imm_data = 0;
  probe.num_sge = 0;
  probe.wr.rdma.remote_addr = p.remote.recv_addr;
  probe.wr.rdma.rkey = p.remote.recv_rkey;
  ibv_send_wr* bad = nullptr;
  if (const int rc = ibv_post_send(s.qp.get(), &probe, &bad); rc != 0) {
    return absl::InternalError(
        absl::StrCat(PeerName(p), ": queue pair ", q, ": ibv_post_send (probe): ", Errno(rc)));
  }
  ++s.sq_posted;
  return absl::OkStatus();
}

absl::Status RdmaGroupLink::Connect(int32_t node, std::string_view descriptor) {
  if (closed_ || core_->stopped()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", options_.group, "': the link is closed",
                     core_->stopped() ? " (the RDMA transport was shut down)" : ""));
  }
  if (!ValidNode(node)) return NotAPeerError(options_, node, "Connect");
  absl::StatusOr<rdma::RemoteEndpoint> remote = rdma::ParseDescriptor(
      descriptor, node, options_.self_node, options_.num_nodes, num_qps_, port_.link_layer);
  if (!remote.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", options_.group, "': ", remote.status().message()));
  }
  RdmaPeer& p = *peers_[static_cast<size_t>(node)];
  std::lock_guard<std::mutex> l(core_->mu());
  if (p.machine.state() != PeerState::kIdle) {
    // A new incarnation: its queue pairs start over (same numbers, new epochs), its writes
    // and undelivered immediates are dropped, and the old completions with them.
    for (uint32_t q = 0; q < p.num_qps; ++q) (void)ResetQp(p, q);
    std::array<ibv_wc, kPollBatch> wcs{};
    while (ibv_poll_cq(p.cq.get(), kPollBatch, wcs.data()) > 0) {
    }
    for (uint32_t q = 0; q < p.num_qps; ++q) {
      p.qps[q].probe_recvs.store(0, std::memory_order_relaxed);
      p.qps[q].recv_posted = 0;
    }
    p.writes_posted.store(0, std::memory_order_relaxed);
    p.writes_done.store(0, std::memory_order_relaxed);
    p.got_max = 0;
    p.delivered.store(0, std::memory_order_relaxed);
    p.consumed.store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> sl(status_mu_);
    p.status = absl::OkStatus();
  }
  p.remote = *remote;
  p.address = p.remote.link_layer == IBV_LINK_LAYER_ETHERNET
                  ? absl::StrCat("rdma GID ", GidText(p.remote.gid))
                  : absl::StrCat("rdma LID ", p.remote.lid);
  p.machine.OnConnect(Clock::now() +
                      std::chrono::milliseconds(core_->options().connect_timeout_ms));
  p.state.store(PeerState::kConnecting, std::memory_order_release);
  for (uint32_t q = 0; q < p.num_qps; ++q) {
    if (const absl::Status s = BringUp(p, q); !s.ok()) {
      Fail(
          p,
          errors::WithReason(absl::UnavailableError(s.message()), errors::Reason::kTransportFailed),
          FailedBy::kEngine);
      break;
    }
  }
  core_->Wake();
  return absl::OkStatus();
}

PeerState RdmaGroupLink::State(int32_t node) const {
  if (!ValidNode(node)) return NonPeerState(options_, node);
  return peers_[static_cast<size_t>(node)]->state.load(std::memory_order_acquire);
}

absl::Status RdmaGroupLink::PeerStatus(int32_t node) const {
  if (!ValidNode(node)) return NonPeerStatus(options_, node);
  const RdmaPeer& p = *peers_[static_cast<size_t>(node)];
  if (p.state.load(std::memory_order_acquire) != PeerState::kFailed) return absl::OkStatus();
  std::lock_guard<std::mutex> l(status_mu_);
  return p.status;
}

absl::Status RdmaGroupLink::Flush(RdmaPeer& p, uint32_t q, uint32_t n) {
  if (n == 0) return absl::OkStatus();
  wrs_[n - 1].next = nullptr;
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(p.qps[q].qp.get(), wrs_.data(), &bad);
  if (rc == 0) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(PeerName(p), ": queue pair ", q, ": ibv_post_send: ", Errno(rc)));
}

absl::StatusOr<int> RdmaGroupLink::AddSendRegion(const MemoryRegion& region) {
  const std::string what = absl::StrCat("group '", options_.group, "': send region added at 0x",
                                        absl::Hex(reinterpret_cast<uint64_t>(region.base)));
  if (region.kind == MemoryKind::kCudaDevice && !core_->gpu_direct()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": GPU memory, but this rdma transport has GPUDirect off"));
  }
  EPD_ASSIGN_OR_RETURN(auto mr,
                       rdma::RegisterRegion(device_->pd(), region, IBV_ACCESS_LOCAL_WRITE, what));
  const auto base = reinterpret_cast<uint64_t>(region.base);
  regions_.push_back({base, base + region.bytes, mr->lkey, mr->rkey});
  mrs_.push_back(std::move(mr));
  const int handle = next_region_handle_++;
  region_handles_.push_back(handle);
  return handle;
}

void RdmaGroupLink::RemoveSendRegion(int handle) {
  for (size_t i = 0; i < region_handles_.size(); ++i) {
    if (handle < 0 || region_handles_[i] != handle) continue;
    region_handles_.erase(region_handles_.begin() + static_cast<ptrdiff_t>(i));
    regions_.erase(regions_.begin() + static_cast<ptrdiff_t>(i));
    mrs_.erase(mrs_.begin() + static_cast<ptrdiff_t>(i));  // Deregisters it.
    return;
  }
}

absl::Status RdmaGroupLink::PostWrite(int32_t node, std::span<const WritePiece> pieces,
                                      uint32_t imm) {
  if (!ValidNode(node)) return NotAPeerError(options_, node, "PostWrite");
  RdmaPeer& p = *peers_[static_cast<size_t>(node)];
  const PeerState state = p.state.load(std::memory_order_acquire);
  if (state != PeerState::kReady) {
    if (state == PeerState::kFailed) return PeerStatus(node);
    return errors::WithReason(
        absl::UnavailableError(absl::StrCat(PeerName(p), " is not connected yet")),
        errors::Reason::kTransportFailed);
  }
  if (const ptrdiff_t bad = FirstPieceOutside(pieces, p.remote.recv_bytes); bad >= 0) {
    return PieceOutsideError(pieces, bad, p.remote.recv_bytes, PeerName(p));
  }
  if (const ptrdiff_t bad =
          FirstSourceOutside(pieces, std::span<const rdma::RegisteredRegion>(regions_));
      bad >= 0) {
    return SourceOutsideError(pieces, bad, PeerName(p));
  }
  rdma::CountWrs(pieces, stripe_, num_qps_, counts_);
  for (uint32_t q = 0; q < num_qps_; ++q) {
    const uint64_t need = std::max<uint32_t>(counts_[q], 1);
    if (need > plan_.send_wr) {
      return absl::InvalidArgumentError(absl::StrCat(
          PeerName(p), ": a write of ", pieces.size(), " pieces needs ", need,
          " work requests on queue pair ", q, ", its send queue holds ", plan_.send_wr));
    }
    const QpSlot& s = p.qps[q];
    if (s.sq_posted - s.sq_done.load(std::memory_order_acquire) + need > plan_.send_wr) {
      return absl::ResourceExhaustedError(absl::StrCat(PeerName(p), ": too many writes in flight"));
    }
  }
  const uint32_t be_imm = htonl(imm);
  for (uint32_t q = 0; q < num_qps_; ++q) {
    QpSlot& s = p.qps[q];
    uint32_t n = 0;
    absl::Status posted = absl::OkStatus();
    rdma::PlanQpWrs(pieces, stripe_, num_qps_, q, counts_[q], [&](const rdma::PlannedWr& w) {
      if (!posted.ok()) return;
      ibv_send_wr& wr = wrs_[n];
      ibv_sge& sge = sges_[n];
      wr = ibv_send_wr{};
      const uint64_t ordinal = s.sq_posted++;
      wr.wr_id = WrId(w.with_imm ? kWrSendLast : kWrSend, q, s.epoch, ordinal);
      wr.opcode = w.with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
      wr.send_flags =
          rdma::Signalled(ordinal, plan_.signal_every, w.with_imm) ? IBV_SEND_SIGNALED : 0;
      wr.imm_data = be_imm;
      wr.wr.rdma.rkey = p.remote.recv_rkey;
      wr.wr.rdma.remote_addr = p.remote.recv_addr;
      if (w.piece != rdma::kNoPiece) {
        const WritePiece& piece = pieces[w.piece];
        const uint64_t src = reinterpret_cast<uint64_t>(piece.src) + w.offset;
        sge.addr = src;
        sge.length = static_cast<uint32_t>(w.bytes);
        sge.lkey = rdma::FindRegion(regions_, piece.src, piece.bytes)->lkey;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.wr.rdma.remote_addr += piece.remote_offset + w.offset;
      }
      wr.next = &wrs_[n + 1 < kPostBatch ? n + 1 : n];
      if (++n == kPostBatch) {
        posted = Flush(p, q, n);
        n = 0;
      }
    });
    if (posted.ok()) posted = Flush(p, q, n);
    if (!posted.ok()) {
      // Part of the write may be on the wire: the peer cannot be trusted to see it whole.
      std::lock_guard<std::mutex> l(core_->mu());
      Fail(p,
           errors::WithReason(absl::UnavailableError(posted.message()),
                              errors::Reason::kTransportFailed),
           FailedBy::kEngine);
      return PeerStatus(node);
    }
  }
  p.writes_posted.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

LinkCounters RdmaGroupLink::Counters(int32_t node) const {
  LinkCounters out;  // Verbs shows no retransmits per queue pair (the NIC's hw_counters do).
  if (!ValidNode(node)) return out;
  out.error_completions = static_cast<int64_t>(
      peers_[static_cast<size_t>(node)]->error_completions.load(std::memory_order_relaxed));
  return out;
}

uint64_t RdmaGroupLink::WritesCompleted(int32_t node) const {
  if (!ValidNode(node)) return 0;
  // kFailed is stored after the peer's queue pairs moved to ERROR: the NIC reads no source
  // of theirs any more.
  return peers_[static_cast<size_t>(node)]->WritesCompleted();
}

bool RdmaGroupLink::PollImm(int32_t node, uint32_t* imm) {
  if (!ValidNode(node)) return false;
  RdmaPeer& p = *peers_[static_cast<size_t>(node)];
  if (!p.PopImm(imm)) return false;
  const uint64_t consumed = p.consumed.load(std::memory_order_relaxed);
  // Once ready the engine thread owns the receive queues: it gives back what it consumed,
  // in batches.
  if (p.state.load(std::memory_order_acquire) == PeerState::kReady) {
    const uint64_t batch = std::max<uint64_t>(1, plan_.recv_wr / 8);
    for (uint32_t q = 0; q < p.num_qps; ++q) {
      const QpSlot& slot = p.qps[q];
      if (slot.recv_posted + batch >
          consumed + plan_.recv_wr + slot.probe_recvs.load(std::memory_order_acquire)) {
        continue;
      }
      if (const absl::Status s = TopUpRecv(p, q); !s.ok()) {
        std::lock_guard<std::mutex> l(core_->mu());
        Fail(p, s, FailedBy::kEngine);
        break;
      }
    }
  }
  return true;
}

void RdmaGroupLink::FailPeer(int32_t node, const absl::Status& cause) {
  if (!ValidNode(node) || closed_) return;
  RdmaPeer& p = *peers_[static_cast<size_t>(node)];
  std::lock_guard<std::mutex> l(core_->mu());
  Fail(p, PeerError(p, cause.message()), FailedBy::kEngine);
}

void RdmaGroupLink::Close() {
  if (closed_) return;
  closed_ = true;
  if (registered_) core_->Unregister(this);
}

void RdmaGroupLink::Detach(const absl::Status& cause, bool wake) {
  bool failed = false;
  for (auto& p : peers_) {
    if (p == nullptr) continue;
    failed |= p->state.load() != PeerState::kFailed;
    Fail(*p, PeerError(*p, cause.message()), FailedBy::kClose);
  }
  if (wake && failed) CallWake();
}

// ---------------------------------------------------------------------------------------
// RdmaGroupLink: the progress side (under RdmaCore::mu_)

void RdmaGroupLink::Fail(RdmaPeer& p, absl::Status status, FailedBy by) {
  if (p.state.load() == PeerState::kFailed) return;
  for (uint32_t q = 0; q < p.num_qps; ++q) {
    (void)rdma::ModifyQp(p.qps[q].qp.get(), rdma::StateTransition(IBV_QPS_ERR), "");
  }
  p.machine.OnFail();
  if (by != FailedBy::kClose) Log()->warn("{}", status.message());
  {
    std::lock_guard<std::mutex> l(status_mu_);
    p.status = std::move(status);
  }
  p.state.store(PeerState::kFailed, std::memory_order_release);
  if (by == FailedBy::kProgress) CallWake();
}

void RdmaGroupLink::Arm() {
  for (auto& p : peers_) {
    if (p != nullptr) ibv_req_notify_cq(p->cq.get(), 0);
  }
}

void RdmaGroupLink::HandleCompletion(RdmaPeer& p, const ibv_wc& wc, Clock::time_point now) {
  const auto kind = static_cast<WrKind>(wc.wr_id >> 62);
  const auto q = static_cast<uint32_t>((wc.wr_id >> 56) & 0x3f);
  const auto epoch = static_cast<uint8_t>((wc.wr_id >> 48) & 0xff);
  const uint64_t ordinal = wc.wr_id & kOrdinalMask;
  if (q >= p.num_qps || epoch != p.qps[q].epoch) return;  // Of an earlier life.
  const PeerState state = p.state.load(std::memory_order_relaxed);
  if (state == PeerState::kFailed || state == PeerState::kIdle) return;
  if (state == PeerState::kReady && rdma::CountsAsErrorCompletion(wc.status)) {
    p.error_completions.fetch_add(1, std::memory_order_relaxed);
  }
  QpSlot& s = p.qps[q];
  switch (kind) {
    case kWrProbe: {
      if (wc.status == IBV_WC_SUCCESS) s.sq_done.store(ordinal + 1, std::memory_order_release);
      switch (p.machine.OnProbe(q, wc.status, now)) {
        case PeerLinkMachine::Action::kReady:
          p.state.store(PeerState::kReady, std::memory_order_release);
          Log()->debug("{}: connected ({} queue pairs, {} probe retries)", PeerName(p), p.num_qps,
                       p.machine.reprobes());
          CallWake();
          break;
        case PeerLinkMachine::Action::kReprobe: {
          // The peer's queue pair was not up (its daemon has not connected yet): reset this
          // one; Progress brings it up and probes again after kReprobeInterval.
          if (const absl::Status st = ResetQp(p, q); !st.ok()) {
            Fail(p, errors::WithReason(absl::UnavailableError(st.message()),
                                       errors::Reason::kTransportFailed));
            break;
          }
          s.reprobe = true;
          s.reprobe_at = now + rdma::kReprobeInterval;
          break;
        }
        case PeerLinkMachine::Action::kFail:
          // The initiator past its deadline, the responder (the initiator's queue pair was
          // up when it probed back), or a ready peer.
          Fail(p, rdma::WcStatusToStatus(wc.status, wc.vendor_err, PeerName(p), q, false));
          break;
        case PeerLinkMachine::Action::kNone:
          break;
      }
      return;
    }
    case kWrSend:
    case kWrSendLast:
      if (wc.status != IBV_WC_SUCCESS) {
        Fail(p, rdma::WcStatusToStatus(wc.status, wc.vendor_err, PeerName(p), q, false));
        return;
      }
      s.sq_done.store(ordinal + 1, std::memory_order_release);
      if (kind == kWrSendLast) ++s.writes_done;
      return;
    case kWrRecv: {
      // While connecting a flushed receive only says the queue pair went to ERROR; the
      // probe's own completion says why (and the initiator probes again).
      if (wc.status == IBV_WC_WR_FLUSH_ERR && state == PeerState::kConnecting) return;
      if (wc.status != IBV_WC_SUCCESS) {
        Fail(p, rdma::WcStatusToStatus(wc.status, wc.vendor_err, PeerName(p), q, true));
        return;
      }
      if (!p.machine.peer_probed(q)) {
        // The first receive since Connect is the peer's probe, not an immediate.
        s.probe_recvs.fetch_add(1, std::memory_order_release);
        if (p.machine.OnPeerProbe(q) == PeerLinkMachine::Action::kSendProbe) {
          if (const absl::Status st = PostProbe(p, q); !st.ok()) {
            Fail(p, errors::WithReason(absl::UnavailableError(st.message()),
                                       errors::Reason::kTransportFailed));
          }
        }
        return;
      }
      if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || (wc.wc_flags & IBV_WC_WITH_IMM) == 0) {
        Fail(p, errors::WithReason(
                    absl::DataLossError(absl::StrCat(PeerName(p), ": queue pair ", q,
                                                     ": a receive that is not an RDMA write with "
                                                     "immediate (opcode ",
                                                     static_cast<int>(wc.opcode), ")")),
                    errors::Reason::kPeerProtocol));
        return;
      }
      const uint32_t imm = ntohl(wc.imm_data);
      uint32_t& slot = p.imm_slots[s.got % p.imm_slots.size()];
      if (s.got < p.got_max) {
        // Another queue pair delivered this write's immediate already: they must agree.
        if (slot != imm) {
          Fail(p, errors::WithReason(absl::DataLossError(absl::StrCat(
                                         PeerName(p), ": write ", s.got, " carries immediate ", imm,
                                         " on queue pair ", q, " and ", slot, " on another")),
                                     errors::Reason::kPeerProtocol));
          return;
        }
      } else {
        slot = imm;
        p.got_max = s.got + 1;
      }
      ++s.got;
      return;
    }
  }
}

bool RdmaGroupLink::Progress(Clock::time_point now) {
  bool busy = false;
  std::array<ibv_wc, kPollBatch> wcs{};
  for (auto& pp : peers_) {
    if (pp == nullptr) continue;
    RdmaPeer& p = *pp;
    if (p.machine.state() == PeerState::kIdle) continue;
    for (int round = 0; round < kPollRounds; ++round) {
      const int n = ibv_poll_cq(p.cq.get(), kPollBatch, wcs.data());
      if (n < 0) {
        Fail(p, PeerError(p, "ibv_poll_cq failed"));
        break;
      }
      for (int i = 0; i < n; ++i) HandleCompletion(p, wcs[static_cast<size_t>(i)], now);
      busy |= n > 0;
      if (n < kPollBatch) break;
    }
    const PeerState state = p.state.load(std::memory_order_relaxed);
    if (state == PeerState::kConnecting) {
      if (p.machine.OnTick(now) == PeerLinkMachine::Action::kFail) {
        const ibv_wc_status last = p.machine.last_error();
        Fail(p,
             PeerError(p, absl::StrCat(
                              "not connected within ", core_->options().connect_timeout_ms, " ms (",
                              p.machine.probed(), " of ", p.num_qps, " queue pairs answered",
                              last == IBV_WC_SUCCESS
                                  ? std::string()
                                  : absl::StrCat("; last probe: ", ibv_wc_status_str(last)),
                              "): is the peer's daemon up and its port reachable with this "
                              "GID, service level and traffic class?")));
        continue;
      }
      for (uint32_t q = 0; q < p.num_qps; ++q) {
        QpSlot& s = p.qps[q];
        if (!s.reprobe || now < s.reprobe_at) continue;
        s.reprobe = false;
        if (const absl::Status st = BringUp(p, q); !st.ok()) {
          Fail(p, errors::WithReason(absl::UnavailableError(st.message()),
                                     errors::Reason::kTransportFailed));
          break;
        }
      }
      if (p.state.load(std::memory_order_relaxed) == PeerState::kFailed) continue;
      // Until ready the progress thread gives the receive queues back (immediates may come
      // from a peer that is ready before this end is).
      for (uint32_t q = 0; q < p.num_qps; ++q) {
        if (p.qps[q].reprobe) continue;  // In RESET: BringUp posts them.
        if (const absl::Status st = TopUpRecv(p, q); !st.ok()) {
          Fail(p, st);
          break;
        }
      }
    }
    if (p.state.load(std::memory_order_relaxed) == PeerState::kFailed) continue;
    uint64_t done = UINT64_MAX;
    uint64_t got = UINT64_MAX;
    for (uint32_t q = 0; q < p.num_qps; ++q) {
      done = std::min(done, p.qps[q].writes_done);
      got = std::min(got, p.qps[q].got);
    }
    bool woke = false;
    if (done > p.writes_done.load(std::memory_order_relaxed)) {
      p.writes_done.store(done, std::memory_order_release);
      woke = true;
    }
    if (got > p.delivered.load(std::memory_order_relaxed)) {
      p.delivered.store(got, std::memory_order_release);
      woke = true;
    }
    if (woke) CallWake();
  }
  return busy;
}

// ---------------------------------------------------------------------------------------
// RdmaTransport

class RdmaTransport final : public Transport {
 public:
  explicit RdmaTransport(std::shared_ptr<RdmaCore> core) : core_(std::move(core)) {}
  ~RdmaTransport() override { Shutdown(); }
  std::string name() const override { return "rdma"; }
  absl::Status CompareDescriptorSettings(std::string_view ours, std::string_view theirs,
                                         std::string_view our_node,
                                         std::string_view their_node) const override {
    return rdma::CompareDescriptorSettings(ours, theirs, our_node, their_node);
  }
  bool Supports(MemoryKind kind) const override {
    return kind == MemoryKind::kHost || (kind == MemoryKind::kCudaDevice && core_->gpu_direct());
  }
  absl::StatusOr<std::unique_ptr<GroupLink>> CreateGroupLink(
      const GroupLinkOptions& options) override {
    if (core_->stopped()) {
      return absl::FailedPreconditionError("the RDMA transport was shut down");
    }
    const auto refuse = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", options.group, "': ", what,
                       " is CUDA device memory, which this RDMA transport does not register (rdma "
                       "gpudirect off or unusable): stage through host memory"));
    };
    if (!Supports(options.recv_kind)) return refuse("the receive region");
    for (const MemoryRegion& r : options.send_regions) {
      if (!Supports(r.kind)) return refuse("a send region");
    }
    auto link = std::make_unique<RdmaGroupLink>(core_, options);
    EPD_RETURN_IF_ERROR(link->Init());
    return std::unique_ptr<GroupLink>(std::move(link));
  }
  void Shutdown() override { core_->Shutdown(); }

 private:
  std::shared_ptr<RdmaCore> core_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> MakeRdmaTransport(const RdmaTransportOptions& options) {
  auto core = std::make_shared<RdmaCore>(options);
  EPD_RETURN_IF_ERROR(core->Start());
  return std::unique_ptr<Transport>(std::make_unique<RdmaTransport>(std::move(core)));
}

}  // namespace epd::transport

#else  // !EPD_HAVE_RDMA

#include "absl/strings/str_cat.h"

namespace epd::transport {

absl::StatusOr<std::unique_ptr<Transport>> MakeRdmaTransport(const RdmaTransportOptions& options) {
  (void)options;
  return absl::UnimplementedError(
      "the RDMA transport is not built into this epd (EPD_WITH_RDMA=OFF, or libibverbs-dev / "
      "librdmacm-dev were missing when it was built): use transport \"tcp\", or rebuild with "
      "them installed");
}

}  // namespace epd::transport

#endif  // EPD_HAVE_RDMA
