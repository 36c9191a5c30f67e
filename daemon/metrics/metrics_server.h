// The --metrics_listen HTTP listener: GET /metrics answers the Prometheus text format of
// the registry (exposition.h). A small HTTP/1.1 server of its own (why not a library:
// DESIGN.md §10): one thread running a poll loop, every connection closed after one
// answer, and every resource a client can make it hold bounded (MetricsServer::Limits).
// It reads only atomics and the control path's state, so a scrape never waits for, or
// stalls, the data plane.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/os/scoped_fd.h"

namespace epd::metrics {

class MetricsServer {
 public:
  /// What one client, or many, can make the listener hold.
  struct Limits {
    /// Bytes of a request's head (request line and header lines, up to the empty line);
    /// one past it is answered 431 and the connection closed.
    size_t max_head_bytes = 8 * 1024;
    /// From accept until the head is complete; then the connection is closed unanswered
    /// (a slow or idle client cannot hold a connection longer).
    std::chrono::milliseconds head_timeout{5000};
    /// From the complete head until the answer is written (a reader that does not read).
    std::chrono::milliseconds write_timeout{5000};
    /// Connections open at once. At the bound no more are accepted: new ones wait in the
    /// kernel's listen queue (as long again), and past that the kernel refuses them.
    size_t max_connections = 16;
  };

  /// Listens on `listen` ("host:port"; "[v6]:port"; port 0 = any free port) and serves
  /// GET /metrics with `render()` (called on the listener's thread, once per scrape).
  /// Every other path is 404, every other method 405 (Allow: GET), a head that is not
  /// HTTP 400; a request body is never read. INVALID_ARGUMENT when `listen` is not
  /// host:port; UNAVAILABLE when it cannot be bound (naming it and the field
  /// metrics_listen).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              std::function<std::string()> render,
                                                              Limits limits);
  /// As above with the default Limits.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              std::function<std::string()> render);
  ~MetricsServer();  ///< Stop().
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  /// The bound port (the real one for port 0).
  int port() const { return port_; }
  /// Stops listening, closes every connection and joins the thread. Idempotent.
  void Stop();

 private:
  struct Connection;
  MetricsServer(std::function<std::string()> render, Limits limits)
      : render_(std::move(render)), limits_(limits) {}
  /// The poll loop (the listener's thread) until Stop.
  void Run();
  /// Reads what `c` sent of its head; answers it when complete or too long.
  void ReadHead(Connection& c);
  /// The answer to the complete head `head`.
  std::string Answer(const std::string& head);
  /// Writes what is left of `c`'s answer; then closes or drains it.
  void WriteAnswer(Connection& c);
  /// Reads and drops what `c` still sends after its answer (so closing does not reset the
  /// connection before the client read the answer), until EOF or the drain's bounds.
  void Drain(Connection& c);

  const std::function<std::string()> render_;
  const Limits limits_;
  ScopedFd listen_fd_;
  ScopedFd wake_fd_;  ///< An eventfd: Stop wakes the loop through it.
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  int port_ = 0;
};

}  // namespace epd::metrics
