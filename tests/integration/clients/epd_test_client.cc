// epd_test_client: a real libepdclient process for integration tests. It connects to
// epd (holding its Session), joins one rank of a group, prints
//   JOINED group=<name> rank=<r> session=<id> endpoint=<id> pid=<pid>
// and then holds the endpoint until it is killed or its stdin closes. Lines on stdin:
// "leave" leaves the group (prints "LEFT" or "LEAVE_ERROR <CODE>: <message>").
// On failure it prints "CONNECT_ERROR <CODE>: <message>" (exit 3) or
// "JOIN_ERROR <CODE>: <message>" (exit 4). Exit 0 after stdin closes. The join secret
// (JoinOptions::join_secret) comes from the environment variable EPD_JOIN_SECRET, as an
// application's ranks get it.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "epd/client.h"

ABSL_FLAG(std::string, socket, "/run/epd/epd.sock", "epd socket (/path, unix:///path, host:port)");
ABSL_FLAG(std::string, name, "g", "group name");
ABSL_FLAG(int32_t, num_ranks, 2, "R");
ABSL_FLAG(int32_t, num_experts, 8, "E");
ABSL_FLAG(int32_t, hidden, 256, "H");
ABSL_FLAG(int32_t, num_topk, 2, "K");
ABSL_FLAG(int32_t, max_tokens_per_rank, 16, "M");
ABSL_FLAG(int32_t, ll_max_tokens_per_rank, 0, "low-latency M");
ABSL_FLAG(bool, use_fp8, false, "FP8");
ABSL_FLAG(int32_t, rank, 0, "rank to join");
ABSL_FLAG(std::string, gpu_uuid, "", "GPU UUID or PCI bus id");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(5), "Client::Connect timeout");

namespace {

void Say(const std::string& line) {
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

std::string Describe(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  epd::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.client_name = absl::StrCat("epd_test_client rank ", absl::GetFlag(FLAGS_rank));
  options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  absl::StatusOr<std::unique_ptr<epd::Client>> client = epd::Client::Connect(options);
  if (!client.ok()) {
    Say("CONNECT_ERROR " + Describe(client.status()));
    return 3;
  }

  epd::JoinOptions join;
  join.spec.set_name(absl::GetFlag(FLAGS_name));
  join.spec.set_num_ranks(absl::GetFlag(FLAGS_num_ranks));
  join.spec.set_num_experts(absl::GetFlag(FLAGS_num_experts));
  join.spec.set_hidden(absl::GetFlag(FLAGS_hidden));
  join.spec.set_num_topk(absl::GetFlag(FLAGS_num_topk));
  join.spec.set_max_tokens_per_rank(absl::GetFlag(FLAGS_max_tokens_per_rank));
  join.spec.set_ll_max_tokens_per_rank(absl::GetFlag(FLAGS_ll_max_tokens_per_rank));
  join.spec.set_use_fp8(absl::GetFlag(FLAGS_use_fp8));
  join.rank = absl::GetFlag(FLAGS_rank);
  join.gpu_uuid = absl::GetFlag(FLAGS_gpu_uuid);
  if (const char* secret = std::getenv("EPD_JOIN_SECRET"); secret != nullptr) {
    join.join_secret = secret;
  }
  absl::StatusOr<std::unique_ptr<epd::Endpoint>> endpoint = (*client)->Join(join);
  if (!endpoint.ok()) {
    Say("JOIN_ERROR " + Describe(endpoint.status()));
    return 4;
  }
  Say(absl::StrCat("JOINED group=", join.spec.name(), " rank=", join.rank,
                   " session=", (*client)->session_id(),
                   " endpoint=", (*endpoint)->info().endpoint_id(), " pid=", ::getpid()));

  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "leave") {
      absl::Status left = (*endpoint)->Leave();
      Say(left.ok() ? "LEFT" : "LEAVE_ERROR " + Describe(left));
    }
  }
  return 0;
}
