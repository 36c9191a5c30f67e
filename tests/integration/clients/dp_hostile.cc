// epd_dp_hostile: a hostile client process for tests/integration/fd_channel_test.cc that
// speaks the protocol itself, without the client library's checks.
//   --scenario=resize  Joins rank 0 of a 1-rank group --group, fetches its descriptors on the
//                      fd channel and tries to resize each (ftruncate, fallocate, a seal),
//                      printing "RESIZE <fd> <attempt> <errno name or OK>"; then, for
//                      --seconds, keeps trying while it scribbles and hole-punches the
//                      doorbell page. Prints "DONE resized=<n>"; exit 0 when no resize ever
//                      succeeded, 1 when one did, 2 on setup errors.
//   --scenario=fetch   Asks the fd channel for (--group, --rank) in the name of --session:
//                      "FETCH OK fds=<n>" or "FETCH <CODE>: <message> fds=<n>".
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/fd_frame.h"
#include "common/os/shm_region.h"
#include "epd/client.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "proto/abi/shm_abi.h"

ABSL_FLAG(std::string, socket, "", "epd socket path");
ABSL_FLAG(std::string, scenario, "resize", "resize or fetch");
ABSL_FLAG(std::string, group, "hostile", "group name");
ABSL_FLAG(int, rank, 0, "fetch: rank");
ABSL_FLAG(std::string, session, "", "fetch: the session id to present");
ABSL_FLAG(double, seconds, 2.0, "resize: how long the tight loop runs");

namespace {

struct Fetched {
  int code = 0;
  std::string message;
  std::vector<epd::ScopedFd> fds;
};

/// The fd channel by hand: preamble, one request frame, one answer frame.
Fetched FetchRaw(const std::string& socket_path, const std::string& session,
                 const std::string& group, int rank) {
  Fetched out;
  epd::ScopedFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", socket_path.c_str());
  if (::connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    out.code = static_cast<int>(absl::StatusCode::kUnavailable);
    out.message = absl::StrCat("connect: ", std::strerror(errno));
    return out;
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  epd::v1::FdChannelRequest request;
  request.set_session_id(session);
  request.set_group(group);
  request.set_rank(rank);
  absl::Status sent = epd::SendAll(
      conn.get(),
      absl::string_view(epd::abi::kFdChannelPreamble, sizeof(epd::abi::kFdChannelPreamble)),
      deadline);
  if (sent.ok()) sent = epd::SendFrame(conn.get(), request.SerializeAsString(), {}, deadline);
  absl::StatusOr<epd::ReceivedFrame> frame =
      sent.ok()
          ? epd::ReceiveFrame(conn.get(), epd::kMaxFdFrameBytes, epd::kMaxFdFrameFds, deadline)
          : absl::StatusOr<epd::ReceivedFrame>(sent);
  if (!frame.ok()) {
    out.code = static_cast<int>(frame.status().code());
    out.message = std::string(frame.status().message());
    return out;
  }
  epd::v1::FdChannelResponse response;
  response.ParseFromString(frame->body);
  out.code = response.code();
  out.message = response.message();
  out.fds = std::move(frame->fds);
  return out;
}

const char* ErrnoName(int err) {
  switch (err) {
    case 0:
      return "OK";
    case EPERM:
      return "EPERM";
    case EINVAL:
      return "EINVAL";
    case EBUSY:
      return "EBUSY";
    case EFBIG:
      return "EFBIG";
    default:
      return "other";
  }
}

/// Tries every way to change the size (or the seals) of `fd` of `bytes`; returns how many
/// succeeded, printing each attempt once when `say`.
int TryResize(int fd, uint64_t bytes, const char* what, bool say) {
  int resized = 0;
  auto note = [&](const std::string& attempt, int err) {
    if (say) std::printf("RESIZE %s %s %s\n", what, attempt.c_str(), ErrnoName(err));
    if (err == 0) ++resized;
  };
  for (const uint64_t size :
       {uint64_t{0}, bytes / 2, bytes - 1, bytes + 1, bytes * 2, uint64_t{1} << 40}) {
    const int rc = ::ftruncate(fd, static_cast<off_t>(size));
    note(absl::StrCat("ftruncate(", size, ")"), rc == 0 ? 0 : errno);
  }
  // fallocate beyond the end grows the file (posix_fallocate returns the error).
  note("fallocate(grow)", ::posix_fallocate(fd, 0, static_cast<off_t>(bytes * 2)));
  const int rc = ::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE);
  note("F_ADD_SEALS(F_SEAL_WRITE)", rc == 0 ? 0 : errno);
  return resized;
}

int Resize() {
  const std::string socket = absl::GetFlag(FLAGS_socket);
  epd::ClientOptions options;
  options.socket_path = socket;
  options.client_name = "dp_hostile resize";
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("connect: %s\n", client.status().ToString().c_str());
    return 2;
  }
  auto stub = epd::v1::Control::NewStub(
      grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
  epd::v1::JoinGroupRequest join;
  epd::v1::GroupSpec* spec = join.mutable_spec();
  spec->set_name(absl::GetFlag(FLAGS_group));
  spec->set_num_ranks(1);
  spec->set_num_experts(2);
  spec->set_hidden(128);
  spec->set_num_topk(1);
  spec->set_max_tokens_per_rank(4);
  join.set_rank(0);
  join.set_session_id((*client)->session_id());
  epd::v1::JoinGroupResponse joined;
  grpc::ClientContext context;
  grpc::Status status = stub->JoinGroup(&context, join, &joined);
  if (!status.ok()) {
    std::printf("join: %s\n", status.error_message().c_str());
    return 2;
  }
  Fetched fetched = FetchRaw(socket, (*client)->session_id(), spec->name(), 0);
  if (fetched.code != 0 || fetched.fds.size() != 2) {
    std::printf("fetch: %d %s (%zu fds)\n", fetched.code, fetched.message.c_str(),
                fetched.fds.size());
    return 2;
  }
  const int region = fetched.fds[0].get();
  const int doorbell = fetched.fds[1].get();
  const uint64_t region_bytes = joined.endpoint().shm_bytes();
  const uint64_t doorbell_bytes = sizeof(epd::abi::DoorbellPage);
  int resized = TryResize(region, region_bytes, "region", true);
  resized += TryResize(doorbell, doorbell_bytes, "doorbell", true);
  std::fflush(stdout);

  auto* page = static_cast<epd::abi::DoorbellPage*>(
      ::mmap(nullptr, doorbell_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, doorbell, 0));
  if (page == MAP_FAILED) {
    std::printf("mmap doorbell: %s\n", std::strerror(errno));
    return 2;
  }
  std::mt19937 rng(1);
  const absl::Time end = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_seconds));
  uint64_t rounds = 0;
  while (absl::Now() < end) {
    resized += TryResize(region, region_bytes, "region", false);
    resized += TryResize(doorbell, doorbell_bytes, "doorbell", false);
    for (int i = 0; i < 64; ++i) {
      epd::abi::Atomic(page->futex_word).store(rng());
      epd::abi::Atomic(page->engine_sleeping).store(rng() & 1);
      page->magic = rng();
      page->size = rng();
    }
    // Zeroes the page under everyone's mapping (allowed without F_SEAL_WRITE): harmless.
    (void)::fallocate(doorbell, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                      static_cast<off_t>(doorbell_bytes));
    ++rounds;
  }
  std::printf("DONE resized=%d rounds=%llu\n", resized, static_cast<unsigned long long>(rounds));
  return resized == 0 ? 0 : 1;
}

int Fetch() {
  Fetched f = FetchRaw(absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_session),
                       absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_rank));
  if (f.code == 0) {
    std::printf("FETCH OK fds=%zu\n", f.fds.size());
  } else {
    std::printf("FETCH %s: %s fds=%zu\n",
                absl::StatusCodeToString(static_cast<absl::StatusCode>(f.code)).c_str(),
                f.message.c_str(), f.fds.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  if (scenario == "resize") return Resize();
  if (scenario == "fetch") return Fetch();
  std::fprintf(stderr, "unknown --scenario=%s\n", scenario.c_str());
  return 2;
}
