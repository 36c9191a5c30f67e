// epd_bench: flags → the chosen benchmark families → exit code (docs/BENCHMARKS.md).
//   epd_bench --backend=cuda --mode=ll        CUDA low-latency kernels
//   epd_bench --backend=cuda --mode=ll --ll_specialised=off,on,off,on   generic vs
//                                             shape-specialised low-latency kernels, A/B
//   epd_bench --backend=cuda --mode=normal    CUDA normal-mode kernels
//   epd_bench --backend=cuda --mode=all       both
//   epd_bench --backend=cuda --mode=multigpu [--gpus=N]   normal mode, one rank per GPU,
//                                             beside NCCL all-to-all (skips on one GPU)
//   epd_bench --backend=cuda --mode=launch [--epd=PATH | --socket=PATH]   launch modes
//                                             through a real epd (client-, daemon-launched)
//   epd_bench --backend=cuda --mode=profile [--profile_ops=ll,normal]   each op of all
//                                             ranks in one CUDA graph, for Nsight Compute
//   epd_bench --backend=host                  host backend (daemon + clients over shm), then
//                                             rank masking through a real epd (kill -9,
//                                             rejoin; --mask_trials=0 skips it)
//   epd_bench --backend=host --nodes=2 --ranks_per_node=2   a group across 2 real daemons,
//                                             beside plain TCP and the one-node group
//   epd_bench --backend=cuda --nodes=2 --ranks_per_node=4   the same on the CUDA backend
//                                             (every node on GPU 0), + the host copies
// (--json: one JSON object per figure.)
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tests/bench/bench.h"

ABSL_FLAG(std::string, backend, "cuda", "cuda or host");
ABSL_FLAG(std::string, mode, "all",
          "ll, normal, all (= ll and normal), multigpu, launch or profile (CUDA backend)");
ABSL_FLAG(bool, json, false, "print one JSON object per figure instead of tables");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "epd_bench --backend=cuda|host [--mode=ll|normal|all|multigpu|launch|profile] [--nodes=N] "
      "[--json]: "
      "latency "
      "and bandwidth "
      "of the epd data plane beside same-run bounds");
  absl::ParseCommandLine(argc, argv);
  if (const int victim = epd::bench::MaybeRunMaskVictim(); victim >= 0) return victim;
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (backend != "cuda" && backend != "host") {
    std::cerr << "epd_bench: --backend=" << backend << " is not one of cuda, host\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_nodes) >= 2) return epd::bench::RunInternodeBench(backend);
  if (backend == "host") return epd::bench::RunHostBench();
  if (mode != "ll" && mode != "normal" && mode != "all" && mode != "multigpu" && mode != "launch" &&
      mode != "profile") {
    std::cerr << "epd_bench: --mode=" << mode
              << " is not one of ll, normal, all, multigpu, launch, profile\n";
    return 2;
  }
#if defined(EPD_HAVE_CUDA)
  int rc = 0;
  if (mode == "ll" || mode == "all") rc |= epd::bench::RunLowLatencyBench();
  if (mode == "normal" || mode == "all") rc |= epd::bench::RunNormalBench();
  if (mode == "multigpu") rc |= epd::bench::RunMultiGpuBench();
  if (mode == "launch") rc |= epd::bench::RunLaunchBench();
  if (mode == "profile") rc |= epd::bench::RunProfileWorkloads();
  return rc;
#else
  std::cerr << "epd_bench: built without CUDA; only --backend=host is available\n";
  return 2;
#endif
}
