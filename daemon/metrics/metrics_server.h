// The --metrics_listen HTTP listener: GET /metrics answers the Prometheus text format of
// the registry (exposition.h), on cpp-httplib (Debian's libcpp-httplib-dev; why:
// DESIGN.md §10). It runs on threads of its own and reads only atomics and the control
// path's state, so a scrape never waits for, or stalls, the data plane.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace epd::metrics {

class MetricsServer {
 public:
  /// Listens on `listen` ("host:port"; "[v6]:port"; port 0 = any free port) and serves
  /// GET /metrics with `render()` (called on a server thread per scrape). Every other
  /// path is 404, every other method 405 (Allow: GET). Requests are bounded: no body
  /// (4 KiB at most), 5 s to read and write, at most 2 worker threads. UNAVAILABLE when
  /// the address cannot be bound (naming it and the field metrics_listen).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              std::function<std::string()> render);
  ~MetricsServer();  ///< Stop().
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  /// The bound port (the real one for port 0).
  int port() const { return port_; }
  /// Stops listening and joins the threads. Idempotent.
  void Stop();

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace epd::metrics
