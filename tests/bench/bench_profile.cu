// Kernel profiling workloads (epd_bench --backend=cuda --mode=profile): every rank's launch
// of one op captured into one CUDA graph, so that a profiler that serialises kernels still
// sees the ranks run concurrently (they wait for each other's flags). Under Nsight Compute
// with `--graph-profiling graph` each graph launch is one workload: its DRAM bytes read and
// written are the op's HBM traffic, measured. Without a profiler the mode prints each
// graph's GPU time (events, median of --profile_iters replays).
//
//   ncu --clock-control none --graph-profiling graph \
//       --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
//       epd_bench --backend=cuda --mode=profile --profile_ops=normal
//
// Graphs, in launch order per iteration: --profile_ops=ll: LL dispatch FP8, LL combine BF16
// (T=128 H=7168 K=8 E=256, R=8); normal: dispatch FP8, dispatch BF16, combine BF16 (T=4096).
// With --profile_ranks=1 the kernels of one rank can be profiled one by one (no peer to
// wait for), e.g. with `--section SpeedOfLight --section MemoryWorkloadAnalysis
// --section WarpStateStats`.

// nvcc (EDG) warns about assigning an absl::Status ([[nodiscard]] on operator=) by mistake.
#pragma nv_diag_suppress 2810

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

ABSL_FLAG(std::string, profile_ops, "ll,normal", "profile mode: ll, normal or both");
ABSL_FLAG(int, profile_ranks, 8, "profile mode: virtual ranks");
ABSL_FLAG(int, profile_iters, 5, "profile mode: replays of each op's graph");

namespace epd::bench {

/// Captures `launch(r, stream(r))` for every rank into one graph: the ranks' streams fork
/// from rank 0's and join back, so the ranks' kernels are concurrent nodes.
absl::StatusOr<cudaGraphExec_t> CaptureAllRanks(
    testing::VirtualRankGroup& g,
    const std::function<absl::Status(int32_t, cudaStream_t)>& launch) {
  const int32_t R = g.num_ranks();
  cudaStream_t origin = g.stream(0);
  std::vector<cudaEvent_t> events(R + 1, nullptr);
  absl::Status st;
  for (cudaEvent_t& e : events) {
    st.Update(EPD_CUDA_STATUS(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)));
  }
  cudaGraph_t graph = nullptr;
  if (st.ok()) {
    st.Update(EPD_CUDA_STATUS(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal)));
  }
  if (st.ok()) {
    st.Update(EPD_CUDA_STATUS(cudaEventRecord(events[R], origin)));
    for (int32_t r = 1; r < R && st.ok(); ++r) {
      st.Update(EPD_CUDA_STATUS(cudaStreamWaitEvent(g.stream(r), events[R], 0)));
    }
    for (int32_t r = 0; r < R && st.ok(); ++r) st.Update(launch(r, g.stream(r)));
    for (int32_t r = 1; r < R && st.ok(); ++r) {
      st.Update(EPD_CUDA_STATUS(cudaEventRecord(events[r], g.stream(r))));
      if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaStreamWaitEvent(origin, events[r], 0)));
    }
    // Ends the capture on every path (a failed capture is discarded).
    const cudaError_t end = cudaStreamEndCapture(origin, &graph);
    if (st.ok()) st.Update(EPD_CUDA_STATUS(end));
  }
  cudaGraphExec_t exec = nullptr;
  if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaGraphInstantiate(&exec, graph, 0)));
  if (graph != nullptr) cudaGraphDestroy(graph);
  for (cudaEvent_t e : events) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (!st.ok()) return st;
  return exec;
}

namespace {

namespace kc = ::epd::kernels::cuda;
using ::epd::testing::VirtualRankGroup;

/// A captured graph of one op on every rank, with its name.
struct OpGraph {
  std::string name;
  cudaGraphExec_t exec = nullptr;
};

/// Owns the graphs and their events; destroys them on every path.
class Graphs {
 public:
  ~Graphs() {
    for (OpGraph& g : graphs_) {
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
    }
  }
  std::vector<OpGraph>& list() { return graphs_; }

 private:
  std::vector<OpGraph> graphs_;
};

/// Replays the graphs in order `iters` times and prints each one's median GPU time.
absl::Status ReplayAndReport(VirtualRankGroup& g, std::vector<OpGraph>& graphs, int iters,
                             const char* shape) {
  cudaStream_t s = g.stream(0);
  std::vector<std::vector<float>> ms(graphs.size());
  cudaEvent_t a = nullptr, b = nullptr;
  absl::Status st = EPD_CUDA_STATUS(cudaEventCreate(&a));
  if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventCreate(&b)));
  for (int it = 0; it < iters && st.ok(); ++it) {
    for (size_t i = 0; i < graphs.size() && st.ok(); ++i) {
      st.Update(EPD_CUDA_STATUS(cudaEventRecord(a, s)));
      if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaGraphLaunch(graphs[i].exec, s)));
      if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventRecord(b, s)));
      if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventSynchronize(b)));
      float t = 0;
      if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventElapsedTime(&t, a, b)));
      ms[i].push_back(t);
    }
  }
  if (a != nullptr) cudaEventDestroy(a);
  if (b != nullptr) cudaEventDestroy(b);
  EPD_RETURN_IF_ERROR(st);
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "profile"));
  }
  for (size_t i = 0; i < graphs.size(); ++i) {
    std::vector<float>& v = ms[i];
    std::sort(v.begin(), v.end());
    std::printf("%-22s %s R=%d: graph %zu of each iteration, median %.1f us over %d replays\n",
                graphs[i].name.c_str(), shape, g.num_ranks(), i, 1000.0 * v[v.size() / 2], iters);
  }
  return absl::OkStatus();
}

absl::Status ProfileLowLatency(int32_t ranks, int iters) {
  const kernels::GroupShape s = LowLatencyBenchShape(ranks);
  EPD_ASSIGN_OR_RETURN(auto group, VirtualRankGroup::Create(s, 10'000'000'000));
  VirtualRankGroup& g = *group;
  g.set_all_ranks_on_device(true);
  EPD_RETURN_IF_ERROR(UploadLowLatencyBenchInputs(g).status());
  Graphs graphs;
  kc::LowLatencyDispatchArgs da;
  da.use_fp8 = true;
  EPD_ASSIGN_OR_RETURN(cudaGraphExec_t dispatch,
                       CaptureAllRanks(g, [&](int32_t r, cudaStream_t st) {
                         return kc::LowLatencyDispatch(g.Context(r), da, st);
                       }));
  graphs.list().push_back({"ll dispatch fp8", dispatch});
  EPD_ASSIGN_OR_RETURN(cudaGraphExec_t combine, CaptureAllRanks(g, [&](int32_t r, cudaStream_t st) {
                         kc::LowLatencyCombineArgs a;
                         return kc::LowLatencyCombine(g.Context(r), a, st);
                       }));
  graphs.list().push_back({"ll combine bf16", combine});
  return ReplayAndReport(g, graphs.list(), iters, "T=128 H=7168 K=8 E=256");
}

absl::Status ProfileNormal(int32_t ranks, int iters) {
  const kernels::GroupShape shape = NormalBenchShape(ranks);
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<VirtualRankGroup> group, VirtualRankGroup::Create(shape));
  VirtualRankGroup& g = *group;
  const kernels::EndpointLayout& l = g.layout();
  std::mt19937_64 rng(2024);
  for (int32_t r = 0; r < ranks; ++r) {
    const std::vector<int64_t> topk =
        testing::RandomTopk(kNormalBenchTokens, kNormalBenchTopk, kNormalBenchExperts, {}, rng);
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_idx, topk.data(), topk.size() * 8));
    const std::vector<float> w = testing::RandomFloats(topk.size(), rng);
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    for (const kernels::Region* region : {&l.in_x, &l.in_scales, &l.in_combine_x}) {
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemset(g.At<uint8_t>(r, *region), 0x3c ^ (r & 1), region->bytes));
    }
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(g.Context(r), kNormalBenchTokens, g.stream(r)));
  }
  EPD_RETURN_IF_ERROR(g.SynchronizeAll());
  Graphs graphs;
  for (bool fp8 : {true, false}) {
    EPD_ASSIGN_OR_RETURN(cudaGraphExec_t exec, CaptureAllRanks(g, [&](int32_t r, cudaStream_t st) {
                           kc::NormalDispatchArgs a;
                           a.fp8 = fp8;
                           return kc::NormalDispatch(g.Context(r), a, st);
                         }));
    graphs.list().push_back({fp8 ? "normal dispatch fp8" : "normal dispatch bf16", exec});
  }
  EPD_ASSIGN_OR_RETURN(cudaGraphExec_t combine, CaptureAllRanks(g, [&](int32_t r, cudaStream_t st) {
                         kc::NormalCombineArgs a;
                         a.with_weights = true;
                         return kc::NormalCombine(g.Context(r), a, st);
                       }));
  graphs.list().push_back({"normal combine bf16", combine});
  return ReplayAndReport(g, graphs.list(), iters, "T=4096 H=7168 K=8 E=256");
}

}  // namespace

int RunProfileWorkloads() {
  const std::string ops = absl::GetFlag(FLAGS_profile_ops);
  const int32_t ranks = absl::GetFlag(FLAGS_profile_ranks);
  const int iters = absl::GetFlag(FLAGS_profile_iters);
  if (ranks < 1 || ranks > 8 || iters < 1) {
    std::fprintf(stderr, "profile: --profile_ranks=%d must be in [1, 8], --profile_iters=%d >= 1\n",
                 ranks, iters);
    return 2;
  }
  absl::Status st = kc::PreloadKernels();
  if (st.ok() && ops.find("ll") != std::string::npos) st = ProfileLowLatency(ranks, iters);
  if (st.ok() && ops.find("normal") != std::string::npos) st = ProfileNormal(ranks, iters);
  if (!st.ok()) {
    std::fprintf(stderr, "profile failed: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace epd::bench
