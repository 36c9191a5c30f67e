// epd_chaos: the chaos suite (CTest label chaos). A real `epd --backend=host`, many groups of
// real client processes (tests/multinode/clients/mn_client.cc, one per rank, each checking
// every OK result bit for bit against kernels/host over the whole group's inputs), and a
// seeded schedule of faults, one per cycle:
//
//   clean      a loop of Dispatch/Combine/LowLatency rounds: ranks with zero tokens, T = M,
//              extreme skew (every token to one expert, or to one rank's experts)
//   ops        one pass of every op and option (FP8, round_scale, UE8M0, cached dispatch)
//   probes     bad input on one rank: expert ids >= E and -2, T > M (capacity overflow),
//              T > M_ll, x of dtype float32, x of hidden H + 1: INVALID_ARGUMENT on every
//              rank, then every op exact again
//   kill9      kill -9 of a client mid-loop: the others fail (bounded) and stay exact
//   kill9_rejoin  kill -9, then a new process joins the dead rank: the group is in step
//   leave_join a client leaves (exits cleanly) mid-loop and a new one joins its rank
//   stop_cont  SIGSTOP a client past op_timeout, then SIGCONT: errors, then in step again
//   restart    the daemon is killed (SIGKILL or SIGTERM) mid-loop and restarted; clients
//              get errors, then the group re-forms (RejoinAfterRestart): in a seeded half of
//              the cycles the same processes call Client::Reconnect (half of those in a
//              MASK group), else new ones join
//   peer_death (two daemons as nodes) node 1's daemon is killed mid-loop and restarted;
//              node 0's ranks fail, then are in step with node 1's new ranks. In a seeded
//              half of the cycles (host backend) the group is MASK: node 0's ranks never
//              fail, run with node 1's ranks masked within op_timeout + 1 s, and once node
//              1's new ranks rejoin every rank's last round has none masked
//   net_fault  (two daemons started with --testing_transport_faults) a partition, a link
//              reset, dropped writes, or delayed writes (the last: every result exact)
//   mask_kill9, mask_stop, mask_rejoin, mask_self  (rank masking, MaskingFaults: the group
//              is on_rank_failure = MASK and its clients check every OK result against
//              kernels/host under the mask it ran with) kill -9 or SIGSTOP of a client: the
//              survivors' ops never fail and run with it masked within op_timeout + 1 s; a
//              continued one is refused as masked until it unmasks itself; a new process
//              joins a dead one's masked slot; a client masks and later unmasks another
//              rank. Every rank then reports the same mask epoch.
//
// Every cycle runs a second, clean group beside the faulty one (a "bystander", except
// across a restart): a fault in one group never reaches another. Invariants checked after
// every cycle: no client saw a wrong OK result; no op took longer than op_timeout + 1 s
// (op_timeout + 2 s across nodes, where a node waits a grace of min(1 s, op_timeout) for its
// peer's error); every daemon answers grpc.health.v1 SERVING and `epctl groups` lists no
// group of the cycle; every daemon's fds
// (/proc/PID/fd) and own threads (/proc/PID/task; gRPC's pools, which size themselves, only
// under a bound) are back to their count after the first cycle that used it, /dev/shm holds
// no new entry, and its RSS is within --rss_growth_mib of that baseline.
//
//   epd_chaos [--seed=N] [--seconds=S] [--cycles=N] [--faults=kill9,restart,...]
//             [--backend=host|cuda] [--launch_mode=daemon|client]
//
// --backend=cuda (the GPU machine; CTest chaos.cuda, label gpu): every daemon runs
// `epd --backend=cuda`, every client joins on the daemon's first GPU (--gpu_uuid: all ranks
// are virtual ranks of one GPU, daemon-launched unless --launch_mode=client) and copies its
// results to the host before checking them. op_timeout defaults to 5 s there (2 s on host).
// Fault kinds the CUDA backend does not serve that way are left out of the schedule with a
// printed reason (WhyLeftOut). One more kind runs there only:
//
//   graph_replay  client-launched ranks capture LowLatencyDispatch (T on the device) and its
//              LowLatencyCombine in a CUDA graph and replay it 4-12 times with every rank's
//              T changed between replays (mn_client --scenario=graph), every round exact,
//              beside a bystander group on the same daemon. Without MPS (client-launched
//              kernels of several processes on one GPU only run side by side under MPS) the
//              group spans the two CUDA daemons, whose exchange runs in the daemons.
//
// and one more invariant: each daemon's GPU memory comes back within --gpu_growth_mib of its
// baseline after every cycle, read per process (nvidia-smi --query-compute-apps, when it
// lists the daemon's pid) or else for the whole GPU (nvidia-smi --query-gpu=memory.used, or
// GetStats' free_memory_bytes without nvidia-smi; under MPS the daemon's memory is the MPS
// server's, and in a PID namespace nvidia-smi shows other pids): the source is printed.
// Without a usable GPU it exits 77 at once (CTest: skipped) saying why.
//
// The seed (printed; default: from the clock, or EPD_CHAOS_SEED) fixes the schedule: the
// same seed gives the same cycles. EPD_CHAOS_SECONDS overrides --seconds (an hour: 3600).
// Exit 0 after the summary table; 1 with "FAILED seed=<n> cycle=<i> fault=<f> step=<s>"
// and the outputs of the processes involved; 77 when --backend=cuda finds no usable GPU.
// Binaries: EPD_BINARY, EPCTL_BINARY and EPD_MN_CLIENT_BINARY when set (a bundle run on
// another machine), else the build's.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "epd/client.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"
#include "tests/multinode/data_cluster.h"

ABSL_FLAG(uint64_t, seed, 0, "schedule seed (0: EPD_CHAOS_SEED, else from the clock)");
ABSL_FLAG(int, seconds, 120, "run cycles until this many seconds passed (EPD_CHAOS_SECONDS)");
ABSL_FLAG(int, cycles, 0, "stop after this many cycles (0: --seconds decides)");
ABSL_FLAG(std::string, faults, "", "only these fault kinds, comma-separated (\"\": all)");
ABSL_FLAG(int, op_timeout_ms, 0, "the daemons' --op_timeout (0: 2000 on host, 5000 on cuda)");
ABSL_FLAG(int, rss_growth_mib, 64, "bound of a daemon's RSS growth over its baseline");
ABSL_FLAG(bool, multinode, true, "run the faults across nodes (two daemons)");
ABSL_FLAG(std::string, backend, "host",
          "the daemons' --backend: host, or cuda (the GPU machine; exit 77 without a GPU)");
ABSL_FLAG(std::string, launch_mode, "daemon",
          "cuda: the groups' launch mode, daemon or client (graph_replay is always client)");
ABSL_FLAG(int, gpu_growth_mib, 32, "cuda: bound of a daemon's GPU memory growth over its baseline");
ABSL_FLAG(bool, self_check, false,
          "instead: show that a client with wrong results is caught (exit 0 when it is)");

namespace epd::chaos {
namespace {

using multinode::ErrorMillis;
using testing::DaemonProcess;
using testing::DaemonProcessOptions;
using testing::Subprocess;

#ifndef EPD_MN_CLIENT_BINARY
#define EPD_MN_CLIENT_BINARY "epd_mn_client"
#endif

enum class Fault {
  kClean,
  kOps,
  kProbes,
  kKill9,
  kKill9Rejoin,
  kLeaveJoin,
  kStopCont,
  kRestart,
  kPeerDeath,
  kNetFault,
  kGraphReplay,  ///< CUDA only (CudaOnlyFaults).
  // Rank masking (MaskingFaults): the group's spec has on_rank_failure = MASK.
  kMaskKill9,
  kMaskStop,
  kMaskRejoin,
  kMaskSelf,
};
constexpr Fault kAllFaults[] = {
    Fault::kClean,     Fault::kOps,      Fault::kProbes,  Fault::kKill9,     Fault::kKill9Rejoin,
    Fault::kLeaveJoin, Fault::kStopCont, Fault::kRestart, Fault::kPeerDeath, Fault::kNetFault};

const char* Name(Fault f) {
  switch (f) {
    case Fault::kClean:
      return "clean";
    case Fault::kOps:
      return "ops";
    case Fault::kProbes:
      return "probes";
    case Fault::kKill9:
      return "kill9";
    case Fault::kKill9Rejoin:
      return "kill9_rejoin";
    case Fault::kLeaveJoin:
      return "leave_join";
    case Fault::kStopCont:
      return "stop_cont";
    case Fault::kRestart:
      return "restart";
    case Fault::kPeerDeath:
      return "peer_death";
    case Fault::kNetFault:
      return "net_fault";
    case Fault::kGraphReplay:
      return "graph_replay";
    case Fault::kMaskKill9:
      return "mask_kill9";
    case Fault::kMaskStop:
      return "mask_stop";
    case Fault::kMaskRejoin:
      return "mask_rejoin";
    case Fault::kMaskSelf:
      return "mask_self";
  }
  return "?";
}

bool AcrossNodes(Fault f) { return f == Fault::kPeerDeath || f == Fault::kNetFault; }

/// The faults of rank masking (GroupSpec.on_rank_failure = MASK, one node, host backend;
/// Chaos::MaskCycle runs them): the group's clients check every OK result against
/// kernels/host with the masked ranks' experts dropped (mn_client --on_rank_failure=mask).
///   mask_kill9   kill -9 of a client: within op_timeout + 1 s every survivor runs rounds
///                with it masked, and no survivor's op fails
///   mask_stop    SIGSTOP of a client: after op_timeout it is masked for being late and the
///                survivors' ops complete; after SIGCONT its ops are refused
///                (FAILED_PRECONDITION, masked) until it unmasks itself (UpdateRankMask),
///                then it is in step again
///   mask_rejoin  kill -9, then a new process joins the masked slot: unmasked at an op
///                boundary, every rank in step
///   mask_self    one client masks another rank (UpdateRankMask) and unmasks it rounds later:
///                every other rank ran rounds with it masked, it is in step again after
/// In each, the survivors' ops never fail, and at the end every rank's last round reports
/// the same mask epoch and masked ranks.
std::vector<Fault> MaskingFaults() {
  return {Fault::kMaskKill9, Fault::kMaskStop, Fault::kMaskRejoin, Fault::kMaskSelf};
}
bool IsMasking(Fault f) {
  const std::vector<Fault> masking = MaskingFaults();
  return std::find(masking.begin(), masking.end(), f) != masking.end();
}

/// Fault kinds that only run with --backend=cuda.
std::vector<Fault> CudaOnlyFaults() { return {Fault::kGraphReplay}; }

/// What the CUDA daemon and its clients are run with (--backend=cuda), as the driver found it.
struct CudaSetup {
  std::string launch_mode = "daemon";  ///< --launch_mode: of every group but graph_replay's.
  bool mps_active = false;             ///< GetStats.mps_active of the chaos daemon.
  bool multinode = true;               ///< --multinode.
};

/// Why `f` is left out of a --backend=cuda schedule ("" when it runs): the daemon refuses its
/// groups at Join, or it would check what the CUDA backend documents otherwise.
std::string WhyLeftOut(Fault f, const CudaSetup& cuda) {
  const std::vector<Fault> masking_faults = MaskingFaults();
  const bool masking =
      std::find(masking_faults.begin(), masking_faults.end(), f) != masking_faults.end();
  if (masking && cuda.launch_mode == "client") {
    return "refused at Join: spec.on_rank_failure = MASK needs daemon-launched ranks on the "
           "CUDA backend (a dead client's kernels are launched by no one)";
  }
  if (f == Fault::kProbes && cuda.launch_mode == "client") {
    return "client-launched, a bad input found by the client fails that rank's op only (the "
           "others run on); the probes cycle checks INVALID_ARGUMENT on every rank";
  }
  if (f == Fault::kGraphReplay && !cuda.mps_active && !cuda.multinode) {
    return "without MPS the graph's client-launched ranks span the two CUDA daemons (on one "
           "node their kernels would time-slice), and --multinode=false starts none";
  }
  return "";
}

/// A step of a cycle failed: the cycle stops and the run fails with it.
struct Failure {
  std::string step;
  std::string detail;
};

// ---- a daemon's resources ------------------------------------------------------------

/// A daemon's fds, its own threads, gRPC's threads and its RSS. gRPC's pools (the sync
/// server's, the executor's, the event engine's) grow and shrink with load on their own:
/// they are only held to a bound (MaxGrpcThreads()); every other thread is epd's.
struct Resources {
  int fds = 0, threads = 0, grpc_threads = 0;
  int64_t rss_kib = 0;
  std::string ToString() const {
    return absl::StrCat("fds=", fds, " threads=", threads, "+", grpc_threads,
                        "(grpc) rss=", rss_kib / 1024, "MiB");
  }
};
/// gRPC sizes its pools by the machine's cores (the event engine's and the executor's
/// reserve grow with them), so the bound does too: 64 on the 2-core CI machine, 96 on the
/// GPU machine's 16 cores, where many parallel instances load every daemon at once.
int MaxGrpcThreads() {
  static const int bound =
      std::max(64, 32 + 4 * static_cast<int>(std::thread::hardware_concurrency()));
  return bound;
}

/// Thread names (comm, 15 characters) of gRPC's own pools.
bool IsGrpcThread(const std::string& comm) {
  for (const char* prefix : {"default-executo", "event_engine", "grpc", "nexting_thread",
                             "resolver-execut", "timer_manager"}) {
    if (absl::StartsWith(comm, prefix)) return true;
  }
  return false;
}

/// Calls `fn` with each entry of directory `dir` (none when it cannot be read).
void ForEachEntry(const std::string& dir,
                  const std::function<void(const std::filesystem::path&)>& fn) {
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    fn(it->path());
  }
}

/// The first line of a file ("" when it cannot be read).
std::string FirstLine(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

/// " <key> x<count>;" for each key `key_of` gives the entries of `dir`, for a leak's message.
std::string Census(const std::string& dir,
                   const std::function<std::string(const std::filesystem::path&)>& key_of) {
  std::map<std::string, int> count;
  ForEachEntry(dir, [&](const std::filesystem::path& p) { ++count[key_of(p)]; });
  std::string out;
  for (const auto& [key, n] : count) absl::StrAppend(&out, " ", key, " x", n, ";");
  return out;
}

/// Targets of a process's fds ("socket", "/memfd:...").
std::string FdTargets(pid_t pid) {
  return Census(absl::StrCat("/proc/", pid, "/fd"), [](const std::filesystem::path& p) {
    std::error_code ec;
    std::string target = std::filesystem::read_symlink(p, ec).string();
    if (absl::StartsWith(target, "socket:")) target = "socket";
    if (absl::StartsWith(target, "anon_inode:")) target = target.substr(0, target.find(' '));
    return target;
  });
}

/// Names of a process's threads (/proc/PID/task/TID/comm).
std::string ThreadNames(pid_t pid) {
  return Census(absl::StrCat("/proc/", pid, "/task"),
                [](const std::filesystem::path& p) { return FirstLine(p / "comm"); });
}

Resources Measure(pid_t pid) {
  Resources r;
  ForEachEntry(absl::StrCat("/proc/", pid, "/fd"), [&](const std::filesystem::path&) { ++r.fds; });
  ForEachEntry(absl::StrCat("/proc/", pid, "/task"), [&](const std::filesystem::path& p) {
    ++(IsGrpcThread(FirstLine(p / "comm")) ? r.grpc_threads : r.threads);
  });
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)),
                             &r.rss_kib);
    }
  }
  return r;
}

/// /dev/shm entries whose name mentions epd (epd's regions are memfds: there should be none).
std::set<std::string> ShmEntries() {
  std::set<std::string> out;
  ForEachEntry("/dev/shm", [&](const std::filesystem::path& p) {
    if (absl::StrContains(p.filename().string(), "epd")) out.insert(p.filename().string());
  });
  return out;
}

// ---- GPU memory (--backend=cuda) -------------------------------------------------------

/// The path of executable `name` in a directory of $PATH ("" when there is none).
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

/// The lines `smi` (nvidia-smi) prints for `query` in CSV without header or units; empty when
/// it fails.
std::vector<std::string> NvidiaSmiLines(const std::string& smi, const std::string& query) {
  auto out = testing::RunCommand({smi, query, "--format=csv,noheader,nounits"}, absl::Seconds(20));
  if (!out.ok() || out->exit_code != 0) return {};
  return absl::StrSplit(out->stdout_text, '\n', absl::SkipWhitespace());
}

/// nvidia-smi's GPU memory (MiB) of each compute process it lists by pid (a process whose
/// used_memory is "[N/A]" is left out).
std::map<pid_t, int64_t> ComputeAppsMib(const std::string& smi) {
  std::map<pid_t, int64_t> out;
  for (const std::string& line : NvidiaSmiLines(smi, "--query-compute-apps=pid,used_memory")) {
    std::vector<std::string> f = absl::StrSplit(line, ',');
    int64_t pid = 0, mib = 0;
    if (f.size() == 2 && absl::SimpleAtoi(absl::StripAsciiWhitespace(f[0]), &pid) &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(f[1]), &mib)) {
      out[static_cast<pid_t>(pid)] += mib;  // One line per GPU the process uses.
    }
  }
  return out;
}

/// One reading of GPU memory in use, in MiB (-1: unknown), and where it came from.
struct GpuReading {
  int64_t mib = -1;
  std::string source;
};

/// Memory in use on the whole GPU `uuid`: nvidia-smi's memory.used when `smi` is set, else the
/// GetStats of the daemon on `socket` (total - free, refreshed by it every 2 s).
GpuReading DeviceUsedMib(const std::string& smi, const std::string& uuid,
                         const std::string& socket) {
  if (!smi.empty()) {
    for (const std::string& line : NvidiaSmiLines(smi, "--query-gpu=uuid,memory.used")) {
      std::vector<std::string> f = absl::StrSplit(line, ',');
      int64_t mib = 0;
      if (f.size() == 2 && absl::StripAsciiWhitespace(f[0]) == uuid &&
          absl::SimpleAtoi(absl::StripAsciiWhitespace(f[1]), &mib)) {
        return {mib, "device-wide, nvidia-smi --query-gpu=memory.used"};
      }
    }
    return {-1, "nvidia-smi --query-gpu=uuid,memory.used lists no " + uuid};
  }
  ClientOptions options;
  options.socket_path = socket;
  options.client_name = "epd_chaos";
  auto client = Client::Connect(options);
  if (!client.ok()) return {-1, "no nvidia-smi, and GetStats: " + client.status().ToString()};
  auto stats = (*client)->GetStats();
  if (!stats.ok()) return {-1, "no nvidia-smi, and GetStats: " + stats.status().ToString()};
  for (const v1::GpuInfo& g : stats->gpus()) {
    if (g.uuid() == uuid) {
      return {static_cast<int64_t>((g.total_memory_bytes() - g.free_memory_bytes()) >> 20),
              "device-wide, GetStats total - free (no nvidia-smi on PATH; refreshed every 2 s)"};
    }
  }
  return {-1, "no nvidia-smi, and GetStats lists no " + uuid};
}

/// A daemon watched for leaks: its resources once the first cycle is over are the baseline.
struct Watched {
  DaemonProcess* daemon = nullptr;
  std::string label;
  std::optional<Resources> baseline;
  bool used = false;  ///< A group ran on it since it started.
  std::string baseline_threads;
};

// ---- client processes of one group ----------------------------------------------------

/// What a group's client processes are started with.
struct GroupConfig {
  std::string name;
  std::vector<std::string> sockets;  ///< Per rank: its node's daemon socket.
  std::string nodes_flag;            ///< "ADDRESS=RANKS,..." (one node: "local=R").
  std::vector<int> tokens;
  std::string skew = "none";
  int skew_target = 0;
  uint64_t seed = 1;
  std::string scenario = "loop";
  int probe_rank = 0;
  std::string dir;
  int starts = 0;
  /// For --self_check: this rank's client gets another input seed, so its reference of the
  /// group's inputs is wrong and its results must be reported as mismatches (-1: none).
  int miswired_rank = -1;
  /// Clients print a SLOW line for each op slower than this (the op time bound).
  int64_t report_slow_ms = 0;
  /// The CUDA backend: the GPU every rank joins on, and the launch mode ("": not passed).
  std::string gpu_uuid;
  std::string launch_mode;
  int graph_rounds = 0;  ///< --scenario=graph: replays of the captured graph.
  /// mn_client --on_rank_failure ("": the spec leaves it unspecified, FAIL).
  std::string on_rank_failure;
  /// mn_client --reconnect: after UNAVAILABLE (a daemon restart) the same processes call
  /// Client::Reconnect and go on.
  bool reconnect = false;
  /// More flags of one rank's clients (e.g. --mask_self of the rank that masks another).
  std::map<int, std::vector<std::string>> rank_flags;
  /// mask_self: the rank masked, the rank whose client masks it, and the rounds (the
  /// masker's) after which it masks and unmasks it.
  int mask_target = -1, masker = -1, mask_round = 0, unmask_round = 0;
};

/// A group's client processes (mn_client), one per rank.
struct Group : GroupConfig {
  std::vector<std::unique_ptr<Subprocess>> procs;  ///< Per rank, the current process.
  std::vector<std::unique_ptr<Subprocess>> retired;

  int num_ranks() const { return static_cast<int>(sockets.size()); }
  std::string Describe() const {
    return absl::StrCat(name, " R=", num_ranks(), " T=", absl::StrJoin(tokens, ","), " skew=", skew,
                        skew == "none" ? "" : absl::StrCat(":", skew_target),
                        launch_mode.empty() ? "" : " launch=" + launch_mode,
                        on_rank_failure.empty() ? "" : " on_rank_failure=" + on_rank_failure);
  }

  absl::Status Start(int rank) {
    const char* env = std::getenv("EPD_MN_CLIENT_BINARY");
    std::vector<std::string> argv = {
        env != nullptr && *env != '\0' ? env : EPD_MN_CLIENT_BINARY,
        "--socket=" + sockets[rank],
        "--group=" + name,
        "--nodes=" + nodes_flag,
        absl::StrCat("--rank=", rank),
        "--scenario=" + scenario,
        absl::StrCat("--seed=", rank == miswired_rank ? seed + 1 : seed),
        "--tokens=" + absl::StrJoin(tokens, ","),
        "--skew=" + skew,
        absl::StrCat("--skew_target=", skew_target),
        absl::StrCat("--probe_rank=", probe_rank),
        "--max_seconds=120",
        "--wait_seconds=20",
        "--round_pause_ms=2",
        absl::StrCat("--report_slow_ms=", report_slow_ms),
    };
    if (!gpu_uuid.empty()) argv.push_back("--gpu_uuid=" + gpu_uuid);
    if (!launch_mode.empty()) argv.push_back("--launch_mode=" + launch_mode);
    if (graph_rounds > 0) argv.push_back(absl::StrCat("--graph_rounds=", graph_rounds));
    if (!on_rank_failure.empty()) argv.push_back("--on_rank_failure=" + on_rank_failure);
    if (reconnect) argv.push_back("--reconnect");
    if (auto it = rank_flags.find(rank); it != rank_flags.end()) {
      argv.insert(argv.end(), it->second.begin(), it->second.end());
    }
    const std::string base = absl::StrCat(dir, "/", name, ".rank", rank, ".", ++starts);
    testing::SubprocessOptions options;
    options.stdout_path = base + ".stdout";
    options.stderr_path = base + ".stderr";
    options.pipe_stdin = true;
    auto proc = Subprocess::Spawn(argv, options);
    if (!proc.ok()) return proc.status();
    if (procs.size() < sockets.size()) procs.resize(sockets.size());
    if (procs[rank] != nullptr) retired.push_back(std::move(procs[rank]));
    procs[rank] = *std::move(proc);
    return absl::OkStatus();
  }
  absl::Status StartAll() {
    for (int r = 0; r < num_ranks(); ++r) {
      if (absl::Status st = Start(r); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  void CloseAll() {
    for (auto& p : procs) {
      if (p != nullptr) p->CloseStdin();
    }
  }
  void KillAll() {
    for (auto* list : {&procs, &retired}) {
      for (auto& p : *list) {
        if (p != nullptr && p->Running()) {
          p->Signal(SIGCONT);
          p->Signal(SIGKILL);
          (void)p->Wait(absl::Seconds(5));
        }
      }
    }
  }
  /// Every process's output (current and retired), for a failure's message.
  std::string Outputs() const {
    std::string out;
    auto one = [&](const Subprocess& p, const std::string& what) {
      std::string text = p.Stdout() + p.Stderr();
      if (text.size() > 4000) {
        // The tail is kept; a wrong result's own lines (MISMATCH) before it are kept too.
        std::string mismatches;
        const size_t cut = text.size() - 4000;
        int kept = 0;
        for (size_t at = text.find("MISMATCH"); at != std::string::npos && at < cut && kept < 5;
             at = text.find("MISMATCH", at + 1)) {
          const size_t begin = text.rfind('\n', at);
          const size_t start = begin == std::string::npos ? 0 : begin + 1;
          const size_t end = text.find('\n', at);
          absl::StrAppend(&mismatches, text.substr(start, end - start), "\n");
          ++kept;
          if (end == std::string::npos) break;
          at = end;
        }
        text = mismatches + "..." + text.substr(cut);
      }
      absl::StrAppend(&out, "---- ", name, " ", what, " (pid ", p.pid(), "):\n", text);
    };
    for (size_t r = 0; r < procs.size(); ++r) {
      if (procs[r] != nullptr) one(*procs[r], absl::StrCat("rank ", r));
    }
    for (const auto& p : retired) one(*p, "earlier process");
    return out;
  }
};

/// The longest op any line of `output` reports ("after <ms> ms", "max_op_ms=<n>").
int64_t LongestOp(const std::string& output) {
  int64_t longest = 0;
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    longest = std::max(longest, ErrorMillis(std::string(line)));
    const size_t at = line.find("max_op_ms=");
    int64_t ms = 0;
    if (at != absl::string_view::npos && absl::SimpleAtoi(line.substr(at + 10), &ms)) {
      longest = std::max(longest, ms);
    }
  }
  return longest;
}

/// Lines "ROUND <i> OK" after the last error line of `output` past `skip` bytes.
int OkRoundsSinceLastError(const std::string& output, size_t skip) {
  if (skip > output.size()) return 0;
  int oks = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(output).substr(skip), '\n')) {
    if (!absl::StartsWith(line, "ROUND ")) continue;
    if (absl::StrContains(line, " ERROR ")) oks = 0;
    if (absl::EndsWith(line, " OK")) ++oks;
  }
  return oks;
}

bool HasError(const std::string& output, size_t skip = 0) {
  return !multinode::FirstErrorLine(output, skip).empty();
}

/// A round's mask as a client under MASK prints it: "MASK <i> epoch=<e> masked=<r,..|->".
struct MaskLine {
  uint32_t epoch = 0;
  std::set<int> masked;
  std::string text;
};
/// The MASK lines of `output` past `skip` bytes.
std::vector<MaskLine> MaskLines(const std::string& output, size_t skip) {
  std::vector<MaskLine> out;
  if (skip > output.size()) return out;
  for (absl::string_view line : absl::StrSplit(absl::string_view(output).substr(skip), '\n')) {
    if (!absl::StartsWith(line, "MASK ")) continue;
    const size_t e = line.find(" epoch="), m = line.find(" masked=");
    MaskLine ml;
    ml.text = std::string(line);
    if (e == absl::string_view::npos || m == absl::string_view::npos ||
        !absl::SimpleAtoi(line.substr(e + 7, m - e - 7), &ml.epoch)) {
      continue;
    }
    for (absl::string_view r : absl::StrSplit(line.substr(m + 8), ',', absl::SkipEmpty())) {
      int rank = 0;
      if (absl::SimpleAtoi(r, &rank)) ml.masked.insert(rank);
    }
    out.push_back(std::move(ml));
  }
  return out;
}

/// Whether an error line is an op refused because the rank itself is masked (the documented
/// FAILED_PRECONDITION "... the rank is masked ..." / "... which was masked ...").
bool IsMaskedRefusal(absl::string_view line) {
  return absl::StrContains(line, " FAILED_PRECONDITION ") &&
         (absl::StrContains(line, "the rank is masked") || absl::StrContains(line, "was masked"));
}

/// Which of the failures a stopped rank's GPU stall causes a caller accepts.
enum class GpuStall {
  /// The op after the stalled one only: the stalled op, given up on, stays on the GPU until
  /// its kernels' own bounds (op_timeout), so the next op cannot start before that and fails
  /// ("an earlier op is still run..."). What the stopped rank, once continued, may see.
  kNextOp,
  /// The stalled op too: it fails at its bound for every rank ("the GPU did not finish the
  /// op"). What the other ranks may see.
  kStalledOrNextOp,
};

/// On the CUDA backend, a rank stopped after it submitted an op (its client's stream never
/// staged it) stalls that op on the GPU: the op fails at its bound for every rank, and so
/// does the next one, which cannot start before it; only then is the rank masked
/// (docs/RELIABILITY.md). Whether an error line is such a failure, of the kinds `accepted`.
bool IsGpuStallOfAStoppedRank(absl::string_view line, GpuStall accepted) {
  if (!absl::StrContains(line, " DEADLINE_EXCEEDED ")) return false;
  if (absl::StrContains(line, "could not start it within op_timeout") &&
      absl::StrContains(line, "an earlier op is still run")) {
    return true;
  }
  return accepted == GpuStall::kStalledOrNextOp &&
         absl::StrContains(line, "the GPU did not finish the op within op_timeout");
}

// ---- the run ---------------------------------------------------------------------------

struct Stats {
  int cycles = 0, passed = 0;
  double seconds = 0;
  int64_t longest_op_ms = 0;
};

class Chaos {
 public:
  Chaos(uint64_t seed, std::vector<Fault> faults)
      : seed_(seed), rng_(seed), faults_(std::move(faults)) {
    backend_ = absl::GetFlag(FLAGS_backend);
    cuda_.launch_mode = absl::GetFlag(FLAGS_launch_mode);
    cuda_.multinode = absl::GetFlag(FLAGS_multinode);
    const int op_timeout_ms = absl::GetFlag(FLAGS_op_timeout_ms);
    op_timeout_ = absl::Milliseconds(op_timeout_ms > 0    ? op_timeout_ms
                                     : backend_ == "cuda" ? 5000
                                                          : 2000);
    dir_ = testing::MakeTempDir("epd-chaos-");
  }
  ~Chaos() {
    std::error_code ec;
    if (!keep_dir_) std::filesystem::remove_all(dir_, ec);
  }

  /// Shows that the invariants can fail: a clean group with one miswired client (its inputs
  /// from another seed) must be caught as wrong results. 0 when it was.
  int SelfCheck() {
    if (absl::Status st = StartNode(); !st.ok()) {
      if (!skip_reason_.empty()) return Skipped();
      std::printf("[chaos] self-check: epd did not start: %s\n", st.ToString().c_str());
      return 1;
    }
    Group g = MakeGroup("self-check", 2);
    g.tokens = {4, 4};
    g.miswired_rank = 1;
    Cleanup cleanup{[&] { g.KillAll(); }};
    if (absl::Status st = g.StartAll(); !st.ok()) {
      std::printf("[chaos] self-check: %s\n", st.ToString().c_str());
      return 1;
    }
    // Bounded: until a round ran (rank 1's reference of rank 0's inputs is wrong, and rank
    // 0's of rank 1's), then every process stops.
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    auto ran = [&] {
      for (const auto& p : g.procs) {
        const std::string out = p->Stdout();
        if (absl::StrContains(out, "MISMATCH") || absl::StrContains(out, " OK\n")) return true;
      }
      return false;
    };
    while (!ran() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    std::optional<Failure> f = Finish(g, /*clean=*/true, false);
    // The cycle failed (at its first finding, in rank order) and the outputs it reports show
    // the wrong results.
    if (f && absl::StrContains(f->detail, "MISMATCH")) {
      std::printf("[chaos] self-check passed: a miswired client's results were caught (%s)\n",
                  f->step.c_str());
      return SelfCheckMask();
    }
    std::printf("[chaos] self-check FAILED: %s\n",
                f ? (f->step + ": " + f->detail).c_str() : "wrong results went unnoticed");
    return 1;
  }

  /// Shows that results under a mask are checked against the masked reference: in a MASK
  /// group of 2 whose rank 0 routes every token to rank 1's experts, rank 1 is killed; rank
  /// 0's client checks against the unmasked reference (--testing_ignore_mask), so its
  /// results (every pair dropped) must be reported as mismatches. 0 when they were.
  int SelfCheckMask() {
    Group g = MakeGroup("self-check-mask", 2);
    g.tokens = {4, 4};
    g.skew = "rank";
    g.skew_target = 1;
    g.on_rank_failure = "mask";
    g.rank_flags[0] = {"--testing_ignore_mask"};
    Cleanup cleanup{[&] { g.KillAll(); }};
    if (absl::Status st = g.StartAll(); !st.ok()) {
      std::printf("[chaos] self-check (mask): %s\n", st.ToString().c_str());
      return 1;
    }
    if (auto f = WaitFlowing(g, AllRanks(g))) {
      std::printf("[chaos] self-check (mask) FAILED: %s: %s\n", f->step.c_str(), f->detail.c_str());
      return 1;
    }
    g.procs[1]->Signal(SIGKILL);
    const absl::Status caught = g.procs[0]->WaitForOutput("MISMATCH", absl::Seconds(20));
    std::optional<Failure> f = Finish(g, /*clean=*/false, false, {g.procs[1].get()});
    if (caught.ok() && f && absl::StrContains(f->detail, "MISMATCH")) {
      std::printf(
          "[chaos] self-check passed: results under a mask checked against the unmasked "
          "reference were caught (%s)\n",
          f->step.c_str());
      return 0;
    }
    std::printf("[chaos] self-check (mask) FAILED: %s\n",
                f ? (f->step + ": " + f->detail).c_str() : "wrong masked results went unnoticed");
    return 1;
  }

  int Run(absl::Duration budget, int max_cycles) {
    std::printf(
        "[chaos] seed=%llu budget=%llds op_timeout=%lldms faults=%s\n",
        static_cast<unsigned long long>(seed_),
        static_cast<long long>(absl::ToInt64Seconds(budget)),
        static_cast<long long>(absl::ToInt64Milliseconds(op_timeout_)),
        absl::StrJoin(faults_, ",", [](std::string* o, Fault f) { o->append(Name(f)); }).c_str());
    std::printf("[chaos] reproduce: epd_chaos --seed=%llu\n",
                static_cast<unsigned long long>(seed_));
    std::fflush(stdout);
    const absl::Time start = absl::Now();
    if (absl::Status st = StartNode(); !st.ok()) {
      if (!skip_reason_.empty()) return Skipped();
      std::printf("[chaos] FAILED seed=%llu: epd did not start: %s\n",
                  static_cast<unsigned long long>(seed_), st.ToString().c_str());
      return 1;
    }
    if (backend_ == "cuda" && !ScheduleForCuda()) return 2;
    // The schedule: every kind once (shuffled), then kinds drawn at random.
    std::vector<Fault> first = faults_;
    std::shuffle(first.begin(), first.end(), rng_);
    for (int cycle = 0;; ++cycle) {
      if (max_cycles > 0 && cycle >= max_cycles) break;
      if (max_cycles == 0 && absl::Now() - start >= budget && cycle >= 1) break;
      const Fault fault =
          cycle < static_cast<int>(first.size()) ? first[cycle] : faults_[rng_() % faults_.size()];
      const absl::Time begin = absl::Now();
      std::string what;
      std::optional<Failure> failure = RunCycle(cycle, fault, &what);
      if (!failure) failure = CheckInvariants();
      const double secs = absl::ToDoubleSeconds(absl::Now() - begin);
      Stats& s = stats_[fault];
      ++s.cycles;
      s.seconds += secs;
      s.longest_op_ms = std::max(s.longest_op_ms, cycle_longest_ms_);
      if (failure) {
        std::printf("[chaos] cycle %d %-12s %s -> FAILED (%.1f s)\n", cycle, Name(fault),
                    what.c_str(), secs);
        std::printf(
            "[chaos] FAILED seed=%llu cycle=%d fault=%s step=%s\n%s\n"
            "[chaos] reproduce: epd_chaos --seed=%llu --cycles=%d (outputs kept in %s)\n",
            static_cast<unsigned long long>(seed_), cycle, Name(fault), failure->step.c_str(),
            failure->detail.c_str(), static_cast<unsigned long long>(seed_), cycle + 1,
            dir_.c_str());
        keep_dir_ = true;
        for (const Watched& w : watched_) {
          std::string log = w.daemon->Logs();
          if (log.size() > 12000) log = "..." + log.substr(log.size() - 12000);
          std::printf("---- the end of %s's log:\n%s\n", w.label.c_str(), log.c_str());
        }
        Summary(absl::Now() - start);
        return 1;
      }
      ++s.passed;
      // A passed cycle's client outputs are not needed (an hour's run would fill /tmp).
      ForEachEntry(dir_, [](const std::filesystem::path& p) {
        std::error_code ec;
        std::filesystem::remove(p, ec);
      });
      std::printf("[chaos] cycle %d %-12s %s -> PASS (%.1f s, longest op %lld ms) %s%s\n", cycle,
                  Name(fault), what.c_str(), secs, static_cast<long long>(cycle_longest_ms_),
                  Measure(node_->pid()).ToString().c_str(), gpu_note_.c_str());
      std::fflush(stdout);
    }
    Summary(absl::Now() - start);
    return 0;
  }

 private:
  absl::Status StartNode() {
    DaemonProcessOptions options;
    options.tcp = false;
    options.log_level = "info";
    options.extra_args = {
        absl::StrCat("--op_timeout=", absl::ToInt64Milliseconds(op_timeout_), "ms")};
    options.backend = backend_;
    if (backend_ == "cuda") options.start_timeout = absl::Seconds(60);  // Kernels load first.
    auto daemon = DaemonProcess::Start(options);
    if (!daemon.ok()) {
      if (backend_ == "cuda") skip_reason_ = NoGpuReason(daemon.status());
      return daemon.status();
    }
    node_ = *std::move(daemon);
    watched_.push_back({node_.get(), "epd", std::nullopt});
    if (backend_ == "cuda") return ReadCudaFacts();
    return absl::OkStatus();
  }

  // ---- --backend=cuda ---------------------------------------------------------------------

  /// Why `epd --backend=cuda` did not start, when it is that no GPU is usable here (its
  /// CUDA_NO_DEVICE line, or no supported GPU); "" for any other failure.
  static std::string NoGpuReason(const absl::Status& start) {
    const std::string text(start.message());
    if (!absl::StrContains(text, "CUDA_NO_DEVICE") &&
        !absl::StrContains(text, "has no supported GPU")) {
      return "";
    }
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::StrContains(line, "failed to start")) return std::string(line);
    }
    return text.substr(0, 600);
  }

  /// Exit code 77 (CTest SKIP_RETURN_CODE) with the reason.
  int Skipped() {
    std::printf("[chaos] SKIPPED: --backend=cuda needs a usable GPU: %s\n", skip_reason_.c_str());
    return 77;
  }

  /// After the chaos daemon started with --backend=cuda: the GPU every rank joins on and
  /// whether MPS is active (GetStats). A daemon that serves another backend (a build without
  /// the CUDA data plane) or lists no supported GPU sets skip_reason_.
  absl::Status ReadCudaFacts() {
    ClientOptions options;
    options.socket_path = node_->socket_path();
    options.client_name = "epd_chaos";
    auto client = Client::Connect(options);
    if (!client.ok()) return client.status();
    auto stats = (*client)->GetStats();
    if (!stats.ok()) return stats.status();
    if (stats->backend() != "cuda") {
      skip_reason_ = absl::StrCat("epd --backend=cuda serves the ", stats->backend(),
                                  " backend: ", stats->backend_reason());
      return absl::FailedPreconditionError(skip_reason_);
    }
    for (const v1::GpuInfo& g : stats->gpus()) {
      if (g.supported() && gpu_uuid_.empty()) gpu_uuid_ = g.uuid();
    }
    if (gpu_uuid_.empty()) {
      skip_reason_ = "epd --backend=cuda lists no supported GPU";
      return absl::FailedPreconditionError(skip_reason_);
    }
    cuda_.mps_active = stats->mps_active();
    nvidia_smi_ = FindOnPath("nvidia-smi");
    std::printf(
        "[chaos] cuda: every rank on GPU %s, launch mode %s (graph_replay: client), MPS %s, "
        "op_timeout %lld ms; GPU memory from %s\n",
        gpu_uuid_.c_str(), cuda_.launch_mode.c_str(), cuda_.mps_active ? "active" : "not active",
        static_cast<long long>(absl::ToInt64Milliseconds(op_timeout_)),
        nvidia_smi_.empty() ? "GetStats (no nvidia-smi on PATH)" : nvidia_smi_.c_str());
    if (cuda_.launch_mode == "client" && !cuda_.mps_active) {
      std::printf(
          "[chaos] warning: --launch_mode=client without MPS: the ranks' kernels (several "
          "processes on one GPU) time-slice, and each op is slow\n");
    }
    return absl::OkStatus();
  }

  /// Leaves out of faults_ the kinds WhyLeftOut names, printing each with its reason. False
  /// (with a message) when none is left.
  bool ScheduleForCuda() {
    std::vector<Fault> kept;
    for (Fault f : faults_) {
      const std::string why = WhyLeftOut(f, cuda_);
      if (why.empty()) {
        kept.push_back(f);
      } else {
        std::printf("[chaos] left out on cuda (not run, not counted): %s: %s\n", Name(f),
                    why.c_str());
        left_out_.emplace_back(Name(f), why);
      }
    }
    faults_ = std::move(kept);
    if (faults_.empty()) std::printf("[chaos] no fault kind is left to run on cuda\n");
    return !faults_.empty();
  }

  /// The CUDA backend's flags of a new group (nothing on host).
  void ForBackend(Group& g) const {
    if (backend_ != "cuda") return;
    g.gpu_uuid = gpu_uuid_;
    g.launch_mode = cuda_.launch_mode;
  }

  /// The two daemons of the faults across nodes, started at the first such cycle.
  absl::Status StartCluster() {
    if (cluster_.has_value()) return absl::OkStatus();
    auto cluster = multinode::StartCluster({2, 2}, op_timeout_, true, {}, backend_);
    if (!cluster.ok()) return cluster.status();
    cluster_ = *std::move(cluster);
    for (size_t i = 0; i < cluster_->daemons.size(); ++i) {
      watched_.push_back({cluster_->daemons[i].get(), absl::StrCat("node ", i), std::nullopt});
    }
    return absl::OkStatus();
  }

  void MarkUsed(DaemonProcess* daemon) {
    for (Watched& w : watched_) {
      if (w.daemon == daemon) w.used = true;
    }
  }

  int Pick(int lo, int hi) { return lo + static_cast<int>(rng_() % uint64_t(hi - lo + 1)); }

  /// A group of `num_ranks` on one node (the chaos daemon): random T (0 and M = 8 often,
  /// sometimes M on every rank with every token to one expert), skew and input seed.
  Group MakeGroup(const std::string& name, int num_ranks) {
    Group g;
    g.name = name;
    g.dir = dir_;
    g.report_slow_ms = absl::ToInt64Milliseconds(OpBound(false));
    g.sockets.assign(num_ranks, node_->socket_path());
    g.nodes_flag = absl::StrCat("local=", num_ranks);
    Randomize(g, num_ranks);
    ForBackend(g);
    return g;
  }
  void Randomize(Group& g, int num_ranks) {
    g.tokens.clear();
    for (int r = 0; r < num_ranks; ++r) {
      const int kind = Pick(0, 4);
      g.tokens.push_back(kind == 0 ? 0 : kind == 1 ? multinode::kMaxTokens : Pick(1, 7));
    }
    const int skew = Pick(0, 3);
    g.skew = skew == 1 ? "expert" : skew == 2 ? "rank" : "none";
    if (Pick(0, 5) == 0) {
      // Full: T = M everywhere, every token to one expert, whose receive buffers (R * M rows
      // of the low-latency layout) are then filled exactly.
      g.tokens.assign(num_ranks, multinode::kMaxTokens);
      g.skew = "expert";
    }
    g.skew_target = g.skew == "expert" ? Pick(0, num_ranks * multinode::kExpertsPerRank - 1)
                                       : Pick(0, num_ranks - 1);
    g.seed = rng_() % 100000 + 1;
  }
  /// A group across the cluster's two nodes: 1 or 2 ranks on each.
  Group MakeNodesGroup(const std::string& name, std::vector<int> per_node,
                       const multinode::Cluster& cluster) {
    Group g;
    g.name = name;
    g.dir = dir_;
    g.report_slow_ms = absl::ToInt64Milliseconds(OpBound(true));
    std::vector<GroupNode> nodes;
    for (size_t i = 0; i < per_node.size(); ++i) {
      nodes.push_back({cluster.daemons[i]->peer_address(), per_node[i]});
      for (int r = 0; r < per_node[i]; ++r) g.sockets.push_back(cluster.daemons[i]->socket_path());
    }
    g.nodes_flag = multinode::NodesFlag(nodes);
    Randomize(g, static_cast<int>(g.sockets.size()));
    ForBackend(g);
    return g;
  }

  absl::Duration OpBound(bool across_nodes) const {
    return op_timeout_ + absl::Seconds(across_nodes ? 2 : 1);
  }

  /// Waits until every listed rank of `g` printed an OK round (joined, ops flowing).
  std::optional<Failure> WaitFlowing(Group& g, const std::vector<int>& ranks) {
    for (int r : ranks) {
      absl::Status st = g.procs[r]->WaitForOutput(" OK\n", absl::Seconds(20));
      if (!st.ok()) {
        return Failure{absl::StrCat("wait for an OK round of ", g.name, " rank ", r),
                       absl::StrCat(st.message(), "\n", g.Outputs())};
      }
    }
    return std::nullopt;
  }
  std::vector<int> AllRanks(const Group& g) {
    std::vector<int> all(g.num_ranks());
    for (int r = 0; r < g.num_ranks(); ++r) all[r] = r;
    return all;
  }

  /// Waits until each listed rank has `oks` OK rounds after its last error (past the
  /// offsets in `since`): in step again.
  std::optional<Failure> WaitInStep(Group& g, const std::vector<int>& ranks,
                                    const std::vector<size_t>& since, const std::string& step) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (int r : ranks) {
      while (OkRoundsSinceLastError(g.procs[r]->Stdout(), since[r]) < 3) {
        if (absl::Now() > deadline || !g.procs[r]->Running()) {
          return Failure{step, absl::StrCat(g.name, " rank ", r,
                                            " is not in step again (3 OK rounds after its last "
                                            "error) within 30 s\n",
                                            g.Outputs())};
        }
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    return std::nullopt;
  }

  /// Waits for an error line from each listed rank after `since` (the fault reached it).
  std::optional<Failure> WaitErrors(Group& g, const std::vector<int>& ranks,
                                    const std::vector<size_t>& since, bool across_nodes,
                                    const std::string& step) {
    for (int r : ranks) {
      const std::string line =
          multinode::WaitErrorLine(*g.procs[r], since[r], OpBound(across_nodes) + absl::Seconds(5));
      if (line.empty()) {
        return Failure{
            step, absl::StrCat(g.name, " rank ", r, " saw no error within ",
                               absl::FormatDuration(OpBound(across_nodes) + absl::Seconds(5)), "\n",
                               g.Outputs())};
      }
    }
    return std::nullopt;
  }

  std::vector<size_t> Offsets(const Group& g) {
    std::vector<size_t> out;
    for (const auto& p : g.procs) out.push_back(p == nullptr ? 0 : p->Stdout().size());
    return out;
  }

  /// Closes every stdin, waits for the exits and checks each process: exit 0 (no wrong OK
  /// result; ops/probes: every op exact), or -9 for those the cycle killed; no op longer
  /// than the bound (but for `exempt` ranks: a stopped process's own clock ran on); with
  /// `clean`, no error line and at least one OK round.
  std::optional<Failure> Finish(Group& g, bool clean, bool across_nodes,
                                const std::set<const Subprocess*>& exempt = {}) {
    // Ranks stop at different rounds: a rank still in an op when another stopped fails it
    // (bounded). "clean" holds for what they printed before the stop.
    std::map<const Subprocess*, size_t> before_stop;
    for (const auto& p : g.procs) {
      if (p != nullptr) before_stop[p.get()] = p->Stdout().size();
    }
    g.CloseAll();
    const absl::Time deadline = absl::Now() + OpBound(across_nodes) + absl::Seconds(25);
    std::optional<Failure> failure;
    auto check = [&](Subprocess& p, const std::string& who) {
      absl::StatusOr<int> code = p.Wait(std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!code.ok()) {
        p.Signal(SIGKILL);
        (void)p.Wait(absl::Seconds(5));
        if (!failure) failure = Failure{"stop " + who, "did not exit within its bound"};
        return;
      }
      const std::string out = p.Stdout();
      const bool killed = *code == -SIGKILL && exempt.count(&p) > 0;
      if (*code != 0 && !killed && !failure) {
        failure = Failure{"exit of " + who,
                          absl::StrCat("exit code ", *code, *code == 1 ? " (a wrong result)" : "")};
      }
      if (absl::StrContains(out, "MISMATCH") && !failure) {
        failure = Failure{"results of " + who, "an OK result differs from the reference"};
      }
      if (absl::StrContains(out, "PROBE ") && absl::StrContains(out, " BAD ") && !failure) {
        failure = Failure{"probes of " + who, "bad input did not fail as documented"};
      }
      if (exempt.count(&p) == 0) {
        const int64_t longest = LongestOp(out);
        cycle_longest_ms_ = std::max(cycle_longest_ms_, longest);
        if (longest > absl::ToInt64Milliseconds(OpBound(across_nodes)) && !failure) {
          failure = Failure{"op time of " + who,
                            absl::StrCat("an op took ", longest, " ms > op_timeout + ",
                                         across_nodes ? 2 : 1, " s")};
        }
      }
      if (clean && !failure) {
        const std::string ran =
            g.scenario == "loop" ? out.substr(0, std::min(out.size(), before_stop[&p])) : out;
        if (HasError(ran) || absl::StrContains(ran, "ERROR ")) {
          failure = Failure{"clean run of " + who, "an op failed"};
        }
        if (g.scenario == "loop" && !absl::StrContains(ran, " OK\n")) {
          failure = Failure{"clean run of " + who, "no OK round"};
        }
      }
    };
    for (size_t r = 0; r < g.procs.size(); ++r) {
      if (g.procs[r] != nullptr) check(*g.procs[r], absl::StrCat(g.name, " rank ", r));
    }
    for (auto& p : g.retired) check(*p, absl::StrCat(g.name, " earlier process"));
    if (failure) absl::StrAppend(&failure->detail, "\n", g.Outputs());
    return failure;
  }

  /// Exits of one-shot scenarios (ops, probes): every process exits by itself.
  std::optional<Failure> WaitOneShot(Group& g) {
    for (size_t r = 0; r < g.procs.size(); ++r) {
      absl::StatusOr<int> code = g.procs[r]->Wait(absl::Seconds(60));
      if (!code.ok()) {
        return Failure{absl::StrCat(g.name, " rank ", r, " ", g.scenario),
                       "did not finish within 60 s\n" + g.Outputs()};
      }
    }
    return Finish(g, /*clean=*/g.scenario == "ops", false);
  }

  std::optional<Failure> RunCycle(int cycle, Fault fault, std::string* what) {
    cycle_longest_ms_ = 0;
    const std::string prefix = absl::StrCat("c", cycle);
    if (fault == Fault::kGraphReplay) return RunGraphCycle(prefix, what);
    if (AcrossNodes(fault)) return RunNodesCycle(prefix, fault, what);
    MarkUsed(node_.get());

    Group v = MakeGroup(prefix + "-v", Pick(2, 4));
    // A clean group beside the faulty one (but across a restart, which ends every group).
    std::optional<Group> bystander;
    if (fault != Fault::kRestart) bystander = MakeGroup(prefix + "-b", 2);
    if (fault == Fault::kOps || fault == Fault::kProbes) v.scenario = Name(fault);
    v.probe_rank = Pick(0, v.num_ranks() - 1);
    if (IsMasking(fault)) ConfigureMasking(v, fault);
    // Some restarts: the same processes reconnect (Client::Reconnect) instead of new ones.
    if (fault == Fault::kRestart) v.reconnect = Pick(0, 1) == 0;
    // Half of those are MASK groups: their clients start their mask epochs again.
    if (v.reconnect && Pick(0, 1) == 0) ConfigureMasking(v, fault);
    *what = v.Describe();
    Cleanup cleanup{[&] {
      v.KillAll();
      if (bystander) bystander->KillAll();
    }};
    if (bystander) {
      if (absl::Status st = bystander->StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};
    }
    if (absl::Status st = v.StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};

    std::optional<Failure> failure;
    const int victim = Pick(0, v.num_ranks() - 1);
    std::vector<int> others;
    for (int r = 0; r < v.num_ranks(); ++r) {
      if (r != victim) others.push_back(r);
    }
    if (fault == Fault::kProbes) {
      absl::StrAppend(what, " bad input from rank ", v.probe_rank);
    } else if (fault == Fault::kMaskSelf) {
      absl::StrAppend(what, " rank ", v.masker, " masks rank ", v.mask_target, " rounds ",
                      v.mask_round, "-", v.unmask_round);
    } else if (fault == Fault::kRestart) {
      absl::StrAppend(what, v.reconnect ? " (Reconnect)" : " (new processes)");
    } else if (fault != Fault::kClean && fault != Fault::kOps) {
      absl::StrAppend(what, " victim=rank ", victim);
    }
    std::set<const Subprocess*> exempt;

    if (fault == Fault::kOps || fault == Fault::kProbes) {
      failure = WaitOneShot(v);
    } else {
      failure = WaitFlowing(v, AllRanks(v));
      if (!failure) absl::SleepFor(absl::Milliseconds(Pick(50, 400)));  // Mid-loop.
      std::vector<size_t> since = Offsets(v);
      switch (fault) {
        case Fault::kClean:
          if (!failure) absl::SleepFor(absl::Milliseconds(Pick(200, 800)));
          break;
        case Fault::kKill9:
        case Fault::kKill9Rejoin:
          if (failure) break;
          exempt.insert(v.procs[victim].get());
          v.procs[victim]->Signal(SIGKILL);
          failure = WaitErrors(v, others, since, false, "survivors see the kill");
          if (failure || fault == Fault::kKill9) break;
          since = Offsets(v);
          if (absl::Status st = v.Start(victim); !st.ok()) return Failure{"rejoin", st.ToString()};
          since[victim] = 0;
          failure = WaitInStep(v, AllRanks(v), since, "in step after the rejoin");
          break;
        case Fault::kLeaveJoin: {
          if (failure) break;
          v.procs[victim]->CloseStdin();
          absl::StatusOr<int> code = v.procs[victim]->Wait(OpBound(false) + absl::Seconds(5));
          if (!code.ok() || *code != 0) {
            failure = Failure{"leave", absl::StrCat("the leaving rank did not exit 0: ",
                                                    code.ok() ? absl::StrCat(*code) : "running",
                                                    "\n", v.Outputs())};
            break;
          }
          if (absl::Status st = v.Start(victim); !st.ok()) return Failure{"rejoin", st.ToString()};
          since = Offsets(v);
          since[victim] = 0;
          failure = WaitInStep(v, AllRanks(v), since, "in step after leave and join");
          break;
        }
        case Fault::kStopCont: {
          if (failure) break;
          exempt.insert(v.procs[victim].get());
          v.procs[victim]->Signal(SIGSTOP);
          failure = WaitErrors(v, others, since, false, "others see the stopped rank");
          const absl::Duration stopped = op_timeout_ + absl::Milliseconds(Pick(100, 600));
          absl::SleepFor(stopped);
          v.procs[victim]->Signal(SIGCONT);
          if (failure) break;
          since = Offsets(v);
          failure = WaitInStep(v, AllRanks(v), since, "in step after SIGCONT");
          break;
        }
        case Fault::kRestart:
          if (failure) break;
          failure = Restart(v);
          break;
        case Fault::kMaskKill9:
        case Fault::kMaskStop:
        case Fault::kMaskRejoin:
        case Fault::kMaskSelf:
          if (failure) break;
          failure = MaskCycle(v, fault, victim, since, &exempt, what);
          break;
        default:
          break;
      }
      if (!failure) failure = Finish(v, fault == Fault::kClean, false, exempt);
    }
    if (bystander && !failure) failure = WaitFlowing(*bystander, AllRanks(*bystander));
    if (bystander && !failure) failure = Finish(*bystander, /*clean=*/true, false);
    if (bystander && failure) absl::StrAppend(&failure->detail, "\n", bystander->Outputs());
    return failure;
  }

  /// The daemon dies mid-loop (SIGKILL or SIGTERM), every client gets an error, and after the
  /// restart the group re-forms (RejoinAfterRestart).
  std::optional<Failure> Restart(Group& v) {
    std::vector<size_t> since = Offsets(v);
    const bool kill = Pick(0, 1) == 0;
    if (kill) {
      node_->Kill();
    } else {
      absl::StatusOr<int> code = node_->Stop(absl::Seconds(10));
      if (!code.ok() || *code != 0) {
        return Failure{"SIGTERM of epd",
                       absl::StrCat("epd did not exit 0: ",
                                    code.ok() ? absl::StrCat(*code) : code.status().ToString(),
                                    "\n", node_->Logs())};
      }
    }
    if (auto f = WaitErrors(v, AllRanks(v), since, false,
                            kill ? "clients see epd killed" : "clients see epd stop")) {
      return f;
    }
    if (!v.reconnect) {
      if (auto f = Finish(v, false, false)) return f;
    }
    if (absl::Status st = node_->Restart(); !st.ok()) {
      return Failure{"restart epd", st.ToString() + "\n" + node_->Logs()};
    }
    for (Watched& w : watched_) {
      if (w.daemon == node_.get()) w.baseline.reset();  // A new process: a new baseline.
    }
    return RejoinAfterRestart(v, since);
  }

  /// How a group comes back after its daemon restarted. With v.reconnect (a seeded half of
  /// the restarts) the same client processes call Client::Reconnect when an op answers
  /// UNAVAILABLE (mn_client --reconnect): each must print RECONNECTED, and every rank must
  /// be in step again (3 OK rounds after its last error past `since`, the offsets before
  /// the daemon died). Otherwise new processes join the same group (name, spec, inputs) and
  /// run one pass of every op, exact. Half of the Reconnect cycles are MASK groups, whose
  /// ranks must then report one mask epoch of the new group and no rank masked.
  std::optional<Failure> RejoinAfterRestart(Group& v, const std::vector<size_t>& since) {
    if (v.reconnect) {
      for (int r = 0; r < v.num_ranks(); ++r) {
        if (absl::Status st = v.procs[r]->WaitForOutput("RECONNECTED", absl::Seconds(35));
            !st.ok()) {
          return Failure{absl::StrCat("Reconnect of ", v.name, " rank ", r),
                         absl::StrCat(st.message(), "\n", v.Outputs(), node_->Logs())};
        }
      }
      if (auto f = WaitInStep(v, AllRanks(v), since, "in step after Reconnect")) return f;
      // A MASK group's epochs start again with the new group: one epoch, no rank masked.
      return v.on_rank_failure == "mask" ? EpochsAgree(v, AllRanks(v), {}) : std::nullopt;
    }
    Group again;  // Same name, spec and inputs: the group re-forms.
    static_cast<GroupConfig&>(again) = v;
    again.scenario = "ops";
    if (absl::Status st = again.StartAll(); !st.ok()) return Failure{"rejoin", st.ToString()};
    std::optional<Failure> f = WaitOneShot(again);
    again.KillAll();
    return f;
  }

  // ---- rank masking (MaskingFaults) ----

  /// Before the group starts: MASK in its spec, and each rank's clients unmask their own
  /// rank when it is refused as masked (a late rank under load, the stopped one after
  /// SIGCONT), except mask_self's target, whose mask only its masker lifts.
  void ConfigureMasking(Group& v, Fault fault) {
    v.on_rank_failure = "mask";
    if (fault == Fault::kMaskSelf) {
      v.mask_target = Pick(0, v.num_ranks() - 1);
      v.masker = (v.mask_target + Pick(1, v.num_ranks() - 1)) % v.num_ranks();
      v.mask_round = Pick(5, 40);
      v.unmask_round = v.mask_round + Pick(5, 40);
      v.rank_flags[v.masker].push_back(
          absl::StrCat("--mask_self=", v.mask_target, ":", v.mask_round, ":", v.unmask_round));
    }
    for (int r = 0; r < v.num_ranks(); ++r) {
      if (r != v.mask_target) v.rank_flags[r].push_back("--unmask_self");
    }
  }

  /// One masking fault on `v` (flowing; `since`: its outputs' offsets now). `victim` is the
  /// rank killed or stopped (mask_self: v.mask_target). Killed and stopped processes are
  /// added to `exempt` (their own clocks are not held to the op bound).
  std::optional<Failure> MaskCycle(Group& v, Fault fault, int victim, std::vector<size_t> since,
                                   std::set<const Subprocess*>* exempt, std::string* what) {
    if (fault == Fault::kMaskSelf) {
      victim = v.mask_target;
      since.assign(v.num_ranks(), 0);  // The mask may come before the loop flowed here.
    }
    std::vector<int> others;
    for (int r = 0; r < v.num_ranks(); ++r) {
      if (r != victim) others.push_back(r);
    }
    std::set<int> masked_at_end;  // What every rank's last round must report.
    switch (fault) {
      case Fault::kMaskKill9:
      case Fault::kMaskRejoin:
      case Fault::kMaskStop: {
        exempt->insert(v.procs[victim].get());
        const absl::Time t0 = absl::Now();
        v.procs[victim]->Signal(fault == Fault::kMaskStop ? SIGSTOP : SIGKILL);
        if (auto f = WaitMasked(v, others, since, victim, t0, what)) {
          if (fault == Fault::kMaskStop) v.procs[victim]->Signal(SIGCONT);
          return f;
        }
        if (fault == Fault::kMaskKill9) {
          absl::SleepFor(absl::Milliseconds(Pick(100, 400)));  // Rounds without it.
          if (auto f = WaitInStep(v, others, since, "survivors run on with the dead rank masked")) {
            return f;
          }
          masked_at_end = {victim};
          break;
        }
        if (fault == Fault::kMaskStop) {
          // Stopped past op_timeout, then continued: its ops are refused as masked until it
          // unmasks itself (--unmask_self), then it is in step again.
          const absl::Time until = t0 + op_timeout_ + absl::Milliseconds(Pick(100, 600));
          absl::SleepFor(std::max(until - absl::Now(), absl::ZeroDuration()));
          std::vector<size_t> cont = Offsets(v);
          v.procs[victim]->Signal(SIGCONT);
          if (auto f = WaitInStep(v, AllRanks(v), cont, "in step after SIGCONT")) return f;
          const std::string out = v.procs[victim]->Stdout();
          for (absl::string_view line : absl::StrSplit(out.substr(cont[victim]), '\n')) {
            if (absl::StartsWith(line, "ROUND ") && absl::StrContains(line, " ERROR ") &&
                !IsMaskedRefusal(line) &&
                !(backend_ == "cuda" && IsGpuStallOfAStoppedRank(line, GpuStall::kNextOp))) {
              return Failure{
                  "the continued rank's errors",
                  absl::StrCat("rank ", victim, ": want FAILED_PRECONDITION (masked), got: ", line,
                               "\n", v.Outputs())};
            }
          }
          if (!absl::StrContains(out.substr(cont[victim]), "UNMASK_SELF epoch=")) {
            return Failure{"the continued rank unmasks itself",
                           absl::StrCat("rank ", victim, " printed no UNMASK_SELF\n", v.Outputs())};
          }
        } else {
          std::vector<size_t> rejoin = Offsets(v);
          if (absl::Status st = v.Start(victim); !st.ok()) return Failure{"rejoin", st.ToString()};
          rejoin[victim] = 0;
          if (auto f = WaitInStep(v, AllRanks(v), rejoin, "in step after the rejoin")) return f;
        }
        break;
      }
      case Fault::kMaskSelf: {
        const std::string unmasked = absl::StrCat("SELFMASK unmask rank ", victim);
        if (absl::Status st = v.procs[v.masker]->WaitForOutput(unmasked, absl::Seconds(30));
            !st.ok()) {
          return Failure{"rank " + std::to_string(v.masker) + " masks and unmasks",
                         absl::StrCat(st.message(), "\n", v.Outputs())};
        }
        if (auto f = WaitInStep(v, AllRanks(v), since, "in step after the unmask")) return f;
        // Every other rank ran rounds with the target masked (the epoch on every rank).
        for (int r : others) {
          bool seen = false;
          for (const MaskLine& m : MaskLines(v.procs[r]->Stdout(), 0))
            seen |= m.masked.count(victim);
          if (!seen) {
            return Failure{"rounds with the target masked",
                           absl::StrCat("rank ", r, " reported no round with rank ", victim,
                                        " masked\n", v.Outputs())};
          }
        }
        for (absl::string_view line : absl::StrSplit(v.procs[victim]->Stdout(), '\n')) {
          if (absl::StartsWith(line, "ROUND ") && absl::StrContains(line, " ERROR ") &&
              !IsMaskedRefusal(line)) {
            return Failure{
                "the masked rank's errors",
                absl::StrCat("want FAILED_PRECONDITION (masked), got: ", line, "\n", v.Outputs())};
          }
        }
        break;
      }
      default:
        return Failure{"mask cycle", absl::StrCat(Name(fault), " is not a masking fault")};
    }
    const bool gpu_stall_ok = backend_ == "cuda" && fault == Fault::kMaskStop;
    if (auto f = SurvivorsNeverFailed(v, others, since, gpu_stall_ok)) return f;
    return EpochsAgree(v, fault == Fault::kMaskKill9 ? others : AllRanks(v), masked_at_end);
  }

  /// Waits until each of `ranks` printed a round that ran with `victim` masked (after
  /// `since`), and checks that it came within the op bound of `t0` (the kill or stop). Adds
  /// the slowest to `what`.
  std::optional<Failure> WaitMasked(Group& v, const std::vector<int>& ranks,
                                    const std::vector<size_t>& since, int victim, absl::Time t0,
                                    std::string* what) {
    const absl::Duration bound = OpBound(false);
    absl::Duration slowest;
    for (int r : ranks) {
      while (true) {
        bool masked = false;
        for (const MaskLine& m : MaskLines(v.procs[r]->Stdout(), since[r])) {
          masked |= m.masked.count(victim) > 0;
        }
        const absl::Duration took = absl::Now() - t0;
        if (masked) {
          slowest = std::max(slowest, took);
          break;
        }
        if (took > bound + absl::Seconds(5) || !v.procs[r]->Running()) {
          return Failure{"survivors run with the rank masked",
                         absl::StrCat(v.name, " rank ", r, " ran no round with rank ", victim,
                                      " masked within ", absl::FormatDuration(took), "\n",
                                      v.Outputs(), node_->Logs())};
        }
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    absl::StrAppend(what, " masked after ", absl::ToInt64Milliseconds(slowest), " ms");
    if (slowest > bound) {
      return Failure{"survivors run with the rank masked",
                     absl::StrCat("the last survivor's first round with rank ", victim,
                                  " masked came ", absl::FormatDuration(slowest),
                                  " after the fault, more than op_timeout + 1 s\n", v.Outputs())};
    }
    return std::nullopt;
  }

  /// Under MASK no survivor's op fails: no error line after `since`, but ops refused because
  /// that rank was itself masked for being late (documented; it then unmasks itself), and,
  /// with `gpu_stall_ok` (a stopped rank on the CUDA backend), the ops its stall held on
  /// the GPU (IsGpuStallOfAStoppedRank).
  std::optional<Failure> SurvivorsNeverFailed(Group& v, const std::vector<int>& ranks,
                                              const std::vector<size_t>& since, bool gpu_stall_ok) {
    for (int r : ranks) {
      const std::string out = v.procs[r]->Stdout();
      for (absl::string_view line :
           absl::StrSplit(out.substr(std::min(since[r], out.size())), '\n')) {
        if (absl::StartsWith(line, "ROUND ") && absl::StrContains(line, " ERROR ") &&
            !IsMaskedRefusal(line) &&
            !(gpu_stall_ok && IsGpuStallOfAStoppedRank(line, GpuStall::kStalledOrNextOp))) {
          return Failure{"survivors' ops under MASK",
                         absl::StrCat(v.name, " rank ", r, ": ", line, "\n", v.Outputs())};
        }
      }
    }
    return std::nullopt;
  }

  /// Every listed rank's last round reports the same mask epoch, and the masked ranks
  /// `masked` (within 5 s: a change may be on its way to some of them).
  std::optional<Failure> EpochsAgree(Group& v, const std::vector<int>& ranks,
                                     const std::set<int>& masked) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (true) {
      std::string lines;
      bool agree = true;
      std::optional<uint32_t> epoch;
      for (int r : ranks) {
        std::vector<MaskLine> all = MaskLines(v.procs[r]->Stdout(), 0);
        if (all.empty()) {
          agree = false;
          absl::StrAppend(&lines, " rank ", r, ": none;");
          continue;
        }
        const MaskLine& last = all.back();
        absl::StrAppend(&lines, " rank ", r, ": ", last.text, ";");
        agree &= last.masked == masked && (!epoch || *epoch == last.epoch);
        epoch = last.epoch;
      }
      if (agree) return std::nullopt;
      if (absl::Now() > deadline) {
        return Failure{
            "mask epochs agree",
            absl::StrCat("want masked ranks {", absl::StrJoin(masked, ","),
                         "} and one epoch on every rank; last rounds:", lines, "\n", v.Outputs())};
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

  std::optional<Failure> RunNodesCycle(const std::string& prefix, Fault fault, std::string* what) {
    std::vector<int> per_node = {Pick(1, 2), Pick(1, 2)};
    if (fault == Fault::kPeerDeath) {
      if (absl::Status st = StartCluster(); !st.ok()) return Failure{"start nodes", st.ToString()};
      for (auto& d : cluster_->daemons) MarkUsed(d.get());
      Group g = MakeNodesGroup(prefix + "-n", per_node, *cluster_);
      // In a seeded half of the cycles on the host backend the group is MASK: node 0's ranks
      // go on without node 1's (masked), then take them back unmasked.
      const bool mask = backend_ == "host" && Pick(0, 1) == 1;
      if (mask) ConfigureMasking(g, fault);
      *what = g.Describe() + absl::StrCat(" nodes=", per_node[0], "+", per_node[1]);
      Cleanup cleanup{[&] { g.KillAll(); }};
      if (absl::Status st = g.StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};
      if (auto f = WaitFlowing(g, AllRanks(g))) return f;
      absl::SleepFor(absl::Milliseconds(Pick(50, 300)));
      std::vector<size_t> since = Offsets(g);
      const absl::Time killed = absl::Now();
      cluster_->daemons[1]->Kill();
      std::vector<int> node0, node1;
      for (int r = 0; r < g.num_ranks(); ++r) (r < per_node[0] ? node0 : node1).push_back(r);
      if (mask) {
        // Within op_timeout + 1 s node 0's ranks run rounds with node 1's ranks masked, and
        // none of their ops fails.
        if (auto f = WaitMasked(g, node0, since, node1.front(), killed, what)) return f;
        if (auto f = SurvivorsNeverFailed(g, node0, since, false)) return f;
      } else if (auto f = WaitErrors(g, node0, since, true, "node 0 sees node 1 die")) {
        return f;
      }
      // Node 1's clients lost their daemon: they stop; new ones join the restarted node.
      std::set<const Subprocess*> exempt;
      for (int r : node1) {
        g.procs[r]->CloseStdin();
        absl::StatusOr<int> code = g.procs[r]->Wait(absl::Seconds(10));
        if (!code.ok() || *code != 0) {
          return Failure{"node 1's clients stop",
                         absl::StrCat("rank ", r, " did not exit 0\n", g.Outputs())};
        }
      }
      if (absl::Status st = cluster_->daemons[1]->Restart(); !st.ok()) {
        return Failure{"restart node 1", st.ToString()};
      }
      for (Watched& w : watched_) {
        if (w.daemon == cluster_->daemons[1].get()) w.baseline.reset();
      }
      since = Offsets(g);
      for (int r : node1) {
        if (absl::Status st = g.Start(r); !st.ok()) return Failure{"rejoin", st.ToString()};
        since[r] = 0;
      }
      if (auto f = WaitInStep(g, AllRanks(g), since, "in step with node 1's new ranks")) {
        return Failure{f->step, f->detail + cluster_->Logs()};
      }
      if (mask) {
        // Node 1's new ranks are unmasked: every rank's last round has none masked.
        if (auto f = EpochsAgree(g, AllRanks(g), {})) {
          return Failure{f->step, f->detail + cluster_->Logs()};
        }
      }
      return Finish(g, false, true, exempt);
    }
    // net_fault: a cluster of its own whose transports inject the plan.
    const int kind = Pick(0, 3);
    std::string plan;
    switch (kind) {
      case 0:
        plan = "partition=0|1";
        break;
      case 1:
        plan = absl::StrCat("reset_after_writes=", Pick(0, 60), ":node=", Pick(0, 1));
        break;
      case 2:
        plan = absl::StrCat("drop_after_writes=", Pick(0, 60));
        break;
      default:
        plan = absl::StrCat("delay_ms=", Pick(1, 20));
        break;
    }
    auto cluster = multinode::StartCluster({2, 2}, op_timeout_, true,
                                           {"--testing_transport_faults=" + plan}, backend_);
    if (!cluster.ok()) return Failure{"start nodes with " + plan, cluster.status().ToString()};
    Group g = MakeNodesGroup(prefix + "-f", per_node, *cluster);
    *what = g.Describe() + absl::StrCat(" nodes=", per_node[0], "+", per_node[1], " ", plan);
    Cleanup cleanup{[&] { g.KillAll(); }};
    if (absl::Status st = g.StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};
    std::optional<Failure> f;
    if (kind == 3) {
      f = WaitFlowing(g, AllRanks(g));
      if (!f) absl::SleepFor(absl::Milliseconds(Pick(300, 800)));
      if (!f) f = Finish(g, /*clean=*/true, true);
    } else {
      // Joining takes well under a second; then every rank's op fails, bounded.
      f = WaitErrors(g, AllRanks(g), std::vector<size_t>(g.num_ranks(), 0), true,
                     "every rank sees " + plan);
      if (!f) f = Finish(g, false, true);
    }
    for (size_t i = 0; !f && i < cluster->daemons.size(); ++i) {
      auto& d = cluster->daemons[i];
      auto health = d->CheckHealth();
      if (!health.ok() || *health != grpc::health::v1::HealthCheckResponse::SERVING) {
        f = Failure{absl::StrCat("health of node ", i, " under ", plan), d->Logs()};
        break;
      }
      absl::StatusOr<int> code = d->Stop(absl::Seconds(10));
      if (!code.ok() || *code != 0) {
        f = Failure{absl::StrCat("SIGTERM of node ", i, " under ", plan),
                    absl::StrCat("did not exit 0\n", d->Logs())};
      }
    }
    if (f) absl::StrAppend(&f->detail, "\n", cluster->Logs());
    return f;
  }

  /// graph_replay (CUDA): client-launched ranks each capture LowLatencyDispatch (T on the
  /// device) + LowLatencyCombine in a CUDA graph once and replay it with every rank's T
  /// changed between replays (mn_client --scenario=graph); every process exits 0 with every
  /// round exact ("DONE ok=<rounds + 1> bad=0"), while a clean bystander group loops on the
  /// same daemon. Without MPS the group spans the two CUDA daemons (one node's
  /// client-launched ranks would wait on each other's time-sliced kernels).
  std::optional<Failure> RunGraphCycle(const std::string& prefix, std::string* what) {
    const bool across = Pick(0, 1) == 0 || !cuda_.mps_active;
    const int rounds = Pick(4, 12);
    Group g, b;
    std::string nodes;
    if (across) {
      if (absl::Status st = StartCluster(); !st.ok()) return Failure{"start nodes", st.ToString()};
      for (auto& d : cluster_->daemons) MarkUsed(d.get());
      const std::vector<int> per_node = {Pick(1, 2), Pick(1, 2)};
      g = MakeNodesGroup(prefix + "-g", per_node, *cluster_);
      nodes = absl::StrCat(" nodes=", per_node[0], "+", per_node[1]);
      b = MakeGroup(prefix + "-b", 2);
      b.sockets.assign(2, cluster_->daemons[0]->socket_path());  // Beside node 0's ranks.
    } else {
      MarkUsed(node_.get());
      g = MakeGroup(prefix + "-g", Pick(2, 4));
      b = MakeGroup(prefix + "-b", 2);
    }
    g.scenario = "graph";
    g.launch_mode = "client";
    g.graph_rounds = rounds;
    *what = absl::StrCat(g.Describe(), nodes, " rounds=", rounds);
    Cleanup cleanup{[&] {
      g.KillAll();
      b.KillAll();
    }};
    if (absl::Status st = b.StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};
    if (absl::Status st = g.StartAll(); !st.ok()) return Failure{"spawn", st.ToString()};
    std::optional<Failure> f = WaitFlowing(b, AllRanks(b));
    for (int r = 0; !f && r < g.num_ranks(); ++r) {
      // Join, one round outside the graph, the capture and the replays: seconds.
      if (!g.procs[r]->Wait(absl::Seconds(90)).ok()) {
        f = Failure{absl::StrCat("graph replays of ", g.name, " rank ", r),
                    "did not finish within 90 s\n" + g.Outputs()};
      }
    }
    if (!f) f = Finish(g, /*clean=*/true, across);
    const std::string done = absl::StrCat("DONE ok=", rounds + 1, " bad=0");
    for (int r = 0; !f && r < g.num_ranks(); ++r) {
      if (!absl::StrContains(g.procs[r]->Stdout(), done)) {
        f = Failure{absl::StrCat("graph replays of ", g.name, " rank ", r),
                    absl::StrCat("no \"", done, "\" (every round OK and exact)\n", g.Outputs())};
      }
    }
    if (!f) f = Finish(b, /*clean=*/true, false);
    if (f) absl::StrAppend(&f->detail, "\n", b.Outputs(), across ? cluster_->Logs() : "");
    return f;
  }

  /// After every cycle (--backend=cuda): each watched daemon's GPU memory is back within
  /// --gpu_growth_mib of its baseline (taken with its other resources' baseline), polled
  /// for up to 15 s while the cycle's client contexts go. Per process when nvidia-smi lists
  /// every such daemon's pid; otherwise for the whole GPU, whose baseline is retaken when the
  /// set of running daemons changes. Sets gpu_note_ (the cycle line's GPU part).
  std::optional<Failure> CheckGpuMemory() {
    if (backend_ != "cuda") return std::nullopt;
    std::vector<const Watched*> ready;
    std::vector<pid_t> running;
    for (const Watched& w : watched_) {
      if (!w.daemon->Running()) continue;
      running.push_back(w.daemon->pid());
      if (w.baseline) ready.push_back(&w);
    }
    if (ready.empty()) return std::nullopt;
    const int64_t bound = absl::GetFlag(FLAGS_gpu_growth_mib);
    const absl::Time deadline = absl::Now() + absl::Seconds(15);
    while (true) {
      std::map<pid_t, int64_t> apps;
      if (!nvidia_smi_.empty()) apps = ComputeAppsMib(nvidia_smi_);
      bool per_process = !apps.empty();
      for (const Watched* w : ready) per_process = per_process && apps.count(w->daemon->pid()) > 0;
      std::string over, now;
      if (per_process) {
        for (const Watched* w : ready) {
          const pid_t pid = w->daemon->pid();
          auto [base, added] = gpu_pid_baseline_.emplace(pid, apps[pid]);
          if (added) {
            std::printf(
                "[chaos] GPU memory baseline of %s (pid %d): %lld MiB (per process, nvidia-smi "
                "--query-compute-apps)\n",
                w->label.c_str(), pid, static_cast<long long>(apps[pid]));
          }
          absl::StrAppend(&now, " ", w->label, "=", apps[pid], "MiB");
          if (apps[pid] - base->second > bound) {
            absl::StrAppend(&over, w->label, " (pid ", pid, ") uses ", apps[pid],
                            " MiB of GPU memory, baseline ", base->second, " MiB; ");
          }
        }
        gpu_note_ = absl::StrCat(" gpu(per process):", now);
      } else {
        const GpuReading used = DeviceUsedMib(nvidia_smi_, gpu_uuid_, node_->socket_path());
        if (used.mib < 0) {
          gpu_note_ = " gpu=unknown";
          if (!gpu_unknown_reported_) {
            std::printf("[chaos] GPU memory NOT CHECKED: %s\n", used.source.c_str());
            gpu_unknown_reported_ = true;
          }
          return std::nullopt;
        }
        if (running != gpu_device_key_) {
          gpu_device_key_ = running;
          gpu_device_baseline_ = used.mib;
          std::printf(
              "[chaos] GPU memory baseline of %s with daemons (pids %s) running: %lld MiB (%s; "
              "%s)\n",
              gpu_uuid_.c_str(), absl::StrJoin(running, ",").c_str(),
              static_cast<long long>(used.mib), used.source.c_str(),
              nvidia_smi_.empty() ? "no per-process figures"
                                  : "nvidia-smi lists no daemon pid per process: MPS, or a PID "
                                    "namespace");
        }
        gpu_note_ = absl::StrCat(" gpu(device-wide)=", used.mib, "MiB");
        if (used.mib - gpu_device_baseline_ > bound) {
          over = absl::StrCat("GPU ", gpu_uuid_, " has ", used.mib, " MiB in use, baseline ",
                              gpu_device_baseline_, " MiB (", used.source, "); ");
        }
      }
      if (over.empty()) return std::nullopt;
      if (absl::Now() > deadline) {
        std::string listed;
        for (const auto& [pid, mib] : apps) absl::StrAppend(&listed, " pid ", pid, "=", mib, "MiB");
        return Failure{"GPU memory",
                       absl::StrCat(over, "more than --gpu_growth_mib=", bound,
                                    " over it 15 s after the cycle; nvidia-smi compute apps:",
                                    listed.empty() ? " none" : listed)};
      }
      absl::SleepFor(absl::Milliseconds(250));
    }
  }

  /// `epctl groups` on `w` answers (exit 0) and lists no group, within 5 s.
  std::optional<Failure> NoGroupsLeft(const Watched& w) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (true) {
      auto out = testing::RunCommand(
          {testing::EpctlBinary(), "--socket=" + w.daemon->socket_path(), "--json", "groups"},
          absl::Seconds(10));
      if (!out.ok() || out->exit_code != 0) {
        return Failure{"epctl groups on " + w.label,
                       out.ok() ? absl::StrCat("exit ", out->exit_code, ": ", out->stderr_text)
                                : out.status().ToString()};
      }
      if (!absl::StrContains(out->stdout_text, "\"name\"")) return std::nullopt;
      if (absl::Now() > deadline) {
        return Failure{"groups left on " + w.label, out->stdout_text};
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  }

  /// After every cycle: every watched daemon SERVING, and back to its baseline.
  std::optional<Failure> CheckInvariants() {
    for (Watched& w : watched_) {
      auto health = w.daemon->CheckHealth();
      if (!health.ok() || *health != grpc::health::v1::HealthCheckResponse::SERVING) {
        return Failure{"health of " + w.label,
                       absl::StrCat(health.ok() ? "not SERVING" : health.status().ToString(), "\n",
                                    w.daemon->Logs())};
      }
      const pid_t pid = w.daemon->pid();
      if (!w.baseline) {
        // Threads and fds some daemons start at their first group are part of the baseline.
        if (!w.used) continue;
        // The first cycle's end (or a restart's): let groups go, then take the baseline.
        absl::SleepFor(absl::Milliseconds(300));
        w.baseline = Measure(pid);
        w.baseline_threads = ThreadNames(pid);
        std::printf("[chaos] baseline of %s (pid %d): %s\n", w.label.c_str(), pid,
                    w.baseline->ToString().c_str());
        continue;
      }
      // Groups of the cycle are destroyed when their last rank's session ends: wait for it.
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      Resources now = Measure(pid);
      auto leaked = [&] {
        return now.fds > w.baseline->fds || now.threads > w.baseline->threads ||
               now.grpc_threads > MaxGrpcThreads();
      };
      while (leaked() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(50));
        now = Measure(pid);
      }
      if (leaked()) {
        return Failure{"leak check of " + w.label,
                       absl::StrCat("now ", now.ToString(), ", baseline ", w.baseline->ToString(),
                                    "; fds:", FdTargets(pid), "\nthreads:", ThreadNames(pid),
                                    "\nbaseline threads:", w.baseline_threads)};
      }
      // Every group of the cycle is gone (epctl, as an operator sees it).
      if (auto f = NoGroupsLeft(w)) return f;
      const int64_t growth_kib = now.rss_kib - w.baseline->rss_kib;
      if (growth_kib > int64_t(absl::GetFlag(FLAGS_rss_growth_mib)) * 1024) {
        return Failure{"RSS of " + w.label,
                       absl::StrCat("grew by ", growth_kib / 1024, " MiB > ",
                                    absl::GetFlag(FLAGS_rss_growth_mib), " MiB")};
      }
    }
    if (auto f = CheckGpuMemory()) return f;
    if (std::set<std::string> shm = ShmEntries(); shm != shm_baseline_) {
      std::set<std::string> added;
      for (const std::string& e : shm) {
        if (shm_baseline_.count(e) == 0) added.insert(e);
      }
      if (!added.empty()) {
        return Failure{"/dev/shm", "new entries: " + absl::StrJoin(added, " ")};
      }
    }
    return std::nullopt;
  }

  void Summary(absl::Duration elapsed) {
    std::printf("\n[chaos] summary (seed=%llu, %.0f s):\n", static_cast<unsigned long long>(seed_),
                absl::ToDoubleSeconds(elapsed));
    std::printf("  %-14s %7s %7s %9s %14s\n", "fault", "cycles", "passed", "seconds",
                "longest op ms");
    int cycles = 0, passed = 0;
    for (const auto& [fault, s] : stats_) {
      std::printf("  %-14s %7d %7d %9.1f %14lld\n", Name(fault), s.cycles, s.passed, s.seconds,
                  static_cast<long long>(s.longest_op_ms));
      cycles += s.cycles;
      passed += s.passed;
    }
    std::printf("  %-14s %7d %7d\n", "total", cycles, passed);
    for (const Watched& w : watched_) {
      if (w.baseline) {
        std::printf("  %s: baseline %s, now %s\n", w.label.c_str(), w.baseline->ToString().c_str(),
                    Measure(w.daemon->pid()).ToString().c_str());
      }
    }
    for (const auto& [name, why] : left_out_) {
      std::printf("  %-14s left out on cuda: %s\n", name.c_str(), why.c_str());
    }
    if (backend_ == "cuda") {
      std::printf("  GPU memory (--gpu_growth_mib=%d) at the last check:%s\n",
                  absl::GetFlag(FLAGS_gpu_growth_mib),
                  gpu_note_.empty() ? " not read" : gpu_note_.c_str());
    }
    std::fflush(stdout);
  }

  /// Runs `fn` at scope exit.
  struct Cleanup {
    std::function<void()> fn;
    ~Cleanup() { fn(); }
  };

  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<Fault> faults_;
  absl::Duration op_timeout_;
  std::string dir_;
  bool keep_dir_ = false;
  std::unique_ptr<DaemonProcess> node_;
  std::optional<multinode::Cluster> cluster_;
  std::vector<Watched> watched_;
  std::set<std::string> shm_baseline_ = ShmEntries();
  std::map<Fault, Stats> stats_;
  int64_t cycle_longest_ms_ = 0;
  // --backend=cuda.
  std::string backend_ = "host";
  CudaSetup cuda_;
  std::string gpu_uuid_;     ///< Every rank's GPU (the chaos daemon's first).
  std::string skip_reason_;  ///< Why the run is skipped (no usable GPU); "" otherwise.
  std::string nvidia_smi_;   ///< Its path; "" when not on PATH.
  std::map<pid_t, int64_t> gpu_pid_baseline_;  ///< MiB per daemon pid (per-process source).
  std::vector<pid_t> gpu_device_key_;          ///< Daemons running at the device baseline.
  int64_t gpu_device_baseline_ = -1;           ///< MiB in use on the GPU (device-wide source).
  bool gpu_unknown_reported_ = false;
  std::string gpu_note_;  ///< The last reading, for the cycle line.
  std::vector<std::pair<std::string, std::string>> left_out_;  ///< Kinds not run, and why.
};

/// Checks --backend and --launch_mode; with --backend=cuda adds the CUDA-only kinds `wanted`
/// names (all when it is empty) to `faults`. On host a CUDA-only kind asked for by name is
/// left out, saying so. INVALID_ARGUMENT naming the flag for a bad value.
absl::Status AddCudaFaults(const std::vector<std::string>& wanted, std::vector<Fault>& faults) {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const std::string launch_mode = absl::GetFlag(FLAGS_launch_mode);
  if (backend != "host" && backend != "cuda") {
    return absl::InvalidArgumentError("--backend=" + backend + " is not host or cuda");
  }
  if (launch_mode != "daemon" && launch_mode != "client") {
    return absl::InvalidArgumentError("--launch_mode=" + launch_mode + " is not daemon or client");
  }
  for (Fault f : CudaOnlyFaults()) {
    const bool named = std::find(wanted.begin(), wanted.end(), Name(f)) != wanted.end();
    if (backend == "cuda" && (wanted.empty() || named)) faults.push_back(f);
    if (backend != "cuda" && named) {
      std::fprintf(stderr, "--faults: %s runs with --backend=cuda only; left out\n", Name(f));
    }
  }
  return absl::OkStatus();
}

int Main() {
  uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (const char* env = std::getenv("EPD_CHAOS_SEED"); seed == 0 && env != nullptr && *env) {
    if (!absl::SimpleAtoi(env, &seed)) {
      std::fprintf(stderr, "EPD_CHAOS_SEED=%s is not a number\n", env);
      return 2;
    }
  }
  if (seed == 0) {
    seed = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now())) % 1000000000ull + 1;
  }
  int seconds = absl::GetFlag(FLAGS_seconds);
  if (const char* env = std::getenv("EPD_CHAOS_SECONDS"); env != nullptr && *env) {
    if (!absl::SimpleAtoi(env, &seconds)) {
      std::fprintf(stderr, "EPD_CHAOS_SECONDS=%s is not a number\n", env);
      return 2;
    }
  }
  std::vector<Fault> faults;
  const std::string only = absl::GetFlag(FLAGS_faults);
  const std::vector<std::string> wanted = absl::StrSplit(only, ',', absl::SkipEmpty());
  for (Fault f : kAllFaults) {
    if (AcrossNodes(f) && !absl::GetFlag(FLAGS_multinode)) continue;
    if (wanted.empty() || std::find(wanted.begin(), wanted.end(), Name(f)) != wanted.end()) {
      faults.push_back(f);
    }
  }
  for (Fault f : MaskingFaults()) {
    if (wanted.empty() || std::find(wanted.begin(), wanted.end(), Name(f)) != wanted.end()) {
      faults.push_back(f);
    }
  }
  if (absl::Status st = AddCudaFaults(wanted, faults); !st.ok()) {
    std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
    return 2;
  }
  if (faults.empty()) {
    std::fprintf(stderr, "--faults=%s names no fault kind\n", only.c_str());
    return 2;
  }
  Chaos chaos(seed, faults);
  if (absl::GetFlag(FLAGS_self_check)) return chaos.SelfCheck();
  return chaos.Run(absl::Seconds(seconds), absl::GetFlag(FLAGS_cycles));
}

}  // namespace
}  // namespace epd::chaos

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // A client killed mid-write must not take the driver with it.
  std::signal(SIGPIPE, SIG_IGN);
  return epd::chaos::Main();
}
