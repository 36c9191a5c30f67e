// epd_bench: one binary, one entry point per family of figures. epd_bench.cc parses the
// flags and calls these; each prints its table (or JSON lines with --json) to stdout and
// returns a process exit code (0 = every figure measured and every check passed).
#pragma once

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/declare.h"

/// --json: print one JSON object per figure instead of a table.
ABSL_DECLARE_FLAG(bool, json);
/// --nodes: >= 2 runs RunInternodeBench (either backend) instead of the one-node figures.
ABSL_DECLARE_FLAG(int, nodes);

namespace epd::bench {

/// CUDA low-latency dispatch/combine kernels, 8 virtual ranks on one GPU, beside a
/// cudaMemcpy of the same bytes (tests/bench/bench_ll.cu). Needs CUDA.
int RunLowLatencyBench();
/// CUDA normal-mode dispatch/combine (tests/bench/bench_normal.cu). Needs CUDA.
int RunNormalBench();
/// Profiling workloads: each op on every rank captured into one CUDA graph and replayed
/// (for Nsight Compute's --graph-profiling graph; tests/bench/bench_profile.cu). Needs CUDA.
int RunProfileWorkloads();
/// CUDA normal-mode dispatch/combine with one rank per GPU (--gpus), beside NCCL
/// all-to-all of the same bytes (tests/bench/bench_multigpu.cu). Needs CUDA; prints a skip
/// and returns 0 with fewer than 2 GPUs.
int RunMultiGpuBench();
/// Launch modes through a real epd daemon (client-launched, daemon-launched, MPS), beside
/// a same-bytes cudaMemcpy and the same kernels in-process (tests/bench/bench_launch.cc).
/// Needs CUDA and the epd binary.
int RunLaunchBench();
/// Host backend: the real daemon and clients over shm (tests/bench/bench_host.cc).
int RunHostBench();
/// Across nodes: --nodes real daemons of `backend` ("host" or "cuda") on this machine with
/// their Peer listeners, one client thread per rank, each op beside the plain-TCP time of
/// the bytes that cross nodes, the one-node group's time and (CUDA) the host copies of
/// those bytes (tests/bench/bench_internode.cc).
int RunInternodeBench(const std::string& backend);

/// Host backend, rank masking through a real epd (tests/bench/bench_mask.cc): the time from
/// kill -9 of a rank's process to the first op without it, and from a rejoin to the first op
/// with it, beside the goal (< 100 ms). Called by RunHostBench; --mask_trials=0 skips it.
int RunMaskBench(bool json);
/// With --mask_victim: runs as the bench's masked rank (a re-run of this binary) and never
/// returns but with an error; -1 without the flag.
int MaybeRunMaskVictim();

/// The `epd` next to this binary, else the build tree's (tests/bench/epd_bench →
/// daemon/epd), else "epd" (from PATH).
inline std::string SiblingEpdPath() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "epd";
  for (const std::filesystem::path& p :
       {self.parent_path() / "epd", self.parent_path() / ".." / ".." / "daemon" / "epd"}) {
    if (std::filesystem::exists(p, ec)) return p.lexically_normal().string();
  }
  return "epd";
}

/// Latency percentiles of a sample, in the sample's unit.
struct Percentiles {
  double p50 = 0;
  double p99 = 0;
  size_t count = 0;
};

/// Nearest-rank percentiles (p-th value of the sorted sample, index ceil(p * n) - 1).
inline Percentiles ComputePercentiles(std::vector<double> sample) {
  Percentiles p;
  p.count = sample.size();
  if (sample.empty()) return p;
  std::sort(sample.begin(), sample.end());
  auto at = [&](double q) {
    size_t rank = static_cast<size_t>(q * sample.size() + 0.999999);
    return sample[std::min(sample.size() - 1, rank == 0 ? 0 : rank - 1)];
  };
  p.p50 = at(0.50);
  p.p99 = at(0.99);
  return p;
}

}  // namespace epd::bench
