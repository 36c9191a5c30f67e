// epd_bench --backend=host|cuda --nodes=N (N >= 2): a group across nodes through the real
// data path. N real `epd --backend=host` (or `--backend=cuda`, every node on this machine's
// GPU 0, the clients' tensors in device memory) daemons on this machine (tests/common StartNodes:
// each its own socket, Peer listener and TCP transport, one shared secret in a 0600 file) stand in
// for N nodes; one client (libepdclient, a thread of this process with its own Client) per rank
// joins its own node's daemon. Each op runs `--internode_iters` times after a warm-up; its p50/p99
// (every rank's samples) are printed beside two same-run bounds:
//  - plain TCP: the bytes that cross nodes for that op (what each node sends each other
//    node, counted from the inputs with the exchange's layout, proto/abi/exchange_abi.h,
//    DESIGN §5.1) exchanged through plain sockets between the same hosts, with the same
//    connections per ordered pair of nodes as the daemons' transport;
//  - one node: the same shape and inputs as a one-node group of all the ranks on node 0's
//    daemon;
//  - CUDA only, host copies: the largest number of bytes one node sends or receives for
//    the op, copied device-to-host into pinned memory and back (the staging those bytes
//    take through the host when the transport cannot reach GPU memory).
// Goal: internode p50 <= 2 x plain-TCP p50 + one-node p50 (+ the host copies on CUDA).
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/os/scoped_fd.h"
#include "daemon/core/config.h"
#include "daemon/transport/tcp/tcp_transport.h"
#include "epd/client.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/types.h"
#include "proto/abi/exchange_abi.h"
#include "tests/bench/bench.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"

#if defined(EPD_HAVE_CUDA)
#include <cuda_runtime.h>

#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/gpu_uuid.h"
#include "tests/bench/bench_cuda.h"
#endif

ABSL_FLAG(int, nodes, 1,
          "host bench: daemons standing in for nodes; >= 2 measures a group across them");
ABSL_FLAG(int, ranks_per_node, 2, "host bench across nodes: ranks (client threads) per node");
ABSL_FLAG(int, internode_tokens, 512, "host bench across nodes: normal-mode tokens per rank");
ABSL_FLAG(int, internode_ll_tokens, 128, "host bench across nodes: low-latency tokens per rank");
ABSL_FLAG(int, internode_hidden, 2048, "host bench across nodes: hidden");
ABSL_FLAG(int, internode_experts, 32, "host bench across nodes: experts");
ABSL_FLAG(int, internode_topk, 8, "host bench across nodes: top-k");
ABSL_FLAG(int, internode_iters, 50, "host bench across nodes: timed iterations per op");
ABSL_FLAG(int, internode_warmup, 5, "host bench across nodes: warm-up iterations per op");
ABSL_FLAG(int, internode_connections, static_cast<int>(epd::kDefaultTcpConnectionsPerPeer),
          "host bench across nodes: TCP connections per ordered pair of nodes (the daemons' "
          "--tcp_connections_per_peer and the plain-TCP bound's)");

namespace epd::bench {
namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;
using Clock = std::chrono::steady_clock;

/// Bound of one op's Wait and of one plain-TCP exchange.
constexpr auto kOpWait = absl::Seconds(60);
constexpr auto kExchangeDeadline = std::chrono::seconds(30);

/// The ops measured, in order.
enum Op { kDispatch, kCombine, kLlDispatch, kLlCombine, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"Dispatch (bf16)", "Combine (bf16)",
                                           "LowLatencyDispatch (fp8)", "LowLatencyCombine (bf16)"};
constexpr const char* kOpKeys[kNumOps] = {"dispatch_bf16", "combine_bf16", "ll_dispatch_fp8",
                                          "ll_combine_bf16"};

struct Shape {
  int nodes = 0, ranks_per_node = 0, T = 0, Tll = 0, H = 0, E = 0, K = 0;
  int R() const { return nodes * ranks_per_node; }
};

/// Every rank's inputs: uniform random routing, distinct experts per token. The
/// low-latency ops use the first Tll rows.
struct Inputs {
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<int64_t>> idx;
  std::vector<std::vector<float>> w;
#if defined(EPD_HAVE_CUDA)
  /// With --backend=cuda: each rank's x, topk_idx and weights copied to GPU 0.
  std::vector<DeviceMemory> dx, didx, dw;
#endif
  bool on_gpu = false;
  std::string gpu_uuid;  ///< GPU 0's, which every rank joins with (--backend=cuda).
};

#if defined(EPD_HAVE_CUDA)
/// A device copy of `bytes` bytes at `src` on the current GPU (set-up, not the op path).
absl::StatusOr<DeviceMemory> ToDevice(const void* src, size_t bytes) {
  absl::StatusOr<DeviceMemory> d = AllocateDevice(std::max<size_t>(bytes, 1));
  if (!d.ok()) return d.status();
  if (bytes > 0) {
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(d->get(), src, bytes, cudaMemcpyHostToDevice));
  }
  return d;
}

/// Copies every rank's inputs to GPU 0 (Inputs::dx, didx, dw).
absl::Status InputsToDevice(Inputs& in) {
  EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(0));
  for (size_t r = 0; r < in.x.size(); ++r) {
    absl::StatusOr<DeviceMemory> x = ToDevice(in.x[r].data(), in.x[r].size() * 2);
    if (!x.ok()) return x.status();
    absl::StatusOr<DeviceMemory> idx = ToDevice(in.idx[r].data(), in.idx[r].size() * 8);
    if (!idx.ok()) return idx.status();
    absl::StatusOr<DeviceMemory> w = ToDevice(in.w[r].data(), in.w[r].size() * 4);
    if (!w.ok()) return w.status();
    in.dx.push_back(*std::move(x));
    in.didx.push_back(*std::move(idx));
    in.dw.push_back(*std::move(w));
  }
  cudaDeviceProp prop{};
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  in.gpu_uuid = FormatGpuUuid(prop.uuid.bytes);
  in.on_gpu = true;
  return absl::OkStatus();
}
#endif

Inputs MakeInputs(const Shape& s) {
  Inputs in;
  const int R = s.R();
  in.x.resize(R);
  in.idx.resize(R);
  in.w.resize(R);
  std::mt19937 rng(7);
  std::vector<int> ex(s.E);
  for (int r = 0; r < R; ++r) {
    in.x[r].resize(size_t(s.T) * s.H);
    for (auto& v : in.x[r]) v = kernels::FloatToBf16(float(rng() % 200) / 100.f - 1.f);
    in.idx[r].resize(size_t(s.T) * s.K);
    in.w[r].assign(size_t(s.T) * s.K, 1.f / s.K);
    for (int t = 0; t < s.T; ++t) {
      for (int e = 0; e < s.E; ++e) ex[e] = e;
      std::shuffle(ex.begin(), ex.end(), rng);
      for (int k = 0; k < s.K; ++k) in.idx[r][size_t(t) * s.K + k] = ex[k];
    }
  }
  return in;
}

using ByteMatrix = std::vector<std::vector<uint64_t>>;  // [from node][to node].

/// The bytes node a writes to node b (a != b) for each op, as the host backend's exchange
/// lays them out (host_data_plane.cc StartExchange): the slot's head (header, per-rank T,
/// counts, rows) and, per sender rank, the rows that node b needs: dispatches send a token
/// once per destination node (id, topk_idx, weights or FP8 scales, x); combines send back
/// the rows a rank/expert holds of node b's tokens.
std::vector<ByteMatrix> CrossNodeBytes(const Shape& s, const Inputs& in) {
  const int N = s.nodes, Rl = s.ranks_per_node, R = s.R(), E = s.E, K = s.K, H = s.H;
  kernels::GroupShape gs;
  gs.num_ranks = R;
  gs.num_experts = E;
  gs.hidden = H;
  gs.num_topk = K;
  gs.max_tokens_per_rank = s.T;
  gs.ll_max_tokens_per_rank = s.Tll;
  gs.use_fp8 = true;
  abi::ExchangeShape xs{R, E, H, K, s.T, s.Tll};
  const uint64_t S = static_cast<uint64_t>(xs.num_scales());
  const uint64_t head = abi::ExchangeSlotLayout::Compute(xs, Rl, Rl).payload;
  // Per source rank: tokens to each rank (normal) and to each expert (low-latency).
  std::vector<std::vector<int32_t>> to_rank(R, std::vector<int32_t>(R)),
      to_expert(R, std::vector<int32_t>(E));
  for (int r = 0; r < R; ++r) {
    kernels::host::CountDispatchRows(gs, s.T, in.idx[r].data(), nullptr, to_rank[r].data());
    kernels::host::CountLowLatencyRows(gs, s.Tll, in.idx[r].data(), to_expert[r].data());
  }
  std::vector<ByteMatrix> out(kNumOps, ByteMatrix(N, std::vector<uint64_t>(N, 0)));
  for (int a = 0; a < N; ++a) {
    for (int b = 0; b < N; ++b) {
      if (a == b) continue;
      const kernels::host::NodeRanks to{b * Rl, Rl};
      for (int op = 0; op < kNumOps; ++op) out[op][a][b] = head;
      for (int r = a * Rl; r < (a + 1) * Rl; ++r) {
        uint64_t m = 0, mll = 0;
        for (int t = 0; t < s.T; ++t) {
          const bool goes = kernels::host::GoesToNode(gs, to, &in.idx[r][size_t(t) * K], nullptr);
          m += goes;
          mll += goes && t < s.Tll;
        }
        out[kDispatch][a][b] += m * (4 + 8 * K + 4 * K + 2 * H);  // ids, idx, weights, x.
        out[kLlDispatch][a][b] += mll * (4 + 8 * K + 4 * S + H);  // ids, idx, scales, x.
        for (int src = b * Rl; src < (b + 1) * Rl; ++src) {
          out[kCombine][a][b] += uint64_t(to_rank[src][r]) * 2 * H;
          for (int e = r * (E / R); e < (r + 1) * (E / R); ++e) {
            out[kLlCombine][a][b] += uint64_t(to_expert[src][e]) * 2 * H;
          }
        }
      }
    }
  }
  return out;
}

/// Plain TCP sockets between `nodes` ends on one host, `connections` per ordered pair,
/// all in this process: the yardstick of the transport moving an op's exchange.
class PlainTcpMesh {
 public:
  /// Connects every ordered pair of the `nodes` ends `connections` times on `host`. Errors
  /// as transport::ConnectPlainTcpPairs.
  static absl::StatusOr<std::unique_ptr<PlainTcpMesh>> Create(int nodes, int connections,
                                                              const std::string& host) {
    auto pairs = transport::ConnectPlainTcpPairs(nodes * (nodes - 1) * connections, host);
    if (!pairs.ok()) return pairs.status();
    std::unique_ptr<PlainTcpMesh> m(new PlainTcpMesh());
    m->nodes_ = nodes;
    m->connections_ = connections;
    m->out_.resize(nodes);
    m->in_.resize(nodes);
    size_t next = 0;
    for (int a = 0; a < nodes; ++a) {
      for (int b = 0; b < nodes; ++b) {
        for (int c = 0; c < connections && a != b; ++c, ++next) {
          m->out_[a].push_back({std::move((*pairs)[next].sender), b, c});
          m->in_[b].push_back({std::move((*pairs)[next].receiver), a, c});
        }
      }
    }
    return m;
  }

  /// `warmup + iters` exchanges of bytes[a][b] from every node a to every node b, one
  /// thread per node; a node's sample runs from its first send to its last byte in (the
  /// nodes keep in step: an exchange ends only when every peer's bytes arrived). Returns
  /// every node's timed samples in µs. UNAVAILABLE when a socket call fails or one exchange
  /// takes longer than 30 s.
  absl::StatusOr<std::vector<double>> Exchange(const ByteMatrix& bytes, int warmup, int iters) {
    std::vector<std::vector<double>> samples(nodes_);
    std::vector<absl::Status> errors(nodes_);
    std::vector<std::thread> threads;
    for (int a = 0; a < nodes_; ++a) {
      threads.emplace_back([&, a] { errors[a] = RunNode(a, bytes, warmup, iters, samples[a]); });
    }
    for (std::thread& t : threads) t.join();
    std::vector<double> all;
    for (int a = 0; a < nodes_; ++a) {
      if (!errors[a].ok()) return errors[a];
      all.insert(all.end(), samples[a].begin(), samples[a].end());
    }
    return all;
  }

 private:
  struct Conn {
    ScopedFd fd;
    int peer = 0;   // The node at the other end.
    int index = 0;  // Among the pair's connections.
  };
  PlainTcpMesh() = default;

  uint64_t Share(uint64_t bytes, int index) const {
    return bytes / connections_ + (static_cast<uint64_t>(index) < bytes % connections_ ? 1 : 0);
  }

  absl::Status RunNode(int a, const ByteMatrix& bytes, int warmup, int iters,
                       std::vector<double>& samples) {
    constexpr size_t kCall = 1 << 20;
    std::vector<char> sendbuf(kCall, 1), recvbuf(kCall);
    std::vector<Conn>& outs = out_[a];
    std::vector<Conn>& ins = in_[a];
    std::vector<uint64_t> left_out(outs.size()), left_in(ins.size());
    std::vector<pollfd> fds;
    fds.reserve(outs.size() + ins.size());
    for (int i = 0; i < warmup + iters; ++i) {
      for (size_t j = 0; j < outs.size(); ++j) {
        left_out[j] = Share(bytes[a][outs[j].peer], outs[j].index);
      }
      for (size_t j = 0; j < ins.size(); ++j) {
        left_in[j] = Share(bytes[ins[j].peer][a], ins[j].index);
      }
      const auto start = Clock::now();
      for (;;) {
        bool progress = false, pending = false;
        fds.clear();
        for (size_t j = 0; j < outs.size(); ++j) {
          if (left_out[j] == 0) continue;
          const ssize_t n = ::send(outs[j].fd.get(), sendbuf.data(), std::min(left_out[j], kCall),
                                   MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n > 0) left_out[j] -= static_cast<uint64_t>(n), progress = true;
          if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return absl::UnavailableError(absl::StrCat("plain TCP mesh: node ", a, " send to node ",
                                                       outs[j].peer, ": ", std::strerror(errno)));
          }
          if (left_out[j] > 0) fds.push_back({outs[j].fd.get(), POLLOUT, 0}), pending = true;
        }
        for (size_t j = 0; j < ins.size(); ++j) {
          if (left_in[j] == 0) continue;
          const ssize_t n =
              ::recv(ins[j].fd.get(), recvbuf.data(), std::min(left_in[j], kCall), MSG_DONTWAIT);
          if (n > 0) left_in[j] -= static_cast<uint64_t>(n), progress = true;
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            return absl::UnavailableError(absl::StrCat("plain TCP mesh: node ", a,
                                                       " receive from node ", ins[j].peer, ": ",
                                                       n == 0 ? "EOF" : std::strerror(errno)));
          }
          if (left_in[j] > 0) fds.push_back({ins[j].fd.get(), POLLIN, 0}), pending = true;
        }
        if (!pending) break;
        if (Clock::now() - start > kExchangeDeadline) {
          return absl::UnavailableError(
              absl::StrCat("plain TCP mesh: node ", a, ": an exchange took over 30 s"));
        }
        if (!progress) ::poll(fds.data(), fds.size(), 100);
      }
      if (i >= warmup) {
        samples.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      }
    }
    return absl::OkStatus();
  }

  int nodes_ = 0, connections_ = 0;
  std::vector<std::vector<Conn>> out_, in_;  // [node]: its connections to / from others.
};

/// Waits (bounded) for a submitted op; its result into *out when out is not null.
template <typename Result>
absl::Status Finish(absl::StatusOr<PendingOp<Result>> op, Result* out = nullptr) {
  if (!op.ok()) return op.status();
  absl::StatusOr<Result> result = op->Wait(kOpWait);
  if (!result.ok()) return result.status();
  if (out != nullptr) *out = *std::move(result);
  return absl::OkStatus();
}

/// One rank's client side: its tensors.
struct RankState {
  std::vector<int64_t> xs, ks, xll, kll, eshape, llshape;
  DLTensor x{}, idx{}, w{}, x_ll{}, idx_ll{}, w_ll{}, expert_out{}, ll_out{};
  std::vector<uint16_t> expert_buf, ll_buf;
#if defined(EPD_HAVE_CUDA)
  DeviceMemory d_expert, d_ll;  // On GPU 0 with --backend=cuda.
#endif
};

/// Where a rank's tensors live: host memory, or GPU 0 with --backend=cuda.
DLDevice TensorDevice(const Inputs& in) {
  return in.on_gpu ? DLDevice{kDLCUDA, 0} : DLDevice{kDLCPU, 0};
}

/// Points `*t` at `host` (host memory) or at a device buffer of the same bytes, made or
/// reused in `*dev`, filled from `host` (with --backend=cuda).
absl::Status BindOutput(const Inputs& in, std::vector<uint16_t>& host, std::vector<int64_t>& shape,
                        DLTensor* t, [[maybe_unused]] void* dev_slot) {
  void* data = host.data();
#if defined(EPD_HAVE_CUDA)
  if (in.on_gpu) {
    auto* dev = static_cast<DeviceMemory*>(dev_slot);
    absl::StatusOr<DeviceMemory> d = ToDevice(host.data(), host.size() * 2);
    if (!d.ok()) return d.status();
    *dev = *std::move(d);
    data = dev->get();
  }
#endif
  *t = MakeDLTensor(data, kBf16, shape, TensorDevice(in));
  return absl::OkStatus();
}

/// Per-op latency samples (µs) of one group, every rank's pooled.
struct GroupRun {
  std::vector<double> samples[kNumOps];
};

/// Joins every rank of `spec` (rank r at sockets[r]) from one thread per rank, runs each op
/// `warmup + iters` times in order and returns the timed samples. `label` heads the
/// progress lines (stderr).
absl::StatusOr<GroupRun> RunGroup(const std::string& label, const v1::GroupSpec& spec,
                                  const std::vector<std::string>& sockets, const Shape& s,
                                  Inputs& in, int warmup, int iters) {
  const int R = s.R();
  GroupRun run;
  std::vector<std::vector<double>> lat(kNumOps * R);
  std::vector<absl::Status> errors(R);
  std::barrier sync(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](absl::string_view what, const absl::Status& st) {
        errors[r] = absl::Status(st.code(),
                                 absl::StrCat(label, ": rank ", r, ": ", what, ": ", st.message()));
        sync.arrive_and_drop();
      };
      ClientOptions co;
      co.socket_path = sockets[r];
      co.client_name = absl::StrCat("epd_bench rank ", r);
      auto client = Client::Connect(co);
      if (!client.ok()) return fail("connect", client.status());
      JoinOptions jo;
      jo.spec = spec;
      jo.rank = r;
      jo.gpu_uuid = in.gpu_uuid;
      auto ep = (*client)->Join(jo);
      if (!ep.ok()) return fail("join", ep.status());
      RankState st;
      st.xs = {s.T, s.H};
      st.ks = {s.T, s.K};
      st.xll = {s.Tll, s.H};
      st.kll = {s.Tll, s.K};
      void* x_data = in.x[r].data();
      void* idx_data = in.idx[r].data();
      void* w_data = in.w[r].data();
      void* dev_expert = nullptr;
      void* dev_ll = nullptr;
#if defined(EPD_HAVE_CUDA)
      if (in.on_gpu) {
        x_data = in.dx[r].get();
        idx_data = in.didx[r].get();
        w_data = in.dw[r].get();
        if (cudaSetDevice(0) != cudaSuccess) {
          return fail("cudaSetDevice(0)", absl::InternalError("failed"));
        }
      }
      dev_expert = &st.d_expert;
      dev_ll = &st.d_ll;
#endif
      const DLDevice dev = TensorDevice(in);
      st.x = MakeDLTensor(x_data, kBf16, st.xs, dev);
      st.idx = MakeDLTensor(idx_data, kI64, st.ks, dev);
      st.w = MakeDLTensor(w_data, kF32, st.ks, dev);
      st.x_ll = MakeDLTensor(x_data, kBf16, st.xll, dev);
      st.idx_ll = MakeDLTensor(idx_data, kI64, st.kll, dev);
      st.w_ll = MakeDLTensor(w_data, kF32, st.kll, dev);
      st.llshape = {s.E / R, int64_t(R) * s.Tll, s.H};
      st.ll_buf.assign(size_t(s.E / R) * R * s.Tll * s.H, 0x3f80);
      if (absl::Status e = BindOutput(in, st.ll_buf, st.llshape, &st.ll_out, dev_ll); !e.ok()) {
        return fail("low-latency combine input", e);
      }
      DispatchResult dispatched;
      LowLatencyDispatchResult ll_dispatched;
      auto run_op = [&](int op) -> absl::Status {
        switch (op) {
          case kDispatch: {
            DispatchArgs a;
            a.x = &st.x;
            a.topk_idx = &st.idx;
            a.topk_weights = &st.w;
            return Finish((*ep)->Dispatch(a), &dispatched);
          }
          case kCombine: {
            CombineArgs a;
            a.x = &st.expert_out;
            a.handle = &dispatched.handle;
            return Finish((*ep)->Combine(a));
          }
          case kLlDispatch: {
            LowLatencyDispatchArgs a;
            a.x = &st.x_ll;
            a.topk_idx = &st.idx_ll;
            a.use_fp8 = true;
            return Finish((*ep)->LowLatencyDispatch(a), &ll_dispatched);
          }
          default: {
            // Reuses the last low-latency dispatch's handle (valid: no dispatch since).
            LowLatencyCombineArgs a;
            a.x = &st.ll_out;
            a.topk_idx = &st.idx_ll;
            a.topk_weights = &st.w_ll;
            a.handle = &ll_dispatched.handle;
            return Finish((*ep)->LowLatencyCombine(a));
          }
        }
      };
      for (int op = 0; op < kNumOps; ++op) {
        if (r == 0) {
          std::fprintf(stderr, "[%s] %s: %d + %d warm-up iterations\n", label.c_str(), kOpNames[op],
                       iters, warmup);
        }
        for (int i = 0; i < warmup + iters; ++i) {
          const auto start = Clock::now();
          if (absl::Status e = run_op(op); !e.ok()) return fail(kOpNames[op], e);
          if (i >= warmup) {
            lat[op * R + r].push_back(
                std::chrono::duration<double, std::micro>(Clock::now() - start).count());
          }
        }
        if (op == kDispatch) {
          st.eshape = {dispatched.num_recv_tokens, s.H};
          st.expert_buf.assign(std::max<size_t>(size_t(dispatched.num_recv_tokens) * s.H, 1),
                               0x3f80);
          if (absl::Status e = BindOutput(in, st.expert_buf, st.eshape, &st.expert_out, dev_expert);
              !e.ok()) {
            return fail("combine input", e);
          }
        }
        sync.arrive_and_wait();  // Every rank done with this op before the next kind.
      }
      // Leave together: a rank gone early would fail its peers' last op.
      if (absl::Status e = (*ep)->Leave(); !e.ok()) errors[r] = e;
    });
  }
  for (std::thread& t : threads) t.join();
  // Every rank's error: the first one is often only a consequence of another rank's.
  absl::Status first;
  for (const absl::Status& e : errors) {
    if (e.ok()) continue;
    std::fprintf(stderr, "[%s] %s\n", label.c_str(), e.ToString().c_str());
    if (first.ok()) first = e;
  }
  if (!first.ok()) return first;
  for (int op = 0; op < kNumOps; ++op) {
    for (int r = 0; r < R; ++r) {
      run.samples[op].insert(run.samples[op].end(), lat[op * R + r].begin(), lat[op * R + r].end());
    }
  }
  return run;
}

v1::GroupSpec MakeGroupSpec(const std::string& name, const Shape& s) {
  v1::GroupSpec spec;
  spec.set_name(name);
  spec.set_num_ranks(s.R());
  spec.set_num_experts(s.E);
  spec.set_hidden(s.H);
  spec.set_num_topk(s.K);
  spec.set_max_tokens_per_rank(s.T);
  spec.set_ll_max_tokens_per_rank(s.Tll);
  spec.set_use_fp8(true);
  return spec;
}

}  // namespace

int RunInternodeBench(const std::string& backend) {
  Shape s;
  s.nodes = absl::GetFlag(FLAGS_nodes);
  s.ranks_per_node = absl::GetFlag(FLAGS_ranks_per_node);
  s.T = absl::GetFlag(FLAGS_internode_tokens);
  s.Tll = absl::GetFlag(FLAGS_internode_ll_tokens);
  s.H = absl::GetFlag(FLAGS_internode_hidden);
  s.E = absl::GetFlag(FLAGS_internode_experts);
  s.K = absl::GetFlag(FLAGS_internode_topk);
  const int iters = absl::GetFlag(FLAGS_internode_iters);
  const int warmup = absl::GetFlag(FLAGS_internode_warmup);
  const int conns = absl::GetFlag(FLAGS_internode_connections);
  const bool json = absl::GetFlag(FLAGS_json);
  const int R = s.R();
  if (s.nodes < 2 || s.ranks_per_node < 1 || s.T < 1 || s.Tll < 1 || s.Tll > s.T || s.K < 1 ||
      s.K > s.E || s.E % R != 0 || s.H % 128 != 0 || iters < 1 || warmup < 0 || conns < 1 ||
      conns > 16) {
    std::fprintf(stderr,
                 "internode bench: need --nodes >= 2, --ranks_per_node >= 1, 1 <= "
                 "--internode_ll_tokens <= --internode_tokens, 1 <= K <= E, E %% (nodes x "
                 "ranks_per_node) == 0, H %% 128 == 0, iters >= 1, connections in [1, 16]\n");
    return 2;
  }
  const bool cuda = backend == "cuda";
#if !defined(EPD_HAVE_CUDA)
  if (cuda) {
    std::fprintf(stderr, "internode bench: built without CUDA; only --backend=host\n");
    return 2;
  }
#endif
  // The daemons: one per node, each with its Peer listener and TCP transport.
  testing::DaemonProcessOptions o;
  o.backend = backend;
  o.tcp = false;
  o.log_level = "warn";
  // The production liveness interval (the tests' 100 ms is for failing fast), and the
  // machine's cores shared among the daemons as among nodes.
  o.peer_heartbeat_ms = 500;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  o.extra_args = {"--op_timeout=30s", absl::StrCat("--tcp_connections_per_peer=", conns),
                  absl::StrCat("--host_threads=", std::max(1u, cores / unsigned(s.nodes)))};
  std::fprintf(stderr, "[internode] starting %d epd --backend=%s daemons\n", s.nodes,
               backend.c_str());
  auto daemons = testing::StartNodes(s.nodes, o);
  if (!daemons.ok()) {
    std::fprintf(stderr, "internode bench: %s\n", daemons.status().ToString().c_str());
    return 1;
  }
  auto fail = [&](const absl::Status& st) {
    std::fprintf(stderr, "internode bench: %s\n", st.ToString().c_str());
    for (size_t i = 0; i < daemons->size(); ++i) {
      std::fprintf(stderr, "---- node %zu log:\n%s\n", i, (*daemons)[i]->Logs().c_str());
    }
    return 1;
  };
  if (!json) {
    std::printf(
        "internode bench (%s backend): %d nodes x %d ranks, T=%d (low-latency %d) H=%d E=%d "
        "K=%d, %d connections per pair of nodes, %d iterations (+%d warm-up) per op\n",
        backend.c_str(), s.nodes, s.ranks_per_node, s.T, s.Tll, s.H, s.E, s.K, conns, iters,
        warmup);
    std::fflush(stdout);
  }
  Inputs in = MakeInputs(s);
#if defined(EPD_HAVE_CUDA)
  if (cuda) {
    if (absl::Status e = InputsToDevice(in); !e.ok()) return fail(e);
  }
#endif
  std::vector<GroupNode> nodes;
  std::vector<std::string> sockets, node0(R, (*daemons)[0]->socket_path());
  for (int n = 0; n < s.nodes; ++n) {
    nodes.push_back({(*daemons)[n]->peer_address(), s.ranks_per_node});
    for (int i = 0; i < s.ranks_per_node; ++i) sockets.push_back((*daemons)[n]->socket_path());
  }
  v1::GroupSpec spec = MakeGroupSpec("bench-internode", s);
  SetNodes(&spec, nodes);
  auto across = RunGroup("internode", spec, sockets, s, in, warmup, iters);
  if (!across.ok()) return fail(across.status());

  // The plain-TCP bound between the daemons' host.
  const std::string peer = (*daemons)[0]->peer_address();
  const std::string host = peer.substr(0, peer.rfind(':'));
  std::fprintf(stderr, "[plain TCP] %d ends on %s, %d connections per pair\n", s.nodes,
               host.c_str(), conns);
  auto mesh = PlainTcpMesh::Create(s.nodes, conns, host);
  if (!mesh.ok()) return fail(mesh.status());
  const std::vector<ByteMatrix> bytes = CrossNodeBytes(s, in);
  std::vector<double> tcp[kNumOps];
  for (int op = 0; op < kNumOps; ++op) {
    auto t = (*mesh)->Exchange(bytes[op], warmup, iters);
    if (!t.ok()) return fail(t.status());
    tcp[op] = *std::move(t);
  }

  // CUDA: the host copies of the most bytes one node sends or receives, per op.
  Percentiles copies[kNumOps];
#if defined(EPD_HAVE_CUDA)
  if (cuda) {
    for (int op = 0; op < kNumOps; ++op) {
      uint64_t most = 0;
      for (int a = 0; a < s.nodes; ++a) {
        uint64_t sent = 0, received = 0;
        for (int b = 0; b < s.nodes; ++b) sent += bytes[op][a][b], received += bytes[op][b][a];
        most = std::max({most, sent, received});
      }
      std::fprintf(stderr, "[host copies] %s: %llu bytes there and back\n", kOpNames[op],
                   static_cast<unsigned long long>(most));
      auto t = TimeHostDeviceRoundTrip(most, warmup, iters);
      if (!t.ok()) return fail(t.status());
      copies[op] = *t;
    }
  }
#endif

  // The one-node group of the same shape on node 0's daemon.
  auto one = RunGroup("one node", MakeGroupSpec("bench-one-node", s), node0, s, in, warmup, iters);
  if (!one.ok()) return fail(one.status());

  struct Row {
    Percentiles inter, single, plain, copy;
    uint64_t total = 0, max_pair = 0;
    double bound = 0, ratio = 0;
    bool met = false;
  };
  Row rows[kNumOps];
  bool all_met = true;
  for (int op = 0; op < kNumOps; ++op) {
    Row& w = rows[op];
    w.inter = ComputePercentiles(across->samples[op]);
    w.single = ComputePercentiles(one->samples[op]);
    w.plain = ComputePercentiles(tcp[op]);
    for (const auto& from : bytes[op]) {
      for (uint64_t b : from) w.total += b, w.max_pair = std::max(w.max_pair, b);
    }
    w.copy = copies[op];
    w.bound = 2 * w.plain.p50 + w.single.p50 + w.copy.p50;
    w.ratio = w.inter.p50 / w.bound;
    w.met = w.ratio <= 1.0;
    all_met &= w.met;
  }
  if (json) {
    std::printf(
        "{\"backend\":\"%s\",\"mode\":\"internode\",\"nodes\":%d,\"ranks_per_node\":%d,"
        "\"tokens\":%d,\"ll_tokens\":%d,\"hidden\":%d,\"experts\":%d,\"topk\":%d,"
        "\"connections\":%d,\"iters\":%d,\"ops\":[",
        backend.c_str(), s.nodes, s.ranks_per_node, s.T, s.Tll, s.H, s.E, s.K, conns, iters);
    for (int op = 0; op < kNumOps; ++op) {
      const Row& w = rows[op];
      std::printf(
          "%s{\"op\":\"%s\",\"internode_p50_us\":%.1f,\"internode_p99_us\":%.1f,"
          "\"cross_node_bytes\":%llu,\"max_pair_bytes\":%llu,\"plain_tcp_p50_us\":%.1f,"
          "\"plain_tcp_p99_us\":%.1f,\"one_node_p50_us\":%.1f,\"one_node_p99_us\":%.1f,"
          "\"host_copies_p50_us\":%.1f,\"goal_us\":%.1f,\"ratio\":%.3f,\"goal_met\":%s}",
          op ? "," : "", kOpKeys[op], w.inter.p50, w.inter.p99,
          static_cast<unsigned long long>(w.total), static_cast<unsigned long long>(w.max_pair),
          w.plain.p50, w.plain.p99, w.single.p50, w.single.p99, w.copy.p50, w.bound, w.ratio,
          w.met ? "true" : "false");
    }
    std::printf("],\"goal_met\":%s}\n", all_met ? "true" : "false");
    return 0;
  }
  std::printf("%-25s %19s %12s %10s %19s %19s %10s %10s\n", "", "internode (us)", "bytes across",
              "max pair", "plain TCP (us)", "one node (us)", cuda ? "host copy" : "", "goal (us)");
  std::printf("%-25s %9s %9s %12s %10s %9s %9s %9s %9s %10s %10s %6s\n", "op", "p50", "p99",
              "nodes", "bytes", "p50", "p99", "p50", "p99", cuda ? "p50" : "",
              cuda ? "2tcp+1n+cp" : "2tcp+1n", "ratio");
  for (int op = 0; op < kNumOps; ++op) {
    const Row& w = rows[op];
    std::printf("%-25s %9.1f %9.1f %12llu %10llu %9.1f %9.1f %9.1f %9.1f %10s %10.1f %6.2f %s\n",
                kOpNames[op], w.inter.p50, w.inter.p99, static_cast<unsigned long long>(w.total),
                static_cast<unsigned long long>(w.max_pair), w.plain.p50, w.plain.p99, w.single.p50,
                w.single.p99, cuda ? absl::StrFormat("%.1f", w.copy.p50).c_str() : "", w.bound,
                w.ratio, w.met ? "met" : "NOT met");
  }
  std::printf(
      "(bytes across nodes: what every node writes to every other node for the op, the "
      "exchange's layout; plain TCP: those bytes exchanged at once between %d ends on %s over "
      "%d connections per ordered pair; one node: the same shape and inputs as one daemon's "
      "group%s)\n",
      s.nodes, host.c_str(), conns,
      cuda ? "; host copy: the most bytes one node sends or receives, device to pinned host "
             "and back"
           : "");
  int num_met = 0;
  for (const Row& w : rows) num_met += w.met ? 1 : 0;
  std::printf("goal internode p50 <= 2 x plain-TCP p50 + one-node p50%s (ratio <= 1): %s\n",
              cuda ? " + host copy p50" : "",
              num_met == kNumOps ? "met for every op"
              : num_met == 0     ? "NOT met for any op"
                                 : absl::StrCat("met for ", num_met, " of ", kNumOps,
                                                " ops, NOT met for the others")
                                   .c_str());
  if (std::getenv("EPD_OP_TRACE") != nullptr) {  // The daemons' per-op phase lines.
    for (size_t i = 0; i < daemons->size(); ++i) {
      for (absl::string_view line : absl::StrSplit((*daemons)[i]->Logs(), '\n')) {
        if (absl::StrContains(line, "span trace")) {
          std::printf("node %zu: %.*s\n", i, static_cast<int>(line.size()), line.data());
        }
      }
    }
  }
  return 0;
}

}  // namespace epd::bench
