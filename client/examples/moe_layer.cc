// moe_layer: a toy Mixture-of-Experts layer run by one process per rank through epd:
// router (x·G → top-k, softmax weights) → dispatch → per-expert FFN (y = W_e·x) → combine,
// in normal and in low-latency mode, each rank checking its combined output against a
// single-process f64 computation of the same layer. The parent starts the R rank
// processes (they die with it), prints a table and exits 0 only when every rank matched.
//
//   moe_layer --socket=/run/epd/epd.sock --num_ranks=8 [--launch_mode=auto|daemon|client]
//
// The ranks join with the join secret in EPD_JOIN_SECRET (a random one when unset; never
// printed). README "Quick start" and "Users, join secrets and quotas" say more.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
// StatusText: "CODE: message [EPD-4004 QUOTA_EXCEEDED]", not absl's ToString, which
// appends the reason payload's raw bytes.
#include "common/errors/reason.h"
#include "epd/client.h"
#include "epd/kernels/types.h"

#if EPD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, socket, "/run/epd/epd.sock", "epd's unix socket");
ABSL_FLAG(int, num_ranks, 8, "ranks (one process each)");
ABSL_FLAG(int, rank, -1, "internal: run as this rank");
ABSL_FLAG(std::string, group, "moe-layer-demo", "group name");
ABSL_FLAG(int, num_experts, 32, "experts (a multiple of num_ranks)");
ABSL_FLAG(int, hidden, 256, "hidden size (a multiple of 128 for --fp8)");
ABSL_FLAG(int, topk, 4, "experts per token");
ABSL_FLAG(int, tokens, 48, "tokens per rank per iteration");
ABSL_FLAG(int, iters, 3, "iterations");
ABSL_FLAG(bool, fp8, true, "low-latency dispatch in FP8 (normal mode stays BF16)");
ABSL_FLAG(std::string, launch_mode, "auto",
          "auto (epd's default), daemon or client: who launches the kernels on the CUDA "
          "backend (client.h)");
ABSL_FLAG(double, tolerance, 0.0,
          "max relative error, >= 0 (0 = the defaults: 2e-2 BF16, 8e-2 with FP8)");

namespace {

/// The environment variable carrying the group's join secret to the rank processes.
constexpr char kJoinSecretEnv[] = "EPD_JOIN_SECRET";

/// A join secret for this run's group: 32 random bytes from the kernel, hex-encoded (an
/// environment variable holds no NUL). Empty when /dev/urandom cannot be read.
std::string RandomJoinSecret() {
  unsigned char bytes[32];
  FILE* urandom = std::fopen("/dev/urandom", "rb");
  if (urandom == nullptr) return "";
  const size_t got = std::fread(bytes, 1, sizeof(bytes), urandom);
  std::fclose(urandom);
  if (got != sizeof(bytes)) return "";
  std::string hex;
  for (unsigned char b : bytes) hex += absl::StrFormat("%02x", b);
  return hex;
}

using epd::kernels::bf16_bits;
using epd::kernels::Bf16ToFloat;
using epd::kernels::E4m3ToFloat;
using epd::kernels::FloatToBf16;

struct Model {
  int R, E, H, K, T;
  std::vector<float> gate;     // [H, E]
  std::vector<float> experts;  // [E, H, H]: y = W_e x, W_e row-major [out, in]
};

Model MakeModel() {
  Model m;
  m.R = absl::GetFlag(FLAGS_num_ranks);
  m.E = absl::GetFlag(FLAGS_num_experts);
  m.H = absl::GetFlag(FLAGS_hidden);
  m.K = absl::GetFlag(FLAGS_topk);
  m.T = absl::GetFlag(FLAGS_tokens);
  std::mt19937 rng(1234);  // Same weights in every process.
  std::normal_distribution<float> g(0.f, 1.f);
  m.gate.resize(static_cast<size_t>(m.H) * m.E);
  for (auto& v : m.gate) v = g(rng);
  m.experts.resize(static_cast<size_t>(m.E) * m.H * m.H);
  const float s = 1.0f / std::sqrt(static_cast<float>(m.H));
  for (auto& v : m.experts) v = g(rng) * s;
  return m;
}

/// Tokens of `rank` at iteration `iter`, as bf16 [T, H] (deterministic).
std::vector<bf16_bits> Tokens(const Model& m, int rank, int iter) {
  std::mt19937 rng(1000003u * static_cast<unsigned>(iter + 1) + static_cast<unsigned>(rank));
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<bf16_bits> x(static_cast<size_t>(m.T) * m.H);
  for (auto& v : x) v = FloatToBf16(g(rng));
  return x;
}

/// Router: scores = x·G; top-k experts by score; weights = softmax over the top-k.
void Route(const Model& m, const std::vector<bf16_bits>& x, std::vector<int64_t>& idx,
           std::vector<float>& w) {
  idx.assign(static_cast<size_t>(m.T) * m.K, -1);
  w.assign(static_cast<size_t>(m.T) * m.K, 0.f);
  std::vector<float> score(m.E);
  std::vector<int> order(m.E);
  for (int t = 0; t < m.T; ++t) {
    std::fill(score.begin(), score.end(), 0.f);
    for (int h = 0; h < m.H; ++h) {
      float xv = Bf16ToFloat(x[static_cast<size_t>(t) * m.H + h]);
      for (int e = 0; e < m.E; ++e) score[e] += xv * m.gate[static_cast<size_t>(h) * m.E + e];
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + m.K, order.end(),
                      [&](int a, int b) { return score[a] > score[b]; });
    float mx = score[order[0]], sum = 0.f;
    for (int k = 0; k < m.K; ++k) sum += std::exp(score[order[k]] - mx);
    for (int k = 0; k < m.K; ++k) {
      idx[static_cast<size_t>(t) * m.K + k] = order[k];
      w[static_cast<size_t>(t) * m.K + k] = std::exp(score[order[k]] - mx) / sum;
    }
  }
}

/// y = W_e · x for one token (f32 in, f32 out).
void Expert(const Model& m, int e, const float* x, float* y) {
  const float* W = &m.experts[static_cast<size_t>(e) * m.H * m.H];
  for (int o = 0; o < m.H; ++o) {
    float acc = 0.f;
    for (int i = 0; i < m.H; ++i) acc += W[static_cast<size_t>(o) * m.H + i] * x[i];
    y[o] = acc;
  }
}

/// A host copy of a result view: views are kDLCUDA on the CUDA backend (device memory in
/// this process through CUDA IPC), kDLCPU on the host backend.
template <typename T>
std::vector<T> HostCopy(const epd::TensorView& v) {
  std::vector<T> out(static_cast<size_t>(v.numel()));
  if (out.empty()) return out;
  if (v.dl().device.device_type == kDLCUDA) {
#if EPD_HAVE_CUDA
    if (cudaMemcpy(out.data(), v.data(), out.size() * sizeof(T), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      std::fprintf(stderr, "moe_layer: cudaMemcpy of a result view failed\n");
      std::exit(3);
    }
#else
    std::fprintf(stderr, "moe_layer: a kDLCUDA view in a build without CUDA\n");
    std::exit(3);
#endif
  } else {
    std::memcpy(out.data(), v.data(), out.size() * sizeof(T));
  }
  return out;
}

/// Relative error ‖got − ref‖∞ / max(‖ref‖∞, 1e-3) over the rank's tokens.
double RelError(const std::vector<double>& ref, const bf16_bits* got, size_t n) {
  double num = 0, den = 1e-3;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, std::abs(ref[i] - Bf16ToFloat(got[i])));
    den = std::max(den, std::abs(ref[i]));
  }
  return num / den;
}

int RunRank(int rank) {
  const Model m = MakeModel();
  const int El = m.E / m.R;
  epd::ClientOptions copt;
  copt.socket_path = absl::GetFlag(FLAGS_socket);
  copt.client_name = absl::StrCat("moe_layer rank ", rank);
  auto client = epd::Client::Connect(copt);
  if (!client.ok()) {
    std::fprintf(stderr, "rank %d: connect: %s\n", rank,
                 epd::errors::StatusText(client.status()).c_str());
    return 2;
  }
  epd::JoinOptions jopt;
  jopt.spec.set_name(absl::GetFlag(FLAGS_group));
  jopt.spec.set_num_ranks(m.R);
  jopt.spec.set_num_experts(m.E);
  jopt.spec.set_hidden(m.H);
  jopt.spec.set_num_topk(m.K);
  jopt.spec.set_max_tokens_per_rank(m.T);
  jopt.spec.set_ll_max_tokens_per_rank(m.T);
  jopt.spec.set_use_fp8(absl::GetFlag(FLAGS_fp8));
  jopt.rank = rank;
  if (const char* secret = std::getenv(kJoinSecretEnv); secret != nullptr) {
    jopt.join_secret = secret;
  }
  const std::string mode = absl::GetFlag(FLAGS_launch_mode);
  jopt.launch_mode = mode == "client"   ? epd::v1::LAUNCH_MODE_CLIENT
                     : mode == "daemon" ? epd::v1::LAUNCH_MODE_DAEMON
                                        : epd::v1::LAUNCH_MODE_UNSPECIFIED;
  // On the CUDA backend each rank names its GPU by UUID: rank r takes GPU r % (number of
  // GPUs epd reports), so 8 ranks on one GPU are virtual ranks.
  auto stats = (*client)->GetStats();
  if (stats.ok() && stats->backend() == "cuda" && stats->gpus_size() > 0) {
    jopt.gpu_uuid = stats->gpus(rank % stats->gpus_size()).uuid();
  }
  auto ep_or = (*client)->Join(jopt);
  if (!ep_or.ok()) {
    std::fprintf(stderr, "rank %d: join: %s\n", rank,
                 epd::errors::StatusText(ep_or.status()).c_str());
    return 2;
  }
  epd::Endpoint& ep = **ep_or;
  const bool fp8 = absl::GetFlag(FLAGS_fp8);
  double tol = absl::GetFlag(FLAGS_tolerance);
  double worst_normal = 0, worst_ll = 0;
  auto fail = [&](const char* what, const absl::Status& st) {
    std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, epd::errors::StatusText(st).c_str());
    return 1;
  };
  const auto start = std::chrono::steady_clock::now();
  for (int iter = 0; iter < absl::GetFlag(FLAGS_iters); ++iter) {
    std::vector<bf16_bits> x = Tokens(m, rank, iter);
    std::vector<int64_t> idx;
    std::vector<float> w;
    Route(m, x, idx, w);
    // Single-process reference of this rank's tokens.
    std::vector<double> ref(static_cast<size_t>(m.T) * m.H, 0.0);
    std::vector<float> xf(m.H), yf(m.H);
    for (int t = 0; t < m.T; ++t) {
      for (int h = 0; h < m.H; ++h) xf[h] = Bf16ToFloat(x[static_cast<size_t>(t) * m.H + h]);
      for (int k = 0; k < m.K; ++k) {
        int e = static_cast<int>(idx[static_cast<size_t>(t) * m.K + k]);
        Expert(m, e, xf.data(), yf.data());
        for (int h = 0; h < m.H; ++h) {
          ref[static_cast<size_t>(t) * m.H + h] += w[static_cast<size_t>(t) * m.K + k] * yf[h];
        }
      }
    }
    std::vector<int64_t> xs{m.T, m.H}, ks{m.T, m.K};
    DLTensor x_t = epd::MakeDLTensor(x.data(), {kDLBfloat, 16, 1}, xs);
    DLTensor idx_t = epd::MakeDLTensor(idx.data(), {kDLInt, 64, 1}, ks);
    DLTensor w_t = epd::MakeDLTensor(w.data(), {kDLFloat, 32, 1}, ks);

    // ---- normal mode: experts weight their outputs, combine sums them ----
    epd::DispatchArgs da;
    da.x = &x_t;
    da.topk_idx = &idx_t;
    da.topk_weights = &w_t;
    auto d_op = ep.Dispatch(da);
    if (!d_op.ok()) return fail("Dispatch", d_op.status());
    auto d = d_op->Wait();
    if (!d.ok()) return fail("Dispatch", d.status());
    const int64_t N = d->num_recv_tokens;
    std::vector<bf16_bits> expert_out(static_cast<size_t>(N) * m.H);
    const std::vector<bf16_bits> rx_host = HostCopy<bf16_bits>(d->recv_x);
    const std::vector<int64_t> ridx_host = HostCopy<int64_t>(d->recv_topk_idx);
    const std::vector<float> rw_host = HostCopy<float>(d->recv_topk_weights);
    const bf16_bits* rx = rx_host.data();
    const int64_t* ridx = ridx_host.data();
    const float* rw = rw_host.data();
    std::vector<float> acc(m.H);
    for (int64_t n = 0; n < N; ++n) {
      for (int h = 0; h < m.H; ++h) xf[h] = Bf16ToFloat(rx[n * m.H + h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int k = 0; k < m.K; ++k) {
        int64_t j = ridx[n * m.K + k];
        if (j < 0) continue;
        Expert(m, rank * El + static_cast<int>(j), xf.data(), yf.data());
        for (int h = 0; h < m.H; ++h) acc[h] += rw[n * m.K + k] * yf[h];
      }
      for (int h = 0; h < m.H; ++h) expert_out[n * m.H + h] = FloatToBf16(acc[h]);
    }
    std::vector<int64_t> os{N, m.H};
    DLTensor out_t = epd::MakeDLTensor(expert_out.data(), {kDLBfloat, 16, 1}, os);
    epd::CombineArgs ca;
    ca.x = &out_t;
    ca.handle = &d->handle;
    auto c_op = ep.Combine(ca);
    if (!c_op.ok()) return fail("Combine", c_op.status());
    auto c = c_op->Wait();
    if (!c.ok()) return fail("Combine", c.status());
    worst_normal = std::max(worst_normal,
                            RelError(ref, HostCopy<bf16_bits>(c->combined_x).data(), ref.size()));

    // ---- low-latency mode: per-expert blocks, weighted combine ----
    epd::LowLatencyDispatchArgs la;
    la.x = &x_t;
    la.topk_idx = &idx_t;
    la.use_fp8 = fp8;
    auto ld_op = ep.LowLatencyDispatch(la);
    if (!ld_op.ok()) return fail("LowLatencyDispatch", ld_op.status());
    auto ld = ld_op->Wait();
    if (!ld.ok()) return fail("LowLatencyDispatch", ld.status());
    const int64_t rows = static_cast<int64_t>(m.R) * m.T;
    std::vector<bf16_bits> ll_out(static_cast<size_t>(El) * rows * m.H, 0);
    const std::vector<int32_t> count_host = HostCopy<int32_t>(ld->recv_count);
    const int32_t* count = count_host.data();
    const std::vector<uint8_t> lrx_fp8 =
        fp8 ? HostCopy<uint8_t>(ld->recv_x) : std::vector<uint8_t>();
    const std::vector<bf16_bits> lrx_bf16 =
        fp8 ? std::vector<bf16_bits>() : HostCopy<bf16_bits>(ld->recv_x);
    const std::vector<float> lscales =
        fp8 ? HostCopy<float>(ld->recv_scales) : std::vector<float>();
    // recv_scales [El, rows, S] is stored token index fastest: its strides say where.
    const epd::TensorShape& st = ld->recv_scales.strides();
    for (int j = 0; j < El; ++j) {
      for (int32_t row = 0; row < count[j]; ++row) {
        const int64_t base = (static_cast<int64_t>(j) * rows + row) * m.H;
        for (int h = 0; h < m.H; ++h) {
          if (fp8) {
            const float scale = lscales[j * st[0] + row * st[1] + (h / 128) * st[2]];
            xf[h] = E4m3ToFloat(lrx_fp8[base + h]) * scale;
          } else {
            xf[h] = Bf16ToFloat(lrx_bf16[base + h]);
          }
        }
        Expert(m, rank * El + j, xf.data(), yf.data());
        for (int h = 0; h < m.H; ++h) ll_out[base + h] = FloatToBf16(yf[h]);
      }
    }
    std::vector<int64_t> ls{El, rows, m.H};
    DLTensor ll_t = epd::MakeDLTensor(ll_out.data(), {kDLBfloat, 16, 1}, ls);
    epd::LowLatencyCombineArgs lca;
    lca.x = &ll_t;
    lca.topk_idx = &idx_t;
    lca.topk_weights = &w_t;
    lca.handle = &ld->handle;
    auto lc_op = ep.LowLatencyCombine(lca);
    if (!lc_op.ok()) return fail("LowLatencyCombine", lc_op.status());
    auto lc = lc_op->Wait();
    if (!lc.ok()) return fail("LowLatencyCombine", lc.status());
    worst_ll =
        std::max(worst_ll, RelError(ref, HostCopy<bf16_bits>(lc->combined_x).data(), ref.size()));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const double tol_normal = tol > 0 ? tol : 2e-2;
  const double tol_ll = tol > 0 ? tol : (fp8 ? 8e-2 : 2e-2);
  const bool ok = worst_normal <= tol_normal && worst_ll <= tol_ll;
  std::printf("%4d  %14.2e  %14.2e  %9.1f  %s\n", rank, worst_normal, worst_ll, ms,
              ok ? "ok" : "MISMATCH");
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "a toy MoE layer run by one process per rank through epd; checks every rank's output "
      "against a single-process computation.\n"
      "Usage: moe_layer --socket=/run/epd/epd.sock --num_ranks=8 "
      "[--launch_mode=auto|daemon|client]");
  absl::ParseCommandLine(argc, argv);
  const int rank = absl::GetFlag(FLAGS_rank);
  if (rank >= 0) return RunRank(rank);
  const int R = absl::GetFlag(FLAGS_num_ranks);
  const int E = absl::GetFlag(FLAGS_num_experts), H = absl::GetFlag(FLAGS_hidden),
            K = absl::GetFlag(FLAGS_topk), T = absl::GetFlag(FLAGS_tokens),
            iters = absl::GetFlag(FLAGS_iters);
  // The example's own limits (it holds E dense H x H expert matrices and forks R
  // processes); the daemon validates the group spec itself on join.
  std::string bad;
  if (R < 1 || R > 1024)
    bad = absl::StrCat("--num_ranks=", R, " is outside [1, 1024]");
  else if (E < 1 || E % R != 0)
    bad = absl::StrCat("--num_experts=", E, " is not a positive multiple of --num_ranks=", R);
  else if (H < 1 || H > 8192)
    bad = absl::StrCat("--hidden=", H, " is outside [1, 8192]");
  else if (absl::GetFlag(FLAGS_fp8) && H % 128 != 0)
    bad = absl::StrCat("--hidden=", H,
                       " is not a multiple of 128, which --fp8 needs (one scale per 128 "
                       "channels); pass --fp8=false or another --hidden");
  else if (static_cast<double>(E) * H * H * 4 > 8e9)
    bad = absl::StrCat("--num_experts=", E, " x --hidden=", H, "^2 expert matrices exceed 8 GB");
  else if (K < 1 || K > E)
    bad = absl::StrCat("--topk=", K, " is outside [1, --num_experts=", E, "]");
  else if (T < 1 || T > 65536)
    bad = absl::StrCat("--tokens=", T, " is outside [1, 65536]");
  else if (iters < 1)
    bad = absl::StrCat("--iters=", iters, " must be >= 1");
  else if (absl::GetFlag(FLAGS_launch_mode) != "auto" &&
           absl::GetFlag(FLAGS_launch_mode) != "daemon" &&
           absl::GetFlag(FLAGS_launch_mode) != "client")
    bad = absl::StrCat("--launch_mode=", absl::GetFlag(FLAGS_launch_mode),
                       " must be auto, daemon or client");
  else if (const double tol = absl::GetFlag(FLAGS_tolerance); !(tol >= 0) || !std::isfinite(tol))
    bad = absl::StrCat("--tolerance=", tol,
                       " must be a finite number >= 0 (a relative error such as 2e-2; 0 = the "
                       "defaults)");
  if (!bad.empty()) {
    std::fprintf(stderr, "moe_layer: %s\n", bad.c_str());
    return 2;
  }
  std::printf(
      "moe_layer: %d ranks, E=%d H=%d K=%d T=%d, %d iterations, LL FP8 %s, %s-launched, via "
      "%s\n",
      R, absl::GetFlag(FLAGS_num_experts), absl::GetFlag(FLAGS_hidden), absl::GetFlag(FLAGS_topk),
      absl::GetFlag(FLAGS_tokens), absl::GetFlag(FLAGS_iters),
      absl::GetFlag(FLAGS_fp8) ? "on" : "off", absl::GetFlag(FLAGS_launch_mode).c_str(),
      absl::GetFlag(FLAGS_socket).c_str());
  // The ranks' join secret: the caller's EPD_JOIN_SECRET (every rank of a job launched
  // elsewhere gets the same), else a fresh one that the rank processes inherit.
  const char* given_secret = std::getenv(kJoinSecretEnv);
  if (given_secret == nullptr || given_secret[0] == '\0') {
    const std::string secret = RandomJoinSecret();
    if (secret.empty() || ::setenv(kJoinSecretEnv, secret.c_str(), 1) != 0) {
      std::fprintf(stderr, "moe_layer: cannot make a join secret (/dev/urandom, setenv)\n");
      return 2;
    }
    std::printf("join secret: a random one for this run (set %s to choose it)\n", kJoinSecretEnv);
  } else {
    std::printf("join secret: from %s\n", kJoinSecretEnv);
  }
  std::printf("rank  normal rel.err  low-lat rel.err  time (ms)  result\n");
  std::fflush(stdout);
  // Each rank process dies with the parent (SIGKILL when the parent dies, however it
  // dies): without that, a killed moe_layer would leave its ranks holding the group.
  const pid_t parent = ::getpid();
  std::map<pid_t, int> rank_of;
  for (int r = 0; r < R; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
        std::perror("prctl(PR_SET_PDEATHSIG)");
        ::_exit(127);
      }
      // The parent may have died before prctl: then the signal never comes.
      if (::getppid() != parent) ::_exit(127);
      std::string rank_flag = absl::StrCat("--rank=", r);
      std::vector<char*> child_argv(argv, argv + argc);
      child_argv.push_back(rank_flag.data());
      child_argv.push_back(nullptr);
      ::execv("/proc/self/exe", child_argv.data());
      std::perror("execv");
      ::_exit(127);
    }
    if (pid < 0) {
      std::perror("fork");
      return 2;
    }
    rank_of[pid] = r;
  }
  // Reaped in the order they end, so a rank killed by a signal is named at once (its own
  // output cannot say why it stopped).
  int failures = 0;
  while (!rank_of.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      std::perror("waitpid");
      failures += static_cast<int>(rank_of.size());
      break;
    }
    auto it = rank_of.find(pid);
    if (it == rank_of.end()) continue;
    const int r = it->second;
    rank_of.erase(it);
    if (WIFSIGNALED(status)) {
      const int sig = WTERMSIG(status);
      const char* abbrev = ::sigabbrev_np(sig);
      std::printf("%4d  rank %d (pid %d) was killed by signal %d (SIG%s)\n", r, r,
                  static_cast<int>(pid), sig, abbrev != nullptr ? abbrev : "?");
      std::fflush(stdout);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::printf("moe_layer: %s (%d of %d ranks failed)\n",
              failures ? "FAILED" : "all ranks match the single-process layer", failures, R);
  return failures ? 1 : 0;
}
