// Rank masking on the CUDA backend with real processes: a real `epd --backend=cuda` and one
// epd_dp_mask process per rank (tests/integration/clients/dp_mask.cc, daemon-launched, its
// views on the GPU), the kill -9 scenario of tests/common/mask_process_scenario.h: a killed
// client's rank is masked, the survivors' rounds equal kernels/host's reference with its
// experts dropped (checked by each process, bit for bit, with the dropped-pairs count), and
// a new process rejoining the slot is included again.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/common/daemon_process.h"
#include "tests/common/mask_process_scenario.h"
#include "tests/common/subprocess.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

/// epd_dp_mask: $EPD_DP_MASK_BINARY (a GPU machine running a bundle), else the build's.
std::string DpMaskBinary() {
  const char* env = std::getenv("EPD_DP_MASK_BINARY");
  return env != nullptr && *env != '\0' ? env : EPD_DP_MASK_BINARY;
}

constexpr int kOpTimeoutMs = 2000;

TEST(CudaMaskProcessTest, KilledRankIsMaskedThenARejoinIsIncluded) {
  std::string why;
  if (!HaveGpu(&why)) GTEST_SKIP() << why;
  DaemonProcessOptions o;
  o.backend = "cuda";
  o.tcp = false;
  o.log_level = "info";
  o.extra_args = {absl::StrCat("--op_timeout=", kOpTimeoutMs, "ms")};
  o.start_timeout = absl::Seconds(60);
  auto epd = DaemonProcess::Start(o);
  ASSERT_TRUE(epd.ok()) << epd.status();
  DaemonProcess& daemon = **epd;
  auto spawn = [&](int rank, const std::string& name, std::vector<std::string> flags) {
    std::vector<std::string> argv = {
        DpMaskBinary(), "--socket=" + daemon.socket_path(), "--group=masked_cuda",
        absl::StrCat("--num_ranks=", kMaskScenarioRanks), absl::StrCat("--rank=", rank)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    SubprocessOptions so;
    so.stdout_path = daemon.dir() + "/" + name + ".out";
    so.stderr_path = daemon.dir() + "/" + name + ".err";
    auto p = Subprocess::Spawn(argv, so);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  };
  // A client killed between handing an op to the daemon and its stream's ready_seq fails
  // that one op for every rank (docs/CUDA_BACKEND.md "Rank masking"): at most one failed
  // round per survivor.
  KilledRankIsMaskedThenARejoinIsIncluded(daemon, kOpTimeoutMs, spawn,
                                          /*failed_rounds_allowed=*/1);
}

}  // namespace
}  // namespace epd::testing
