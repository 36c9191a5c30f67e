// The metrics HTTP listener (metrics_server.h).
#include "daemon/metrics/metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/metrics/exposition.h"

namespace epd::metrics {
namespace {

constexpr size_t kWorkerThreads = 2;
constexpr size_t kMaxRequestBody = 4096;
constexpr time_t kIoTimeoutSeconds = 5;

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  const size_t colon = listen.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(listen).substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: \"", listen, "\" is not host:port (e.g. 127.0.0.1:9464)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->server_ = std::make_unique<httplib::Server>();
  httplib::Server& server = *s->server_;
  // httplib owns (and deletes) the queue its factory returns: its API takes a raw pointer.
  server.new_task_queue = [] { return new httplib::ThreadPool(kWorkerThreads); };
  server.set_payload_max_length(kMaxRequestBody);
  server.set_read_timeout(kIoTimeoutSeconds, 0);
  server.set_write_timeout(kIoTimeoutSeconds, 0);
  server.set_keep_alive_max_count(5);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second epd
  // bind the same port and share its scrapes with the first.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server.Get("/metrics",
             [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
               res.set_content(render(), kPrometheusContentType);
             });
  auto refuse = [](const httplib::Request&, httplib::Response& res) {
    res.status = 405;
    res.set_header("Allow", "GET");
  };
  server.Post(".*", refuse);
  server.Put(".*", refuse);
  server.Delete(".*", refuse);
  server.Patch(".*", refuse);
  if (port == 0) {
    const int bound = server.bind_to_any_port(host);
    if (bound <= 0) {
      return absl::UnavailableError(
          absl::StrCat("metrics_listen: cannot listen on ", listen, " (bind failed)"));
    }
    s->port_ = bound;
  } else {
    if (!server.bind_to_port(host, static_cast<int>(port))) {
      return absl::UnavailableError(absl::StrCat("metrics_listen: cannot listen on ", listen,
                                                 " (bind failed: in use, or not an address "
                                                 "of this host)"));
    }
    s->port_ = static_cast<int>(port);
  }
  s->thread_ = std::thread([&server] { server.listen_after_bind(); });
  // stop() only ends a loop that runs: wait (bounded) until it does, so Stop never hangs.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!server.is_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server.is_running()) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: ", listen, ": the HTTP server did not start within 5 s"));
  }
  return s;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace epd::metrics
