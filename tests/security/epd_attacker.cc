// epd_attacker: the hostile client of the security suite (tests/security/), one attack per
// --mode (scribble, truncate, join_flood, conn_flood, ring_flood, claim, spoof_pid,
// list_groups, destroy_pending), using nothing but what every client of epd has: its
// socket, the Control RPCs, and the memory and files epd hands it for its own endpoints.
// It attacks and prints what it saw (line-buffered PROGRESS / mode lines / SUMMARY); the
// test decides what passes. The modes and the output: docs/SECURITY.md "The suite's
// programs".
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/dtypes.h"
#include "tests/security/security_spec.h"

ABSL_FLAG(std::string, socket, "", "epd's unix socket");
ABSL_FLAG(std::string, mode, "", "the attack (see the file comment)");
ABSL_FLAG(std::string, targets, "random",
          "scribble: comma list of header,ring,inputs,routing,random,mask");
ABSL_FLAG(bool, mask_group, false,
          "scribble, truncate: the attacker's groups are on_rank_failure MASK, and its op loop "
          "masks, unmasks, queries and cleans its rank mask between ops");
ABSL_FLAG(double, seconds, 5, "scribble, truncate, ring_flood: how long to attack");
ABSL_FLAG(bool, supervise, false, "scribble, truncate: restart the attack when it dies");
ABSL_FLAG(std::string, group, "attacker", "name of the attacker's own groups");
ABSL_FLAG(int, joins, 3000, "join_flood: ranks to join");
ABSL_FLAG(int, ranks_per_group, 64, "join_flood: ranks of each group it creates");
ABSL_FLAG(double, hold_seconds, 3, "join_flood, conn_flood, claim: how long to hold");
ABSL_FLAG(int, connections, 3000, "conn_flood: connections held");
ABSL_FLAG(int, churn, 3000, "conn_flood: connections opened and closed after the hold");
ABSL_FLAG(int, slots, 20000, "ring_flood: garbage slots to write");
ABSL_FLAG(std::string, victim_group, "victim", "claim: the group to attack");
ABSL_FLAG(std::string, join_secret, "", "claim: a (wrong) secret to try too");
ABSL_FLAG(int64_t, claimed_pid, 1, "spoof_pid: the client_pid to claim");
ABSL_FLAG(uint64_t, seed, 7, "random seed");

namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

using Clock = std::chrono::steady_clock;
namespace v1 = epd::v1;
namespace abi = epd::abi;

std::string CodeName(const absl::Status& st) { return absl::StatusCodeToString(st.code()); }
std::string CodeName(const grpc::Status& st) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code()));
}
/// One line: no newlines in a message.
std::string OneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

// ---- raw Control RPCs (what any process that can connect may send) ---------------------

std::unique_ptr<v1::Control::Stub> ControlStub(const std::string& socket) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A connection of its own.
  return v1::Control::NewStub(
      grpc::CreateCustomChannel("unix://" + socket, grpc::InsecureChannelCredentials(), args));
}

void SetDeadline(grpc::ClientContext& context, int seconds = 10) {
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

/// A Session stream opened by hand: the first message claims whatever pid it likes.
struct RawSession {
  std::unique_ptr<v1::Control::Stub> stub;
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream;
  std::string id;
  ~RawSession() {
    context.TryCancel();
    if (stream) (void)stream->Finish();
  }
};

absl::StatusOr<std::unique_ptr<RawSession>> OpenRawSession(const std::string& socket, int64_t pid,
                                                           const std::string& name) {
  auto s = std::make_unique<RawSession>();
  s->stub = ControlStub(socket);
  s->stream = s->stub->Session(&s->context);
  v1::SessionRequest hello;
  hello.set_client_pid(pid);
  hello.set_client_name(name);
  v1::SessionResponse response;
  if (!s->stream->Write(hello) || !s->stream->Read(&response)) {
    grpc::Status st = s->stream->Finish();
    s->stream.reset();
    return absl::UnavailableError(absl::StrCat("Session: ", CodeName(st), " ", st.error_message()));
  }
  s->id = response.session_id();
  return s;
}

grpc::Status RawJoin(v1::Control::Stub& stub, const std::string& session_id,
                     const v1::GroupSpec& spec, int rank, const std::string& secret,
                     v1::EndpointInfo* info = nullptr) {
  v1::JoinGroupRequest request;
  *request.mutable_spec() = spec;
  request.set_rank(rank);
  request.set_session_id(session_id);
  epd::security::SetRequestJoinSecret(request, secret);
  v1::JoinGroupResponse response;
  grpc::ClientContext context;
  SetDeadline(context, 30);
  grpc::Status st = stub.JoinGroup(&context, request, &response);
  if (st.ok() && info != nullptr) *info = response.endpoint();
  return st;
}

absl::StatusOr<v1::ListGroupsResponse> RawListGroups(v1::Control::Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(context);
  v1::ListGroupsResponse response;
  grpc::Status st = stub.ListGroups(&context, v1::ListGroupsRequest(), &response);
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  return response;
}

// ---- the shared mappings epd gave this process ------------------------------------------

struct Mapping {
  uint8_t* base = nullptr;
  size_t size = 0;
  bool writable = false;
  bool made_writable = false;  ///< Was read-only; mprotect made it writable.
  std::string path;
  std::string range;  ///< "start-end" as /proc/self/maps spells it (map_files name).
};

/// Every shared mapping of this process that is epd's (a /dev/shm file or a memfd), made
/// writable where mprotect allows it.
std::vector<Mapping> EpdMappings(bool make_writable) {
  std::vector<Mapping> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 6 || f[1].size() < 4 || f[1][3] != 's') continue;
    std::string path = f[5];
    for (size_t i = 6; i < f.size(); ++i) path += " " + f[i];
    if (!absl::StrContains(path, "/dev/shm/") && !absl::StrContains(path, "memfd:") &&
        !absl::StrContains(path, "epd")) {
      continue;
    }
    Mapping m;
    const size_t dash = f[0].find('-');
    m.base = reinterpret_cast<uint8_t*>(std::stoull(f[0].substr(0, dash), nullptr, 16));
    m.size = std::stoull(f[0].substr(dash + 1), nullptr, 16) - reinterpret_cast<uintptr_t>(m.base);
    m.path = path;
    m.range = f[0];
    m.writable = f[1][1] == 'w';
    if (!m.writable && make_writable) {
      m.writable = ::mprotect(m.base, m.size, PROT_READ | PROT_WRITE) == 0;
      m.made_writable = m.writable;
    }
    out.push_back(m);
  }
  return out;
}

/// Hostile 64-bit values: extremes, sign bits, sizes around a region's, page multiples.
std::vector<uint64_t> HostileValues(uint64_t around) {
  std::vector<uint64_t> v = {0,
                             1,
                             ~0ull,
                             1ull << 63,
                             (1ull << 63) - 1,
                             0xffffffffull,
                             0x80000000ull,
                             0x7fffffffull,
                             0xffffffff00000000ull,
                             1ull << 40,
                             4096,
                             4095,
                             0x5a5a5a5a5a5a5a5aull};
  for (int64_t k = -4; k <= 4; ++k) v.push_back(around + static_cast<uint64_t>(k) * around);
  v.push_back(around - 8);
  v.push_back(around + 8);
  return v;
}

// ---- the attacker's own group and its op loop -------------------------------------------

/// A client whose 2-rank group lives in this process, and valid inputs for every op kind.
class OwnGroup {
 public:
  explicit OwnGroup(std::string base_name) : base_name_(std::move(base_name)) {
    std::mt19937 rng(static_cast<uint32_t>(::getpid()));
    const int T = 4, H = epd::security::kHidden, K = epd::security::kNumTopk;
    x_.resize(size_t(T) * H);
    for (auto& v : x_) v = epd::kernels::FloatToBf16(float(rng() % 64) / 16.f);
    idx_.resize(size_t(T) * K);
    w_.assign(idx_.size(), 0.5f);
    for (int t = 0; t < T; ++t) {
      idx_[t * K] = t % epd::security::kNumExperts;
      idx_[t * K + 1] = (t + 1) % epd::security::kNumExperts;
    }
    xs_ = {T, H};
    ks_ = {T, K};
    x_t_ = epd::MakeDLTensor(x_.data(), kBf16, xs_);
    idx_t_ = epd::MakeDLTensor(idx_.data(), kI64, ks_);
    w_t_ = epd::MakeDLTensor(w_.data(), kF32, ks_);
  }

  absl::Status Connect(const std::string& socket) {
    epd::ClientOptions options;
    options.socket_path = socket;
    options.client_name = "epd_attacker";
    auto client = epd::Client::Connect(options);
    if (!client.ok()) return client.status();
    client_ = std::move(*client);
    return absl::OkStatus();
  }
  epd::Client& client() { return *client_; }

  /// Joins both ranks of a fresh group.
  absl::Status Join() {
    eps_.clear();
    const std::string name = absl::StrCat(base_name_, "-", ::getpid(), "-", joins_++);
    for (int r = 0; r < epd::security::kNumRanks; ++r) {
      epd::JoinOptions j;
      j.spec = epd::security::SecuritySpec(name);
      if (absl::GetFlag(FLAGS_mask_group)) {
        j.spec.set_on_rank_failure(v1::RANK_FAILURE_POLICY_MASK);
      }
      j.rank = r;
      auto ep = client_->Join(j);
      if (!ep.ok()) return ep.status();
      eps_.push_back(std::move(*ep));
    }
    return absl::OkStatus();
  }
  void Leave() { eps_.clear(); }
  const std::vector<std::unique_ptr<epd::Endpoint>>& endpoints() const { return eps_; }
  std::vector<std::unique_ptr<epd::Endpoint>>& mutable_endpoints() { return eps_; }

  /// A MASK group's requests after op `i` (rank 0 asks for them): mask rank 1 (its next op
  /// is refused as masked), unmask it, query the mask and clean it, once every 40 ops.
  /// Returns the calls made; their errors are counted in mask_errors().
  int MaskStep(int64_t i) {
    if (eps_.size() < 2) return 0;
    epd::Endpoint& ep = *eps_[0];
    absl::StatusOr<epd::RankMask> m;
    switch (i % 40) {
      case 20:
        m = ep.UpdateRankMask({1}, {});
        break;
      case 21:
        m = ep.UpdateRankMask({}, {1});
        break;
      case 30:
        m = ep.QueryRankMask();
        break;
      case 35:
        m = ep.CleanRankMask();
        break;
      default:
        return 0;
    }
    if (!m.ok()) ++mask_errors_;
    return 1;
  }
  int64_t mask_errors() const { return mask_errors_; }

  /// Runs op `i % 6` of the cycle (layout, dispatch, combine, cached dispatch, low-latency
  /// dispatch, low-latency combine) on both ranks; true when both got OK.
  bool RunOp(int64_t i) {
    const int R = static_cast<int>(eps_.size());
    bool ok = true;
    switch (i % 6) {
      case 0:
        ok = Both<epd::LayoutResult>([&](int r) { return eps_[r]->GetDispatchLayout(idx_t_); },
                                     nullptr);
        break;
      case 1:
      case 3: {
        ok = Both<epd::DispatchResult>(
            [&](int r) {
              epd::DispatchArgs a;
              a.x = &x_t_;
              a.topk_idx = &idx_t_;
              a.topk_weights = &w_t_;
              if (i % 6 == 3) a.cached = dispatch_[r].handle;
              return eps_[r]->Dispatch(a);
            },
            [&](int r, epd::DispatchResult& d) {
              if (i % 6 == 1) dispatch_[r] = d;
            });
        break;
      }
      case 2:
        ok = Both<epd::CombineResult>(
            [&](int r) {
              // N as the (possibly scribbled) completion said, within the group's capacity.
              const int32_t n = std::clamp(dispatch_[r].num_recv_tokens, 0,
                                           epd::security::kNumRanks * epd::security::kMaxTokens);
              combine_x_[r].assign(size_t(n) * epd::security::kHidden, 0x3f80);
              combine_shape_[r] = {n, epd::security::kHidden};
              combine_t_[r] = epd::MakeDLTensor(combine_x_[r].data(), kBf16, combine_shape_[r]);
              epd::CombineArgs a;
              a.x = &combine_t_[r];
              a.handle = &dispatch_[r].handle;
              return eps_[r]->Combine(a);
            },
            nullptr);
        break;
      case 4:
        ok = Both<epd::LowLatencyDispatchResult>(
            [&](int r) {
              epd::LowLatencyDispatchArgs a;
              a.x = &x_t_;
              a.topk_idx = &idx_t_;
              return eps_[r]->LowLatencyDispatch(a);
            },
            [&](int r, epd::LowLatencyDispatchResult& d) { ll_[r] = d; });
        break;
      default:
        ok = Both<epd::LowLatencyCombineResult>(
            [&](int r) {
              ll_y_[r] = eps_[r]->LowLatencyCombineInput();
              epd::LowLatencyCombineArgs a;
              a.x = &ll_y_[r].dl();
              a.topk_idx = &idx_t_;
              a.topk_weights = &w_t_;
              a.handle = &ll_[r].handle;
              return eps_[r]->LowLatencyCombine(a);
            },
            nullptr);
        break;
    }
    (void)R;
    return ok;
  }

 private:
  /// Submits on every rank, then waits on every rank (1 s each: an answered op takes
  /// milliseconds; one whose ring the attack broke is given up quickly).
  template <typename Result, typename Submit, typename Keep>
  bool Both(Submit submit, Keep keep) {
    std::vector<std::optional<epd::PendingOp<Result>>> ops(eps_.size());
    bool ok = true;
    for (size_t r = 0; r < eps_.size(); ++r) {
      auto op = submit(static_cast<int>(r));
      if (op.ok()) {
        ops[r].emplace(std::move(*op));
      } else {
        ok = false;
        NoteError(op.status());
      }
    }
    for (size_t r = 0; r < eps_.size(); ++r) {
      if (!ops[r]) continue;
      auto res = ops[r]->Wait(absl::Seconds(1));
      if (!res.ok()) {
        ok = false;
        NoteError(res.status());
        continue;
      }
      if constexpr (!std::is_same_v<Keep, std::nullptr_t>) keep(static_cast<int>(r), *res);
    }
    return ok;
  }

  /// Prints the first error that names a scribbled daemon_closed (CLOSE_FLAG_ERROR), and
  /// any error claiming epd is shutting down (CLOSE_FLAG_SHUTDOWN: epd never shuts down
  /// during an attack, so that is a scribbled word taken for a state).
  void NoteError(const absl::Status& st) {
    const std::string message(st.message());
    if (!close_flag_reported_ && absl::StrContains(message, "daemon_closed")) {
      close_flag_reported_ = true;
      std::printf("CLOSE_FLAG_ERROR %s %s\n", CodeName(st).c_str(), OneLine(message).c_str());
    }
    if (!shutdown_reported_ && absl::StrContains(message, "epd is shutting down")) {
      shutdown_reported_ = true;
      std::printf("CLOSE_FLAG_SHUTDOWN %s %s\n", CodeName(st).c_str(), OneLine(message).c_str());
    }
  }

  std::string base_name_;
  int joins_ = 0;
  int64_t mask_errors_ = 0;
  bool close_flag_reported_ = false;
  bool shutdown_reported_ = false;
  std::unique_ptr<epd::Client> client_;
  std::vector<std::unique_ptr<epd::Endpoint>> eps_;
  std::vector<epd::kernels::bf16_bits> x_;
  std::vector<int64_t> idx_;
  std::vector<float> w_;
  std::vector<int64_t> xs_, ks_;
  DLTensor x_t_{}, idx_t_{}, w_t_{};
  epd::DispatchResult dispatch_[epd::security::kNumRanks];
  epd::LowLatencyDispatchResult ll_[epd::security::kNumRanks];
  epd::TensorView ll_y_[epd::security::kNumRanks];
  std::vector<epd::kernels::bf16_bits> combine_x_[epd::security::kNumRanks];
  std::vector<int64_t> combine_shape_[epd::security::kNumRanks];
  DLTensor combine_t_[epd::security::kNumRanks]{};
};

/// What an op-loop attack's second thread does to the process's shared files and memory.
class Attack {
 public:
  virtual ~Attack() = default;
  /// Called after every (re)join, with the endpoints and no attack step running.
  virtual void Retarget(const OwnGroup& group) = 0;
  /// One burst of the attack; returns the writes (or file operations) it made.
  virtual int64_t Step(std::mt19937_64& rng) = 0;
  /// Key=value pairs for SUMMARY.
  virtual std::string Report() const = 0;
};

/// Runs `attack` beside the op loop of a fresh group until `deadline`: the op thread
/// rejoins (new group, new mappings) after 3 failed ops in a row, with the attack paused.
int RunOpLoopAttack(const std::string& socket, Attack& attack, Clock::time_point deadline) {
  OwnGroup group(absl::GetFlag(FLAGS_group));
  if (absl::Status st = group.Connect(socket); !st.ok()) {
    std::printf("CONNECT_ERROR %s %s\n", CodeName(st).c_str(),
                OneLine(std::string(st.message())).c_str());
    return 2;
  }
  std::shared_mutex mu;  // Exclusive while the endpoints (and mappings) change.
  std::atomic<bool> stop{false};
  std::atomic<int64_t> writes{0};
  {
    std::unique_lock<std::shared_mutex> lock(mu);
    if (absl::Status st = group.Join(); !st.ok()) {
      std::printf("JOIN_ERROR %s %s\n", CodeName(st).c_str(),
                  OneLine(std::string(st.message())).c_str());
      return 2;
    }
    attack.Retarget(group);
  }
  std::thread attacker([&] {
    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) ^ static_cast<uint64_t>(::getpid()));
    while (!stop.load(std::memory_order_relaxed)) {
      {
        std::shared_lock<std::shared_mutex> lock(mu);
        writes.fetch_add(attack.Step(rng), std::memory_order_relaxed);
      }
      std::this_thread::yield();
    }
  });
  int64_t ops = 0, ok = 0, failed_in_row = 0, rejoins = 0;
  auto progress = [&] {
    std::printf("PROGRESS child=%d ops=%" PRId64 " ok=%" PRId64 " failed=%" PRId64
                " writes=%" PRId64 " rejoins=%" PRId64 "\n",
                ::getpid(), ops, ok, ops - ok, writes.load(), rejoins);
  };
  const bool mask_group = absl::GetFlag(FLAGS_mask_group);
  int64_t mask_calls = 0;
  while (Clock::now() < deadline) {
    const bool op_ok = group.RunOp(ops);
    if (mask_group) mask_calls += group.MaskStep(ops);
    ++ops;
    ok += op_ok;
    failed_in_row = op_ok ? 0 : failed_in_row + 1;
    if (failed_in_row >= 3) {
      std::unique_lock<std::shared_mutex> lock(mu);
      group.Leave();
      absl::Status st = group.Join();
      ++rejoins;
      failed_in_row = 0;
      if (!st.ok()) {
        std::printf("REJOIN_ERROR %s %s\n", CodeName(st).c_str(),
                    OneLine(std::string(st.message())).c_str());
        absl::SleepFor(absl::Milliseconds(200));
        continue;
      }
      attack.Retarget(group);
    }
    if (ops % 25 == 0) progress();
  }
  stop.store(true);
  attacker.join();
  progress();
  std::printf("SUMMARY ops=%" PRId64 " ok=%" PRId64 " writes=%" PRId64 " rejoins=%" PRId64
              " mask_calls=%" PRId64 " mask_errors=%" PRId64 " %s\n",
              ops, ok, writes.load(), rejoins, mask_calls, group.mask_errors(),
              attack.Report().c_str());
  std::fflush(stdout);
  {
    std::unique_lock<std::shared_mutex> lock(mu);
    std::printf("TEARDOWN child=%d leaving\n", ::getpid());
    group.Leave();
    std::printf("TEARDOWN child=%d left\n", ::getpid());
  }
  // Done with epd: every call was answered. Exit without running this process's own
  // destructors, which may trip over the memory the attack scribbled in this process (a
  // child once hung in absl's Mutex bookkeeping there, after epd had answered its leave):
  // that is the attacker harming itself, not epd failing to answer.
  std::fflush(stdout);
  std::_Exit(0);
}

/// Runs `body(deadline)` in child processes until `seconds` have passed, forking a new
/// child whenever one dies before the deadline. Prints one CHILD line per child.
int Supervise(double seconds, const std::function<int(Clock::time_point)>& body) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  int children = 0, crashed = 0;
  while (Clock::now() < deadline) {
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::printf("FORK_ERROR %s\n", std::strerror(errno));
      return 2;
    }
    if (pid == 0) {
      const int rc = body(deadline);
      std::fflush(stdout);
      std::_Exit(rc);  // No atexit work of the parent's libraries in the child.
    }
    ++children;
    int status = 0;
    bool killed_at_deadline = false;
    // Stuck past its deadline: SIGABRT first, so that the child's failure signal handler
    // prints where it hangs (stdout), then SIGKILL if it is still there 3 s later.
    std::optional<Clock::time_point> aborted_at;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      const Clock::time_point now = Clock::now();
      if (!aborted_at && now > deadline + std::chrono::seconds(10)) {
        std::printf("STUCK child=%d past its deadline: SIGABRT for its stack\n", pid);
        std::fflush(stdout);
        ::kill(pid, SIGABRT);
        aborted_at = now;
        killed_at_deadline = true;
      } else if (aborted_at && now > *aborted_at + std::chrono::seconds(3)) {
        ::kill(pid, SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (WIFSIGNALED(status)) {
      if (!killed_at_deadline) ++crashed;
      std::printf("CHILD %d killed by signal %d%s\n", pid, WTERMSIG(status),
                  killed_at_deadline ? " (stuck past the deadline)" : "");
    } else {
      std::printf("CHILD %d exited %d\n", pid, WEXITSTATUS(status));
      if (WEXITSTATUS(status) == 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  std::printf("SUPERVISOR children=%d crashed=%d\n", children, crashed);
  return 0;
}

// ---- scribble ----------------------------------------------------------------------------

class Scribble : public Attack {
 public:
  explicit Scribble(const std::string& targets) {
    for (absl::string_view t : absl::StrSplit(targets, ',', absl::SkipEmpty())) {
      targets_.insert(std::string(t));
    }
  }

  void Retarget(const OwnGroup& group) override {
    mappings_ = EpdMappings(/*make_writable=*/true);
    endpoints_.clear();
    retargeted_at_ = Clock::now();
    closed_scribbled_ = false;
    for (const Mapping& m : mappings_) {
      made_writable_ += m.made_writable;
      if (!m.writable || m.size < sizeof(abi::EndpointShmHeader)) continue;
      auto* h = reinterpret_cast<abi::EndpointShmHeader*>(m.base);
      for (const auto& ep : group.endpoints()) {
        if (h->magic != abi::kEndpointMagic || h->endpoint_id != ep->info().endpoint_id()) continue;
        Endpoint e;
        e.map = m;
        e.header = h;
        std::memcpy(&e.original, h, sizeof(e.original));
        for (const v1::BufferRegion& r : ep->info().regions()) {
          const uint64_t begin = ep->info().data_offset() + r.offset();
          if (r.bytes() == 0 || begin + r.bytes() > m.size) continue;
          e.regions[r.name()] = {m.base + begin, r.bytes()};
        }
        endpoints_.push_back(e);
      }
    }
    // One summary of what was found, the first time.
    if (!reported_) {
      reported_ = true;
      std::printf("TARGETS mappings=%zu endpoints=%zu made_writable=%d\n", mappings_.size(),
                  endpoints_.size(), made_writable_);
      for (const Mapping& m : mappings_) {
        std::printf("  mapping %s %zu bytes %s%s\n", m.path.c_str(), m.size,
                    m.writable ? "rw" : "ro", m.made_writable ? " (made writable)" : "");
      }
    }
  }

  int64_t Step(std::mt19937_64& rng) override {
    int64_t n = 0;
    if (targets_.count("header")) n += Header(rng);
    if (targets_.count("ring")) n += Ring(rng);
    if (targets_.count("inputs")) n += Inputs(rng);
    if (targets_.count("routing")) n += Routing(rng);
    if (targets_.count("random")) n += Random(rng);
    if (targets_.count("mask")) n += Mask(rng);
    return n;
  }

  std::string Report() const override {
    return absl::StrCat("endpoints=", endpoints_.size(), " mappings=", mappings_.size(),
                        " made_writable=", made_writable_);
  }

 private:
  struct Span {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
  };
  struct Endpoint {
    Mapping map;
    abi::EndpointShmHeader* header = nullptr;
    abi::EndpointShmHeader original{};
    std::map<std::string, Span> regions;
  };

  template <typename T>
  static void Store(void* at, T value) {
    std::atomic_ref<T>(*static_cast<T*>(at)).store(value, std::memory_order_relaxed);
  }
  /// Holds `value` at `at` for `spins` stores (racing a reader), then writes `after`.
  template <typename T>
  static void Pulse(void* at, T value, T after, int spins) {
    for (int i = 0; i < spins; ++i) Store<T>(at, value);
    Store<T>(at, after);
  }

  /// Each header word in turn, to each hostile value; the layout words (offsets, sizes)
  /// are put back after a pulse so the attacker's own library keeps working between them.
  int64_t Header(std::mt19937_64& rng) {
    int64_t n = 0;
    for (Endpoint& e : endpoints_) {
      constexpr size_t kWords = sizeof(abi::EndpointShmHeader) / 8;
      const size_t word = header_cursor_ % kWords;
      const std::vector<uint64_t> values = HostileValues(e.map.size);
      const uint64_t value = values[(header_cursor_ / kWords) % values.size()];
      auto* at = reinterpret_cast<uint64_t*>(e.header) + word;
      const uint64_t original = reinterpret_cast<const uint64_t*>(&e.original)[word];
      if (word < offsetof(abi::EndpointShmHeader, ring_head) / 8) {
        Pulse<uint64_t>(at, value, original, 2000 + static_cast<int>(rng() % 20000));
      } else {
        Store<uint64_t>(at, value);
      }
      n += 1;
    }
    ++header_cursor_;
    return n;
  }

  int64_t Ring(std::mt19937_64& rng) {
    int64_t n = 0;
    for (Endpoint& e : endpoints_) {
      const uint64_t begin = e.original.ring_offset;
      const uint64_t end = e.original.completion_offset +
                           uint64_t(abi::kCompletionCapacity) * sizeof(abi::Completion);
      if (end > e.map.size || begin >= end) continue;
      for (int i = 0; i < 64; ++i) {
        const uint64_t off = begin + (rng() % ((end - begin) / 8)) * 8;
        Store<uint64_t>(e.map.base + off, rng() % 3 == 0 ? rng() : HostileOf(rng, e.map.size));
        ++n;
      }
    }
    return n;
  }

  /// One staged id at a time pulsed out of range and back (the check may pass, the use
  /// must then see the bad value); floats to NaN/Inf; x to garbage.
  int64_t Inputs(std::mt19937_64& rng) {
    int64_t n = 0;
    static const int64_t kBadIds[] = {int64_t{1} << 40,           -2,      INT64_MIN, INT64_MAX,
                                      epd::security::kNumExperts, 1 << 20, -(1 << 20)};
    for (Endpoint& e : endpoints_) {
      for (const char* name : {"in_topk_idx"}) {
        auto it = e.regions.find(name);
        if (it == e.regions.end()) continue;
        const uint64_t count = std::min<uint64_t>(it->second.bytes / 8, 16);
        for (int i = 0; i < 16; ++i) {
          auto* at = reinterpret_cast<int64_t*>(it->second.data) + rng() % count;
          const int64_t good = static_cast<int64_t>(rng() % epd::security::kNumExperts);
          Pulse<int64_t>(at, kBadIds[rng() % std::size(kBadIds)], good,
                         1 + static_cast<int>(rng() % 400));
          ++n;
        }
      }
      for (const char* name : {"in_topk_weights", "in_combine_weights", "in_scales"}) {
        auto it = e.regions.find(name);
        if (it == e.regions.end()) continue;
        for (int i = 0; i < 8; ++i) {
          auto* at = reinterpret_cast<uint32_t*>(it->second.data) + rng() % (it->second.bytes / 4);
          static const uint32_t kBadFloats[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                                0xffffffffu};
          Store<uint32_t>(at, kBadFloats[rng() % std::size(kBadFloats)]);
          ++n;
        }
      }
      for (const char* name : {"in_x", "in_combine_x", "in_ll_combine_x"}) {
        auto it = e.regions.find(name);
        if (it == e.regions.end()) continue;
        for (int i = 0; i < 8; ++i) {
          Store<uint64_t>(it->second.data + (rng() % (it->second.bytes / 8)) * 8, rng());
          ++n;
        }
      }
    }
    return n;
  }

  /// Routing state and counts the daemon may read back: hostile int32 values, pulsed.
  int64_t Routing(std::mt19937_64& rng) {
    int64_t n = 0;
    static const int32_t kBad[] = {INT32_MIN, INT32_MAX,
                                   -2,        1 << 30,
                                   1 << 16,   epd::security::kNumRanks * epd::security::kMaxTokens,
                                   -100000};
    for (Endpoint& e : endpoints_) {
      for (const char* name :
           {"send_pos", "rank_prefix", "recv_count", "recv_tokens_per_expert", "recv_src_info",
            "ll_handle_pos_0", "ll_handle_pos_1", "ll_recv_count_0", "ll_recv_count_1",
            "ll_recv_src_info_0", "ll_recv_src_info_1", "layout_tokens_per_rank"}) {
        auto it = e.regions.find(name);
        if (it == e.regions.end() || it->second.bytes < 4) continue;
        const uint64_t count = std::min<uint64_t>(it->second.bytes / 4, 64);
        for (int i = 0; i < 4; ++i) {
          auto* at = reinterpret_cast<int32_t*>(it->second.data) + rng() % count;
          const int32_t before = std::atomic_ref<int32_t>(*at).load(std::memory_order_relaxed);
          if (rng() % 2) {
            Pulse<int32_t>(at, kBad[rng() % std::size(kBad)], before,
                           1 + static_cast<int>(rng() % 400));
          } else {
            Store<int32_t>(at, kBad[rng() % std::size(kBad)]);
          }
          ++n;
        }
      }
    }
    return n;
  }

  /// Random words anywhere, to random or hostile values. In an endpoint header's layout
  /// words (which this process's own library reads on every op) a pulse, then the original
  /// back, and never its ring counters (ring_head, ring_tail: one write there breaks its own
  /// ring until it rejoins; the header attack covers them): the attacker keeps running ops
  /// instead of breaking its endpoint or crashing itself at once.
  int64_t Random(std::mt19937_64& rng) {
    int64_t n = 0;
    for (const Mapping& m : mappings_) {
      if (!m.writable || m.size < 8) continue;
      const Endpoint* e = nullptr;
      for (const Endpoint& candidate : endpoints_) {
        if (candidate.map.base == m.base) e = &candidate;
      }
      for (int i = 0; i < 256; ++i) {
        const uint64_t off = (rng() % (m.size / 8)) * 8;
        const uint64_t value = rng() % 2 ? rng() : HostileOf(rng, m.size);
        if (e != nullptr && (off == offsetof(abi::EndpointShmHeader, ring_head) ||
                             off == offsetof(abi::EndpointShmHeader, ring_tail))) {
          continue;
        }
        if (e != nullptr && off < offsetof(abi::EndpointShmHeader, ring_head)) {
          Pulse<uint64_t>(m.base + off, value,
                          reinterpret_cast<const uint64_t*>(&e->original)[off / 8],
                          1 + static_cast<int>(rng() % 2000));
        } else {
          Store<uint64_t>(m.base + off, value);
        }
        ++n;
      }
    }
    return n;
  }

  /// What a MASK group's ops carry back in shared memory: each completion record's mask
  /// words (mask_epoch, num_masked, dropped_pairs) and reason, to hostile 32-bit values;
  /// and, 2 ms after each (re)join, the header's daemon_closed to a value epd never writes
  /// (the client must report it as such, not take it for a shutdown or a removal).
  int64_t Mask(std::mt19937_64& rng) {
    static const uint32_t kBad[] = {
        0xffffffffu, 0x80000000u, 0x7fffffffu,
        1u << 20,    3u,          static_cast<uint32_t>(epd::security::kNumRanks + 1)};
    static const uint32_t kBadClosed[] = {3u, 0xffffffffu, 0x80000001u, 0xdeadbeefu};
    int64_t n = 0;
    for (Endpoint& e : endpoints_) {
      const uint64_t records = e.original.completion_offset;
      if (records + uint64_t(abi::kCompletionCapacity) * sizeof(abi::Completion) > e.map.size) {
        continue;
      }
      for (int i = 0; i < 16; ++i) {
        auto* c = reinterpret_cast<abi::Completion*>(e.map.base + records) +
                  rng() % abi::kCompletionCapacity;
        void* words[] = {&c->mask_epoch, &c->num_masked, &c->dropped_pairs, &c->reason};
        Store<uint32_t>(words[rng() % std::size(words)], kBad[rng() % std::size(kBad)]);
        ++n;
      }
    }
    if (!closed_scribbled_ && !endpoints_.empty() &&
        Clock::now() - retargeted_at_ > std::chrono::milliseconds(2)) {
      closed_scribbled_ = true;
      Endpoint& e = endpoints_[rng() % endpoints_.size()];
      Store<uint32_t>(&e.header->daemon_closed, kBadClosed[rng() % std::size(kBadClosed)]);
      ++n;
    }
    return n;
  }

  static uint64_t HostileOf(std::mt19937_64& rng, uint64_t around) {
    const std::vector<uint64_t> values = HostileValues(around);
    return values[rng() % values.size()];
  }

  std::set<std::string> targets_;
  std::vector<Mapping> mappings_;
  std::vector<Endpoint> endpoints_;
  uint64_t header_cursor_ = 0;
  Clock::time_point retargeted_at_;
  bool closed_scribbled_ = false;  // daemon_closed of the current endpoints.
  int made_writable_ = 0;
  bool reported_ = false;
};

// ---- truncate ----------------------------------------------------------------------------

/// The POSIX shm names an EndpointInfo gives (its string fields named "*shm_name", where
/// this build's EndpointInfo has them: an epd of memfd regions names none), region first.
std::vector<std::string> ShmNames(const v1::EndpointInfo& info) {
  std::vector<std::string> names;
  const google::protobuf::Descriptor* d = info.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_STRING || f->is_repeated() ||
        !absl::EndsWith(f->name(), "shm_name")) {
      continue;
    }
    const std::string value = info.GetReflection()->GetString(info, f);
    if (!value.empty()) names.push_back(value);
  }
  return names;
}

/// 16 hex digits of the 64-bit FNV-1a hash of `socket`: the tag in the /dev/shm names of
/// an epd that names its shared memory (common/os/shm_region.h ShmCreatorTag, before memfds).
std::string SocketTag(const std::string& socket) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : socket) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016" PRIx64, h);
  return hex;
}

class Truncate : public Attack {
 public:
  explicit Truncate(std::string socket) : socket_(std::move(socket)) {}

  void Retarget(const OwnGroup& group) override {
    names_.clear();
    for (const auto& ep : group.endpoints()) {
      for (const std::string& name : ShmNames(ep->info())) names_.insert(name);
    }
    // A rank of another group of its own, joined without mapping: its region's name (if
    // epd gives names) stays linked until the client would have mapped it.
    if (raw_ == nullptr) {
      auto raw = OpenRawSession(socket_, ::getpid(), "epd_attacker unmapped");
      if (raw.ok()) {
        raw_ = std::move(*raw);
        v1::EndpointInfo info;
        grpc::Status st = RawJoin(
            *raw_->stub, raw_->id,
            epd::security::SecuritySpec(absl::StrCat("unmapped-", ::getpid()), 1), 0, "", &info);
        if (st.ok() && !ShmNames(info).empty()) unmapped_ = ShmNames(info).front();
      }
    }
    if (!unmapped_.empty()) names_.insert(unmapped_);
    // This epd's names in /dev/shm, whatever the client was told: an epd that names its
    // POSIX shm objects tags them with the FNV-1a hash of its socket path (none of another
    // epd's on this machine is touched).
    const std::string tag = SocketTag(socket_);
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
      const std::string name = entry.path().filename().string();
      if (absl::StrContains(name, tag)) names_.insert("/" + name);
    }
  }

  int64_t Step(std::mt19937_64& rng) override {
    std::vector<std::pair<std::string, int>> fds;
    // The files of its fds and mappings, reopened read-write through /proc.
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
      std::error_code link_ec;
      const std::string target = std::filesystem::read_symlink(entry.path(), link_ec).string();
      if (link_ec ||
          !(absl::StrContains(target, "/dev/shm/") || absl::StrContains(target, "memfd:"))) {
        continue;
      }
      Open(fds, entry.path().string(), "fd " + target);
    }
    for (const Mapping& m : EpdMappings(/*make_writable=*/false)) {
      Open(fds, "/proc/self/map_files/" + m.range, "map_file " + m.path);
    }
    for (const std::string& name : names_) Open(fds, "/dev/shm" + name, "name " + name);
    // All of them at once: cut short (held while ops run), grown, holes punched, restored.
    struct File {
      std::string what;
      int fd;
      off_t size;
    };
    std::vector<File> files;
    for (auto& [what, fd] : fds) {
      struct stat st {};
      if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
        ::close(fd);
        continue;
      }
      files.push_back({what, fd, st.st_size});
    }
    const int cut = static_cast<int>(steps_++ % 4);  // To nothing first.
    int64_t n = 0;
    for (const File& f : files) {
      const off_t to[] = {0, 1, f.size / 2, f.size - 1};
      Note(f.what, "ftruncate", ::ftruncate(f.fd, to[cut]));
      ++n;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (const File& f : files) {
      Note(f.what, "ftruncate", ::ftruncate(f.fd, rng() % 2 ? f.size * 2 : f.size + 4096));
      Note(f.what, "fallocate_grow", ::fallocate(f.fd, 0, 0, f.size * 4));
      n += 2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    for (const File& f : files) {
      (void)::ftruncate(f.fd, f.size);  // Back to its size (zero-filled where it was cut).
      Note(f.what, "fallocate_punch",
           ::fallocate(f.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                       static_cast<off_t>(rng() % static_cast<uint64_t>(f.size) + 1)));
      n += 2;
      ::close(f.fd);
    }
    return n;
  }

  std::string Report() const override {
    return absl::StrCat("files_opened=", opened_, " open_failed=", open_failed_,
                        " changes_done=", succeeded_, " changes_refused=", refused_);
  }

 private:
  void Open(std::vector<std::pair<std::string, int>>& fds, const std::string& path,
            const std::string& what) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      ++open_failed_;
      if (seen_.insert("open " + what).second) {
        std::printf("OPEN_FAILED %s: %s\n", what.c_str(), std::strerror(errno));
      }
      return;
    }
    ++opened_;
    if (seen_.insert("opened " + what).second) std::printf("OPENED %s\n", what.c_str());
    fds.push_back({what, fd});
  }
  void Note(const std::string& what, const char* op, int rc) {
    const int err = rc == 0 ? 0 : errno;
    if (rc == 0) {
      ++succeeded_;
    } else {
      ++refused_;
    }
    const std::string key = absl::StrCat(op, " ", what, " ", err);
    if (seen_.insert(key).second) {
      std::printf("%s %s %s: %s\n", rc == 0 ? "DONE" : "REFUSED", op, what.c_str(),
                  rc == 0 ? "ok" : std::strerror(err));
    }
  }

  std::string socket_;
  std::set<std::string> names_;
  std::unique_ptr<RawSession> raw_;
  std::string unmapped_;
  std::set<std::string> seen_;
  int64_t opened_ = 0, open_failed_ = 0, succeeded_ = 0, refused_ = 0;
  uint64_t steps_ = 0;
};

// ---- floods ------------------------------------------------------------------------------

/// Raises this process's soft RLIMIT_NOFILE to its hard limit.
void RaiseFdLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

int JoinFlood(const std::string& socket) {
  RaiseFdLimit();
  epd::ClientOptions options;
  options.socket_path = socket;
  options.client_name = "epd_attacker join_flood";
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("CONNECT_ERROR %s\n", OneLine(client.status().ToString()).c_str());
    return 2;
  }
  auto stub = ControlStub(socket);
  const int joins = absl::GetFlag(FLAGS_joins);
  const int ranks_per_group = std::max(1, absl::GetFlag(FLAGS_ranks_per_group));
  std::map<std::string, int> by_code;
  std::map<std::string, std::string> first_message;
  const auto start = Clock::now();
  for (int i = 0; i < joins; ++i) {
    v1::GroupSpec spec;
    spec.set_name(
        absl::StrCat(absl::GetFlag(FLAGS_group), "-flood-", ::getpid(), "-", i / ranks_per_group));
    spec.set_num_ranks(ranks_per_group);
    spec.set_num_experts(ranks_per_group);
    spec.set_hidden(128);
    spec.set_num_topk(1);
    spec.set_max_tokens_per_rank(1);
    grpc::Status st = RawJoin(*stub, (*client)->session_id(), spec, i % ranks_per_group, "");
    const std::string code = CodeName(st);
    if (++by_code[code] == 1 && !st.ok()) {
      first_message[code] = OneLine(st.error_message());
      std::printf("JOIN %d %s %s\n", i, code.c_str(), first_message[code].c_str());
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::string summary = absl::StrCat("SUMMARY joins=", joins, " seconds=", secs);
  for (const auto& [code, n] : by_code) absl::StrAppend(&summary, " ", code, "=", n);
  std::printf("%s\n", summary.c_str());
  for (const auto& [code, message] : first_message) {
    std::printf("FIRST_ERROR %s %s\n", code.c_str(), message.c_str());
  }
  std::printf("HOLDING\n");
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_hold_seconds)));
  // Its own Session is still served (a control RPC over its connection).
  auto stats = (*client)->GetStats();
  std::printf("AFTER_HOLD GetStats %s\n", CodeName(stats.status()).c_str());
  return 0;
}

/// A connection to `socket` that sends `preamble` (maybe nothing), non-blocking; -1 on error.
int Connect(const std::string& socket, const std::string& preamble, int* error) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *error = errno;
    return -1;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 &&
      errno != EINPROGRESS && errno != EAGAIN) {
    *error = errno;
    ::close(fd);
    return -1;
  }
  if (!preamble.empty()) (void)::send(fd, preamble.data(), preamble.size(), MSG_NOSIGNAL);
  return fd;
}

/// The connections of a flood, by kind: what each sends first.
constexpr int kConnectionKinds = 5;
const char* const kConnectionKindNames[kConnectionKinds] = {"silent", "garbage", "h2_preface",
                                                            "fd_preamble", "half_preamble"};
std::string ConnectionPreamble(int kind) {
  switch (kind) {
    case 1:
      return "GET / HTTP/1.1\r\nHost: epd\r\n\r\n";
    case 2:
      return "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";  // The HTTP/2 preface, then nothing.
    case 3:
      return std::string(abi::kFdChannelPreamble, sizeof(abi::kFdChannelPreamble));
    case 4:
      return "EPD";  // Half a preamble.
    default:
      return "";
  }
}

/// Opens `count` connections of `kinds` (round robin), holds them `seconds`, then prints
/// "<label> <kind> <closed> of <total>" per kind: how many epd closed meanwhile. Closes them.
size_t HoldConnections(const std::string& socket, int count, const std::vector<int>& kinds,
                       double seconds, const char* label, bool announce) {
  std::vector<std::pair<int, int>> held;  // (fd, kind)
  std::map<std::string, int> connect_errors;
  for (int i = 0; i < count; ++i) {
    const int kind = kinds[i % kinds.size()];
    int error = 0;
    const int fd = Connect(socket, ConnectionPreamble(kind), &error);
    if (fd < 0) {
      ++connect_errors[std::strerror(error)];
      continue;
    }
    held.push_back({fd, kind});
  }
  if (announce) std::printf("HOLDING %zu\n", held.size());
  for (const auto& [error, n] : connect_errors) {
    std::printf("CONNECT_FAILED %d %s\n", n, error.c_str());
  }
  std::fflush(stdout);
  absl::SleepFor(absl::Seconds(seconds));
  int closed[kConnectionKinds] = {}, total[kConnectionKinds] = {};
  for (auto [fd, kind] : held) {
    ++total[kind];
    char buffer[4096];
    ssize_t n;
    while ((n = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT)) > 0) {
    }
    closed[kind] += n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
    ::close(fd);
  }
  for (int kind : std::set<int>(kinds.begin(), kinds.end())) {
    std::printf("%s %s %d of %d\n", label, kConnectionKindNames[kind], closed[kind], total[kind]);
  }
  return held.size();
}

int ConnFlood(const std::string& socket) {
  RaiseFdLimit();
  // A few hundred idle ones first (well within epd's descriptors): each must be closed
  // within epd's bound for a connection's first bytes.
  HoldConnections(socket, 300, {0, 1, 4}, 3.5, "IDLE_CLOSED_BY_EPD", false);
  // The flood: more than epd has descriptors for, of every kind.
  const size_t held = HoldConnections(socket, absl::GetFlag(FLAGS_connections), {0, 1, 2, 3, 4},
                                      absl::GetFlag(FLAGS_hold_seconds), "CLOSED_BY_EPD", true);
  int churn_errors = 0;
  const int churn = absl::GetFlag(FLAGS_churn);
  for (int i = 0; i < churn; ++i) {
    int error = 0;
    const int fd = Connect(socket, ConnectionPreamble(i % kConnectionKinds), &error);
    if (fd < 0) {
      ++churn_errors;
      continue;
    }
    ::close(fd);
  }
  std::printf("SUMMARY held=%zu churn=%d churn_connect_errors=%d\n", held, churn, churn_errors);
  return 0;
}

void FutexWake(uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

int RingFlood(const std::string& socket) {
  epd::ClientOptions options;
  options.socket_path = socket;
  options.client_name = "epd_attacker ring_flood";
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("CONNECT_ERROR %s\n", OneLine(client.status().ToString()).c_str());
    return 2;
  }
  epd::JoinOptions join;
  join.spec = epd::security::SecuritySpec(
      absl::StrCat(absl::GetFlag(FLAGS_group), "-ring-", ::getpid()), 1);
  auto ep = (*client)->Join(join);
  if (!ep.ok()) {
    std::printf("JOIN_ERROR %s\n", OneLine(ep.status().ToString()).c_str());
    return 2;
  }
  abi::EndpointShmHeader* header = nullptr;
  uint64_t region_bytes = 0;
  abi::DoorbellPage* doorbell = nullptr;
  for (const Mapping& m : EpdMappings(false)) {
    if (!m.writable || m.size < sizeof(abi::DoorbellPage)) continue;
    const uint32_t magic = reinterpret_cast<const abi::DoorbellPage*>(m.base)->magic;
    if (magic == abi::kDoorbellMagic) doorbell = reinterpret_cast<abi::DoorbellPage*>(m.base);
    auto* h = reinterpret_cast<abi::EndpointShmHeader*>(m.base);
    if (m.size >= sizeof(*h) && h->magic == abi::kEndpointMagic &&
        h->endpoint_id == (*ep)->info().endpoint_id()) {
      header = h;
      region_bytes = m.size;
    }
  }
  if (header == nullptr) {
    std::printf("NO_RING the endpoint's region is not mapped writable here\n");
    return 2;
  }
  // Where the client's copy of the header says the ring is (read before any scribbling).
  const uint64_t ring_offset = header->ring_offset;
  if (ring_offset > region_bytes - sizeof(abi::RequestSlot) * abi::kRingCapacity) {
    std::printf("NO_RING ring_offset %" PRIu64 " outside the %" PRIu64 "-byte mapping\n",
                ring_offset, region_bytes);
    return 2;
  }
  auto* ring =
      reinterpret_cast<abi::RequestSlot*>(reinterpret_cast<uint8_t*>(header) + ring_offset);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const int slots = absl::GetFlag(FLAGS_slots);
  const uint64_t tail0 = abi::Atomic(header->ring_tail).load();
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::milliseconds(static_cast<int64_t>(absl::GetFlag(FLAGS_seconds) * 1000));
  int written = 0, stalls = 0;
  uint64_t head = abi::Atomic(header->ring_head).load();
  for (; written < slots && Clock::now() < deadline; ++written) {
    // Bounded wait for ring space: epd consumes (rejects) the slots.
    auto wait_until = Clock::now() + std::chrono::milliseconds(500);
    while (head - abi::Atomic(header->ring_tail).load() >= abi::kRingCapacity - 1) {
      if (Clock::now() > wait_until) break;
      if (doorbell != nullptr) FutexWake(&doorbell->futex_word);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (head - abi::Atomic(header->ring_tail).load() >= abi::kRingCapacity - 1) {
      ++stalls;
      head = abi::Atomic(header->ring_tail).load();  // Resynchronise on what epd consumed.
    }
    abi::RequestSlot slot{};
    const uint64_t seq = head + 1;
    switch (written % 8) {
      case 0:
        break;  // All zeros.
      case 1:
        for (auto* w = reinterpret_cast<uint64_t*>(&slot);
             w < reinterpret_cast<uint64_t*>(&slot + 1); ++w) {
          *w = rng();
        }
        break;
      default:
        slot.magic = abi::kRequestMagic;
        slot.seq = written % 8 == 2 ? rng() : seq;
        slot.op = written % 8 == 3 ? 99u : static_cast<uint32_t>(1 + rng() % abi::kMaxOpKind);
        slot.flags = written % 8 == 4 ? 0xffffffffu : static_cast<uint32_t>(rng() % 64);
        slot.num_tokens = written % 8 == 5 ? INT32_MIN : static_cast<int32_t>(rng() % 1000) - 500;
        slot.expert_alignment = written % 8 == 6 ? 0 : static_cast<int32_t>(rng());
        slot.num_sms = static_cast<int32_t>(rng());
        slot.handle_seq = rng();
        slot.program_num_steps = rng();
        for (uint64_t& r : slot.program_steps) r = rng();
        break;
    }
    std::memcpy(&ring[seq % abi::kRingCapacity], &slot, sizeof(slot));
    abi::Atomic(header->ring_head).store(seq, std::memory_order_seq_cst);
    head = seq;
    if (doorbell != nullptr && abi::Atomic(doorbell->engine_sleeping).load() != 0) {
      abi::Atomic(doorbell->futex_word).fetch_add(1);
      FutexWake(&doorbell->futex_word);
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::printf("SUMMARY written=%d consumed=%" PRIu64 " stalls=%d seconds=%.2f rejected=%" PRIu64
              " closed=%u\n",
              written, abi::Atomic(header->ring_tail).load() - tail0, stalls, secs,
              abi::Atomic(header->rejected_requests).load(),
              abi::Atomic(header->daemon_closed).load());
  return 0;
}

// ---- identity ---------------------------------------------------------------------------

int Claim(const std::string& socket) {
  auto session = OpenRawSession(socket, ::getpid(), "epd_attacker claim");
  if (!session.ok()) {
    std::printf("SESSION_ERROR %s\n", OneLine(session.status().ToString()).c_str());
    return 2;
  }
  v1::Control::Stub& stub = *(*session)->stub;
  const std::string victim = absl::GetFlag(FLAGS_victim_group);
  // The spec: from ListGroups when it shows the group, else the one the victims use (an
  // attacker can guess it: it is no secret).
  v1::GroupSpec spec = epd::security::SecuritySpec(victim);
  if (auto groups = RawListGroups(stub); groups.ok()) {
    for (const v1::GroupInfo& g : groups->groups()) {
      if (g.spec().name() == victim) {
        spec = g.spec();
        std::printf("SEEN %s (spec visible to this client)\n", victim.c_str());
      }
    }
  }
  int claimed = 0;
  std::vector<std::string> secrets = {""};
  if (!absl::GetFlag(FLAGS_join_secret).empty())
    secrets.push_back(absl::GetFlag(FLAGS_join_secret));
  for (const std::string& secret : secrets) {
    for (int r = 0; r < spec.num_ranks(); ++r) {
      v1::EndpointInfo info;
      grpc::Status st = RawJoin(stub, (*session)->id, spec, r, secret, &info);
      std::printf("CLAIM rank %d secret=%s %s %s\n", r, secret.empty() ? "none" : "wrong",
                  st.ok() ? "OK" : CodeName(st).c_str(),
                  st.ok() ? absl::StrCat("endpoint ", info.endpoint_id()).c_str()
                          : OneLine(st.error_message()).c_str());
      claimed += st.ok();
    }
  }
  // Reading its endpoints, then leaving its ranks, in this session's name.
  auto each_rank = [&](const char* what, auto rpc) {
    for (int r = 0; r < spec.num_ranks(); ++r) {
      grpc::ClientContext context;
      SetDeadline(context);
      grpc::Status st = rpc(r, context);
      std::printf("%s rank %d %s %s\n", what, r, st.ok() ? "OK" : CodeName(st).c_str(),
                  OneLine(st.error_message()).c_str());
    }
    std::fflush(stdout);
  };
  each_rank("ENDPOINTS", [&](int r, grpc::ClientContext& context) {
    v1::GetGroupEndpointsRequest request;
    request.set_group(victim);
    request.set_rank(r);
    request.set_session_id((*session)->id);
    v1::GetGroupEndpointsResponse response;
    return stub.GetGroupEndpoints(&context, request, &response);
  });
  if (claimed > 0) absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_hold_seconds)));
  each_rank("LEAVE", [&](int r, grpc::ClientContext& context) {
    v1::LeaveGroupRequest request;
    request.set_group(victim);
    request.set_rank(r);
    request.set_session_id((*session)->id);
    v1::LeaveGroupResponse response;
    return stub.LeaveGroup(&context, request, &response);
  });
  std::printf("SUMMARY claimed=%d\n", claimed);
  return 0;
}

int SpoofPid(const std::string& socket) {
  const int64_t claimed = absl::GetFlag(FLAGS_claimed_pid);
  auto session = OpenRawSession(socket, claimed, "epd_attacker spoof_pid");
  if (!session.ok()) {
    std::printf("SESSION_ERROR %s\n", OneLine(session.status().ToString()).c_str());
    return 2;
  }
  const std::string group = absl::StrCat(absl::GetFlag(FLAGS_group), "-spoof-", ::getpid());
  grpc::Status st =
      RawJoin(*(*session)->stub, (*session)->id, epd::security::SecuritySpec(group, 1), 0, "");
  if (!st.ok()) {
    std::printf("JOIN_ERROR %s %s\n", CodeName(st).c_str(), OneLine(st.error_message()).c_str());
    return 2;
  }
  auto groups = RawListGroups(*(*session)->stub);
  if (!groups.ok()) {
    std::printf("LIST_ERROR %s\n", OneLine(groups.status().ToString()).c_str());
    return 2;
  }
  for (const v1::GroupInfo& g : groups->groups()) {
    if (g.spec().name() != group) continue;
    for (const v1::RankInfo& r : g.ranks()) {
      std::printf("PID real=%d claimed=%" PRId64 " recorded=%" PRId64 "\n", ::getpid(), claimed,
                  static_cast<int64_t>(r.client_pid()));
    }
  }
  std::printf("SUMMARY done=1\n");
  return 0;
}

int ListGroups(const std::string& socket) {
  auto stub = ControlStub(socket);
  auto groups = RawListGroups(*stub);
  if (!groups.ok()) {
    std::printf("LIST_ERROR %s\n", OneLine(groups.status().ToString()).c_str());
    return 0;
  }
  for (const v1::GroupInfo& g : groups->groups()) {
    std::printf("GROUP %s ranks=%d joined=%d\n", g.spec().name().c_str(), g.spec().num_ranks(),
                g.ranks_size());
  }
  std::printf("SUMMARY listed=%d\n", groups->groups_size());
  return 0;
}

// ---- PendingOp after its Endpoint -------------------------------------------------------

/// Reuses freed heap memory: blocks of every small size filled with 0xa5, kept alive, so
/// that a dangling pointer into a freed Endpoint reads 0xa5a5... (and faults) instead of
/// the stale but plausible bytes a fresh free leaves behind.
std::vector<std::unique_ptr<uint8_t[]>> SprayHeap() {
  std::vector<std::unique_ptr<uint8_t[]>> blocks;
  for (int round = 0; round < 8; ++round) {
    for (size_t size = 16; size <= 16384; size += 16) {
      blocks.emplace_back(new uint8_t[size]);
      std::memset(blocks.back().get(), 0xa5, size);
    }
  }
  return blocks;
}

int DestroyPending(const std::string& socket) {
  OwnGroup group(absl::GetFlag(FLAGS_group));
  if (absl::Status st = group.Connect(socket); !st.ok()) {
    std::printf("CONNECT_ERROR %s\n", OneLine(st.ToString()).c_str());
    return 2;
  }
  int cases = 0;
  auto report = [&](const char* what, const absl::Status& st) {
    std::printf("%s %s %s\n", what, st.ok() ? "OK" : CodeName(st).c_str(),
                OneLine(std::string(st.message())).c_str());
    std::fflush(stdout);
    ++cases;
  };
  std::vector<int64_t> shape = {1, epd::security::kNumTopk};
  std::vector<int64_t> idx = {0, 1};
  DLTensor t = epd::MakeDLTensor(idx.data(), kI64, shape);
  // 1. A GetDispatchLayout submitted by rank 0 alone (rank 1 never submits): pending.
  // 2. One both ranks submitted and rank 1 waited for: complete, not yet waited for.
  for (bool complete : {false, true}) {
    const char* what = complete ? "completed" : "pending";
    if (absl::Status st = group.Join(); !st.ok()) {
      std::printf("JOIN_ERROR %s\n", OneLine(st.ToString()).c_str());
      return 2;
    }
    auto& eps = group.mutable_endpoints();
    auto op = eps[0]->GetDispatchLayout(t);
    if (complete) {
      auto op1 = eps[1]->GetDispatchLayout(t);
      if (op1.ok()) (void)op1->Wait(absl::Seconds(5));  // Done once rank 0's is too.
    }
    if (!op.ok()) {
      report(absl::StrCat("SUBMIT ", what).c_str(), op.status());
    } else {
      eps[0].reset();
      auto spray = SprayHeap();
      report(absl::StrCat("WAIT ", what).c_str(), op->Wait(absl::Seconds(2)).status());
      if (!complete) report("ENQUEUED pending", op->Enqueued().status());
    }
    group.Leave();
  }
  std::printf("SUMMARY cases=%d\nDONE\n", cases);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  absl::ParseCommandLine(argc, argv);
  // A crash or the supervisor's SIGABRT of a stuck child prints the stack on stdout, which
  // the tests capture.
  absl::FailureSignalHandlerOptions failure_options;
  failure_options.writerfn = [](const char* text) {
    if (text != nullptr) (void)!::write(STDOUT_FILENO, text, std::strlen(text));
  };
  absl::InstallFailureSignalHandler(failure_options);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  ::signal(SIGPIPE, SIG_IGN);
  const std::string socket = absl::GetFlag(FLAGS_socket);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  auto op_loop = [&](auto make_attack) {
    auto body = [&, make_attack](Clock::time_point deadline) {
      auto attack = make_attack();
      return RunOpLoopAttack(socket, *attack, deadline);
    };
    if (absl::GetFlag(FLAGS_supervise)) return Supervise(seconds, body);
    return body(Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  };
  if (mode == "scribble") {
    return op_loop([] { return std::make_unique<Scribble>(absl::GetFlag(FLAGS_targets)); });
  }
  if (mode == "truncate") return op_loop([&] { return std::make_unique<Truncate>(socket); });
  if (mode == "join_flood") return JoinFlood(socket);
  if (mode == "conn_flood") return ConnFlood(socket);
  if (mode == "ring_flood") return RingFlood(socket);
  if (mode == "claim") return Claim(socket);
  if (mode == "spoof_pid") return SpoofPid(socket);
  if (mode == "list_groups") return ListGroups(socket);
  if (mode == "destroy_pending") return DestroyPending(socket);
  std::fprintf(stderr, "unknown --mode=%s\n", mode.c_str());
  return 2;
}
